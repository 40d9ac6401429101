"""DualKV-aware Ulysses attention: all-to-all from sequence slices to head slices, the DualKV op on
the WHOLE packed sequence with ``H / sp`` heads, and the inverse all-to-all.

Every rank holds ``L = ceil(T / sp)`` consecutive packed tokens with all heads. The forward
all-to-all gives every rank all ``Tp = sp * L`` tokens for its block of heads; the padding tail is
cut off, so the attention op sees exactly the micro-batch's T tokens and its whole ``PackedLayout``
(prompts once, responses after them, nothing sliced). The output goes back the same way::

    rank r:  q_LHd (tokens [rL, rL+L), heads 0..H)  --all-to-all-->  q_THh (all tokens, heads [rh, rh+h))
             out_THh  --pad to Tp, all-to-all-->  out_LHd

GQA under Ulysses: rank r gets query heads ``[r*H/sp, (r+1)*H/sp)`` and must get the K/V heads those
queries read. When ``sp`` does not divide ``H_kv`` (e.g. sp > H_kv) each K/V head is repeated
``f = sp / gcd(H_kv, sp)`` times IN PLACE (``repeat_interleave``: kv0 kv0 kv1 kv1 ...), so head
block r holds exactly the K/V heads of query block r. A tiled repeat (kv0 kv1 kv0 kv1) would hand
query heads the wrong K/V heads. Gradients of the copies are summed back by autograd.

Shape suffixes: T packed tokens, Tp padded tokens (sp * L), L tokens per rank, H query heads,
K kv heads, h = H / sp and k = K * f / sp heads per rank after the all-to-all, d head dim.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dualkv.core import dualkv_attention

from .groups import as_process_group, group_size

__all__ = [
    "UlyssesAttention",
    "ulysses_attention",
    "seq_to_heads",
    "heads_to_seq",
    "kv_replication_factor",
    "replicate_kv_heads",
]


# ---------------------------------------------------------------- all-to-all (one collective for many tensors)
def _exchange(chunks_sn: list[torch.Tensor], group) -> list[torch.Tensor]:
    """chunks[i] (sp, n_i): row j goes to rank j. Returns (sp, n_i) tensors whose row j came from rank j.

    All tensors travel in ONE all_to_all_single (packed side by side per destination)."""
    sizes = [c.shape[1] for c in chunks_sn]
    send = chunks_sn[0] if len(chunks_sn) == 1 else torch.cat(chunks_sn, dim=1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return list(recv.split(sizes, dim=1))


def _seq_to_heads(xs_LHd, group, sp):
    chunks = []
    for x in xs_LHd:
        L, H, d = x.shape
        chunks.append(x.reshape(L, sp, H // sp, d).transpose(0, 1).reshape(sp, -1))
    recv = _exchange(chunks, group)
    return tuple(r.reshape(sp * x.shape[0], x.shape[1] // sp, x.shape[2]) for r, x in zip(recv, xs_LHd))


def _heads_to_seq(xs_Tphd, group, sp):
    chunks = [x.reshape(sp, -1) for x in xs_Tphd]
    recv = _exchange(chunks, group)
    out = []
    for r, x in zip(recv, xs_Tphd):
        Tp, h, d = x.shape
        out.append(r.reshape(sp, Tp // sp, h, d).transpose(0, 1).reshape(Tp // sp, sp * h, d))
    return tuple(out)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, sp, *xs_LHd):
        ctx.group, ctx.sp = group, sp
        return _seq_to_heads(xs_LHd, group, sp)

    @staticmethod
    def backward(ctx, *grads_Tphd):
        return (None, None, *_heads_to_seq([g.contiguous() for g in grads_Tphd], ctx.group, ctx.sp))


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, sp, *xs_Tphd):
        ctx.group, ctx.sp = group, sp
        return _heads_to_seq(xs_Tphd, group, sp)

    @staticmethod
    def backward(ctx, *grads_LHd):
        return (None, None, *_seq_to_heads([g.contiguous() for g in grads_LHd], ctx.group, ctx.sp))


def _check_split(xs, what):
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"{what}[{i}]: expected a 3-D tensor (tokens, heads, headdim), got {tuple(getattr(x, 'shape', ()))}")
        if x.dtype != xs[0].dtype:
            raise ValueError(f"{what}[{i}]: expected dtype {xs[0].dtype} like the first tensor, got {x.dtype}")


def seq_to_heads(sp_group, *xs_LHd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(L, H_i, d_i) sequence slices -> (sp*L, H_i/sp, d_i) head slices, one all-to-all for all of them.

    Rank r receives heads ``[r*H_i/sp, (r+1)*H_i/sp)`` of every rank's tokens, in rank (= packed)
    order. Differentiable (the backward is ``heads_to_seq``)."""
    sp = group_size(sp_group)
    _check_split(xs_LHd, "xs")
    for i, x in enumerate(xs_LHd):
        if x.shape[1] % sp:
            raise ValueError(f"xs[{i}]: expected a head count divisible by the SP size {sp}, got {x.shape[1]} heads")
        if x.shape[0] != xs_LHd[0].shape[0]:
            raise ValueError(f"xs[{i}]: expected {xs_LHd[0].shape[0]} tokens like the first tensor, got {x.shape[0]}")
    if sp == 1:
        return tuple(xs_LHd)
    return _SeqToHeads.apply(as_process_group(sp_group), sp, *xs_LHd)


def heads_to_seq(sp_group, *xs_Tphd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(sp*L, h_i, d_i) head slices -> (L, sp*h_i, d_i) sequence slices; inverse of ``seq_to_heads``."""
    sp = group_size(sp_group)
    _check_split(xs_Tphd, "xs")
    for i, x in enumerate(xs_Tphd):
        if x.shape[0] % sp:
            raise ValueError(f"xs[{i}]: expected a token count divisible by the SP size {sp}, got {x.shape[0]}")
    if sp == 1:
        return tuple(xs_Tphd)
    return _HeadsToSeq.apply(as_process_group(sp_group), sp, *xs_Tphd)


# ---------------------------------------------------------------- GQA: K/V heads per rank
def kv_replication_factor(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many in-place copies of each K/V head Ulysses needs so that rank r's query heads
    ``[r*H/sp, (r+1)*H/sp)`` find their own K/V heads in K/V head block r: ``sp / gcd(H_kv, sp)``.

    Raises ValueError when ``sp`` does not divide ``num_heads`` or ``num_kv_heads`` does not."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: expected a divisor of num_heads={num_heads} (GQA/MQA), got {num_kv_heads}")
    if num_heads % sp:
        raise ValueError(
            f"sp: expected the SP size to divide the number of query heads ({num_heads}); Ulysses gives every "
            f"rank num_heads/sp heads, got sp={sp}"
        )
    return sp // math.gcd(num_kv_heads, sp)


def replicate_kv_heads(x_LKd: torch.Tensor, factor: int) -> torch.Tensor:
    """(L, K, d) -> (L, K*factor, d) with every head repeated in place: kv0 kv0 kv1 kv1 ... (GQA-correct)."""
    return x_LKd if factor == 1 else x_LKd.repeat_interleave(factor, dim=1)


# ---------------------------------------------------------------- the attention wrapper
def _check_local(q, k, v, layout, sp):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor (local tokens, heads, headdim), got {tuple(getattr(t, 'shape', ()))}")
    T = layout.total_tokens
    L = -(-T // sp)
    if q.shape[0] != L or k.shape[0] != L or v.shape[0] != L:
        raise ValueError(
            f"q/k/v: expected this rank's slice of ceil(T={T} / sp={sp}) = {L} tokens (see "
            f"dualkv.parallel.shard_sequence), got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"v: expected {k.shape[1]} heads like k, got {v.shape[1]}")


def ulysses_attention(q_LHd, k_LKd, v_LKd, layout, sp_group, *, attn_fn=dualkv_attention, return_lse=False, **kwargs):
    """DualKV attention of this rank's slice of the packed tokens under Ulysses SP.

    Args:
        q_LHd: (L, nheads, headdim); k_LKd, v_LKd: (L, nheads_k, headdim), with L = ceil(T / sp):
            this rank's slice of the packed (and padded) micro-batch.
        layout: the WHOLE micro-batch's ``PackedLayout`` (the same on every SP rank).
        sp_group: the SP process group (or 1-D DeviceMesh; None = single device).
        attn_fn: the local op, ``dualkv_attention`` by default (any callable with its signature).
        return_lse: also return lse (nheads, L) float32 of the local tokens (padding rows = 0).
        kwargs: passed to ``attn_fn`` (softmax_scale, window, softcap, deterministic, backend).
    Returns out (L, nheads, headdim) [, lse]. Padding rows of the output are zero.
    """
    sp = group_size(sp_group)
    _check_local(q_LHd, k_LKd, v_LKd, layout, sp)
    T = layout.total_tokens
    factor = kv_replication_factor(q_LHd.shape[1], k_LKd.shape[1], sp)
    k_LKd, v_LKd = replicate_kv_heads(k_LKd, factor), replicate_kv_heads(v_LKd, factor)
    q_Thd, k_Tkd, v_Tkd = (x[:T] for x in seq_to_heads(sp_group, q_LHd, k_LKd, v_LKd))
    res = attn_fn(q_Thd, k_Tkd, v_Tkd, layout, return_lse=True, **kwargs) if return_lse else attn_fn(
        q_Thd, k_Tkd, v_Tkd, layout, **kwargs)
    out_Thd, lse_hT = res if return_lse else (res, None)
    Tp = sp * q_LHd.shape[0]
    (out_LHd,) = heads_to_seq(sp_group, F.pad(out_Thd, (0, 0, 0, 0, 0, Tp - T)))
    if not return_lse:
        return out_LHd
    with torch.no_grad():
        lse_Tph1 = F.pad(lse_hT, (0, Tp - T)).transpose(0, 1).unsqueeze(-1).contiguous()
        (lse_LH1,) = heads_to_seq(sp_group, lse_Tph1)
    return out_LHd, lse_LH1.squeeze(-1).transpose(0, 1).contiguous()


class UlyssesAttention:
    """Drop-in ``attn_fn`` for a model's attention modules under Ulysses SP.

    ``module.attn_fn = UlyssesAttention(sp_group, module.attn_fn)`` (``parallelize_sequence`` does
    this for a whole model). Called exactly like ``dualkv_attention`` but on this rank's slice:
    ``attn(q (L, H, d), k (L, H_kv, d), v (L, H_kv, d), layout, softmax_scale=, window=, softcap=)``.
    """

    def __init__(self, sp_group, attn_fn=dualkv_attention):
        if not callable(attn_fn):
            raise ValueError(f"attn_fn: expected a callable with dualkv_attention's signature, got {type(attn_fn).__name__}")
        self.sp_group = sp_group
        self.attn_fn = attn_fn
        self.sp_size = group_size(sp_group)

    def __call__(self, q_LHd, k_LKd, v_LKd, layout, **kwargs):
        return ulysses_attention(q_LHd, k_LKd, v_LKd, layout, self.sp_group, attn_fn=self.attn_fn, **kwargs)

    def __repr__(self) -> str:
        inner = getattr(self.attn_fn, "__name__", type(self.attn_fn).__name__)
        return f"UlyssesAttention(sp={self.sp_size}, attn_fn={inner})"
