// The backward kernels on Hopper warpgroup MMA (sm_90a) at head dims 192, 256 and 512: dQ and dK/dV
// with the two warpgroups' roles split over one tile (dkv_bwd_sm90.cu launches them, one schedule). The
// pieces they share with the d = 64 / 128 kernels are in dkv_bwd_sm90.cuh.
//
// d = 512: a 64-row tile of Q or dO, or of K or V, is 64 KB, and a warpgroup's 64 x 512 fp32
// accumulator would take 256 registers a thread. So the dQ kernel walks key tiles of 16 (Q and dO take
// 128 KB; two buffers of 16-key K / V tiles fit beside them), and the dK/dV kernel walks query tiles of
// 16 (K and V take 128 KB) twice, once per half of the head dim: each pass accumulates 256 columns of
// dV (warpgroup 0) and dK (warpgroup 1) and recomputes S^T and dP^T, 12 products where 8 would do.
#pragma once

#include "dkv_bwd_sm90.cuh"

namespace dkv {

// dQ at head dims 192 and 256, where the d = 128 kernel's shape does not fit (at d = 256 its 128-row Q /
// dO tiles and 3-stage K / V ring would take 320 KB of shared memory, and a warpgroup's 64 x d dQ
// accumulator beside S and dP 192 registers a thread): a block is two warpgroups on ONE tile of 64
// query rows, the forward's walk over 64-key tiles (two buffers), with the roles split as in the dK/dV
// kernel below. Per key tile:
//
//   warpgroup 0:  S  = Q K^T  (SS), the dS factor F = P (times 1 - tanh^2 under a softcap)
//   warpgroup 1:  dP = dO V^T (SS), G = dP - D
//   both:         F and G swapped through shared memory (element e of thread t at [e][t] in both
//                 warpgroups' accumulators: no bank conflicts), dS = F G in registers,
//                 dQ[:, their half of the 64-column parts] += dS K   (RS, K as an MN-major operand)
//
// Warpgroup w takes column parts w, w + 2, ... (d = 256: two each; d = 192: parts 0 and 2, and 1).
// Two block barriers a key tile: the tile's arrival, and the swap.
//
// kTma (DUALKV_CUDA_BWD_TMA=1, the default): thread 0 loads Q, dO and every key tile by bulk tensor
// copies (boxes of 64 columns x 64 rows, key boxes of kBlockN rows) onto the buffer's mbarrier, which
// every thread waits on before the tile's block barrier, instead of all 256 threads' cp.async and its
// address arithmetic. Key rows past a tile's valid ones are loaded as they are (finite; their scores
// are masked).
template <int kHeadDim_, bool kTma_ = false>
struct DqSm90Split {
  static constexpr bool kTma = kTma_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = 64, kThreads = 256, kStages = 2;
  static constexpr int kBlockN = kHeadDim == 512 ? 16 : 64;  // keys per tile
  static constexpr int kParts = kHeadDim / 64, kMyParts = (kParts + 1) / 2;  // column parts, a warpgroup's
  static constexpr int kQTile = kBlockM * kHeadDim, kKvTile = kBlockN * kHeadDim;  // elements
  // Q, dO; the K / V ring; F and G (fp32); (kTma) the ring's mbarriers; alignment.
  static constexpr int kSmemBytes = (2 * kQTile + 2 * kStages * kKvTile) * 2 + 2 * kBlockM * kBlockN * 4 + 16 + 1024;
  static_assert(kHeadDim == 192 || kHeadDim == 256 || kHeadDim == 512, "the split wgmma dQ kernel: head dim 192, 256 or 512");
  static_assert(!kTma || kBlockM == kSm90DkdvQueryRows, "(kTma) the binding's q / dout maps: boxes of 64 rows");
  static_assert(!kTma || kBlockN == (kHeadDim == 512 ? kSm90DqKeyRows512 : 64), "(kTma) the binding's key maps' boxes");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 / H200 block");
};

template <class E, int D, bool kTma = false>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_dq_sm90_split_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DqSm90Split<D, kTma>;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kStages = K::kStages, kMyParts = K::kMyParts;
  const QueryTile qt = query_tile<kBlockM>(p, p.q_tile_prefix, p.q_seg_order);
  if (qt.s < 0) return;
  const int row0 = qt.row0, q0 = qt.q0, m_valid = qt.m_valid, h = qt.h, hk = qt.hk;
  const int W = p.window;
  const int tid = thread_idx(), lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);
  const int g = lane >> 2, tq = lane & 3;
  const bool p_role = wg == 0;  // warpgroup 0: S and F; warpgroup 1: dP and G

  uint16_t* sQ = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  uint16_t* sdO = sQ + K::kQTile;
  uint16_t* sK0 = sdO + K::kQTile;  // K buffers, then V buffers; tile t in buffer t % kStages
  float* sF = reinterpret_cast<float*>(sK0 + 2 * kStages * K::kKvTile);  // F, then G: [32][128] each
  float* mine = sF + (p_role ? 0 : kBlockM * kBlockN) + (tid & 127);
  const float* theirs = sF + (p_role ? kBlockM * kBlockN : 0) + (tid & 127);
  uint64_t* full = reinterpret_cast<uint64_t*>(sF + 2 * kBlockM * kBlockN);  // (kTma) per K / V buffer
  auto sK = [&](int t) { return sK0 + (t % kStages) * K::kKvTile; };
  auto sV = [&](int t) { return sK0 + (kStages + t % kStages) * K::kKvTile; };

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, qt.ctx_len, qt.ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
  const int qpos_lo = qt.ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  constexpr int kParts = K::kParts;
  auto load_kv = [&](int t) {
    if constexpr (kTma) {
      if (tid == 0) {
        const KvTile kt = walk.tile<kBlockN>(t);
        uint64_t* bar = &full[t % kStages];
        sm90::mbar_arrive_expect_tx(bar, (2 * K::kKvTile + (t == 0 ? 2 * K::kQTile : 0)) * 2);
        if (t == 0) {
          sm90::tma_load_tile<kParts>(sQ, p.tma_q, h, row0 + q0, kBlockM, bar);
          sm90::tma_load_tile<kParts>(sdO, p.tma_dout, h, row0 + q0, kBlockM, bar);
        }
        sm90::tma_load_tile<kParts>(sK(t), kt.ctx ? p.tma_k_ctx : p.tma_k, hk, kt.row, kBlockN, bar);
        sm90::tma_load_tile<kParts>(sV(t), kt.ctx ? p.tma_v_ctx : p.tma_v, hk, kt.row, kBlockN, bar);
      }
    } else {
      load_kv_tile<D, K::kThreads, kBlockN>(p, walk, t, sK(t), sV(t), hk, tid);
    }
  };
  if constexpr (kTma) {
    sm90::init_copy_barriers(full, kStages);
    block_sync();
  } else {
    sm90::load_tile_sw128_async<D, K::kThreads, kBlockM>(sQ, p.q, row0 + q0, h, m_valid, tid);
    sm90::load_tile_sw128_async<D, K::kThreads, kBlockM>(sdO, p.dout, row0 + q0, h, m_valid, tid);
  }
  load_kv(0);  // n_tiles >= 1: a query always sees its own key
  cp_async_commit();

  const int row_in_tile[2] = {16 * warp + g, 16 * warp + g + 8};
  float lse2[2], dsum[2];
  load_row_stats(p, h, row0 + q0, row_in_tile, m_valid, lse2, dsum);

  // S = Q K^T (warpgroup 0) or dP = dO V^T (warpgroup 1); dQ += dS K (both).
  const uint64_t desc_a = sm90::smem_desc_sw128(p_role ? sQ : sdO);
  const uint64_t desc_kv = sm90::smem_desc_sw128(p_role ? sK(0) : sV(0));
  const uint64_t desc_k_mn = sm90::smem_desc_sw128_mn64(sK(0));
  constexpr uint32_t kKvTileBytes = K::kKvTile * 2;

  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  float dq[kMyParts][32];
  for (int i = 0; i < kMyParts; ++i)
    for (int e = 0; e < 32; ++e) dq[i][e] = 0.f;
  float s[kBlockN / 2];
  uint32_t dsa[kBlockN / 16][4];

  auto issue_ss = [&](int t) {
    const uint64_t da = sm90::desc_here(desc_a);
    const uint64_t db = sm90::desc_advance(sm90::desc_here(desc_kv), (t % kStages) * kKvTileBytes);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {  // part k / 4, 32 bytes per k16 step inside it
      const uint32_t q_off = (k / 4) * kBlockM * 128 + (k % 4) * 32, kv_off = (k / 4) * kBlockN * 128 + (k % 4) * 32;
      sm90::wgmma_ss_k_major<E, kBlockN>(s, sm90::desc_advance(da, q_off), sm90::desc_advance(db, kv_off), k > 0);
    }
  };
  // Keys 16 kk .. 16 kk + 15: dS fragment kk, 2048 bytes down the K tile.
  auto issue_dq = [&](int t) {
    const uint64_t db = sm90::desc_advance(sm90::desc_here(desc_k_mn), (t % kStages) * kKvTileBytes);
#pragma unroll
    for (int i = 0; i < kMyParts; ++i) {
      const int part = 2 * i + wg;
      // d = 192: warpgroup 1 has one part. Tested only where it can fail: a branch around wgmma that
      // the compiler cannot rule out serialises every wgmma of the kernel.
      if (K::kParts % 2 == 1 && part >= K::kParts) break;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        sm90::wgmma_m64n64k16_rs<E, 1>(dq[i], dsa[kk], sm90::desc_advance(db, part * kBlockN * 128 + kk * 2048), true);
    }
  };
  // Warpgroup 0: F in place of S (0 where masked), and into shared memory.
  auto factors = [&](int t) {
    row_probabilities<kBlockN>(s, walk.tile<kBlockN>(t), qpos_lo, qpos_hi, row_in_tile, lse2, tq, W, score,
                               [&](int e, int, bool masked, float pr, float dtanh) {
                                 s[e] = masked ? 0.f : pr * dtanh;
                                 mine[e * 128] = s[e];
                               });
  };

  for (int t = 0; t < n_tiles; ++t) {
    // Tile t has landed, and both warpgroups are done with tile t - 1, whose buffers the load refills.
    if constexpr (kTma) sm90::mbar_wait(&full[t % kStages], (t / kStages) & 1);
    cp_async_wait<0>();
    sm90::fence_smem_to_async_proxy();
    block_sync();
    if (t + 1 < n_tiles) load_kv(t + 1);
    cp_async_commit();

    sm90::wgmma_fence();
    issue_ss(t);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operand<kBlockN / 2>(s);
    if (p_role) {
      factors(t);
    } else {
#pragma unroll
      for (int e = 0; e < kBlockN / 2; ++e) {
        s[e] -= dsum[(e / 2) % 2];  // G = dP - D
        mine[e * 128] = s[e];
      }
    }
    block_sync();  // F and G are in shared memory
#pragma unroll
    for (int e = 0; e < kBlockN / 2; ++e) s[e] *= theirs[e * 128];  // dS = F G (the same in both warpgroups)
    c_to_a<E, kBlockN>(dsa, reinterpret_cast<const float(&)[kBlockN / 8][4]>(s));
    sm90::wgmma_fence();
    issue_dq(t);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operand(dsa);
    for (int i = 0; i < kMyParts; ++i) sm90::fence_operand<32>(dq[i]);
  }
  cp_async_wait<0>();

  uint16_t* dq_ptr = static_cast<uint16_t*>(p.dq.ptr);
  for (int r = 0; r < 2; ++r) {
    const int row = row_in_tile[r];
    if (row >= m_valid) continue;
    uint16_t* dst = dq_ptr + p.dq.offset(row0 + q0 + row, h) + 2 * tq;
    for (int i = 0; i < kMyParts; ++i) {
      const int part = 2 * i + wg;
      if (K::kParts % 2 == 1 && part >= K::kParts) break;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        store_u32(dst + 64 * part + 8 * j, pack2<E>(dq[i][4 * j + 2 * r] * p.scale, dq[i][4 * j + 2 * r + 1] * p.scale));
    }
  }
}

// dK/dV at head dims 192 and 256, where one warpgroup cannot hold both accumulators of its keys
// (2 x 64 keys x d fp32 = 256 registers a thread at d = 256): a block is two warpgroups on ONE tile of
// 64 keys with the roles split instead of the keys. Per query tile of 64 rows:
//
//   warpgroup 0:  S^T  = K Q^T  (SS), P^T = exp2(score(S^T) - lse),     dV (64 x d) += P^T dO  (RS)
//   warpgroup 1:  dP^T = V dO^T (SS), dS^T = P^T (dP^T - D),            dK (64 x d) += dS^T Q  (RS)
//
// The two run products of the same size, and each accumulator takes d / 2 registers a thread. P^T
// (times 1 - tanh^2 under a softcap) passes from warpgroup 0 to warpgroup 1 through 16 KB of shared
// memory in the accumulator's register order (element e of thread t at [e][t]: no bank conflicts), so
// the score is computed once; an mbarrier tells warpgroup 1 they are there, and warpgroup 0 goes on
// to its dV product without waiting. Same work items, reader walk and output modes as the other dK/dV
// kernels; the in-turn schedule; dQ comes from the split dQ kernel above.
//
// kTma (DUALKV_CUDA_BWD_TMA=1, the default): thread 0 loads each reader tile's Q and dO by bulk tensor
// copies (boxes of 64 columns x kBlockM rows: the reader maps tma_q_reader / tma_dout_reader, copies of
// the q / dout maps at 192 / 256, 16-row twins at 512) onto its buffer's mbarrier, which every thread waits on before the tile's block barrier; K / V
// (once an item) and lse_log2 / dsum stay cp.async.
// Query rows past a tile's valid ones are loaded as they are (finite; P^T and dS^T are 0 there).
template <int kHeadDim_, bool kTma_ = false>
struct DkdvSm90Split {
  static constexpr bool kTma = kTma_;
  static constexpr int kHeadDim = kHeadDim_, kBlockN = 64, kThreads = 256;
  static constexpr int kBlockM = kHeadDim == 512 ? 16 : 64;  // query rows per reader tile
  static constexpr int kPasses = kHeadDim == 512 ? 2 : 1;    // walks over the readers, one per column range
  static constexpr int kParts = kHeadDim / 64, kPassParts = kParts / kPasses;
  static constexpr int kKvTile = kBlockN * kHeadDim, kQTile = kBlockM * kHeadDim;  // elements
  // K, V; Q and dO, two buffers each; the P^T factors; lse_log2 and dsum, two buffers; the factors'
  // mbarrier and the item slot; alignment.
  static constexpr int kSmemBytes =
      (2 * kKvTile + 4 * kQTile) * 2 + kBlockN * kBlockM * 4 + 4 * kBlockM * 4 + 32 + 16 + 1024;
  static_assert(kHeadDim == 192 || kHeadDim == 256 || kHeadDim == 512, "the split wgmma dK/dV kernel: head dim 192, 256 or 512");
  static_assert(!kTma || kBlockM == (kHeadDim == 512 ? kSm90DkdvReaderRows512 : kSm90DkdvQueryRows),
                "(kTma) the binding's reader maps tma_q_reader / tma_dout_reader: boxes of kBlockM rows");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 / H200 block");
};

template <class E, int D, bool kTma = false>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_dkdv_sm90_split_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DkdvSm90Split<D, kTma>;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kPassParts = K::kPassParts;
  const int tid = thread_idx(), lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
  const int g = lane >> 2, tq = lane & 3;
  const int rep = p.nheads / p.nheads_kv;
  const int W = p.window;
  const int total_items = p.kv_item_prefix[p.num_item_groups] * p.nheads_kv;
  const bool dv_role = wg == 0;  // warpgroup 0: P^T and dV; warpgroup 1: dS^T and dK

  uint16_t* sK = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  uint16_t* sV = sK + K::kKvTile;
  uint16_t* sQ0 = sV + K::kKvTile;        // buffer b at sQ0 + b * kQTile
  uint16_t* sdO0 = sQ0 + 2 * K::kQTile;   // buffer b at sdO0 + b * kQTile
  float* sF = reinterpret_cast<float*>(sdO0 + 2 * K::kQTile);  // P^T factors, [32][128]
  float* sL0 = sF + kBlockN * kBlockM;
  float* sD0 = sL0 + 2 * kBlockM;
  uint64_t* f_ready = reinterpret_cast<uint64_t*>(sD0 + 2 * kBlockM);  // warpgroup 0 -> 1: sF written
  uint64_t* full = f_ready + 1;  // (kTma) per Q / dO buffer
  int* s_item = reinterpret_cast<int*>(full + 2);
  float* my_f = sF + (tid & 127);
  if (tid == 0) sm90::mbar_init(f_ready, 128);
  if constexpr (kTma) sm90::init_copy_barriers(full, 2);
  block_sync();
  int f_phase = 0, full_phase = 0;  // (kTma) bit b: the parity of buffer b's next completion

  // Warpgroup 0 multiplies K by Q and accumulates with dO; warpgroup 1 V by dO, and accumulates with Q.
  const uint64_t desc_a = sm90::smem_desc_sw128(dv_role ? sK : sV);
  const uint64_t desc_b = sm90::smem_desc_sw128(dv_role ? sQ0 : sdO0);
  const uint64_t desc_rs = sm90::smem_desc_sw128_mn(dv_role ? sdO0 : sQ0, kBlockM * 128);
  constexpr uint32_t kQTileBytes = K::kQTile * 2;

  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  const int key_in_tile[2] = {16 * warp + g, 16 * warp + g + 8};

  float acc[kPassParts][32];  // dV (warpgroup 0) or dK (warpgroup 1), the pass's columns
  float s[kBlockM / 2];       // S^T, then P^T (warpgroup 0); dP^T, then dS^T (warpgroup 1)
  uint32_t a[kBlockM / 16][4] = {};

  // S^T = K Q^T or dP^T = V dO^T of the query tile in buffer b.
  auto issue_ss = [&](int b) {
    const uint64_t da = sm90::desc_here(desc_a), db = sm90::desc_advance(sm90::desc_here(desc_b), b * kQTileBytes);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {  // part k / 4, 32 bytes per k16 step inside it
      const uint32_t kv_off = (k / 4) * kBlockN * 128 + (k % 4) * 32, q_off = (k / 4) * kBlockM * 128 + (k % 4) * 32;
      sm90::wgmma_ss_k_major<E, kBlockM>(s, sm90::desc_advance(da, kv_off), sm90::desc_advance(db, q_off), k > 0);
    }
  };
  // dV += P^T dO or dK += dS^T Q over the pass's column parts, with the tile in buffer b (queries
  // 16 kq .. 16 kq + 15 per step).
  auto issue_rs = [&](int b, int pass) {
    const uint64_t d0 = sm90::desc_here(desc_rs);
    const uint32_t first = b * kQTileBytes + pass * kPassParts * kBlockM * 128;
#pragma unroll
    for (int kq = 0; kq < kBlockM / 16; ++kq)
      sm90::wgmma_rs_mn_parts<E, kPassParts>(acc, a[kq], sm90::desc_advance(d0, first + kq * 2048), kBlockM * 128);
  };
  // Warpgroup 0: P^T in place of S^T, and its factor for dS^T into sF.
  auto probabilities = [&](const QTileDesc& desc, int b) {
    ColumnStats<kBlockM> lse;
    lse.load(sL0 + b * kBlockM, tq);
    transposed_probabilities<kBlockM, kBlockN>(s, desc, lse, key_in_tile, tq, W, score,
                                               [&](int e, int, bool masked, float pr, float dtanh) {
                                                 s[e] = masked ? 0.f : pr;
                                                 my_f[e * 128] = masked ? 0.f : pr * dtanh;
                                               });
  };

  for (;;) {
    const int item = next_item(p, s_item);
    if (item >= total_items) break;
    const KvItem it = decode_item<kBlockN>(p, item);
    load_item_kv<D, K::kThreads, kBlockN>(p, it, sK, sV, tid);

    auto issue_tile = [&](const ReaderCursor<kBlockM>& cur, int b) -> QTileDesc {
      if constexpr (kTma) {
        const ReaderTile rt = reader_tile(cur, it, rep);
        if (tid == 0) {
          sm90::mbar_arrive_expect_tx(&full[b], 2 * K::kQTile * 2);
          sm90::tma_load_tile<K::kParts>(sQ0 + b * K::kQTile, p.tma_q_reader, rt.hq, rt.row, kBlockM, &full[b]);
          sm90::tma_load_tile<K::kParts>(sdO0 + b * K::kQTile, p.tma_dout_reader, rt.hq, rt.row, kBlockM, &full[b]);
        }
        load_reader_stats<K::kThreads, kBlockM>(p, rt, sL0 + b * kBlockM, sD0 + b * kBlockM, tid);
        return rt.desc;
      } else {
        return load_reader_tile<D, K::kThreads>(p, cur, it, rep, sQ0 + b * K::kQTile, sdO0 + b * K::kQTile,
                                                sL0 + b * kBlockM, sD0 + b * kBlockM, tid).desc;
      }
    };

    for (int pass = 0; pass < K::kPasses; ++pass) {
      if (pass > 0) block_sync();  // both warpgroups are done with the last pass's buffers
      for (int part = 0; part < kPassParts; ++part)
        for (int i = 0; i < 32; ++i) acc[part][i] = 0.f;

      ReaderCursor<kBlockM> cur;
      bool have = cur.begin(p, it);
      QTileDesc desc{};
      if (have) desc = issue_tile(cur, 0);
      cp_async_commit();  // group: (pass 0) K, V and the first query tile
      int b = 0;
      while (have) {
        // The next tile loads into tile i - 1's buffers (sF is free too), issued under this tile's
        // first products. One block barrier a tile.
        if constexpr (kTma) {
          sm90::mbar_wait(&full[b], (full_phase >> b) & 1);
          full_phase ^= 1 << b;
        }
        open_reader_tile([&] { issue_ss(b); });
        ReaderCursor<kBlockM> nxt = cur;
        const bool have_next = nxt.advance(p, it, rep);
        QTileDesc next_desc{};
        if (have_next) next_desc = issue_tile(nxt, b ^ 1);
        cp_async_commit();

        sm90::wgmma_wait<0>();
        sm90::fence_operand<kBlockM / 2>(s);
        if (dv_role) {
          probabilities(desc, b);
          sm90::mbar_arrive(f_ready);  // warpgroup 0 goes on to dV without waiting for warpgroup 1
        } else {
          const float* sD = sD0 + b * kBlockM;
#pragma unroll
          for (int e = 0; e < kBlockM / 2; ++e) s[e] -= sD[8 * (e / 4) + 2 * tq + (e % 2)];  // dP^T - D
          sm90::mbar_wait(f_ready, f_phase);  // the P^T factors are in sF
#pragma unroll
          for (int e = 0; e < kBlockM / 2; ++e) s[e] *= my_f[e * 128];  // dS^T (0 where masked)
        }
        f_phase ^= 1;
        c_to_a<E, kBlockM>(a, reinterpret_cast<const float(&)[kBlockM / 8][4]>(s));
        sm90::wgmma_fence();
        issue_rs(b, pass);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_operand(a);
        for (int part = 0; part < kPassParts; ++part) sm90::fence_operand<32>(acc[part]);

        cur = nxt;
        have = have_next;
        desc = next_desc;
        b ^= 1;
      }
      cp_async_wait<0>();  // an item with no reader still has its K/V load in flight
      // acc[part][4 j + i]: key key_in_tile[i / 2], column 64 (the pass's first part + part) + 8 j + 2 tq + i % 2.
      for (int r = 0; r < 2; ++r) {
        const int key = key_in_tile[r];
        if (key >= it.nk) continue;
        store_grad_row<E>(p, it, it.key_row0 + key, !dv_role, [&](auto&& store) {
          for (int part = 0; part < kPassParts; ++part)
#pragma unroll
            for (int j = 0; j < 8; ++j)
              store(64 * (pass * kPassParts + part) + 8 * j + 2 * tq, acc[part][4 * j + 2 * r], acc[part][4 * j + 2 * r + 1]);
        });
      }
    }
    block_sync();  // shared K/V are reloaded by the next item
  }
}

}  // namespace dkv
