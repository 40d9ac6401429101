// Device primitives of the DualKV kernels: tensor-core MMA (mma.sync m16n8k16), ldmatrix,
// cp.async with zero fill, warp shuffles, fp16/bf16 packing. Each has a host-emulation twin
// (dkv_emulation.h) selected by -DDKV_EMULATE, so the same kernel source runs on a CPU for debugging.
#pragma once

#include <cstdint>

#ifdef DKV_EMULATE
#include "dkv_emulation.h"
#define DKV_DEV inline
#define DKV_GLOBAL
#define DKV_LAUNCH_BOUNDS(threads)
#define DKV_GRID_CONSTANT
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define DKV_DEV __device__ __forceinline__
#define DKV_GLOBAL __global__
#define DKV_LAUNCH_BOUNDS(threads) __launch_bounds__(threads, 1)
#define DKV_GRID_CONSTANT __grid_constant__
#endif

namespace dkv {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -__builtin_huge_valf();

// Element tags: the kernels move raw 16-bit words and only need the type for MMA and conversions.
struct Fp16 {
  static constexpr bool kIsBf16 = false;
};
struct Bf16 {
  static constexpr bool kIsBf16 = true;
};

#ifdef DKV_EMULATE

DKV_DEV int thread_idx() { return dkv_emu::self.tid; }
DKV_DEV int block_idx_x() { return static_cast<int>(dkv_emu::self.block.x); }
DKV_DEV int block_idx_y() { return static_cast<int>(dkv_emu::self.block.y); }
DKV_DEV int grid_dim_x() { return static_cast<int>(dkv_emu::self.grid.x); }
DKV_DEV unsigned char* dynamic_smem() { return dkv_emu::self.smem; }
DKV_DEV void block_sync() { dkv_emu::block_sync(); }

DKV_DEV void cp_async_16(void* smem, const void* gmem, bool pred) { dkv_emu::cp_async(smem, gmem, 16, pred ? 16 : 0); }
DKV_DEV void cp_async_4(void* smem, const void* gmem, bool pred) { dkv_emu::cp_async(smem, gmem, 4, pred ? 4 : 0); }
DKV_DEV void cp_async_commit() { dkv_emu::cp_commit(); }
template <int N>
DKV_DEV void cp_async_wait() {
  dkv_emu::cp_wait(N);
}

DKV_DEV void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) { dkv_emu::ldmatrix_x4(r, p, false); }
DKV_DEV void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) { dkv_emu::ldmatrix_x4(r, p, true); }
DKV_DEV void stsm_x4_trans(const uint32_t (&r)[4], uint16_t* p) { dkv_emu::stmatrix_x4(r, p, true); }

template <class E>
DKV_DEV void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  dkv_emu::mma_16816(d, a, b, E::kIsBf16);
}

DKV_DEV float shfl_xor(float v, int mask) { return dkv_emu::shfl_xor(v, mask); }
DKV_DEV int warp_uniform(int v) { return v; }
DKV_DEV bool warp_any(bool pred) { return dkv_emu::warp_any(pred); }
DKV_DEV float fast_exp2(float x) { return std::exp2(x); }
DKV_DEV float fast_log2(float x) { return std::log2(x); }
DKV_DEV float tanh_f(float x) { return std::tanh(x); }
DKV_DEV void atomic_add_f32(float* p, float v) { std::atomic_ref<float>(*p).fetch_add(v); }
DKV_DEV void atomic_add_f32x2(float* p, float a, float b) {
  atomic_add_f32(p, a);
  atomic_add_f32(p + 1, b);
}
DKV_DEV int atomic_add_i32(int* p, int v) { return std::atomic_ref<int>(*p).fetch_add(v); }
DKV_DEV void store_f32x2(float* p, float a, float b) {
  dkv_emu::require_aligned(p, 8, "8-byte store");
  p[0] = a;
  p[1] = b;
}

template <class E>
DKV_DEV float to_float(uint16_t h) {
  return E::kIsBf16 ? dkv_emu::bf16_to_float(h) : dkv_emu::fp16_to_float(h);
}
template <class E>
DKV_DEV uint16_t from_float(float f) {
  return E::kIsBf16 ? dkv_emu::float_to_bf16(f) : dkv_emu::float_to_fp16(f);
}
template <class E>
DKV_DEV uint32_t pack2(float lo, float hi) {
  return static_cast<uint32_t>(from_float<E>(lo)) | (static_cast<uint32_t>(from_float<E>(hi)) << 16);
}
DKV_DEV void load_16B(uint32_t (&r)[4], const uint16_t* p) { std::memcpy(r, p, 16); }
DKV_DEV void load_f32x4(float (&r)[4], const float* p) {
  dkv_emu::require_aligned(p, 16, "16-byte load");
  std::memcpy(r, p, 16);
}
DKV_DEV void store_u32(uint16_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

#else  // device

DKV_DEV int thread_idx() { return static_cast<int>(threadIdx.x); }
DKV_DEV int block_idx_x() { return static_cast<int>(blockIdx.x); }
DKV_DEV int block_idx_y() { return static_cast<int>(blockIdx.y); }
DKV_DEV int grid_dim_x() { return static_cast<int>(gridDim.x); }
DKV_DEV unsigned char* dynamic_smem() {
  extern __shared__ __align__(16) unsigned char dkv_dynamic_smem[];
  return dkv_dynamic_smem;
}
DKV_DEV void block_sync() { __syncthreads(); }

DKV_DEV uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16-byte async copy global -> shared; when pred is false the destination is zero-filled and the
// source is not read.
DKV_DEV void cp_async_16(void* smem, const void* gmem, bool pred) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
DKV_DEV void cp_async_4(void* smem, const void* gmem, bool pred) {
  const int src_bytes = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
DKV_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
DKV_DEV void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

DKV_DEV void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
DKV_DEV void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// stmatrix (sm_90): four 8 x 8 b16 matrices from their mma fragments, each stored transposed (lane l
// gives row l % 8 of matrix l / 8 the address of its 16 bytes).
DKV_DEV void stsm_x4_trans(const uint32_t (&r)[4], uint16_t* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
#else
  (void)r, (void)p;
  __trap();  // stmatrix needs sm_90
#endif
}

template <class E>
DKV_DEV void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (E::kIsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

DKV_DEV float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
// v, which every lane of the warp holds, as lane 0's: the compiler then knows it is warp-uniform and
// keeps what is derived from it (shared-memory descriptors of wgmma) in uniform registers.
DKV_DEV int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }
DKV_DEV bool warp_any(bool pred) { return __any_sync(0xffffffffu, pred); }
DKV_DEV float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
DKV_DEV float fast_log2(float x) { return __log2f(x); }
DKV_DEV float tanh_f(float x) { return tanhf(x); }
DKV_DEV void atomic_add_f32(float* p, float v) { atomicAdd(p, v); }
// p[0] = a, p[1] = b as one 8-byte store; p 8-byte aligned.
DKV_DEV void store_f32x2(float* p, float a, float b) { *reinterpret_cast<float2*>(p) = make_float2(a, b); }
// p[0] += a, p[1] += b; p 8-byte aligned. One vector atomic on sm_90, two elsewhere.
DKV_DEV void atomic_add_f32x2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}
DKV_DEV int atomic_add_i32(int* p, int v) { return atomicAdd(p, v); }

template <class E>
DKV_DEV float to_float(uint16_t h) {
  if constexpr (E::kIsBf16) {
    return __bfloat162float(__ushort_as_bfloat16(h));
  } else {
    return __half2float(__ushort_as_half(h));
  }
}
template <class E>
DKV_DEV uint16_t from_float(float f) {
  if constexpr (E::kIsBf16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
}
template <class E>
DKV_DEV uint32_t pack2(float lo, float hi) {
  if constexpr (E::kIsBf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}
DKV_DEV void load_16B(uint32_t (&r)[4], const uint16_t* p) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}
// r = p[0 .. 3] as one 16-byte load; p 16-byte aligned.
DKV_DEV void load_f32x4(float (&r)[4], const float* p) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}
DKV_DEV void store_u32(uint16_t* p, uint32_t v) { *reinterpret_cast<uint32_t*>(p) = v; }

#endif

// Low / high half of a packed pair as float.
template <class E>
DKV_DEV float lo_f(uint32_t v) {
  return to_float<E>(static_cast<uint16_t>(v & 0xffffu));
}
template <class E>
DKV_DEV float hi_f(uint32_t v) {
  return to_float<E>(static_cast<uint16_t>(v >> 16));
}

DKV_DEV int ceil_div(int a, int b) { return (a + b - 1) / b; }
DKV_DEV int imin(int a, int b) { return a < b ? a : b; }
DKV_DEV int imax(int a, int b) { return a > b ? a : b; }

// Largest s in [0, n) with prefix[s] <= x, given prefix[0] <= x < prefix[n] (prefix non-decreasing).
DKV_DEV int find_bucket(const int* prefix, int n, int x) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (prefix[mid] <= x) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace dkv
