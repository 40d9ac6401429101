"""The N-replicated padded batch a layout stands for: what a framework runs without DualKV.

Row b is its group's prompt followed by its response, right-padded to the longest row, positions
0..P+R-1. Running a stock model on it (any attention, a padding mask) and reading the response
log-probs with ``replicated_response_logprobs`` gives the baseline every DualKV result must equal.

Shape legend: B rows, L longest replicated row (max P + R), V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dualkv.core import PackedLayout
from dualkv.core.layout import to_device
from dualkv.core.logprobs import gather_logprobs

__all__ = ["ReplicatedBatch", "replicated_batch", "replicated_response_logprobs"]


class ReplicatedBatch(NamedTuple):
    """input_ids, attention_mask, position_ids: (B, L); src, tgt: flat (n,) indices into B*L,
    ``src`` the row position whose logits predict token ``tgt``, in ``layout.logprob_index`` order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    src: torch.Tensor
    tgt: torch.Tensor


def _to_padded(flat_pos: torch.Tensor, cu: torch.Tensor, L: int) -> torch.Tensor:
    row = torch.searchsorted(cu[1:], flat_pos, right=True)
    return row * L + (flat_pos - cu[row])


def replicated_batch(layout: PackedLayout, pad_token_id: int = 0) -> ReplicatedBatch:
    """The replicated rows of ``layout`` (which must carry ``input_ids``), right-padded."""
    if not isinstance(layout, PackedLayout) or layout.input_ids is None:
        raise ValueError("layout: expected a dualkv.core.PackedLayout carrying input_ids (from_groups / from_rows)")
    index, cu = layout.replicated_index()
    cu = cu.long()
    # sizes from the host lengths: reading them off ``cu`` would wait for the device
    lens = [layout.prompt_lens[g] + layout.response_lens[g][i] for g, i in zip(layout.row_group, layout.row_index_in_group)]
    B, L = layout.num_rows, max(lens)
    flat = torch.arange(layout.replicated_tokens, device=layout.device)
    padded = _to_padded(flat, cu, L)
    input_ids = torch.full((B * L,), pad_token_id, dtype=layout.input_ids.dtype, device=layout.device)
    input_ids[padded] = layout.input_ids[index]
    lens_B = to_device(torch.tensor(lens), layout.device)
    mask = (torch.arange(L, device=layout.device)[None, :] < lens_B[:, None]).long().view(-1)
    position_ids = torch.arange(L, device=layout.device).expand(B, L).contiguous()
    src, tgt = layout.replicated_logprob_index()
    return ReplicatedBatch(
        input_ids.view(B, L), mask.view(B, L), position_ids, _to_padded(src, cu, L), _to_padded(tgt, cu, L)
    )


def replicated_response_logprobs(
    logits_BLV: torch.Tensor, batch: ReplicatedBatch, layout: PackedLayout, temperature: float = 1.0
) -> torch.Tensor:
    """logits (B, L, V) of the replicated batch -> (B, R_max) response log-probs, zero-padded."""
    B, L = batch.input_ids.shape
    if logits_BLV.dim() != 3 or tuple(logits_BLV.shape[:2]) != (B, L):
        raise ValueError(f"logits_BLV: expected shape ({B}, {L}, vocab), got {tuple(logits_BLV.shape)}")
    flat = logits_BLV.reshape(B * L, -1)
    targets = batch.input_ids.reshape(-1)[batch.tgt]
    return layout.unpack_logprobs(gather_logprobs(flat[batch.src], targets, temperature))
