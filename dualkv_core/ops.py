"""The attention op as ``torch.library`` custom ops (forward, backward) with fake implementations,
so torch.compile and FSDP2 trace through it, and autograd registered on the forward.

``torch.ops.dualkv.attention_fwd`` / ``attention_bwd`` dispatch to a backend by name
(``dualkv.core.backends``). Models never call these directly: use ``dualkv.core.dualkv_attention``.
Conventions: window = -1 means none, softcap = 0.0 means none; k_ctx / v_ctx None means context keys
live in k / v (the packed layout).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backends import get_backend, split_backend
from .reference import AttnMeta

__all__ = ["attention_fwd", "attention_bwd"]


def _opts(window: int, softcap: float):
    return (None if window < 0 else window), (None if softcap == 0.0 else softcap)


@torch.library.custom_op("dualkv::attention_fwd", mutates_args=())
def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_ctx: Optional[Tensor],
    v_ctx: Optional[Tensor],
    meta: list[Tensor],
    softmax_scale: float,
    window: int,
    softcap: float,
    deterministic: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """out (total_q, H, d) in q's dtype, lse (H, total_q) float32."""
    win, cap = _opts(window, softcap)
    out, lse = get_backend(split_backend(backend)[0]).forward(q, k, v, k_ctx, v_ctx, AttnMeta(*meta), softmax_scale, win, cap)
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap, deterministic, backend):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("dualkv::attention_bwd", mutates_args=())
def attention_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_ctx: Optional[Tensor],
    v_ctx: Optional[Tensor],
    out: Tensor,
    lse: Tensor,
    meta: list[Tensor],
    softmax_scale: float,
    window: int,
    softcap: float,
    deterministic: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dk_ctx, dv_ctx (the last two empty when k_ctx is None)."""
    win, cap = _opts(window, softcap)
    dq, dk, dv, dk_ctx, dv_ctx = get_backend(split_backend(backend)[1]).backward(
        dout, q, k, v, k_ctx, v_ctx, out, lse, AttnMeta(*meta), softmax_scale, win, cap, deterministic
    )
    if dk_ctx is None:
        dk_ctx, dv_ctx = q.new_empty(0), q.new_empty(0)
    return dq, dk, dv, dk_ctx, dv_ctx


@attention_bwd.register_fake
def _(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic, backend):
    if k_ctx is None:
        dk_ctx, dv_ctx = q.new_empty(0), q.new_empty(0)
    else:
        dk_ctx, dv_ctx = torch.empty_like(k_ctx), torch.empty_like(v_ctx)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dk_ctx, dv_ctx


def _setup_context(ctx, inputs, output):
    q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, k_ctx, v_ctx, out, lse, *meta)
    ctx.options = dict(softmax_scale=softmax_scale, window=window, softcap=softcap, deterministic=deterministic, backend=backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, k_ctx, v_ctx, out, lse, *meta = ctx.saved_tensors
    dq, dk, dv, dk_ctx, dv_ctx = attention_bwd(dout.contiguous(), q, k, v, k_ctx, v_ctx, out, lse, meta, **ctx.options)
    if k_ctx is None:
        dk_ctx = dv_ctx = None
    return dq, dk, dv, dk_ctx, dv_ctx, [None] * len(meta), None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
