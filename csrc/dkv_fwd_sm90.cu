// Forward on Hopper warpgroup MMA (dkv_fwd_sm90.cuh): bf16, head dim 128. The kernel traps unless the
// unit is built for sm_90a; the binding only calls it on such a device (DUALKV_CUDA_WGMMA=1).
#include "dkv_fwd_sm90.cuh"
#include "dkv_launch_impl.cuh"

namespace dkv {

cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  auto kernel = &dkv_fwd_sm90_kernel<Bf16>;
  static const cudaError_t attr = allow_smem(kernel, FwdSm90::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  if (p.grid_tiles == 0 || p.nheads == 0) return cudaSuccess;
  DKV_LAUNCH(kernel, dim3(p.grid_tiles, p.nheads), dim3(FwdSm90::kThreads), FwdSm90::kSmemBytes, stream, p);
  return last_error();
}

}  // namespace dkv
