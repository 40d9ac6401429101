"""Triton backend: fused DualKV attention kernels, forward and backward, one launch each.

Forward: one launch over (query tiles of every segment, heaviest first) x heads; a response tile
reads its group's prompt blocks (no mask but a window edge or the ragged tail) then its own blocks
(causal only near the diagonal); online softmax in fp32 with exp2; LSE saved for backward. GQA/MQA
read K/V of the shared kv head directly (never expanded); a tile's heads are neighbours in the
launch, so they read the same K/V through L2.

Backward: ``delta = rowsum(dO * O)``; a key-parallel dK/dV kernel (a prompt key block takes its own
prompt queries causally plus every reader query of its group, the long reader range split over
several programs whose fp32 partials are summed in a fixed order and cast once); then dQ from a
query-parallel kernel, written once. On Hopper (sm_90, fp16 / bf16, the packed layout without a
window or softcap) warp-specialised Gluon kernels take over: at head dim 128 ``gluon_dkdv_ws``, a
dK/dV kernel that also adds dQ into an fp32 accumulator by TMA reduce-adds (five matrix products a
block pair instead of seven; 1.2-1.3x the ``tl`` backward's speed at P >= 16K on an H200), at 256
``gluon_split256`` (dK/dV and dQ, each program's two warpgroups split by role; 1.6-1.7x).
``DUALKV_TRITON_GLUON_BWD=0`` runs the ``tl`` kernels.

Determinism: dK and dV are bit-identical run to run always (fixed-order sums, no atomics). dQ is too,
except where it is added by reduce-adds: by default at head dim 128 on Hopper (the order of the adds
varies, so its last bits do), or anywhere with ``DUALKV_TRITON_ATOMIC_DQ=1``. ``deterministic=True``
always takes the dQ kernel instead, which costs the backward about 15-25% of its speed at head dim
128 on Hopper (the ``tl`` kernels' time) and nothing elsewhere.

Supported: fp16 and bf16 on CUDA (fp32 too, exact IEEE dots, slow); head dims 16..512 (96 and 192
run padded to 128 and 256); any GQA ratio; sliding windows; tanh softcap. Without a GPU the
kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, fp32/fp16), which is what the
CPU tests use.
"""

from __future__ import annotations

import os

import torch

NAME = "triton"
HEAD_DIMS = (16, 32, 64, 96, 128, 192, 256, 512)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

try:
    import triton  # noqa: F401

    _IMPORT_ERROR = None
except ImportError as err:  # pragma: no cover - triton is a test dependency
    _IMPORT_ERROR = err


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_available() -> bool:
    return _IMPORT_ERROR is None and (torch.cuda.is_available() or _interpret())


def unavailable_reason() -> str:
    if _IMPORT_ERROR is not None:
        return f"triton is not importable ({_IMPORT_ERROR}); install dualkv[triton]"
    if not is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the CPU interpreter)"
    return ""


def check_tensor(name: str, t: torch.Tensor, what: str) -> None:
    """Raise ValueError, naming ``name``, unless Triton kernels (``what``, for the message) can run on
    ``t`` here: its dtype, and a CUDA device or the CPU interpreter (which has no bf16)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: expected float16, bfloat16 or float32 for {what}, got dtype {t.dtype}")
    if t.is_cuda:
        if t.dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{name}: bfloat16 needs a GPU with bf16 support (compute capability >= 8.0)")
    elif not _interpret():
        raise ValueError(f"{name}: expected a CUDA tensor for {what}, got device {t.device} "
                         "(TRITON_INTERPRET=1 runs the kernels on CPU)")
    elif t.dtype == torch.bfloat16:
        raise ValueError(f"{name}: bfloat16 is not supported by the Triton CPU interpreter; use float16 or float32")


def check_supported(q, k, v, window, softcap) -> None:
    """Raise ValueError, naming the argument, for inputs these kernels do not handle."""
    check_tensor("q", q, "the triton backend")
    if q.shape[2] not in HEAD_DIMS:
        raise ValueError(f"q: expected headdim in {HEAD_DIMS} for the triton backend, got {q.shape[2]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last dimension, got strides {t.stride()}")


def forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap):
    from .launcher import forward as _forward

    return _forward(q, k, v, k_ctx, v_ctx, meta, softmax_scale, window, softcap)


def backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic):
    from .launcher import backward as _backward

    return _backward(dout, q, k, v, k_ctx, v_ctx, out, lse, meta, softmax_scale, window, softcap, deterministic)
