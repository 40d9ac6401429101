// sm_90a build of csrc/dkv_wgmma_check.cuh for tests/gpu/test_wgmma_gpu.py: host launchers, one block
// of one warpgroup each, raw device pointers.
#include "dkv_wgmma_check.cuh"

using dkv::wgmma_check::Args;
using dkv::wgmma_check::kSmemBytes;

extern "C" void dkv_check_gemm_ss(const void* a, const void* b, float* out, int trans_b, cudaStream_t stream) {
  const Args p{static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), nullptr, out};
  if (trans_b)
    dkv::wgmma_check::gemm_ss<1><<<1, 128, kSmemBytes, stream>>>(p);
  else
    dkv::wgmma_check::gemm_ss<0><<<1, 128, kSmemBytes, stream>>>(p);
}

extern "C" void dkv_check_gemm_rs(const void* a, const void* b, float* out, cudaStream_t stream) {
  const Args p{static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), nullptr, out};
  dkv::wgmma_check::gemm_rs<<<1, 128, kSmemBytes, stream>>>(p);
}

extern "C" void dkv_check_gemm_rs_wide(const void* a, const void* b, const void* c, float* out, cudaStream_t stream) {
  const Args p{static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), static_cast<const uint16_t*>(c), out};
  dkv::wgmma_check::gemm_rs_wide<<<1, 128, kSmemBytes, stream>>>(p);
}

extern "C" void dkv_check_attention_step(const void* q, const void* k, const void* v, float* out,
                                         cudaStream_t stream) {
  const Args p{static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v),
               out};
  dkv::wgmma_check::attention_step<<<1, 128, kSmemBytes, stream>>>(p);
}
