// Forward on Hopper warpgroup MMA (dkv_fwd_sm90.cuh): bf16, head dims 64, 128, 192, 256. The kernel traps
// unless the unit is built for sm_90a; the binding only calls it on such a device (DUALKV_CUDA_WGMMA=1).
#include "dkv_fwd_sm90.cuh"
#include "dkv_launch_impl.cuh"

namespace dkv {

template <int D>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using K = FwdSm90<D>;
  auto kernel = &dkv_fwd_sm90_kernel<Bf16, D>;
  static const cudaError_t attr = allow_smem(kernel, K::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  if (p.grid_tiles == 0 || p.nheads == 0) return cudaSuccess;
  DKV_LAUNCH(kernel, dim3(p.grid_tiles, p.nheads), dim3(K::kThreads), K::kSmemBytes, stream, p);
  return last_error();
}

bool sm90_forward_supports(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 192 || head_dim == 256; }

cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_fwd_sm90<64>(p, stream);
    case 128: return launch_fwd_sm90<128>(p, stream);
    case 192: return launch_fwd_sm90<192>(p, stream);
    case 256: return launch_fwd_sm90<256>(p, stream);
    default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue: the binding never asks for it
  }
}

}  // namespace dkv
