// Backward kernels on Hopper warpgroup MMA (sm_90a), fp16 / bf16 (docs/cuda.md): dQ (query-parallel,
// the forward's walk) and dK/dV (key-parallel), at head dims 64 and 128; at 192 and 256 both with the
// warpgroups' roles split (dkv_bwd_sm90_split.cuh). The default backward on sm_90 at
// these head dims (DUALKV_CUDA_WGMMA_BWD=0 opts out); checked on an H200 (tests/gpu/test_cuda_gpu.py)
// and on the CPU emulation (csrc/emulation/emulate.py --sm90-bwd).
//
// dK/dV:
// Same work items, reader walk and output modes as the mma.sync kernel (dkv_bwd.cuh): a persistent
// block takes a tile of 128 keys of one kv head, walks every query tile that reads it (its owner
// segment, then the reader segments of a shared prompt, for every query head of the group), and
// writes dK / dV directly or adds them to the fp32 context workspace. A block is two warpgroups
// (256 threads), warpgroup w on keys 64 w .. 64 w + 63; per query tile of 64 rows, each warpgroup:
//
//   S^T  (64 keys x 64 queries) = K Q^T     wgmma SS (both operands K-major in shared memory)
//   dP^T (64 x 64)              = V dO^T    wgmma SS
//   P^T = exp2(score(S^T) - lse), dS^T = P^T (dP^T - D)     in the accumulator registers
//   dV (64 x d) += P^T dO                   wgmma RS: P^T re-packed as the register operand,
//   dK (64 x d) += dS^T Q                   dO / Q as MN-major operands, per 64-column part
//
// Q, dO, lse and D of the next query tile load (cp.async, 128B-swizzled) while this one computes.
//
// dQ: a block is two warpgroups on 128 query rows of one head (the forward's walk over its group's
// prompt keys, then its own), key tiles of 64 in a ring of 3 buffers; per key tile, each
// warpgroup computes S = Q K^T and dP = dO V^T (wgmma SS), dS = P (dP - D) in registers, and
// dQ (64 x d) += dS K (wgmma RS, K as an MN-major operand).
//
// Both kernels have two schedules (DUALKV_CUDA_WGMMA_BWD=1: the products of a tile in turn; =2: the
// next tile's shared-memory products issued before this tile's register-operand ones, and the
// element-wise step under them; on an H200 the first is 2-4% faster). =3 runs the in-turn dK/dV
// kernel with dQ accumulated in it (DkdvSm90::kDq) and no dQ kernel; =4 runs the dK/dV kernel
// warp-specialised (dkv_dkdv_sm90_ws_kernel in dkv_bwd_sm90_ws.cuh: a producer warpgroup loads, the two compute warpgroups
// never meet at a barrier) with the in-turn dQ kernel; =5 both kernels warp-specialised
// (dkv_dq_sm90_ws_kernel); =6 the warp-specialised dK/dV kernel with dQ accumulated in it
// (DkdvSm90Ws::kDq) and no dQ kernel; =8 as 5 with S^T and dP^T waited for apart (DkdvSm90Ws::kSplit).
// The default: 6 at d = 64 and 128 (5 with deterministic=True).
#pragma once

#include "dkv_bwd.cuh"
#include "dkv_launch.h"
#include "dkv_wgmma.cuh"

namespace dkv {

// The dQ kernels' load of key tile t of the walk into the K / V buffers (cp.async, not committed).
template <int D, int kThreads, int kBlockN>
DKV_DEV void load_kv_tile(const BwdParams& p, const TwoRegionWalk& walk, int t, uint16_t* sK, uint16_t* sV, int hk,
                          int tid) {
  const KvTile kt = walk.tile<kBlockN>(t);
  sm90::load_tile_sw128_async<D, kThreads, kBlockN>(sK, kt.ctx ? p.k_ctx : p.k, kt.row, hk, kt.valid, tid);
  sm90::load_tile_sw128_async<D, kThreads, kBlockN>(sV, kt.ctx ? p.v_ctx : p.v, kt.row, hk, kt.valid, tid);
}

// lse_log2 / dsum of this thread's two query rows of the tile at packed row row0 (0 past m_valid).
DKV_DEV void load_row_stats(const BwdParams& p, int h, int row0, const int (&row_in_tile)[2], int m_valid,
                            float (&lse2)[2], float (&dsum)[2]) {
  for (int r = 0; r < 2; ++r) {
    const int row = row_in_tile[r];
    const int64_t i = static_cast<int64_t>(h) * p.total_q + row0 + row;
    lse2[r] = row < m_valid ? p.lse_log2[i] : 0.f;
    dsum[r] = row < m_valid ? p.dsum[i] : 0.f;
  }
}

// The element-wise step of the dQ kernels over a score tile S of 64 query rows x kBlockN keys (s[4 j + i]:
// row row_in_tile[i / 2], key 8 j + 2 tq + i % 2; queries at positions qpos_lo + row): for every
// element fn(e, r, masked, pr, dtanh) with r = i / 2, pr = exp2(score - lse) and dtanh = 1 - tanh^2
// under a softcap (1 without one: dS = pr (dP - D) dtanh).
template <int kBlockN, class Fn>
DKV_DEV void row_probabilities(const float (&s)[kBlockN / 2], const KvTile& kt, int qpos_lo, int qpos_hi,
                               const int (&row_in_tile)[2], const float (&lse2)[2], int tq, int W,
                               const ScoreFn& score, Fn&& fn) {
  const bool need_mask = kt.valid < kBlockN || kt.kpos0 + kt.valid - 1 > qpos_lo || qpos_hi - kt.kpos0 >= W;
  with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
#pragma unroll
    for (int e = 0; e < kBlockN / 2; ++e) {
      const int r = (e / 2) % 2;
      bool masked = false;
      if constexpr (decltype(mask)::value) {
        const int col = 8 * (e / 4) + 2 * tq + (e % 2), kpos = kt.kpos0 + col;
        const int qpos = qpos_lo + row_in_tile[r];
        masked = col >= kt.valid || kpos > qpos || qpos - kpos >= W;
      }
      if constexpr (decltype(cap)::value) {
        const float th = tanh_f(s[e] * score.cap_inv_scale);
        fn(e, r, masked, fast_exp2(score.cap_log2 * th - lse2[r]), 1.f - th * th);
      } else {
        fn(e, r, masked, fast_exp2(score.plain(s[e]) - lse2[r]), 1.f);
      }
    }
  });
}

// One warpgroup's products in the dQ kernels (the in-turn and overlapped one and the warp-specialised
// one): its 64 query rows start 64 rows (8 KB) into every 128-row part of Q and dO; the key tile in
// ring buffer b sits at b * kKvTile of the K and V rings.
template <class E, int D, int kBlockM, int kBlockN>
struct DqProducts {
  static constexpr int kParts = D / 64;
  static constexpr uint32_t kKvTileBytes = kBlockN * D * 2;
  uint64_t q, dout, k, v, k_mn;

  DKV_DEV DqProducts(const uint16_t* sQ, const uint16_t* sdO, const uint16_t* sK0, const uint16_t* sV0, int wg)
      : q(sm90::smem_desc_sw128(reinterpret_cast<const char*>(sQ) + wg * 64 * 128)),
        dout(sm90::smem_desc_sw128(reinterpret_cast<const char*>(sdO) + wg * 64 * 128)),
        k(sm90::smem_desc_sw128(sK0)),
        v(sm90::smem_desc_sw128(sV0)),
        k_mn(sm90::smem_desc_sw128_mn(sK0, kBlockN * 128)) {}

  // S = Q K^T and dP = dO V^T with the key tile in buffer b (D / 16 k16 steps each).
  DKV_DEV void issue_ss(float (&s)[32], float (&dp)[32], int b) const {
    const uint32_t buf = b * kKvTileBytes;
    const uint64_t dq0 = sm90::desc_here(q), ddo0 = sm90::desc_here(dout);
    const uint64_t dk0 = sm90::desc_advance(k, buf), dv0 = sm90::desc_advance(v, buf);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {  // part kk / 4, 32 bytes per k16 step inside it
      const uint32_t q_off = (kk / 4) * kBlockM * 128 + (kk % 4) * 32, kv_off = (kk / 4) * kBlockN * 128 + (kk % 4) * 32;
      sm90::wgmma_m64n64k16_ss<E, 0>(s, sm90::desc_advance(dq0, q_off), sm90::desc_advance(dk0, kv_off), kk > 0);
      sm90::wgmma_m64n64k16_ss<E, 0>(dp, sm90::desc_advance(ddo0, q_off), sm90::desc_advance(dv0, kv_off), kk > 0);
    }
  }
  // dQ += dS K with the key tile in buffer b: keys 16 kk .. 16 kk + 15 are rows 2048 bytes apart per step.
  DKV_DEV void issue_rs(float (&dq)[kParts][32], const uint32_t (&dsa)[kBlockN / 16][4], int b) const {
    const uint64_t dk_mn = sm90::desc_advance(sm90::desc_here(k_mn), b * kKvTileBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      sm90::wgmma_rs_mn_parts<E, kParts>(dq, dsa[kk], sm90::desc_advance(dk_mn, kk * 2048), kBlockN * 128);
  }
};

// The dQ kernels' end: each thread's two query rows of dQ (dq[part][4 j + i]: row row_in_tile[i / 2],
// column 64 part + 8 j + 2 tq + i % 2), scaled, for the tile at packed row `row`.
template <class E, int kParts>
DKV_DEV void store_dq_rows(const BwdParams& p, int row, int h, int m_valid, const int (&row_in_tile)[2], int tq,
                           const float (&dq)[kParts][32]) {
  uint16_t* dq_ptr = static_cast<uint16_t*>(p.dq.ptr);
  for (int r = 0; r < 2; ++r) {
    if (row_in_tile[r] >= m_valid) continue;
    uint16_t* dst = dq_ptr + p.dq.offset(row + row_in_tile[r], h) + 2 * tq;
    for (int part = 0; part < kParts; ++part)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        store_u32(dst + 64 * part + 8 * j, pack2<E>(dq[part][4 * j + 2 * r] * p.scale, dq[part][4 * j + 2 * r + 1] * p.scale));
  }
}

// One warpgroup's state in the dQ kernels: a thread's two query rows of the tile (row_in_tile) with
// their lse_log2 and dsum, its dQ accumulators, S and dP of the key tile, and dS as a register operand.
template <class E, int D, int kBlockN>
struct DqWarpgroup {
  static constexpr int kParts = D / 64;
  int row_in_tile[2];
  float lse2[2], dsum[2];
  float dq[kParts][32];
  float s[32], dp[32];
  uint32_t dsa[kBlockN / 16][4] = {};

  // wg: the warpgroup's 64 rows of the 128-row tile at packed row `row` of head h.
  DKV_DEV DqWarpgroup(const BwdParams& p, int h, int row, int m_valid, int wg, int warp, int g)
      : row_in_tile{64 * wg + 16 * warp + g, 64 * wg + 16 * warp + g + 8} {
    load_row_stats(p, h, row, row_in_tile, m_valid, lse2, dsum);
    for (int part = 0; part < kParts; ++part)
      for (int i = 0; i < 32; ++i) dq[part][i] = 0.f;
  }
  // dS = P (dP - D) in place of dP for key tile kt (s[4 j + i]: row row_in_tile[i / 2], key 8 j + 2 tq + i % 2).
  DKV_DEV void tile_ds(const KvTile& kt, int qpos_lo, int qpos_hi, int tq, int W, const ScoreFn& score) {
    row_probabilities<kBlockN>(s, kt, qpos_lo, qpos_hi, row_in_tile, lse2, tq, W, score,
                               [&](int e, int r, bool masked, float pr, float dtanh) {
                                 const float ds = pr * (dp[e] - dsum[r]) * dtanh;
                                 dp[e] = masked ? 0.f : ds;
                               });
  }
  DKV_DEV void pack_ds() { c_to_a<E, kBlockN>(dsa, reinterpret_cast<const float(&)[kBlockN / 8][4]>(dp)); }
  // After the waits that end S / dP and dQ += dS K: their operands pinned (sm90::fence_operand).
  DKV_DEV void pin_ss() {
    sm90::fence_operand<32>(s);
    sm90::fence_operand<32>(dp);
  }
  DKV_DEV void pin_dq() {
    sm90::fence_operand(dsa);
    for (int part = 0; part < kParts; ++part) sm90::fence_operand<32>(dq[part]);
  }
};

// kOverlap = false: per key tile, S and dP, the element-wise step, then dQ += dS K, each waited for;
// the K / V ring loads two tiles ahead. kOverlap = true: S and dP of key tile t are issued before
// dQ += dS_{t-1} K_{t-1}, and the element-wise step of tile t runs while that product still runs;
// the ring then holds tiles t - 1, t and t + 1 and loads one tile ahead.
template <int kHeadDim_, bool kOverlap_>
struct DqSm90 {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 128, kBlockN = 64, kThreads = 256, kStages = 3;
  static constexpr bool kOverlap = kOverlap_;
  static constexpr int kAhead = kOverlap ? 1 : kStages - 1;  // key tiles loaded ahead of the one in use
  static constexpr int kParts = kHeadDim / 64;
  static constexpr int kQTile = kBlockM * kHeadDim, kKvTile = kBlockN * kHeadDim;  // elements
  static constexpr int kSmemBytes = (2 * kQTile + 2 * kStages * kKvTile) * 2 + 1024;  // Q, dO, K / V rings
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the wgmma dQ kernel: head dim 64 or 128");
};

template <class E, int D, bool kOverlap>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_dq_sm90_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DqSm90<D, kOverlap>;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kParts = K::kParts, kStages = K::kStages;
  constexpr int kAhead = K::kAhead;
  const QueryTile qt = query_tile<kBlockM>(p, p.q_tile_prefix, p.q_seg_order);
  if (qt.s < 0) return;
  const int row0 = qt.row0, ctx_len = qt.ctx_len, ctx_row0 = qt.ctx_row0, q0 = qt.q0, m_valid = qt.m_valid;
  const int h = qt.h, hk = qt.hk;
  const int W = p.window;
  const int tid = thread_idx(), lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);
  const int g = lane >> 2, tq = lane & 3;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  uint16_t* sdO = sQ + K::kQTile;
  uint16_t* sK0 = sdO + K::kQTile;  // K buffers, then V buffers; tile t in buffer t % kStages
  auto sK = [&](int t) { return sK0 + (t % kStages) * K::kKvTile; };
  auto sV = [&](int t) { return sK0 + (kStages + t % kStages) * K::kKvTile; };

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, ctx_len, ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
  const int qpos_lo = ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  auto load_kv = [&](int t) { load_kv_tile<D, K::kThreads, kBlockN>(p, walk, t, sK(t), sV(t), hk, tid); };
  // One cp.async group per step: group 0 = Q, dO and tile 0; group j = tile j: iteration t needs group t.
  sm90::load_tile_sw128_async<D, K::kThreads, kBlockM>(sQ, p.q, row0 + q0, h, m_valid, tid);
  sm90::load_tile_sw128_async<D, K::kThreads, kBlockM>(sdO, p.dout, row0 + q0, h, m_valid, tid);
  load_kv(0);  // n_tiles >= 1: a query always sees its own key
  cp_async_commit();
  for (int j = 1; j < kAhead; ++j) {
    if (j < n_tiles) load_kv(j);
    cp_async_commit();
  }

  DqWarpgroup<E, D, kBlockN> w(p, h, row0 + q0, m_valid, wg, warp, g);
  const DqProducts<E, D, kBlockM, kBlockN> products(sQ, sdO, sK(0), sV(0), wg);
  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  auto issue_ss = [&](int t) { products.issue_ss(w.s, w.dp, t % kStages); };  // key tile t
  auto issue_rs = [&](int t) { products.issue_rs(w.dq, w.dsa, t % kStages); };
  auto elementwise = [&](int t) { w.tile_ds(walk.tile<kBlockN>(t), qpos_lo, qpos_hi, tq, W, score); };

  for (int t = 0; t < n_tiles; ++t) {
    // Tile t (group t) has landed, and every warpgroup is done with the products that read the
    // buffer the load below refills (tile t - 1 without overlap, t - 2 with it).
    cp_async_wait<kAhead - 1>();
    sm90::fence_smem_to_async_proxy();
    block_sync();
    if (t + kAhead < n_tiles) load_kv(t + kAhead);
    cp_async_commit();

    sm90::wgmma_fence();
    issue_ss(t);
    sm90::wgmma_commit();
    if (kOverlap && t > 0) {
      issue_rs(t - 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<1>();  // S and dP of tile t; dQ += dS_{t-1} K_{t-1} may still run
    } else {
      sm90::wgmma_wait<0>();
    }
    w.pin_ss();
    elementwise(t);
    if constexpr (kOverlap) {
      sm90::wgmma_wait<0>();
      w.pin_dq();
      w.pack_ds();
    } else {
      w.pack_ds();
      sm90::wgmma_fence();
      issue_rs(t);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      w.pin_dq();
    }
  }
  if constexpr (kOverlap) {  // the last tile's dQ product; its K is still in its buffer
    sm90::wgmma_fence();
    issue_rs(n_tiles - 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    w.pin_dq();
  }
  cp_async_wait<0>();
  store_dq_rows<E, kParts>(p, row0 + q0, h, m_valid, w.row_in_tile, tq, w.dq);
}

// The dQ kernel warp-specialised (DUALKV_CUDA_WGMMA_BWD=5, with the warp-specialised dK/dV kernel;
// d = 64 / 128): warpgroup 0 only loads, warpgroups 1 and 2 compute as the in-turn kernel above (each
// its 64 of the tile's 128 query rows). The producer loads Q and dO with key tile 0, then every key
// tile of the walk into a ring of kStages K / V buffers; it publishes a tile (full) once the next
// one's copies are issued and its own have landed, and refills a buffer once both consumers are done
// with it (empty). So the consumers never meet at a block barrier, and the load addressing leaves
// their registers (setmaxnreg).
template <int kHeadDim_>
struct DqSm90Ws {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 128, kBlockN = 64, kThreads = 384, kStages = 4;
  static constexpr int kParts = kHeadDim / 64;
  static constexpr int kQTile = kBlockM * kHeadDim, kKvTile = kBlockN * kHeadDim;  // elements
  // Shared memory, in bytes from the 1024-aligned base: Q, dO; the K ring, the V ring; the full and
  // empty barriers; then the base's alignment slack.
  static constexpr int kOffDo = kQTile * 2, kOffK = 2 * kQTile * 2, kOffV = kOffK + kStages * kKvTile * 2;
  static constexpr int kOffBars = kOffV + kStages * kKvTile * 2;
  static constexpr int kSmemBytes = kOffBars + 2 * kStages * 8 + 1024;
  static_assert(kKvTile * 2 % 1024 == 0 && kOffK % 1024 == 0 && kOffV % 1024 == 0,
                "128-byte-swizzled tiles start on 1024-byte boundaries");
  static_assert(kOffBars % 8 == 0, "mbarriers 8-byte aligned");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the warp-specialised dQ kernel: head dim 64 or 128");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 / H200 block");
};

template <class E, int D>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(384) dkv_dq_sm90_ws_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DqSm90Ws<D>;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kParts = K::kParts, kStages = K::kStages;
  const QueryTile qt = query_tile<kBlockM>(p, p.q_tile_prefix, p.q_seg_order);
  if (qt.s < 0) return;
  const int row0 = qt.row0, q0 = qt.q0, m_valid = qt.m_valid, h = qt.h, hk = qt.hk;
  const int W = p.window;

  char* smem = reinterpret_cast<char*>(sm90::dynamic_smem_1024());
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sdO = reinterpret_cast<uint16_t*>(smem + K::kOffDo);
  auto sK = [&](int b) { return reinterpret_cast<uint16_t*>(smem + K::kOffK) + b * K::kKvTile; };
  auto sV = [&](int b) { return reinterpret_cast<uint16_t*>(smem + K::kOffV) + b * K::kKvTile; };
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + K::kOffBars);
  uint64_t* empty = full + kStages;

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, qt.ctx_len, qt.ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;  // >= 1: a query always sees its own key
  const int qpos_lo = qt.ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  sm90::init_ring(full, empty, kStages);

  if (thread_idx() < 128) {  // the producer: one cp.async group a key tile (the first with Q and dO)
    sm90::setmaxnreg_dec<sm90::kProducerRegs>();
    const int pt = thread_idx();
    auto publish = [&](int t) {  // tile t's copies (this thread's) have landed: visible to wgmma
      sm90::fence_smem_to_async_proxy();
      sm90::mbar_arrive(&full[t % kStages]);
    };
    sm90::load_tile_sw128_async<D, 128, kBlockM>(sQ, p.q, row0 + q0, h, m_valid, pt);
    sm90::load_tile_sw128_async<D, 128, kBlockM>(sdO, p.dout, row0 + q0, h, m_valid, pt);
    for (int t = 0; t < n_tiles; ++t) {
      const int b = t % kStages;
      if (t >= kStages) sm90::mbar_wait(&empty[b], (t / kStages - 1) & 1);  // tile t - kStages is read
      load_kv_tile<D, 128, kBlockN>(p, walk, t, sK(b), sV(b), hk, pt);
      cp_async_commit();
      if (t > 0) {
        cp_async_wait<1>();
        publish(t - 1);
      }
    }
    cp_async_wait<0>();
    publish(n_tiles - 1);
    return;
  }

  sm90::setmaxnreg_inc<sm90::kConsumerRegs>();
  const int tid = thread_idx() - 128, lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);  // wg: consumer 0 / 1
  const int g = lane >> 2, tq = lane & 3;
  DqWarpgroup<E, D, kBlockN> w(p, h, row0 + q0, m_valid, wg, warp, g);
  const DqProducts<E, D, kBlockM, kBlockN> products(sQ, sdO, sK(0), sV(0), wg);
  const ScoreFn score = make_score_fn(p.scale, p.softcap);

  for (int t = 0; t < n_tiles; ++t) {
    const int b = warp_uniform(t % kStages);
    sm90::mbar_wait(&full[b], (t / kStages) & 1);
    // S = Q K^T and dP = dO V^T (as dkv_dq_sm90_kernel), then dS in place of dP and dQ += dS K.
    sm90::wgmma_fence();
    products.issue_ss(w.s, w.dp, b);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    w.pin_ss();
    w.tile_ds(walk.tile<kBlockN>(t), qpos_lo, qpos_hi, tq, W, score);
    w.pack_ds();
    sm90::wgmma_fence();
    products.issue_rs(w.dq, w.dsa, b);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    w.pin_dq();
    sm90::mbar_arrive(&empty[b]);  // this warpgroup is done with key tile t's buffer
  }
  store_dq_rows<E, kParts>(p, row0 + q0, h, m_valid, w.row_in_tile, tq, w.dq);
}

// A work item's K and V tiles (its nk keys, 128B-swizzled) into sK / sV by all kThreads threads'
// cp.async (not committed): from k_ctx / v_ctx where the item's keys are a separate context's.
template <int D, int kThreads, int kBlockN>
DKV_DEV void load_item_kv(const BwdParams& p, const KvItem& it, uint16_t* sK, uint16_t* sV, int tid) {
  sm90::load_tile_sw128_async<D, kThreads, kBlockN>(sK, it.ctx_tensor ? p.k_ctx : p.k, it.key_row0, it.hk, it.nk, tid);
  sm90::load_tile_sw128_async<D, kThreads, kBlockN>(sV, it.ctx_tensor ? p.v_ctx : p.v, it.key_row0, it.hk, it.nk, tid);
}

// A reader tile's lse_log2 and dsum into sL / sD (cp.async, not committed).
template <int kThreads, int kBlockM>
DKV_DEV void load_reader_stats(const BwdParams& p, const ReaderTile& rt, float* sL, float* sD, int tid) {
  const int64_t si = static_cast<int64_t>(rt.hq) * p.total_q + rt.row;
  load_vec_async<kBlockM, kThreads>(sL, p.lse_log2 + si, rt.desc.m_valid, p.lse_log2, tid);
  load_vec_async<kBlockM, kThreads>(sD, p.dsum + si, rt.desc.m_valid, p.dsum, tid);
}

// The dK/dV kernels' loads of one reader query tile (cp.async, not committed): Q and dO rows into the
// swizzled tiles sQ / sdO, lse_log2 and dsum into sL / sD; returns the tile.
template <int D, int kThreads, int kBlockM>
DKV_DEV ReaderTile load_reader_tile(const BwdParams& p, const ReaderCursor<kBlockM>& cur, const KvItem& it, int rep,
                                    uint16_t* sQ, uint16_t* sdO, float* sL, float* sD, int tid) {
  const ReaderTile rt = reader_tile(cur, it, rep);
  const int m = rt.desc.m_valid;
  sm90::load_tile_sw128_async<D, kThreads, kBlockM>(sQ, p.q, rt.row, rt.hq, m, tid);
  sm90::load_tile_sw128_async<D, kThreads, kBlockM>(sdO, p.dout, rt.row, rt.hq, m, tid);
  load_reader_stats<kThreads, kBlockM>(p, rt, sL, sD, tid);
  return rt;
}

// The dK/dV kernels' start of a reader tile: its loads have landed (every thread's, visible to wgmma)
// and every warpgroup is done with the previous tile, whose buffers are then free for the next
// tile's loads; the tile's shared-memory products are issued (committed, not waited for).
template <class IssueSS>
DKV_DEV void open_reader_tile(IssueSS&& issue_ss) {
  cp_async_wait<0>();
  sm90::fence_smem_to_async_proxy();
  block_sync();
  sm90::wgmma_fence();
  issue_ss();
  sm90::wgmma_commit();
}

// A transposed tile's lse_log2 per query, read from shared memory where an element needs it.
DKV_DEV auto shared_lse(const float* sL) {
  return [sL](int, int query) { return sL[query]; };
}

// The same values read into registers up front, the 16 queries of thread tq's elements (element e's
// query 8 (e / 4) + 2 tq + e % 2 is entry 2 (e / 4) + e % 2). For element-wise steps that store to
// shared memory: the compiler cannot tell those stores from sL, so reads inside the loop would each
// wait for the stores before them (the split dK/dV kernel's exponentials ran one at a time).
template <int kBlockM>
struct ColumnStats {
  float v[kBlockM / 4];
  DKV_DEV void load(const float* sL, int tq) {
#pragma unroll
    for (int j = 0; j < kBlockM / 4; ++j) v[j] = sL[8 * (j / 2) + 2 * tq + (j % 2)];
  }
  DKV_DEV float operator()(int e, int) const { return v[2 * (e / 4) + (e % 2)]; }
};

// The element-wise step of the dK/dV kernels over a transposed score tile S^T of 64 keys x kBlockM
// queries (s[4 j + i]: key key_in_tile[i / 2], query 8 j + 2 tq + i % 2): for every element
// fn(e, query, masked, pr, dtanh) with pr = exp2(score - lse) and dtanh = 1 - tanh^2 under a softcap
// (1 without one: dS^T = pr (dP^T - D) dtanh). lse_at(e, query) gives the tile's lse_log2 of the query:
// read from shared memory (shared_lse) or held in registers (ColumnStats).
template <int kBlockM, int kBlockN, class LseAt, class Fn>
DKV_DEV void transposed_probabilities(const float (&s)[kBlockM / 2], const QTileDesc& desc, LseAt&& lse_at,
                                      const int (&key_in_tile)[2], int tq, int W, const ScoreFn& score, Fn&& fn) {
  const int kpos_first = desc.kpos0 + desc.klo, kpos_last = desc.kpos0 + desc.khi - 1;
  const bool need_mask = desc.m_valid < kBlockM || desc.klo > 0 || desc.khi < kBlockN ||
                         kpos_last > desc.qpos0 || desc.qpos0 + desc.m_valid - 1 - kpos_first >= W;
  with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
#pragma unroll
    for (int e = 0; e < kBlockM / 2; ++e) {
      const int col = 8 * (e / 4) + 2 * tq + (e % 2), key = key_in_tile[(e / 2) % 2];
      bool masked = false;
      if constexpr (decltype(mask)::value) {
        const int qpos = desc.qpos0 + col, kpos = desc.kpos0 + key;
        masked = col >= desc.m_valid || key < desc.klo || key >= desc.khi || kpos > qpos || qpos - kpos >= W;
      }
      if constexpr (decltype(cap)::value) {
        const float th = tanh_f(s[e] * score.cap_inv_scale);
        fn(e, col, masked, fast_exp2(score.cap_log2 * th - lse_at(e, col)), 1.f - th * th);
      } else {
        fn(e, col, masked, fast_exp2(score.plain(s[e]) - lse_at(e, col)), 1.f);
      }
    }
  });
}

// One warpgroup's products in the dK/dV kernels (the in-turn and overlapped one below and the
// warp-specialised one): its 64 keys start 64 rows (8 KB) into every 128-row part of K and V; the
// query tile in buffer b sits at b * kQTile of the Q and dO buffers.
template <class E, int D, int kBlockM, int kBlockN>
struct DkdvProducts {
  static constexpr int kParts = D / 64;
  static constexpr uint32_t kQTileBytes = kBlockM * D * 2;
  uint64_t k, v, q, dout, q_mn, dout_mn;

  DKV_DEV DkdvProducts(const uint16_t* sK, const uint16_t* sV, const uint16_t* sQ0, const uint16_t* sdO0, int wg)
      : k(sm90::smem_desc_sw128(reinterpret_cast<const char*>(sK) + wg * 64 * 128)),
        v(sm90::smem_desc_sw128(reinterpret_cast<const char*>(sV) + wg * 64 * 128)),
        q(sm90::smem_desc_sw128(sQ0)),
        dout(sm90::smem_desc_sw128(sdO0)),
        q_mn(sm90::smem_desc_sw128_mn(sQ0, kBlockM * 128)),
        dout_mn(sm90::smem_desc_sw128_mn(sdO0, kBlockM * 128)) {}

  // Byte offsets of k16 step s (part s / 4, 32 bytes per step inside it) in K / V and in the query
  // tile at byte qb (buffer b: qb = b * kQTileBytes).
  static DKV_DEV uint32_t kv_step(int s) { return (s / 4) * kBlockN * 128 + (s % 4) * 32; }
  static DKV_DEV uint32_t q_step(int s, uint32_t qb) { return qb + (s / 4) * kBlockM * 128 + (s % 4) * 32; }
  // S^T = K Q^T and dP^T = V dO^T of the query tile in buffer b (D / 16 k16 steps each), interleaved.
  DKV_DEV void issue_ss(float (&st)[32], float (&dpt)[32], int b) const {
    const uint32_t qb = b * kQTileBytes;
    const uint64_t dk0 = sm90::desc_here(k), dv0 = sm90::desc_here(v);
    const uint64_t dq0 = sm90::desc_here(q), ddo0 = sm90::desc_here(dout);
#pragma unroll
    for (int s = 0; s < D / 16; ++s) {
      const uint32_t kv_off = kv_step(s), q_off = q_step(s, qb);
      sm90::wgmma_m64n64k16_ss<E, 0>(st, sm90::desc_advance(dk0, kv_off), sm90::desc_advance(dq0, q_off), s > 0);
      sm90::wgmma_m64n64k16_ss<E, 0>(dpt, sm90::desc_advance(dv0, kv_off), sm90::desc_advance(ddo0, q_off), s > 0);
    }
  }
  // S^T alone and dP^T alone (schedule 8: each its own commit group).
  DKV_DEV void issue_s(float (&st)[32], int b) const { issue_ss_one(st, k, q, b); }
  DKV_DEV void issue_dp(float (&dpt)[32], int b) const { issue_ss_one(dpt, v, dout, b); }
  DKV_DEV void issue_ss_one(float (&acc)[32], uint64_t kv, uint64_t qd, int b) const {
    const uint32_t qb = b * kQTileBytes;
    const uint64_t a0 = sm90::desc_here(kv), b0 = sm90::desc_here(qd);
#pragma unroll
    for (int s = 0; s < D / 16; ++s)
      sm90::wgmma_m64n64k16_ss<E, 0>(acc, sm90::desc_advance(a0, kv_step(s)), sm90::desc_advance(b0, q_step(s, qb)), s > 0);
  }
  // dV += P^T dO, dK += dS^T Q with the tile in buffer b: queries 16 kq .. 16 kq + 15 are rows 2048
  // bytes apart per step.
  DKV_DEV void issue_rs(float (&dk)[kParts][32], float (&dv)[kParts][32], const uint32_t (&pa)[kBlockM / 16][4],
                        const uint32_t (&dsa)[kBlockM / 16][4], int b) const {
    const uint64_t ddo_mn = sm90::desc_here(dout_mn), dq_mn = sm90::desc_here(q_mn);
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) {
      const uint32_t off = b * kQTileBytes + kq * 2048;
      sm90::wgmma_rs_mn_parts<E, kParts>(dv, pa[kq], sm90::desc_advance(ddo_mn, off), kBlockM * 128);
      sm90::wgmma_rs_mn_parts<E, kParts>(dk, dsa[kq], sm90::desc_advance(dq_mn, off), kBlockM * 128);
    }
  }
  // dV += P^T dO alone and dK += dS^T Q alone (schedule 6: dQ is issued between them).
  DKV_DEV void issue_dv(float (&dv)[kParts][32], const uint32_t (&pa)[kBlockM / 16][4], int b) const {
    issue_rs_one(dv, pa, dout_mn, b);
  }
  DKV_DEV void issue_dk(float (&dk)[kParts][32], const uint32_t (&dsa)[kBlockM / 16][4], int b) const {
    issue_rs_one(dk, dsa, q_mn, b);
  }
  DKV_DEV void issue_rs_one(float (&acc)[kParts][32], const uint32_t (&a)[kBlockM / 16][4], uint64_t mn, int b) const {
    const uint64_t d0 = sm90::desc_here(mn);
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      sm90::wgmma_rs_mn_parts<E, kParts>(acc, a[kq], sm90::desc_advance(d0, b * kQTileBytes + kq * 2048), kBlockM * 128);
  }
};

// One warpgroup's state in the dK/dV kernels: a thread's two key rows of the tile (key_in_tile), its
// dK / dV accumulators, S^T and dP^T of the query tile, and P^T / dS^T as register operands.
template <class E, int D, int kBlockM, int kBlockN>
struct DkdvWarpgroup {
  static constexpr int kParts = D / 64;
  int key_in_tile[2];
  float dv[kParts][32], dk[kParts][32];  // this order keeps the kernels' register assignment as measured
  float st[32], dpt[32];
  uint32_t pa[kBlockM / 16][4] = {}, dsa[kBlockM / 16][4] = {};

  DKV_DEV DkdvWarpgroup(int wg, int warp, int g) : key_in_tile{64 * wg + 16 * warp + g, 64 * wg + 16 * warp + g + 8} {}
  DKV_DEV void zero_dkdv() {
    for (int part = 0; part < kParts; ++part)
      for (int i = 0; i < 32; ++i) dk[part][i] = dv[part][i] = 0.f;
  }
  // P^T and dS^T in place of S^T and dP^T for the query tile `desc`, its lse_log2 in sL and dsum in sD
  // (st[4 j + i]: key key_in_tile[i / 2], query 8 j + 2 tq + i % 2).
  DKV_DEV void tile_ds(const QTileDesc& desc, const float* sL, const float* sD, int tq, int W, const ScoreFn& score) {
    transposed_probabilities<kBlockM, kBlockN>(st, desc, shared_lse(sL), key_in_tile, tq, W, score,
                                               [&](int e, int col, bool masked, float pr, float dtanh) {
                                                 const float ds = pr * (dpt[e] - sD[col]) * dtanh;
                                                 st[e] = masked ? 0.f : pr;
                                                 dpt[e] = masked ? 0.f : ds;
                                               });
  }
  // Schedule 8's element-wise step in two halves (no softcap). First, once S^T has landed
  // (dP^T may still run): P^T in place of S^T, masked elements 0.
  DKV_DEV void tile_p(const QTileDesc& desc, const float* sL, int tq, int W, const ScoreFn& score) {
    transposed_probabilities<kBlockM, kBlockN>(st, desc, shared_lse(sL), key_in_tile, tq, W, score,
                                               [&](int e, int, bool masked, float pr, float) { st[e] = masked ? 0.f : pr; });
  }
  // Then, once dP^T has landed: dS^T = st (dP^T - D) in place of dP^T (0 where st is 0, masked).
  DKV_DEV void tile_ds_from_p(const float* sD, int tq) {
#pragma unroll
    for (int e = 0; e < 32; ++e) dpt[e] = st[e] * (dpt[e] - sD[8 * (e / 4) + 2 * tq + (e % 2)]);
  }
  DKV_DEV void pack() {
    c_to_a<E, kBlockM>(pa, reinterpret_cast<const float(&)[kBlockM / 8][4]>(st));
    c_to_a<E, kBlockM>(dsa, reinterpret_cast<const float(&)[kBlockM / 8][4]>(dpt));
  }
  // After the waits that end the shared-memory / register-operand products: their operands pinned.
  DKV_DEV void pin_ss() {
    sm90::fence_operand<32>(st);
    sm90::fence_operand<32>(dpt);
  }
  DKV_DEV void pin_rs() {
    sm90::fence_operand(pa);
    sm90::fence_operand(dsa);
    for (int part = 0; part < kParts; ++part) {
      sm90::fence_operand<32>(dk[part]);
      sm90::fence_operand<32>(dv[part]);
    }
  }
};

// The dK/dV kernels' end of an item: each thread's two key rows of dK and dV (dk[part][4 j + i]: key
// key_in_tile[i / 2], column 64 part + 8 j + 2 tq + i % 2) to their destinations.
template <class E, int kParts>
DKV_DEV void store_dkdv_rows(const BwdParams& p, const KvItem& it, const int (&key_in_tile)[2], int tq,
                             const float (&dk)[kParts][32], const float (&dv)[kParts][32]) {
  for (int r = 0; r < 2; ++r) {
    const int key = key_in_tile[r];
    if (key >= it.nk) continue;
    store_dkdv_row<E>(p, it, it.key_row0 + key, [&](auto&& store) {
      for (int part = 0; part < kParts; ++part)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          store(64 * part + 8 * j + 2 * tq, dk[part][4 * j + 2 * r], dk[part][4 * j + 2 * r + 1],
                dv[part][4 * j + 2 * r], dv[part][4 * j + 2 * r + 1]);
    });
  }
}

// dQ accumulated inside a dK/dV kernel (schedules 3 and 6), one warpgroup's share. Each warpgroup
// writes its dS (64 queries x its 64 keys) to shared memory; once both have (the caller's barrier),
// dQ_part (64 queries x 64 head-dim columns) = dS K by wgmma SS (dS K-major, K MN-major; at d = 128
// warpgroup w takes columns 64 w .. 64 w + 63 over all 128 keys, at d = 64 it takes its own 64 keys).
// The warpgroup stages dQ_part in shared memory with the workspace's row pitch (kPitch: kDqAccumPitch,
// padded; 64 with DkdvSm90Ws::kLateAdd, whose columns are rotated instead) and one of its threads adds
// the tile's valid rows to the fp32 workspace, head-major so that they are one contiguous run, with one
// bulk reduce-add (cp.reduce.async.bulk) that runs while the block goes on.
template <class E, int D, int kBlockM, int kBlockN, int kPitch = kDqAccumPitch>
struct FusedDq {
  static constexpr int kParts = D / 64;
  float dq[32];  // dq[4 j + i]: query 16 warp + g + 8 (i / 2), column 64 col_part + 8 j + 2 tq + i % 2

  // dS^T, packed as the A operand of dK += dS^T Q (dsa[kq][i]: the 8 x 8 block of keys 16 warp + 8 (i % 2)
  // .. and queries 16 kq + 8 (i / 2) ..), as dS: query rows, this warpgroup's keys in part wg of sDs
  // (K-major for the A operand of dQ = dS K), one transposing stmatrix per 16 queries. Lane l gives
  // the address of query row 16 kq + 8 (m / 2) + l % 8, keys 16 warp + 8 (m % 2) .., of block m = l / 8.
  DKV_DEV static void store_ds(uint16_t* sDs, const uint32_t (&dsa)[kBlockM / 16][4], int wg, int warp, int lane) {
    const int m = lane >> 3, r = lane & 7;
    uint16_t* row = sDs + wg * kBlockM * 64 + sm90::sw128_offset(8 * (m >> 1) + r, 16 * warp + 8 * (m & 1)) / 2;
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq) stsm_x4_trans(dsa[kq], row + kq * 16 * 64);  // 16 rows of 128 bytes on
  }
  // dQ_part = dS K (not committed); both warpgroups' dS must be visible to the async proxy.
  DKV_DEV void issue(const uint16_t* sDs, const uint16_t* sK, int wg) {
    constexpr int kSteps = kParts == 2 ? kBlockN / 16 : 4;  // k16 steps over keys
    const int col_part = kParts == 2 ? wg : 0, step0 = kParts == 2 ? 0 : 4 * wg;
    const uint64_t da = sm90::smem_desc_sw128(sDs), db = sm90::smem_desc_sw128_mn64(sK);
    sm90::wgmma_fence();
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int k = step0 + s;  // keys 16 k .. 16 k + 15: part k / 4 of dS, rows 16 k of K
      sm90::wgmma_m64n64k16_ss<E, 1>(dq, sm90::desc_advance(da, (k / 4) * kBlockM * 128 + (k % 4) * 32),
                                     sm90::desc_advance(db, col_part * kBlockN * 128 + k * 2048), s > 0);
    }
  }
  // After the product's wait: stage this warpgroup's rows (sStage: both warpgroups' staging) and add
  // the tile's m_valid rows at packed row `row` of query head hq. The warpgroup's first thread issues
  // the addition, once its previous one has read its source.
  DKV_DEV void add(const BwdParams& p, float* sStage, int wg, int warp, int g, int tq, int hq, int row, int m_valid) {
    float* stage = staging(sStage, wg);
    if ((thread_idx() & 127) == 0) sm90::bulk_wait_read<0>();  // the previous tile's rows have been read out
    sm90::warpgroup_sync(thread_idx() >> 7);  // (the warpgroup in the block: a producer warpgroup counts)
    store_rows(stage, warp, g, tq);
    commit(p, stage, wg, hq, row, m_valid);
  }
  // The staged rows `stage` to the async proxy, then (the warpgroup met) their reduce-add.
  DKV_DEV void commit(const BwdParams& p, const float* stage, int wg, int hq, int row, int m_valid) const {
    sm90::fence_smem_to_async_proxy();
    sm90::warpgroup_sync(thread_idx() >> 7);
    issue_add(p, stage, wg, hq, row, m_valid);
  }
  // Warpgroup wg's rows in staging buffer buf (kLateAdd: two buffers of both warpgroups' rows).
  DKV_DEV static float* staging(float* sStage, int wg, int buf = 0) { return sStage + (2 * buf + wg) * kBlockM * kPitch; }
  // This thread's dq to the warpgroup's staging rows `stage` (the tile's first row at packed row `row`).
  // kRotate: packed row t's columns rotated by 8 (t % 4) (mod 64), which gives pitch 64 the banks of
  // pitch 72 (a half-warp's 4 rows 8 words apart); dkv_convert_dq_kernel turns them back.
  template <bool kRotate = false>
  DKV_DEV void store_rows(float* stage, int warp, int g, int tq, int row = 0) const {
    const int rot = kRotate ? 8 * ((row + g) & 3) : 0;  // rows 16 warp + g + 8 r: one t % 4
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float* dst = stage + (16 * warp + g + 8 * r) * kPitch;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = kRotate ? (8 * j + 2 * tq + rot) & 63 : 8 * j + 2 * tq;
        store_f32x2(dst + col, dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
      }
    }
  }
  // The reduce-add of the staged rows `stage` alone: every thread of the warpgroup has fenced its
  // stores to them and passed a barrier since.
  DKV_DEV void issue_add(const BwdParams& p, const float* stage, int wg, int hq, int row, int m_valid) const {
    const int col_part = kParts == 2 ? wg : 0;
    if ((thread_idx() & 127) == 0 && m_valid > 0) {
      const int64_t run = (static_cast<int64_t>(hq) * kParts + col_part) * p.total_q + row;
      sm90::bulk_reduce_add_f32(p.dq_accum + run * kPitch, stage, m_valid * kPitch * 4);
      sm90::bulk_commit();
    }
  }
};

// kOverlap = false: per query tile, the two shared-memory products, the element-wise step, then the
// two register-operand products, each waited for; the next tile's loads are issued under the first
// two, and one block barrier a tile (its arrival) also frees the previous tile's buffers (on an H200
// 12% faster than issuing them before the products behind a second barrier). kOverlap = true: the
// shared-memory products of tile i + 1 are issued before the register-operand products of tile i,
// and the element-wise step of tile i + 1 runs while those still run (the forward's pattern);
// Q / dO / lse / D then need three buffers instead of two.
//
// kDq = true (DUALKV_CUDA_WGMMA_BWD=3, with kOverlap = false): dQ is accumulated here too (FusedDq),
// so no dQ kernel recomputes S and dP; the dQ product is issued with dV / dK, behind a block barrier
// that makes both warpgroups' dS visible.
template <int kHeadDim_, bool kOverlap_, bool kDq_ = false>
struct DkdvSm90 {
  static constexpr int kHeadDim = kHeadDim_, kBlockN = 128, kBlockM = 64, kThreads = 256;
  static constexpr bool kOverlap = kOverlap_, kDq = kDq_;
  static constexpr int kQBuffers = kOverlap ? 3 : 2;
  static constexpr int kParts = kHeadDim / 64;
  static constexpr int kKvTile = kBlockN * kHeadDim, kQTile = kBlockM * kHeadDim;  // elements
  static constexpr int kDsTile = kDq ? kBlockM * kBlockN : 0;                      // elements
  static constexpr int kStage = kDq ? 2 * kBlockM * kDqAccumPitch : 0;              // floats, both warpgroups
  // K, V; Q and dO buffers; (kDq) dS and the dQ staging; lse_log2 and dsum buffers; the item slot;
  // alignment.
  static constexpr int kSmemBytes = (2 * kKvTile + 2 * kQBuffers * kQTile + kDsTile) * 2 + kStage * 4 +
                                    2 * kQBuffers * kBlockM * 4 + 16 + 1024;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the wgmma dK/dV kernel: head dim 64 or 128");
  static_assert(!(kDq && kOverlap), "dQ in the dK/dV kernel: the in-turn schedule only");
};

template <class E, int D, bool kOverlap, bool kDq>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_dkdv_sm90_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DkdvSm90<D, kOverlap, kDq>;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kParts = K::kParts, kQBuffers = K::kQBuffers;
  const int tid = thread_idx(), lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);
  const int g = lane >> 2, tq = lane & 3;
  const int rep = p.nheads / p.nheads_kv;
  const int W = p.window;
  const int total_items = p.kv_item_prefix[p.num_item_groups] * p.nheads_kv;

  uint16_t* sK = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  uint16_t* sV = sK + K::kKvTile;
  uint16_t* sQ0 = sV + K::kKvTile;               // buffer b at sQ0 + b * kQTile
  uint16_t* sdO0 = sQ0 + kQBuffers * K::kQTile;  // buffer b at sdO0 + b * kQTile
  uint16_t* sDs = sdO0 + kQBuffers * K::kQTile;  // (kDq) part c (keys 64 c ..) at sDs + c * kBlockM * 64
  float* sStage = reinterpret_cast<float*>(sDs + K::kDsTile);  // (kDq) warpgroup w's rows at w * 64 * kDqAccumPitch
  float* sL0 = sStage + K::kStage;
  float* sD0 = sL0 + kQBuffers * kBlockM;
  int* s_item = reinterpret_cast<int*>(sD0 + kQBuffers * kBlockM);

  const DkdvProducts<E, D, kBlockM, kBlockN> products(sK, sV, sQ0, sdO0, wg);
  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  DkdvWarpgroup<E, D, kBlockM, kBlockN> w(wg, warp, g);
  const int(&key_in_tile)[2] = w.key_in_tile;

  auto issue_ss = [&](int b) { products.issue_ss(w.st, w.dpt, b); };
  auto issue_rs = [&](int b) { products.issue_rs(w.dk, w.dv, w.pa, w.dsa, b); };
  auto elementwise = [&](const QTileDesc& desc, int b) {
    w.tile_ds(desc, sL0 + b * kBlockM, sD0 + b * kBlockM, tq, W, score);
  };
  auto pack = [&] { w.pack(); };
  auto pin_ss = [&] { w.pin_ss(); };
  auto pin_rs = [&] { w.pin_rs(); };

  FusedDq<E, D, kBlockM, kBlockN> fdq;  // (kDq)

  for (;;) {
    const int item = next_item(p, s_item);
    if (item >= total_items) break;
    const KvItem it = decode_item<kBlockN>(p, item);
    load_item_kv<D, K::kThreads, kBlockN>(p, it, sK, sV, tid);

    auto issue_tile = [&](const ReaderCursor<kBlockM>& cur, int b) -> ReaderTile {
      return load_reader_tile<D, K::kThreads>(p, cur, it, rep, sQ0 + b * K::kQTile, sdO0 + b * K::kQTile,
                                              sL0 + b * kBlockM, sD0 + b * kBlockM, tid);
    };
    auto issue_q = [&](const ReaderCursor<kBlockM>& cur, int b) -> QTileDesc { return issue_tile(cur, b).desc; };

    w.zero_dkdv();

    ReaderCursor<kBlockM> cur;
    bool have = cur.begin(p, it);
    ReaderTile tile{};
    if (have) tile = issue_tile(cur, 0);
    cp_async_commit();  // group: K, V and the first query tile
    if constexpr (!kOverlap) {
      int b = 0;
      while (have) {
        // The next tile loads into tile i - 1's buffer (with kDq, dS is free too), issued under this
        // tile's first products.
        open_reader_tile([&] { issue_ss(b); });
        ReaderCursor<kBlockM> nxt = cur;
        const bool have_next = nxt.advance(p, it, rep);
        ReaderTile next_tile{};
        if (have_next) next_tile = issue_tile(nxt, b ^ 1);
        cp_async_commit();

        sm90::wgmma_wait<0>();
        pin_ss();
        elementwise(tile.desc, b);
        pack();
        if constexpr (kDq) {
          fdq.store_ds(sDs, w.dsa, wg, warp, lane);
          sm90::fence_smem_to_async_proxy();  // this thread's dS stores, for the other warpgroup's wgmma
        }
        sm90::wgmma_fence();
        issue_rs(b);
        if constexpr (kDq) {  // the barrier (both warpgroups' dS) waits while dV / dK run
          block_sync();
          fdq.issue(sDs, sK, wg);
        }
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        pin_rs();
        if constexpr (kDq) {
          sm90::fence_operand<32>(fdq.dq);
          fdq.add(p, sStage, wg, warp, g, tq, tile.hq, tile.row, tile.desc.m_valid);
        }

        cur = nxt;
        have = have_next;
        tile = next_tile;
        b ^= 1;
      }
    } else {
      // Tile i sits in buffer i % 3. Entering step i: tile i is packed (pa, dsa), tile i + 1 is
      // loading (its group is the newest), and tile i - 1's buffer is free once every warpgroup has
      // passed the barrier below.
      ReaderCursor<kBlockM> nxt = cur;
      bool have_next = have && nxt.advance(p, it, rep);
      QTileDesc next_desc{};
      if (have_next) next_desc = issue_q(nxt, 1);
      cp_async_commit();
      if (have) {
        cp_async_wait<1>();
        sm90::fence_smem_to_async_proxy();
        block_sync();
        sm90::wgmma_fence();
        issue_ss(0);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        pin_ss();
        elementwise(tile.desc, 0);
        pack();
      }
      int b = 0;  // buffer of tile i
      while (have) {
        cp_async_wait<0>();  // tile i + 1
        sm90::fence_smem_to_async_proxy();
        block_sync();
        const int b1 = b == kQBuffers - 1 ? 0 : b + 1, b2 = b1 == kQBuffers - 1 ? 0 : b1 + 1;
        ReaderCursor<kBlockM> after = nxt;
        const bool have_after = have_next && after.advance(p, it, rep);
        QTileDesc after_desc{};
        if (have_after) after_desc = issue_q(after, b2);
        cp_async_commit();

        sm90::wgmma_fence();
        if (have_next) {
          issue_ss(b1);
          sm90::wgmma_commit();
        }
        issue_rs(b);
        sm90::wgmma_commit();
        if (have_next) {
          sm90::wgmma_wait<1>();  // S^T and dP^T of tile i + 1; dK / dV of tile i may still run
          pin_ss();
          elementwise(next_desc, b1);
        }
        sm90::wgmma_wait<0>();
        pin_rs();
        if (have_next) pack();

        nxt = after;
        have = have_next;
        have_next = have_after;
        next_desc = after_desc;
        b = b1;
      }
    }
    cp_async_wait<0>();  // an item with no reader still has its K/V load in flight
    store_dkdv_rows<E, kParts>(p, it, key_in_tile, tq, w.dk, w.dv);
    block_sync();  // shared K/V are reloaded by the next item
  }
  if constexpr (kDq) sm90::bulk_wait<0>();  // the dQ rows this thread added (shared memory stays valid)
}

}  // namespace dkv
