"""The Hopper wgmma building blocks of csrc/dkv_wgmma.cuh on an sm_90 GPU, against torch: 64 x 64 bf16
tiles in 128B-swizzled shared memory, S = Q K^T (operands from shared memory, K-major), A B with B
as an MN-major operand, A from registers (also m64n128 over a two-part MN-major B), and the attention step O = bf16(Q K^T) V that a wgmma
attention kernel repeats. tests/gpu/wgmma_check.cu holds the kernels (one warpgroup each)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"

_BINDING = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
extern "C" void dkv_check_gemm_ss(const void*, const void*, float*, int, cudaStream_t);
extern "C" void dkv_check_gemm_rs(const void*, const void*, float*, cudaStream_t);
extern "C" void dkv_check_attention_step(const void*, const void*, const void*, float*, cudaStream_t);
extern "C" void dkv_check_gemm_rs_wide(const void*, const void*, const void*, float*, cudaStream_t);

static torch::Tensor out_like(const torch::Tensor& a) {
  return torch::empty({64, 64}, a.options().dtype(torch::kFloat32));
}

torch::Tensor gemm_ss(torch::Tensor a, torch::Tensor b, int64_t trans_b) {
  auto out = out_like(a);
  dkv_check_gemm_ss(a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), static_cast<int>(trans_b),
                    at::cuda::getCurrentCUDAStream());
  return out;
}
torch::Tensor gemm_rs(torch::Tensor a, torch::Tensor b) {
  auto out = out_like(a);
  dkv_check_gemm_rs(a.data_ptr(), b.data_ptr(), out.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  return out;
}
torch::Tensor gemm_rs_wide(torch::Tensor a, torch::Tensor b, torch::Tensor c) {
  auto out = torch::empty({64, 128}, a.options().dtype(torch::kFloat32));
  dkv_check_gemm_rs_wide(a.data_ptr(), b.data_ptr(), c.data_ptr(), out.data_ptr<float>(),
                         at::cuda::getCurrentCUDAStream());
  return out;
}
torch::Tensor attention_step(torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  auto out = out_like(q);
  dkv_check_attention_step(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr<float>(),
                           at::cuda::getCurrentCUDAStream());
  return out;
}
"""


@functools.cache
def _ext():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="dualkv_wgmma_check", cpp_sources=_BINDING, cuda_sources=(HERE / "wgmma_check.cu").read_text(),
        functions=["gemm_ss", "gemm_rs", "gemm_rs_wide", "attention_step"], extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False)


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (Hopper): wgmma")
    return _ext()


def _tiles(n: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(64, 64, device="cuda", generator=g).to(torch.bfloat16).contiguous() for _ in range(n)]


def _check(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-3):
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"{what}: max error {err:.3e} (scale {want.abs().max():.2f})"


def test_ss_k_major_b(ext):
    a, b = _tiles(2, 0)
    _check(ext.gemm_ss(a, b, 0), a.float() @ b.float().T, "A B^T, B K-major")


def test_ss_mn_major_b(ext):
    a, b = _tiles(2, 1)
    _check(ext.gemm_ss(a, b, 1), a.float() @ b.float(), "A B, B MN-major")


def test_rs_a_from_registers(ext):
    a, b = _tiles(2, 2)
    _check(ext.gemm_rs(a, b), a.float() @ b.float().T, "A (registers) B^T")


def test_rs_wide_mn_major_b(ext):
    """m64n128 with A from registers and a two-part MN-major B (the P V, dV and dK products)."""
    a, b, c = _tiles(3, 4)
    _check(ext.gemm_rs_wide(a, b, c), a.float() @ torch.cat([b, c], dim=1).float(), "A (registers) [B | C], MN-major")


def test_attention_step(ext):
    q, k, v = _tiles(3, 3)
    p = (q.float() @ k.float().T).to(torch.bfloat16).float()  # P rounded to bf16 as the kernel packs it
    # a different fp32 summation order can round a few P entries the other way: a bf16 ulp each
    _check(ext.attention_step(q, k, v), p @ v.float(), "bf16(Q K^T) V", tol=2e-2)
