"""The thread block cluster building blocks of csrc/dkv_cluster.cuh on an sm_90 GPU, against torch: two
blocks exchanging fp32 rows through each other's shared memory (st.async counted on the peer's
mbarrier, remote arrivals freeing the next send; the exchange a paired-block dQ would make) and a bulk
tensor copy multicast to both blocks. tests/gpu/cluster_check.cu holds the launchers; the CPU emulation
runs the same kernels (csrc/emulation/emulate.py --cluster, tests/test_cuda_build.py). Both kernels also
run under compute-sanitizer's memcheck and racecheck."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import check_sanitizer_log, compute_sanitizer

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[1] / "csrc"

_BINDING = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
extern "C" int dkv_check_cluster_pair_sum(const float*, float*, int, cudaStream_t);
extern "C" int dkv_check_cluster_multicast(void*, int64_t, uint16_t*, int, cudaStream_t);

torch::Tensor pair_sum(torch::Tensor a) {
  auto out = torch::empty({a.size(0), 64, 64}, a.options());
  const int status = dkv_check_cluster_pair_sum(a.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(a.size(0)),
                                                at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == 0, "pair_sum launch failed: status ", status);
  return out;
}
torch::Tensor multicast(torch::Tensor src, int64_t rounds) {
  auto out = torch::empty({rounds, 2, 64, 64}, src.options());
  const int status = dkv_check_cluster_multicast(src.data_ptr(), src.size(0), reinterpret_cast<uint16_t*>(out.data_ptr()),
                                                 static_cast<int>(rounds), at::cuda::getCurrentCUDAStream());
  TORCH_CHECK(status == 0, "multicast launch failed: status ", status);
  return out;
}
"""


@functools.cache
def _ext():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="dualkv_cluster_check", cpp_sources=_BINDING, cuda_sources=(HERE / "cluster_check.cu").read_text(),
        functions=["pair_sum", "multicast"], extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-std=c++17", "-O3", "--expt-relaxed-constexpr", "-gencode=arch=compute_90a,code=sm_90a"],
        verbose=False)


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU (Hopper): thread block clusters")
    return _ext()


@pytest.mark.parametrize("rounds", [1, 5])
def test_pair_sum_through_the_peers_shared_memory(ext, rounds):
    g = torch.Generator(device="cuda").manual_seed(rounds)
    a = torch.randn(rounds, 2, 64, 64, device="cuda", generator=g)
    got = ext.pair_sum(a)
    torch.cuda.synchronize()
    assert torch.equal(got, a[:, 0] + a[:, 1]), f"max error {(got - a.sum(dim=1)).abs().max().item():.3e}"


def test_pair_sum_repeats(ext):
    """Many launches in a row: a race between the announcement and the peer's bytes, or a send into a
    buffer not yet read, would show as a wrong round now and then."""
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(8, 2, 64, 64, device="cuda", generator=g)
    want = a[:, 0] + a[:, 1]
    outs = [ext.pair_sum(a) for _ in range(200)]
    torch.cuda.synchronize()
    bad = sum(not torch.equal(o, want) for o in outs)
    assert bad == 0, f"{bad} of 200 launches gave a wrong sum"


@pytest.mark.parametrize("rounds", [1, 4])
def test_multicast_lands_in_both_blocks(ext, rounds):
    g = torch.Generator(device="cuda").manual_seed(11)
    src = torch.randn(64 * rounds, 64, device="cuda", generator=g).to(torch.bfloat16)
    got = ext.multicast(src, rounds)
    torch.cuda.synchronize()
    assert torch.equal(got, src.view(rounds, 1, 64, 64).expand(rounds, 2, 64, 64))


SANITIZER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path[:0] = [{here!r}, {tests!r}]
    import test_cluster_gpu as t
    ext = t._ext()
    a = torch.randn(5, 2, 64, 64, device="cuda")
    assert torch.equal(ext.pair_sum(a), a[:, 0] + a[:, 1])
    src = torch.randn(4 * 64, 64, device="cuda").to(torch.bfloat16)
    assert torch.equal(ext.multicast(src, 4), src.view(4, 1, 64, 64).expand(4, 2, 64, 64))
    torch.cuda.synchronize()
    print("sanitizer script done")
    """
)


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_cluster_checks_under_compute_sanitizer(ext, tool, tmp_path):
    """The exchange through the peer's shared memory and the multicast copy, clean under memcheck and
    racecheck (the extension is built by the fixture first, so the sanitizer only runs the kernels)."""
    sanitizer = compute_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed")
    script = tmp_path / "case.py"
    script.write_text(SANITIZER_SCRIPT.format(here=str(HERE), tests=str(HERE.parent)))
    proc = subprocess.run([sanitizer, "--tool", tool, "--error-exitcode", "3", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=600)
    check_sanitizer_log(proc, "sanitizer script done")
