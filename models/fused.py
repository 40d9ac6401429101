"""Fused element-wise ops for the eager model: Liger-Kernel's Triton RMSNorm, RoPE and gated activations.

In eager PyTorch a Qwen3-style RMSNorm is four kernels forward (cast up, normalise, cast down, times
the weight), RoPE half a dozen (the rotate-half ``cat``, ``neg``, two broadcast multiplies, an add)
and SwiGLU two; their backwards as many again. Liger-Kernel (``pip install liger-kernel``, the
``fused`` extra) has one Triton kernel for each, forward and backward, with the same rounding points
as these modules' PyTorch code (its ``llama`` casting mode is the Qwen3 norm, ``gemma`` with offset 0
the Gemma-4 norm; its RoPE is the half-split rotation; its SwiGLU / GeGLU round the activation to the
input dtype before the product). They are not bit-identical to PyTorch's ops (``rsqrt`` against
``1 / sqrt``, other reduction orders); tests/gpu/test_models_gpu.py holds whole bf16 models with them
to the same fp32-relative tolerance as with PyTorch's ops.

Modes (``set_fused_ops`` / ``fused_ops``; the default is ``auto``)::

    auto    Liger's kernels on CUDA tensors where Liger-Kernel is installed, PyTorch's ops otherwise
    liger   Liger's kernels on every tensor; a clear error where they cannot run
    off     PyTorch's ops everywhere

Under ``torch.compile`` the PyTorch ops are always used (Inductor fuses them itself, with the
residual adds and casts around them), whatever the mode.

Shape legend as in ``layers.py``: ``q_THd`` (T, H, d), ``k_TKd`` (T, K, d), ``cos_Td`` (T, d).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import torch

__all__ = ["FUSED_MODES", "fused_ops", "get_fused_ops", "liger_available", "liger_runs_on", "set_fused_ops",
           "use_liger"]

FUSED_MODES = ("auto", "liger", "off")
_MODE = "auto"


@functools.cache
def liger_available() -> bool:
    """Whether Liger-Kernel can be imported (looked up once: ``use_liger`` asks on every op)."""
    return importlib.util.find_spec("liger_kernel") is not None


def set_fused_ops(mode: str) -> None:
    """Set the fused-op mode for every model in this process (see the module docstring)."""
    global _MODE
    if mode not in FUSED_MODES:
        raise ValueError(f"mode: expected one of {FUSED_MODES}, got {mode!r}")
    if mode == "liger" and not liger_available():
        raise ValueError("mode: 'liger' needs Liger-Kernel (pip install liger-kernel, or the 'fused' extra)")
    _MODE = mode


def get_fused_ops() -> str:
    return _MODE


@contextlib.contextmanager
def fused_ops(mode: str):
    """``with fused_ops("off"): ...`` sets the mode for the block and restores the previous one."""
    previous = _MODE
    set_fused_ops(mode)
    try:
        yield
    finally:
        set_fused_ops(previous)


def use_liger(*tensors: torch.Tensor) -> bool:
    """Whether the ops on these tensors take Liger's kernels under the current mode."""
    if _MODE == "off" or torch.compiler.is_compiling():
        return False
    on_gpu = all(t.is_cuda for t in tensors)
    if _MODE == "liger":
        if not (on_gpu or os.environ.get("TRITON_INTERPRET") == "1"):
            devices = sorted({str(t.device) for t in tensors})
            raise ValueError(f"fused ops 'liger': Liger's Triton kernels need CUDA tensors, got tensors on {devices} "
                             "(use mode 'auto' or 'off')")
        return True
    return on_gpu and liger_available()


def liger_runs_on(device: torch.device | str) -> bool:
    """Whether eager models on ``device`` take Liger's kernels under the current mode (for reports)."""
    return use_liger(torch.empty(0, device=device))


# ------------------------------------------------------------------------------------ the ops
def liger_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, style: str) -> torch.Tensor:
    """RMSNorm over the last dim. style ``qwen3``: fp32 statistics, cast, then times the weight in the
    input dtype; ``gemma4``: all in fp32 (weight optional), then cast. ``dX`` is written to a new tensor
    (never over the incoming gradient, which a residual branch may still need)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    casting = "llama" if style == "qwen3" else "gemma"
    return LigerRMSNormFunction.apply(x, weight, eps, 0.0, casting, False)


def liger_rope_qk(q_THd: torch.Tensor, k_TKd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor):
    """Rotate q and k in one kernel (the half-split convention; ``cos_Td`` / ``sin_Td`` hold each
    frequency twice, as ``rope_tables`` makes them). Liger rotates in place: the caller passes tensors
    that nothing else reads (e.g. fresh norm outputs), never a tensor aliased by v."""
    from liger_kernel.ops.rope import LigerRopeFunction

    # Liger takes (batch, heads, T, d) views of (batch, T, heads, d) storage: ours with batch 1.
    q_1HTd, k_1KTd = LigerRopeFunction.apply(q_THd.unsqueeze(0).transpose(1, 2), k_TKd.unsqueeze(0).transpose(1, 2),
                                             cos_Td, sin_Td)
    return q_1HTd.transpose(1, 2).squeeze(0), k_1KTd.transpose(1, 2).squeeze(0)


def liger_gated(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up in one kernel, ``silu`` or ``gelu_tanh``."""
    if activation == "silu":
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        return LigerSiLUMulFunction.apply(gate, up)
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return LigerGELUMulFunction.apply(gate, up)
