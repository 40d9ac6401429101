// Checks of csrc/dkv_wgmma.cuh on an sm_90 GPU (driven by tests/gpu/test_wgmma_gpu.py, compiled for
// sm_90a): one warpgroup, 64 x 64 bf16 tiles in 128B-swizzled shared memory.
//
//   gemm_ss<kTransB>   D = A B^T (kTransB = 0: B given as N x K rows) or D = A B (1: B given as K x N rows)
//   gemm_rs            D = A B^T with A from registers
//   attention_step     O = bf16(Q K^T) V: S from SS (K-major K), P re-packed in registers, O from RS
//                      with V as an MN-major operand -- the inner step of a wgmma attention kernel.
// Inputs are row-major 64 x 64 bf16 (raw uint16_t), outputs 64 x 64 fp32 row-major.
#include <cuda_bf16.h>

#include <cstdint>

#include "dkv_tile.cuh"
#include "dkv_wgmma.cuh"

namespace {

using dkv::sm90::smem_desc_sw128;
using dkv::sm90::sw128_offset;

constexpr int kT = 64;  // tile side

__device__ void load_tile_sw128(uint16_t* smem, const uint16_t* src) {
  for (int idx = threadIdx.x; idx < kT * kT; idx += blockDim.x) {
    const int r = idx / kT, c = idx % kT;
    smem[sw128_offset(r, c) / 2] = src[idx];
  }
}

// Generic-proxy shared-memory writes become visible to the async proxy that wgmma reads through.
__device__ void smem_to_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
}

__device__ void store_acc(float* out, const float (&d)[32]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * warp + lane / 4 + 8 * (i / 2), col = 8 * j + 2 * (lane % 4) + (i % 2);
      out[row * kT + col] = d[4 * j + i];
    }
}

__device__ uint32_t pack_bf16(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (uint32_t(hi) << 16); }

template <int kTransB>
__global__ void gemm_ss(const uint16_t* a, const uint16_t* b, float* out) {
  __shared__ __align__(1024) uint16_t sA[kT * kT];
  __shared__ __align__(1024) uint16_t sB[kT * kT];
  load_tile_sw128(sA, a);
  load_tile_sw128(sB, b);
  smem_to_async_proxy();
  float d[32];
  for (float& x : d) x = 0.f;
  dkv::sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s) {
    const uint64_t da = smem_desc_sw128(reinterpret_cast<char*>(sA) + 32 * s);
    const uint64_t db = kTransB ? dkv::sm90::smem_desc_sw128_mn64(reinterpret_cast<char*>(sB) + 2048 * s)
                                : smem_desc_sw128(reinterpret_cast<char*>(sB) + 32 * s);
    dkv::sm90::wgmma_m64n64k16_ss_bf16<kTransB>(d, da, db, s > 0);
  }
  dkv::sm90::wgmma_commit();
  dkv::sm90::wgmma_wait<0>();
  store_acc(out, d);
}

__global__ void gemm_rs(const uint16_t* a, const uint16_t* b, float* out) {
  __shared__ __align__(1024) uint16_t sB[kT * kT];
  load_tile_sw128(sB, b);
  smem_to_async_proxy();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const uint16_t* rows = a + (16 * warp + g) * kT;
  float d[32];
  for (float& x : d) x = 0.f;
  dkv::sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s) {
    const int k0 = 16 * s + 2 * t;
    const uint32_t frag[4] = {pack_bf16(rows[k0], rows[k0 + 1]), pack_bf16(rows[8 * kT + k0], rows[8 * kT + k0 + 1]),
                              pack_bf16(rows[k0 + 8], rows[k0 + 9]),
                              pack_bf16(rows[8 * kT + k0 + 8], rows[8 * kT + k0 + 9])};
    dkv::sm90::wgmma_m64n64k16_rs_bf16<0>(d, frag, smem_desc_sw128(reinterpret_cast<char*>(sB) + 32 * s), s > 0);
  }
  dkv::sm90::wgmma_commit();
  dkv::sm90::wgmma_wait<0>();
  store_acc(out, d);
}

__global__ void attention_step(const uint16_t* q, const uint16_t* k, const uint16_t* v, float* out) {
  __shared__ __align__(1024) uint16_t sQ[kT * kT];
  __shared__ __align__(1024) uint16_t sK[kT * kT];
  __shared__ __align__(1024) uint16_t sV[kT * kT];
  load_tile_sw128(sQ, q);
  load_tile_sw128(sK, k);
  load_tile_sw128(sV, v);
  smem_to_async_proxy();
  float s_acc[32];
  for (float& x : s_acc) x = 0.f;
  dkv::sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s)
    dkv::sm90::wgmma_m64n64k16_ss_bf16<0>(s_acc, smem_desc_sw128(reinterpret_cast<char*>(sQ) + 32 * s),
                                          smem_desc_sw128(reinterpret_cast<char*>(sK) + 32 * s), s > 0);
  dkv::sm90::wgmma_commit();
  dkv::sm90::wgmma_wait<0>();
  // S (64 queries x 64 keys) -> P fragments: keys 16 s .. 16 s + 15 are accumulator blocks 2 s, 2 s + 1.
  float blocks[8][4];
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) blocks[j][i] = s_acc[4 * j + i];
  uint32_t p[4][4];
  dkv::c_to_a<dkv::Bf16, 64>(p, blocks);
  float o[32];
  for (float& x : o) x = 0.f;
  dkv::sm90::wgmma_fence();
  for (int s = 0; s < kT / 16; ++s) {
    const uint64_t dv = dkv::sm90::smem_desc_sw128_mn64(reinterpret_cast<char*>(sV) + 2048 * s);
    dkv::sm90::wgmma_m64n64k16_rs_bf16<1>(o, p[s], dv, s > 0);
  }
  dkv::sm90::wgmma_commit();
  dkv::sm90::wgmma_wait<0>();
  store_acc(out, o);
}

}  // namespace

// Host launchers (one block of one warpgroup each), raw device pointers.
extern "C" void dkv_check_gemm_ss(const void* a, const void* b, float* out, int trans_b, cudaStream_t stream) {
  if (trans_b)
    gemm_ss<1><<<1, 128, 0, stream>>>(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), out);
  else
    gemm_ss<0><<<1, 128, 0, stream>>>(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), out);
}

extern "C" void dkv_check_gemm_rs(const void* a, const void* b, float* out, cudaStream_t stream) {
  gemm_rs<<<1, 128, 0, stream>>>(static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), out);
}

extern "C" void dkv_check_attention_step(const void* q, const void* k, const void* v, float* out,
                                         cudaStream_t stream) {
  attention_step<<<1, 128, 0, stream>>>(static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k),
                                        static_cast<const uint16_t*>(v), out);
}
