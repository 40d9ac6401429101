"""What the Gluon kernels (``gluon_fwd``, ``gluon_dkdv``) take from Triton's tile-level language,
with the names that moved between Triton releases (3.6 on the GPU machine, 3.9 in CI), and a
GPU-free sm_90 compile for the CPU tests.

Gluon is experimental: where its Hopper API is missing, ``AVAILABLE`` is False and the Triton
backend runs its ``tl`` kernels instead."""

from __future__ import annotations

import torch
import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton._C.libtriton import ir

    tma_load = getattr(tma, "async_load", None) or getattr(tma, "async_copy_global_to_shared")
    block_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
    AVAILABLE = hasattr(gl, "warp_specialize")
except (ImportError, AttributeError):  # pragma: no cover - a Triton without Gluon, or another API
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
    tma_load = block_barrier = fence_async_shared = builtin = ir = None
    AVAILABLE = False


if AVAILABLE:
    @builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        """global[box at coord] += src (a shared-memory tile) by TMA reduce-add, asynchronously: the
        tile may be overwritten after ``tma.store_wait`` (Gluon's ``async_atomic_add`` in later
        releases; this builder call is the same in 3.6 and 3.9)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)

    @gluon.jit
    def hidden_zero(i):
        """0, by an instruction the compiler cannot see through. ``buffers.index(hidden_zero(i))`` in a
        loop over i makes the compiler rebuild that buffer's wgmma operand descriptors inside the loop:
        left to itself it computes them once before the loop and holds them there, two registers each,
        one per 16-wide step of a product (about 80 registers for the dK/dV kernel's K, V, dS and dQ
        buffers, which then spilled)."""
        return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=True, pack=1)
else:  # pragma: no cover
    tma_add = hidden_zero = None


def on_hopper(t: torch.Tensor) -> bool:
    """The Gluon kernels issue wgmma: sm_90 only."""
    return AVAILABLE and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] == 9


def gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def desc(t: torch.Tensor, rows: int):
    """A descriptor over (rows, heads, d) seen as (rows, heads * d), with boxes of (rows, d)."""
    d = t.shape[2]
    layout = gl.NVMMASharedLayout.get_default_for([rows, d], gl_dtype(t.dtype))
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * d], [t.stride(0), 1], [rows, d], layout)


def tile_sig(dtype: str, rows: int, dim: int) -> str:
    """The signature string of a ``desc(t, rows)`` argument, for ``compile_for_sm90``."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, dim], {"bf16": gl.bfloat16, "fp16": gl.float16,
                                                                "fp32": gl.float32}[dtype])
    return f"tensordesc<{dtype}[{rows}, {dim}],{layout!r}>"


def compile_for_sm90(fn, sig: dict, const: dict, num_warps: int, maxnreg: int | None = None):
    """Compile a Gluon kernel for sm_90 without a GPU. sig: argument -> type string; const: constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**sig, **{name: "constexpr" for name in const}}
    sig = {name: sig[name] for name in fn.arg_names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()})
    options = {"num_warps": num_warps}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
