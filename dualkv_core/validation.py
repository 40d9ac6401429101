"""Input checks shared by every public entry point. Each error names the argument and what was expected."""

from __future__ import annotations

import math

import torch

__all__ = ["check_attention_inputs", "SUPPORTED_DTYPES"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(msg: str):
    raise ValueError(msg)


def check_qkv(q, k, v, total: int | None = None, k_name: str = "k", v_name: str = "v", same_tokens: bool = True) -> None:
    """q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), total_k == total_q if same_tokens."""
    for name, t in (("q", q), (k_name, k), (v_name, v)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            _fail(f"{name}: expected a 3-D tensor (tokens, heads, headdim), got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            _fail(f"{name}: expected dtype float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dtype != q.dtype:
            _fail(f"{name}: expected the same dtype as q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            _fail(f"{name}: expected the same device as q ({q.device}), got {t.device}")
        if t.stride(-1) != 1:
            _fail(f"{name}: expected the last (headdim) dimension to be contiguous, got strides {t.stride()}")
    if total is not None and q.shape[0] != total:
        _fail(f"q: expected {total} tokens (the layout's packed length T), got {q.shape[0]}")
    if same_tokens and k.shape[0] != q.shape[0]:
        _fail(f"{k_name}: expected {q.shape[0]} tokens like q, got {k.shape[0]}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        _fail(f"{v_name}: expected the same (tokens, heads) as {k_name} {tuple(k.shape[:2])}, got {tuple(v.shape[:2])}")
    H, Hkv = q.shape[1], k.shape[1]
    if Hkv < 1 or H % Hkv != 0:
        _fail(f"{k_name}: expected nheads_k to divide nheads (GQA/MQA), got nheads={H}, nheads_k={Hkv}")
    if k.shape[2] != q.shape[2] or v.shape[2] != q.shape[2]:
        _fail(f"{k_name}/{v_name}: expected headdim {q.shape[2]} like q, got {k.shape[2]} and {v.shape[2]}")


def _finite(x) -> bool:
    """math.isfinite by comparisons, which torch.compile traces without a graph break."""
    return x == x and abs(x) != math.inf


def check_options(headdim: int, softmax_scale, window, softcap) -> tuple[float, int | None, float | None]:
    """Normalise the scalar options: a scale > 0, a window >= 1 or None, a softcap > 0 or None."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    if not isinstance(softmax_scale, (int, float)) or not _finite(softmax_scale) or softmax_scale <= 0:
        _fail(f"softmax_scale: expected a finite positive number, got {softmax_scale!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            _fail(f"window: expected None or an int >= 1 (a query sees keys with qpos - kpos < window), got {window!r}")
    if softcap is not None and softcap != 0:
        if not isinstance(softcap, (int, float)) or not _finite(softcap) or softcap <= 0:
            _fail(f"softcap: expected None or a finite positive number, got {softcap!r}")
    else:
        softcap = None
    return float(softmax_scale), window, None if softcap is None else float(softcap)


def check_layout(layout, q: torch.Tensor) -> None:
    from .layout import PackedLayout

    if not isinstance(layout, PackedLayout):
        _fail(f"layout: expected a dualkv.core.PackedLayout, got {type(layout).__name__}")
    if layout.device != q.device:
        _fail(f"layout: expected its tensors on q's device {q.device}, got {layout.device} (use layout.to(device))")


def check_attention_inputs(q, k, v, layout, softmax_scale, window, softcap):
    """All checks of ``dualkv_attention``; returns the normalised (scale, window, softcap)."""
    check_layout(layout, q if isinstance(q, torch.Tensor) else torch.empty(0))
    check_qkv(q, k, v, total=layout.total_tokens)
    return check_options(q.shape[2], softmax_scale, window, softcap)
