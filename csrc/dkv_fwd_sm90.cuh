// Forward kernel on Hopper warpgroup MMA (sm_90a), bf16, head dims 64, 128, 192 and 256 -- the first
// step of the wgmma path (docs/cuda.md). Same contract and two-region walk as dkv_fwd.cuh; per
// block one warpgroup (128 threads) and 64 query rows of one head; a head dim of D is D / 64
// column "halves" (64-column swizzled sub-tiles):
//
//   S (64 x 64 keys) = Q K^T     wgmma SS, D / 16 k16 steps over the head dim
//   P = online softmax of S      in the accumulator registers (rows 16 w + l/4 and + 8 of warp w)
//   O (64 x D) += P V            wgmma RS, P re-packed as the register operand, V an MN-major
//                                operand, one m64n64 product per 64-column output part
//
// Tiles are 128B-swizzled in shared memory (dkv_wgmma.cuh); K/V tiles are double-buffered with
// cp.async, made visible to the wgmma (async) proxy by a proxy fence. No producer warp, TMA or
// ping-pong yet: two blocks fit on an SM, so one's softmax can overlap the other's matmuls.
#pragma once

#include "dkv_fwd.cuh"
#include "dkv_wgmma.cuh"

namespace dkv {

template <int kHeadDim_>
struct FwdSm90 {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kBlockN = 64, kThreads = 128;
  static constexpr int kParts = kHeadDim / 64;  // 64-column swizzled sub-tiles per row
  static constexpr int kHalf = 64 * 64;         // elements of one 64 x 64 sub-tile (8 KB)
  static constexpr int kTile = kParts * kHalf;  // 64 rows x kHeadDim columns
  static constexpr int kSmemBytes = 5 * kTile * 2 + 1024;  // Q + two stages of (K, V), + 1024-byte alignment
  static_assert(kHeadDim % 64 == 0 && kParts >= 1 && kParts <= 4, "head dim: 64, 128, 192 or 256");
};

// Rows [row, row + 64) of one head of a (rows, heads, K::kHeadDim) tensor into a tile of swizzled
// 64-column sub-tiles (rows past `valid` read as zeros).
template <class K>
DKV_DEV void load_tile_sw128_async(uint16_t* dst, const TensorRef& t, int64_t row, int head, int valid, int tid) {
  const uint16_t* base = static_cast<const uint16_t*>(t.ptr);
  constexpr int kChunks = K::kHeadDim / 8;  // chunks of 8 elements per row
  for (int i = tid; i < 64 * kChunks; i += K::kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool ok = r < valid;
    const uint16_t* src = ok ? base + t.offset(row + r, head) + c * 8 : base;
    cp_async_16(dst + (c / 8) * K::kHalf + sm90::sw128_offset(r, (c % 8) * 8) / 2, src, ok);
  }
}

template <class E, int D>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(128) dkv_fwd_sm90_kernel(const DKV_GRID_CONSTANT FwdParams p) {
  using K = FwdSm90<D>;
  constexpr int kParts = K::kParts;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN;
  const QueryTile qt = query_tile<kBlockM>(p, p.q_tile_prefix);
  if (qt.s < 0) return;
  const int row0 = qt.row0, ctx_len = qt.ctx_len, ctx_row0 = qt.ctx_row0, q0 = qt.q0, m_valid = qt.m_valid;
  const int h = qt.h, hk = qt.hk;
  const int W = p.window;

  const int tid = thread_idx(), lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  uint16_t* sK0 = sQ + K::kTile;  // stage b: K at sK0 + 2 b kTile, V right after it
  auto sK = [&](int b) { return sK0 + 2 * b * K::kTile; };
  auto sV = [&](int b) { return sK0 + (2 * b + 1) * K::kTile; };

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, ctx_len, ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
  const int qpos_lo = ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  auto issue_kv = [&](int ti) {
    const KvTile kt = walk.tile<kBlockN>(ti);
    load_tile_sw128_async<K>(sK(ti & 1), kt.ctx ? p.k_ctx : p.k, kt.row, hk, kt.valid, tid);
    load_tile_sw128_async<K>(sV(ti & 1), kt.ctx ? p.v_ctx : p.v, kt.row, hk, kt.valid, tid);
  };
  load_tile_sw128_async<K>(sQ, p.q, row0 + q0, h, m_valid, tid);
  issue_kv(0);  // n_tiles >= 1: a query always sees its own key
  cp_async_commit();

  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  float o[kParts][32];
  for (int half = 0; half < kParts; ++half)
    for (int i = 0; i < 32; ++i) o[half][i] = 0.f;
  float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.f, 0.f};
  const int row_in_tile[2] = {16 * warp + g, 16 * warp + g + 8};

  for (int ti = 0; ti < n_tiles; ++ti) {
    if (ti + 1 < n_tiles) issue_kv(ti + 1);
    cp_async_commit();
    cp_async_wait<1>();
    sm90::fence_smem_to_async_proxy();
    block_sync();

    const KvTile kt = walk.tile<kBlockN>(ti);
    const char* q_bytes = reinterpret_cast<const char*>(sQ);
    const char* k_bytes = reinterpret_cast<const char*>(sK(ti & 1));
    float sc[32];
    sm90::wgmma_fence();
    for (int k = 0; k < K::kHeadDim / 16; ++k) {  // sub-tile k / 4, 32 bytes per k16 step inside it
      const int off = (k / 4) * K::kHalf * 2 + (k % 4) * 32;
      sm90::wgmma_m64n64k16_ss_bf16<0>(sc, sm90::smem_desc_sw128(q_bytes + off), sm90::smem_desc_sw128(k_bytes + off),
                                       k > 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();

    const bool need_mask = kt.valid < kBlockN || kt.kpos0 + kt.valid - 1 > qpos_lo || qpos_hi - kt.kpos0 >= W;
    float blocks[8][4];
    for (int r = 0; r < 2; ++r) {  // rows g (r = 0) and g + 8 (r = 1); a quad of lanes shares a row
      const int qpos = qpos_lo + row_in_tile[r];
      float mx = kNegInf;
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < 2; ++c) {
          float x = score(sc[4 * j + 2 * r + c]);
          if (need_mask) {
            const int col = 8 * j + 2 * tq + c, kpos = kt.kpos0 + col;
            if (col >= kt.valid || kpos > qpos || qpos - kpos >= W) x = kNegInf;
          }
          blocks[j][2 * r + c] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, shfl_xor(mx, 1));
      mx = fmaxf(mx, shfl_xor(mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      const float m_use = m_new == kNegInf ? 0.f : m_new;
      const float alpha = fast_exp2(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.f;
      for (int j = 0; j < 8; ++j)
        for (int c = 0; c < 2; ++c) {
          const float e = fast_exp2(blocks[j][2 * r + c] - m_use);
          blocks[j][2 * r + c] = e;
          sum += e;
        }
      l_run[r] = l_run[r] * alpha + sum;
      for (int half = 0; half < kParts; ++half)
        for (int j = 0; j < 8; ++j) {
          o[half][4 * j + 2 * r] *= alpha;
          o[half][4 * j + 2 * r + 1] *= alpha;
        }
    }
    uint32_t pa[4][4];
    c_to_a<E, 64>(pa, blocks);

    const char* v_bytes = reinterpret_cast<const char*>(sV(ti & 1));
    sm90::wgmma_fence();
    for (int half = 0; half < kParts; ++half)
      for (int k = 0; k < kBlockN / 16; ++k)  // keys 16 k .. 16 k + 15: rows 2048 bytes apart per step
        sm90::wgmma_m64n64k16_rs_bf16<1>(o[half], pa[k],
                                         sm90::smem_desc_sw128_mn64(v_bytes + half * K::kHalf * 2 + k * 2048), true);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    block_sync();  // every thread is done with this stage before the next iteration refills it
  }

  uint16_t* out_ptr = static_cast<uint16_t*>(p.out.ptr);
  for (int r = 0; r < 2; ++r) {
    float l = l_run[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    const int row = row_in_tile[r];
    if (row < m_valid) {
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t qrow = row0 + q0 + row;
      uint16_t* dst = out_ptr + p.out.offset(qrow, h);
      for (int half = 0; half < kParts; ++half)
        for (int j = 0; j < 8; ++j)
          store_u32(dst + 64 * half + 8 * j + 2 * tq,
                    pack2<E>(o[half][4 * j + 2 * r] * inv, o[half][4 * j + 2 * r + 1] * inv));
      if (tq == 0) {
        p.lse[static_cast<int64_t>(h) * p.total_q + qrow] = l > 0.f ? (m_run[r] + fast_log2(l)) * kLn2 : kNegInf;
      }
    }
  }
}

}  // namespace dkv
