"""Repack, then slice: each sequence-parallel rank's share of the packed micro-batch.

The packed sequence (all groups of the micro-batch, ``T`` tokens) is padded at the end to a multiple
of the SP size and cut into equal contiguous slices of ``L = ceil(T / sp)`` tokens. Rank ``r`` holds
packed tokens ``[r*L, (r+1)*L)``; tokens at ``>= T`` are padding (token id ``pad_id``, position 0)
that no real query ever reads and whose outputs are dropped. The layout itself is never sliced:
every rank keeps the whole micro-batch's ``PackedLayout``.

Example, T = 10, sp = 4 (L = 3, two padding tokens on the last rank)::

    packed   t0 t1 t2 | t3 t4 t5 | t6 t7 t8 | t9 .. ..
    rank          0   |     1    |     2    |     3

Shape suffixes: T packed tokens, Tp padded packed tokens (sp * L), L tokens of one rank's slice,
D hidden size, ``...`` trailing dimensions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .groups import as_process_group, group_rank, group_size

__all__ = ["SequenceShard", "shard_sequence", "gather_sequence", "pad_to_multiple"]


def pad_to_multiple(x_T: torch.Tensor, multiple: int, value: float = 0) -> torch.Tensor:
    """Pad dim 0 of ``x`` at the end with ``value`` up to the next multiple of ``multiple``."""
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple: expected an int >= 1, got {multiple!r}")
    extra = -x_T.shape[0] % multiple
    if extra == 0:
        return x_T
    pad = [0, 0] * (x_T.dim() - 1) + [0, extra]
    return F.pad(x_T, pad, value=value)


@dataclass(frozen=True)
class SequenceShard:
    """One SP rank's contiguous slice of the padded packed sequence.

    Attributes:
        rank, size: this rank's index in the SP group and the group's size.
        total_tokens: T, the packed length of the micro-batch.
        local_tokens: L = ceil(T / size), tokens per rank (padding included).
    """

    rank: int
    size: int
    total_tokens: int
    local_tokens: int

    @classmethod
    def build(cls, total_tokens: int, rank: int, size: int) -> SequenceShard:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size: expected the SP group size as an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"rank: expected an int in [0, {size}), got {rank!r}")
        if not isinstance(total_tokens, int) or total_tokens < 1:
            raise ValueError(f"total_tokens: expected an int >= 1, got {total_tokens!r}")
        return cls(rank=rank, size=size, total_tokens=total_tokens, local_tokens=-(-total_tokens // size))

    @property
    def padded_tokens(self) -> int:
        """Tp = size * L."""
        return self.size * self.local_tokens

    @property
    def start(self) -> int:
        """First packed position of this rank's slice."""
        return self.rank * self.local_tokens

    @property
    def end(self) -> int:
        """One past the last packed position of this rank's slice (may exceed T: padding)."""
        return self.start + self.local_tokens

    @property
    def num_valid(self) -> int:
        """Real (non-padding) tokens in this rank's slice; 0 when the whole slice is padding."""
        return max(0, min(self.end, self.total_tokens) - self.start)

    def owner(self, position: torch.Tensor | int):
        """SP rank holding packed ``position`` (int or integer tensor)."""
        return position // self.local_tokens

    def slice(self, x_T: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """(T, ...) whole-sequence tensor -> (L, ...) this rank's slice, padded with ``pad_value``."""
        if not isinstance(x_T, torch.Tensor) or x_T.dim() < 1 or x_T.shape[0] != self.total_tokens:
            raise ValueError(
                f"x: expected a tensor of {self.total_tokens} packed tokens on dim 0, got shape "
                f"{tuple(getattr(x_T, 'shape', ()))}"
            )
        x_L = x_T[self.start : min(self.end, self.total_tokens)]
        missing = self.local_tokens - x_L.shape[0]
        if missing:
            x_L = F.pad(x_L, [0, 0] * (x_T.dim() - 1) + [0, missing], value=pad_value)
        return x_L

    def input_ids(self, layout, pad_id: int = 0) -> torch.Tensor:
        """(L,) this rank's token ids (padding = ``pad_id``)."""
        if layout.input_ids is None:
            raise ValueError("layout: expected a layout carrying input_ids (from_groups / from_rows), got one built from lengths only")
        return self.slice(layout.input_ids, pad_value=pad_id)

    def position_ids(self, layout) -> torch.Tensor:
        """(L,) this rank's RoPE positions (padding = 0)."""
        return self.slice(layout.position_ids, pad_value=0)


def shard_sequence(layout, group=None, *, rank: int | None = None, size: int | None = None) -> SequenceShard:
    """This rank's ``SequenceShard`` of ``layout``'s packed tokens.

    Give the SP process group (or a 1-D DeviceMesh; None = single device), or ``rank`` and ``size``
    directly (no process group needed, e.g. to plan on the host).
    """
    if (rank is None) != (size is None):
        raise ValueError("rank, size: expected both or neither")
    if rank is None:
        rank, size = group_rank(group), group_size(group)
    return SequenceShard.build(layout.total_tokens, rank, size)


class _GatherSequence(torch.autograd.Function):
    """All-gather of equal (L, ...) slices into (Tp, ...); backward keeps this rank's slice of the
    incoming gradient (the loss built from the gathered tensor is the same on every SP rank, so the
    SP ranks' gradients add up to the single-device one)."""

    @staticmethod
    def forward(ctx, x_L, group, rank):
        ctx.rank, ctx.local = rank, x_L.shape[0]
        parts = [torch.empty_like(x_L) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x_L.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad_Tp):
        start = ctx.rank * ctx.local
        return grad_Tp[start : start + ctx.local], None, None


def gather_sequence(x_L: torch.Tensor, shard: SequenceShard, group=None) -> torch.Tensor:
    """(L, ...) per-rank slices -> (T, ...) the whole packed sequence on every rank, padding dropped.

    Differentiable: the backward returns this rank's slice of the gradient (no communication), which
    is right when every SP rank computes the same loss from the gathered tensor.
    """
    if x_L.shape[0] != shard.local_tokens:
        raise ValueError(f"x: expected {shard.local_tokens} tokens (this rank's slice) on dim 0, got {x_L.shape[0]}")
    if shard.size == 1:
        return x_L[: shard.total_tokens]
    return _GatherSequence.apply(x_L, as_process_group(group), shard.rank)[: shard.total_tokens]

