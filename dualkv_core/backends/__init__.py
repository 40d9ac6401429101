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


def available_backends() -> list[str]:
    return [name for name in BACKENDS if _available(name)]


def resolve_backend(name: str, where: torch.Tensor | torch.device | str) -> str:
    """``auto``: the fastest available kernel backend for CUDA tensors, else the reference.

    ``where`` is a tensor (its device counts) or a device.
    """
    is_cuda = where.is_cuda if isinstance(where, torch.Tensor) else torch.device(where).type == "cuda"
    if name != "auto":
        backend = get_backend(name)
        if not backend.is_available():
            raise RuntimeError(f"backend {name!r} is not available here: {backend.unavailable_reason()}")
        return name
    if is_cuda:
        for candidate in AUTO_ORDER_CUDA:
            if _available(candidate):
                return candidate
    return "reference"
