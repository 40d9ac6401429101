"""Pure-PyTorch reference of the DualKV attention rule: exact, any device, the oracle of every test.

Memory is bounded per query chunk of one segment (``H x chunk x (ctx_len + own_len)`` scores), never
T x T for the whole batch, so it runs at P = 4K on a CPU.

Rule (segment s, own query i at logical position ``ctx_len + i``)::

    context keys j in [0, ctx_len):      visible            (and qpos - j < window)
    own keys     i' in [0, own_len):      visible if i' <= i (and qpos - kpos < window)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["AttnMeta", "reference_attention", "reference_attention_meta", "reference_attention_backward_meta"]


class AttnMeta(NamedTuple):
    """The int32 metadata the attention op needs (see ``PackedLayout`` for the meaning).

    cu_seqlens (S+1,), seg_ctx_start (S,), seg_ctx_len (S,) describe the query segments;
    ctx_key_start, ctx_key_len, ctx_reader_start, ctx_reader_end (C,) describe each context region
    and the contiguous query range that reads it (used by backward kernels).
    """

    cu_seqlens: torch.Tensor
    seg_ctx_start: torch.Tensor
    seg_ctx_len: torch.Tensor
    ctx_key_start: torch.Tensor
    ctx_key_len: torch.Tensor
    ctx_reader_start: torch.Tensor
    ctx_reader_end: torch.Tensor

    @classmethod
    def from_layout(cls, layout) -> AttnMeta:
        return cls(
            layout.cu_seqlens,
            layout.seg_ctx_start,
            layout.seg_ctx_len,
            layout.ctx_key_start,
            layout.ctx_key_len,
            layout.ctx_reader_start,
            layout.ctx_reader_end,
        )


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def reference_attention_meta(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttnMeta,
    softmax_scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_ctx: torch.Tensor | None = None,
    v_ctx: torch.Tensor | None = None,
    q_chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference on raw metadata. Context keys come from ``k_ctx``/``v_ctx`` when given, else from k/v.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_q, nheads_k, headdim), own keys of each segment.
        k_ctx, v_ctx: (total_ctx, nheads_k, headdim) or None.
    Returns:
        out: (total_q, nheads, headdim) in q's dtype; lse: (nheads, total_q) float32 (float64 for
        float64 inputs), natural-log sum of exp of the scaled (and softcapped) scores.
    Differentiable through autograd (context gradients are summed over every reader).
    """
    H = q.shape[1]
    outs, lses = [], []
    for blk in _chunks(q, k, v, meta, softmax_scale, window, softcap, k_ctx, v_ctx, q_chunk):
        lse = torch.logsumexp(blk.scores, dim=-1)  # (H, m)
        probs = torch.exp(blk.scores - lse[..., None])
        outs.append(torch.einsum("hmk,khd->mhd", probs, blk.vals))
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype) if outs else q.new_empty(q.shape)
    lse = torch.cat(lses, dim=1) if lses else q.new_empty((H, 0))
    return out, lse if q.dtype == torch.float64 else lse.float()


class _Chunk(NamedTuple):
    q_rows: slice  # rows of q (packed)
    own_rows: slice  # own keys of the segment visible to this chunk (packed rows of k)
    ctx_rows: slice  # context keys (rows of k_ctx)
    qs: torch.Tensor  # (m, H, d) in compute dtype
    keys: torch.Tensor  # (c + n_own, H, d), GQA-expanded
    vals: torch.Tensor
    raw: torch.Tensor  # (H, m, c + n_own) scaled scores before softcap
    scores: torch.Tensor  # masked (and softcapped) scores, -inf where not visible


def _chunks(q, k, v, meta, softmax_scale, window, softcap, k_ctx, v_ctx, q_chunk):
    """Yield every (segment, query chunk) with its visible keys and masked scores."""
    k_ctx = k if k_ctx is None else k_ctx
    v_ctx = v if v_ctx is None else v_ctx
    cdt = _compute_dtype(q.dtype)
    rep = q.shape[1] // k.shape[1]
    cu = meta.cu_seqlens.tolist()
    ctx_start = meta.seg_ctx_start.tolist()
    ctx_len = meta.seg_ctx_len.tolist()
    for s in range(len(cu) - 1):
        a, e = cu[s], cu[s + 1]
        n, c, cs = e - a, ctx_len[s], ctx_start[s]
        for qa in range(0, n, q_chunk):
            qe = min(n, qa + q_chunk)  # own keys past the chunk's last query are never visible
            ctx_rows, own_rows = slice(cs, cs + c), slice(a, a + qe)
            keys = torch.cat([k_ctx[ctx_rows], k[own_rows]]).to(cdt).repeat_interleave(rep, dim=1)
            vals = torch.cat([v_ctx[ctx_rows], v[own_rows]]).to(cdt).repeat_interleave(rep, dim=1)
            qs = q[a + qa: a + qe].to(cdt)
            raw = torch.einsum("mhd,khd->hmk", qs, keys) * softmax_scale
            scores = softcap * torch.tanh(raw / softcap) if softcap else raw
            kpos = torch.arange(c + qe, device=q.device)  # context j -> j, own i -> c + i
            qpos = c + torch.arange(qa, qe, device=q.device)
            visible = kpos[None, :] <= qpos[:, None]
            if window is not None:
                visible &= (qpos[:, None] - kpos[None, :]) < window
            yield _Chunk(slice(a + qa, a + qe), own_rows, ctx_rows, qs, keys, vals, raw, scores.masked_fill(~visible, -math.inf))


def reference_attention_backward_meta(
    dout, q, k, v, meta, softmax_scale, window=None, softcap=None, k_ctx=None, v_ctx=None, q_chunk=1024
):
    """Explicit gradients of ``reference_attention_meta`` (recomputing the forward per chunk).

    Returns dq, dk, dv (and dk_ctx, dv_ctx when k_ctx is given, else None), in the inputs' dtypes;
    accumulation in fp32 (fp64 for fp64). Context gradients are summed over every reading query.
    Used by the reference backend inside the custom op, where autograd is not available; the tests
    check it against autograd through ``reference_attention_meta``.
    """
    cdt = _compute_dtype(q.dtype)
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[2]
    rep = H // Hkv
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    separate = k_ctx is not None
    dk_c = torch.zeros(k_ctx.shape, dtype=cdt, device=q.device) if separate else dk
    dv_c = torch.zeros(v_ctx.shape, dtype=cdt, device=q.device) if separate else dv
    for blk in _chunks(q, k, v, meta, softmax_scale, window, softcap, k_ctx, v_ctx, q_chunk):
        probs = torch.softmax(blk.scores, dim=-1)  # (H, m, K)
        do = dout[blk.q_rows].to(cdt)  # (m, H, d)
        dvals = torch.einsum("hmk,mhd->khd", probs, do)
        dp = torch.einsum("mhd,khd->hmk", do, blk.vals)
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
        if softcap:
            ds = ds * (1 - torch.tanh(blk.raw / softcap) ** 2)
        ds = ds * softmax_scale
        dq[blk.q_rows] += torch.einsum("hmk,khd->mhd", ds, blk.keys)
        dkeys = torch.einsum("hmk,mhd->khd", ds, blk.qs)
        # fold the GQA-expanded heads back onto their kv head
        dkeys = dkeys.view(-1, Hkv, rep, d).sum(2)
        dvals = dvals.view(-1, Hkv, rep, d).sum(2)
        c = blk.ctx_rows.stop - blk.ctx_rows.start
        dk_c[blk.ctx_rows] += dkeys[:c]
        dv_c[blk.ctx_rows] += dvals[:c]
        dk[blk.own_rows] += dkeys[c:]
        dv[blk.own_rows] += dvals[c:]
    grads = [dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)]
    if separate:
        return (*grads, dk_c.to(k_ctx.dtype), dv_c.to(v_ctx.dtype))
    return (*grads, None, None)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    backend: str = "reference",
):
    """DualKV attention in pure PyTorch, same arguments as ``dualkv_attention``.

    q: (T, nheads, headdim), k, v: (T, nheads_k, headdim) over the packed layout. Exact (fp32
    accumulation for fp16/bf16, fp64 for fp64), differentiable by autograd. ``deterministic`` and
    ``backend`` are accepted for signature parity and ignored.
    """
    from .validation import check_attention_inputs

    softmax_scale, window, softcap = check_attention_inputs(q, k, v, layout, softmax_scale, window, softcap)
    out, lse = reference_attention_meta(q, k, v, AttnMeta.from_layout(layout), softmax_scale, window, softcap)
    return (out, lse) if return_lse else out
