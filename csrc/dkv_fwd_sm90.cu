// Forward on Hopper warpgroup MMA (dkv_fwd_sm90.cuh): fp16 and bf16, head dims 64, 128, 192, 256. The
// kernel traps unless the unit is built for sm_90a; the binding only calls it on an sm_90 device.
#include "dkv_fwd_sm90.cuh"
#include "dkv_launch_impl.cuh"

#include <atomic>

namespace dkv {

template <class E, int D, bool kWs>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using K = FwdSm90<D, kWs>;
  return launch_tiles<K, &dkv_fwd_sm90_kernel<E, D, kWs>>(p, stream);
}

bool sm90_forward_supports(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 192 || head_dim == 256; }

#ifndef DKV_EMULATE
DKV_GLOBAL void dkv_wgmma_probe_kernel(int* built) { *built = DKV_HAS_WGMMA; }
#endif

// Whether the device code this process runs was compiled with wgmma (sm_90a): an extension built for
// plain sm_90 (TORCH_CUDA_ARCH_LIST=9.0) has the kernels, but they trap. Asked once, on first use; a
// first use inside CUDA graph capture (where the probe's allocation is not allowed) answers false
// without asking, so that call takes the mma.sync kernels.
bool sm90_kernels_built(cudaStream_t stream) {
#ifdef DKV_EMULATE
  (void)stream;
  return true;
#else
  static std::atomic<int> built{-1};
  const int known = built.load();
  if (known >= 0) return known == 1;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return false;
  int* flag = nullptr;
  int host = 0;
  bool ok = cudaMalloc(&flag, sizeof(int)) == cudaSuccess;
  if (ok) {
    dkv_wgmma_probe_kernel<<<1, 1>>>(flag);
    ok = cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(flag);
  }
  built.store(ok && host == 1 ? 1 : 0);
  return ok && host == 1;
#endif
}

template <class E, bool kWs>
cudaError_t run_fwd_sm90_variant(const FwdParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_fwd_sm90<E, 64, kWs>(p, stream);
    case 128: return launch_fwd_sm90<E, 128, kWs>(p, stream);
    case 192: return launch_fwd_sm90<E, 192, kWs>(p, stream);
    case 256: return launch_fwd_sm90<E, 256, kWs>(p, stream);
    default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue: the binding never asks for it
  }
}

template <class E>
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream, bool warp_specialized) {
  return warp_specialized ? run_fwd_sm90_variant<E, true>(p, stream) : run_fwd_sm90_variant<E, false>(p, stream);
}

template cudaError_t run_fwd_sm90<Fp16>(const FwdParams&, cudaStream_t, bool);
template cudaError_t run_fwd_sm90<Bf16>(const FwdParams&, cudaStream_t, bool);

}  // namespace dkv
