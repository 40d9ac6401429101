"""Attention backends: one module each, one contract.

A backend module defines::

    NAME: str
    def is_available() -> bool
    def check_supported(q, k, v, window, softcap) -> None      # raise ValueError naming the argument
    def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap) -> (out, lse)
    def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap,
                 deterministic) -> (dq, dk, dv, dk_ctx, dv_ctx)

``meta`` is an ``AttnMeta``; ``window`` an int or None; ``softcap`` a float or None; ``k_ctx`` /
``v_ctx`` None when context keys live in k / v themselves (the packed layout), and then the context
gradients are summed into dk / dv and ``dk_ctx``, ``dv_ctx`` are None. ``out`` is (total_q, H, d)
in q's dtype, ``lse`` is (H, total_q) float32.
"""

from __future__ import annotations

import importlib

import torch

__all__ = ["get_backend", "resolve_backend", "available_backends", "BACKENDS"]

BACKENDS = {
    "reference": "dualkv.core.backends.reference",
    "triton": "dualkv.core.backends.triton",
    "cuda": "dualkv.core.backends.cuda",
}
# Preference of "auto" on CUDA tensors, fastest first.
AUTO_ORDER_CUDA = ("triton",)
# Head dims where "auto" takes the CUDA backend instead, for fp16 / bf16 when its extension is already
# built and runs the Hopper wgmma kernels there: measured ahead of Triton forward and backward
# (benchmarks/results/cuda_split_backward_d256_h200.md, d = 256: 1.16x forward+backward). At d = 128
# neither is ahead in every config (within 4%), other head dims are not measured: Triton.
AUTO_CUDA_HEAD_DIMS = (256,)


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"backend: expected one of {['auto', *BACKENDS]}, got {name!r}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as err:  # the module itself is missing (not built yet)
        raise RuntimeError(f"backend {name!r} is not available in this installation: {err}") from err


def _available(name: str) -> bool:
    try:
        return get_backend(name).is_available()
    except RuntimeError:
        return False


def _runs_wgmma(head_dim: int) -> bool:
    try:
        return get_backend("cuda").runs_wgmma(head_dim)
    except RuntimeError:
        return False


def available_backends() -> list[str]:
    return [name for name in BACKENDS if _available(name)]


def resolve_backend(name: str, where: torch.Tensor | torch.device | str, head_dim: int | None = None,
                    dtype: torch.dtype | None = None) -> str:
    """``auto``: the fastest available kernel backend for CUDA tensors, else the reference.

    ``where`` is a tensor (its device, head dim and dtype count) or a device; ``head_dim`` / ``dtype``
    (taken from a tensor when not given) let ``auto`` follow the measured table per shape class.
    """
    is_cuda = where.is_cuda if isinstance(where, torch.Tensor) else torch.device(where).type == "cuda"
    if isinstance(where, torch.Tensor):
        head_dim = where.shape[-1] if head_dim is None else head_dim
        dtype = where.dtype if dtype is None else dtype
    if name != "auto":
        backend = get_backend(name)
        if not backend.is_available():
            raise RuntimeError(f"backend {name!r} is not available here: {backend.unavailable_reason()}")
        return name
    if is_cuda:
        if head_dim in AUTO_CUDA_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16) and _runs_wgmma(head_dim):
            return "cuda"
        for candidate in AUTO_ORDER_CUDA:
            if _available(candidate):
                return candidate
    return "reference"
