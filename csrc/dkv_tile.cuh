// Tile-level building blocks shared by the forward and backward kernels: asynchronous row loads
// into padded shared memory, and warp GEMMs on m16n8k16 fragments.
//
// Shared-memory tiles are row-major with a row stride of (headdim + 8) elements: the 16-byte pad
// puts the 8 rows an ldmatrix reads on distinct bank groups (conflict-free without a swizzle).
//
// Fragment layout (g = lane / 4, t = lane % 4) of a 16 x 8 fp32 accumulator c[4]:
//     c[0], c[1] at (row g,     cols 2t, 2t+1)
//     c[2], c[3] at (row g + 8, cols 2t, 2t+1)
// Two adjacent accumulators (16 x 16) repack into the A operand of the next MMA (c_to_a).
#pragma once

#include <type_traits>

#include "dkv_device.cuh"
#include "dkv_params.h"

namespace dkv {

// Rows [0, kRows) of a tile: row r comes from src + r * row_stride when r < valid, else zeros.
// `safe` is any readable address, used for rows that are not read.
template <int kRows, int kHeadDim, int kThreads>
DKV_DEV void load_rows_async(uint16_t* dst, const uint16_t* src, int64_t row_stride, int valid, const uint16_t* safe,
                             int tid) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kTotal = kRows * kChunks;
  constexpr int kStride = kHeadDim + 8;
#pragma unroll
  for (int i = 0; i < (kTotal + kThreads - 1) / kThreads; ++i) {
    const int c = tid + i * kThreads;
    if (kTotal % kThreads == 0 || c < kTotal) {
      const int r = c / kChunks, ch = c % kChunks;
      const bool ok = r < valid;
      const uint16_t* g = ok ? src + static_cast<int64_t>(r) * row_stride + ch * 8 : safe;
      cp_async_16(dst + r * kStride + ch * 8, g, ok);
    }
  }
}

// Rows [row, row + kRows) of one head of a (rows, heads, headdim) tensor, as load_rows_async.
template <int kRows, int kHeadDim, int kThreads>
DKV_DEV void load_head_rows_async(uint16_t* dst, const TensorRef& t, int64_t row, int head, int valid, int tid) {
  const uint16_t* base = static_cast<const uint16_t*>(t.ptr);
  load_rows_async<kRows, kHeadDim, kThreads>(dst, base + t.offset(row, head), t.row_stride, valid, base, tid);
}

// kRows floats: dst[r] = src[r] when r < valid, else 0.
template <int kRows, int kThreads>
DKV_DEV void load_vec_async(float* dst, const float* src, int valid, const float* safe, int tid) {
  for (int r = tid; r < kRows; r += kThreads) {
    const bool ok = r < valid;
    cp_async_4(dst + r, ok ? src + r : safe, ok);
  }
}

// acc (16 x kN) += A (16 x kK) * B^T, with A rows at sA (row-major, k contiguous) and B stored as
// kN rows of kK (k contiguous) at sB: e.g. S = Q K^T with A = Q rows, B = K rows.
template <class E, int kN, int kK, int kStride>
DKV_DEV void gemm_ss(float (&acc)[kN / 8][4], const uint16_t* sA, const uint16_t* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "tile dims must be multiples of 16");
  const uint16_t* a_ptr = sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
  const uint16_t* b_ptr = sB + ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[4];
    ldsm_x4(a, a_ptr + kk * 16);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, b_ptr + np * 16 * kStride + kk * 16);
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
      mma_16816<E>(acc[2 * np], a, b0);
      mma_16816<E>(acc[2 * np + 1], a, b1);
    }
  }
}

// acc (16 x kN) += A (16 x kK, register fragments) * B, with B stored as kK rows of kN (n
// contiguous) at sB: e.g. O += P V with B = V rows (keys) and columns = head dim.
template <class E, int kN, int kK, int kStride>
DKV_DEV void gemm_rs(float (&acc)[kN / 8][4], const uint32_t (&a)[kK / 16][4], const uint16_t* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "tile dims must be multiples of 16");
  const uint16_t* b_ptr = sB + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldsm_x4_trans(b, b_ptr + kk * 16 * kStride + np * 16);
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
      mma_16816<E>(acc[2 * np], a[kk], b0);
      mma_16816<E>(acc[2 * np + 1], a[kk], b1);
    }
  }
}

// kM stacked 16-row m-tiles (A rows at sA + mt * 16 rows): every B fragment loaded from shared
// memory feeds kM MMAs.
template <class E, int kM, int kN, int kK, int kStride>
DKV_DEV void gemm_ss_m(float (&acc)[kM][kN / 8][4], const uint16_t* sA, const uint16_t* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "tile dims must be multiples of 16");
  const uint16_t* a_ptr = sA + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
  const uint16_t* b_ptr = sB + ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int mt = 0; mt < kM; ++mt) ldsm_x4(a[mt], a_ptr + mt * 16 * kStride + kk * 16);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldsm_x4(b, b_ptr + np * 16 * kStride + kk * 16);
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        mma_16816<E>(acc[mt][2 * np], a[mt], b0);
        mma_16816<E>(acc[mt][2 * np + 1], a[mt], b1);
      }
    }
  }
}

template <class E, int kM, int kN, int kK, int kStride>
DKV_DEV void gemm_rs_m(float (&acc)[kM][kN / 8][4], const uint32_t (&a)[kM][kK / 16][4], const uint16_t* sB, int lane) {
  static_assert(kN % 16 == 0 && kK % 16 == 0, "tile dims must be multiples of 16");
  const uint16_t* b_ptr = sB + ((lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t b[4];
      ldsm_x4_trans(b, b_ptr + kk * 16 * kStride + np * 16);
      const uint32_t b0[2] = {b[0], b[1]};
      const uint32_t b1[2] = {b[2], b[3]};
#pragma unroll
      for (int mt = 0; mt < kM; ++mt) {
        mma_16816<E>(acc[mt][2 * np], a[mt][kk], b0);
        mma_16816<E>(acc[mt][2 * np + 1], a[mt][kk], b1);
      }
    }
  }
}

// 16 x kN accumulators -> A fragments of a 16 x kN (as k) operand, rounded to E.
template <class E, int kN>
DKV_DEV void c_to_a(uint32_t (&a)[kN / 16][4], const float (&c)[kN / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    a[kk][0] = pack2<E>(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack2<E>(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack2<E>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack2<E>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

template <int kN>
DKV_DEV void zero(float (&acc)[kN][4]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
  }
}

// Softcapped (or plain) scaled score in the log2 domain, and tanh for the softcap derivative.
struct ScoreFn {
  float scale_log2;  // scale * log2(e)            (no softcap)
  float cap_inv_scale;  // scale / softcap         (softcap)
  float cap_log2;    // softcap * log2(e)          (softcap)
  bool softcap;
  DKV_DEV float capped(float raw) const { return cap_log2 * tanh_f(raw * cap_inv_scale); }
  DKV_DEV float plain(float raw) const { return raw * scale_log2; }
};

DKV_DEV ScoreFn make_score_fn(float scale, float softcap) {
  ScoreFn f;
  f.softcap = softcap > 0.f;
  f.scale_log2 = scale * kLog2e;
  f.cap_inv_scale = f.softcap ? scale / softcap : 0.f;
  f.cap_log2 = softcap * kLog2e;
  return f;
}

// Calls f(cap, mask) with std::true_type / std::false_type for "softcap on" and "this tile needs its
// mask", so that a tile's element loop is compiled without those branches. Written per element, the
// compiler if-converts the softcap branch of an unrolled tile and evaluates tanh for every score
// (the forward kernels ran at 0.7x that way).
template <class F>
DKV_DEV void with_score_mode(bool softcap, bool need_mask, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (softcap) {
    if (need_mask) f(Yes{}, Yes{}); else f(Yes{}, No{});
  } else {
    if (need_mask) f(No{}, Yes{}); else f(No{}, No{});
  }
}

// x[e] = score(x[e]), or -inf where need_mask and masked(e).
template <int kN, class Masked>
DKV_DEV void apply_scores(float (&x)[kN], const ScoreFn& score, bool need_mask, const Masked& masked) {
  with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
#pragma unroll
    for (int e = 0; e < kN; ++e) {
      float v;
      if constexpr (decltype(cap)::value)
        v = score.capped(x[e]);
      else
        v = score.plain(x[e]);
      if constexpr (decltype(mask)::value) {
        if (masked(e)) v = kNegInf;
      }
      x[e] = v;
    }
  });
}

}  // namespace dkv
