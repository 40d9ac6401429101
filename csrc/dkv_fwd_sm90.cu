// Forward on Hopper warpgroup MMA (dkv_fwd_sm90.cuh): fp16 and bf16, head dims 64, 128, 192, 256 and 512
// (at 64 / 128 the warp-specialised TMA form and the cp.async forms; at 192 / 256 / 512 the in-turn form
// by bulk tensor copies or cp.async, and at 192 / 256 the warp-specialised cp.async form). The
// kernel traps unless the unit is built for sm_90a; the binding only calls it on an sm_90 device.
#include "dkv_fwd_sm90.cuh"
#include "dkv_launch_impl.cuh"

#include <atomic>

namespace dkv {

template <class E, int D, bool kWs, bool kTma = false, bool kWideN = false, bool kMerge = false>
cudaError_t launch_fwd_sm90(const FwdParams& p, cudaStream_t stream) {
  using K = FwdSm90<D, kWs, kTma, kWideN, false, kMerge>;
  return launch_tiles<K, &dkv_fwd_sm90_kernel<E, D, kWs, kTma, kWideN, false, kMerge>>(p, stream);
}

// The TMA warp-specialised forward at d = 64 / 128, per-tile blocks or (p.work_counter set) persistent;
// kMerge (176-key tiles, p.merge_walk) the merged key walk.
template <class E, int D, bool kWideN = false, bool kMerge = false>
cudaError_t launch_fwd_sm90_tma_ws(const FwdParams& p, cudaStream_t stream) {
  if (p.work_counter == nullptr) return launch_fwd_sm90<E, D, true, true, kWideN, kMerge>(p, stream);
  using K = FwdSm90<D, true, true, kWideN, true, kMerge>;
  return launch_persistent<K, &dkv_fwd_sm90_kernel<E, D, true, true, kWideN, true, kMerge>>(p, stream);
}

// At d = 128 on 176-key tiles: the split walk or (p.merge_walk) the merged one, each its own kernel.
template <class E>
cudaError_t launch_fwd_sm90_wide(const FwdParams& p, cudaStream_t stream) {
  return p.merge_walk ? launch_fwd_sm90_tma_ws<E, 128, true, true>(p, stream) : launch_fwd_sm90_tma_ws<E, 128, true>(p, stream);
}

bool sm90_forward_supports(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 192 || head_dim == 256 || head_dim == 512;
}
static_assert(FwdSm90<64>::kBlockM == kSm90BlockM && FwdSm90<256>::kBlockM == kSm90BlockM, "the binding's tile rows");
int sm90_fwd_block_m(int head_dim) { return head_dim == 512 ? FwdSm90<512>::kBlockM : kSm90BlockM; }
int sm90_fwd_block_n(int head_dim, bool wide) {
  switch (head_dim) {
    case 64: return FwdSm90<64>::kBlockN;
    case 128: return wide ? FwdSm90<128, true, true, true>::kBlockN : FwdSm90<128>::kBlockN;
    case 192: return FwdSm90<192>::kBlockN;
    case 256: return FwdSm90<256>::kBlockN;
    default: return FwdSm90<512>::kBlockN;
  }
}

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
    case 512: return launch_fwd_sm90<E, 512, false>(p, stream);  // one (in-turn) form
    default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue: the binding never asks for it
  }
}

template <class E>
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream, int form, bool wide) {
  if (form == 3) {  // the binding checked the head dim and built the tensor maps (wide: 176-row key boxes)
    switch (p.head_dim) {
      case 64: return launch_fwd_sm90_tma_ws<E, 64>(p, stream);
      case 128: return wide ? launch_fwd_sm90_wide<E>(p, stream) : launch_fwd_sm90_tma_ws<E, 128>(p, stream);
      case 192: return launch_fwd_sm90<E, 192, false, true>(p, stream);  // in turn, bulk tensor copies
      case 256: return launch_fwd_sm90<E, 256, false, true>(p, stream);
      case 512: return launch_fwd_sm90<E, 512, false, true>(p, stream);
      default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue
    }
  }
  return form == 2 ? run_fwd_sm90_variant<E, true>(p, stream) : run_fwd_sm90_variant<E, false>(p, stream);
}

template cudaError_t run_fwd_sm90<Fp16>(const FwdParams&, cudaStream_t, int, bool);
template cudaError_t run_fwd_sm90<Bf16>(const FwdParams&, cudaStream_t, int, bool);

}  // namespace dkv
