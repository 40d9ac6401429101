// Emulation build of the cluster check kernels (csrc/dkv_cluster_check.cuh), on CPU tensors:
//   torch.ops.dualkv_cuda_emu.cluster_pair_sum(a, announce): a (rounds, 2, 64, 64) fp32 -> (rounds, 64, 64),
//     each block announcing `announce` bytes a round (8192; fewer plants a bug the emulation must catch);
//   torch.ops.dualkv_cuda_emu.cluster_multicast(src, rounds): src (64 rounds, 64) bf16 -> (rounds, 2, 64, 64),
//     round r's rows as each block of the pair received them.
#include <torch/extension.h>

#include "../dkv_cluster_check.cuh"
#include "../dkv_launch.h"

namespace {

namespace cc = dkv::cluster_check;

torch::Tensor cluster_pair_sum(const torch::Tensor& a, int64_t announce) {
  TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == torch::kFloat32 && a.is_contiguous() && a.dim() == 4 &&
                  a.size(1) == 2 && a.size(2) == cc::kT && a.size(3) == cc::kT,
              "a: expected a contiguous CPU fp32 tensor of shape (rounds, 2, 64, 64), got ", a.sizes());
  auto out = torch::empty({a.size(0), cc::kT, cc::kT}, a.options());
  const cc::PairArgs p{a.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(a.size(0)), static_cast<int>(announce)};
  dkv_emu::launch_cluster(dim3(2), dim3(128), 2, cc::kSmemBytes, [&] { cc::pair_sum(p); });
  return out;
}

torch::Tensor cluster_multicast(const torch::Tensor& src, int64_t rounds) {
  TORCH_CHECK(rounds >= 1, "rounds: expected at least 1, got ", rounds);
  TORCH_CHECK(src.device().is_cpu() && src.scalar_type() == torch::kBFloat16 && src.is_contiguous() && src.dim() == 2 &&
                  src.size(0) >= cc::kT * rounds && src.size(1) == cc::kT,
              "src: expected a contiguous CPU bf16 tensor of shape (>= 64 rounds, 64), got ", src.sizes());
  auto out = torch::empty({rounds, 2, cc::kT, cc::kT}, src.options());
  cc::MulticastArgs p{};
  TORCH_CHECK(dkv::encode_tma_desc(p.src, src.data_ptr(), true, src.size(0), 1, cc::kT, cc::kT, cc::kT * src.size(0), cc::kT) == 0,
              "cluster_multicast: the emulated descriptor could not be built");
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.rounds = static_cast<int>(rounds);
  dkv_emu::launch_cluster(dim3(2), dim3(128), 2, cc::kSmemBytes, [&] { cc::multicast(p); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dualkv_cuda_emu, m) {
  m.def("cluster_pair_sum(Tensor a, int announce) -> Tensor", &cluster_pair_sum);
  m.def("cluster_multicast(Tensor src, int rounds) -> Tensor", &cluster_multicast);
}
