// Emulation build of the wgmma check kernels (csrc/dkv_wgmma_check.cuh): op
// torch.ops.dualkv_cuda_emu.wgmma_check(which, a, b, c) on CPU 64 x 64 bf16 tiles -> 64 x 64 fp32,
// which = 0: A B^T, 1: A B (B MN-major), 2: A (registers) B^T, 3: bf16(A B^T) C (the attention step),
// 4: A (registers) [B | C] (m64n128, [B | C] MN-major) -> 64 x 128.
#include <torch/extension.h>

#include "../dkv_wgmma_check.cuh"

namespace {

const uint16_t* tile(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() && t.dim() == 2 &&
                  t.size(0) == 64 && t.size(1) == 64,
              name, ": expected a contiguous CPU bf16 tensor of shape (64, 64)");
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

torch::Tensor wgmma_check(int64_t which, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
  namespace wc = dkv::wgmma_check;
  auto out = torch::empty({64, which == 4 ? 128 : 64}, a.options().dtype(torch::kFloat32));
  const wc::Args p{tile(a, "a"), tile(b, "b"), tile(c, "c"), out.data_ptr<float>()};
  auto run = [&](auto kernel) { dkv_emu::launch(dim3(1), dim3(128), wc::kSmemBytes, [&] { kernel(p); }); };
  switch (which) {
    case 0: run(wc::gemm_ss<0>); break;
    case 1: run(wc::gemm_ss<1>); break;
    case 2: run(wc::gemm_rs); break;
    case 3: run(wc::attention_step); break;
    case 4: run(wc::gemm_rs_wide); break;
    default: TORCH_CHECK(false, "which: expected 0, 1, 2, 3 or 4, got ", which);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualkv_cuda_emu, m) {
  m.def("wgmma_check(int which, Tensor a, Tensor b, Tensor c) -> Tensor", &wgmma_check);
}
