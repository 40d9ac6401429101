// Forward kernel on Hopper warpgroup MMA (sm_90a), fp16 / bf16, head dims 64, 128, 192, 256 and 512 (docs/cuda.md).
// Same contract and two-region walk as dkv_fwd.cuh. A block is two warpgroups (256 threads) on 128
// query rows of one head (at d = 512 on 64, kSplitK below), warpgroup w on rows 64 w .. 64 w + 63;
// both share every K / V tile. A head
// dim of D is D / 64 column "parts" (64-column swizzled sub-tiles):
//
//   S (64 x kBlockN keys) = Q K^T   wgmma SS, D / 16 k16 steps; kBlockN = 128 for D <= 128 (176: kWideN), else 64
//   P = online softmax of S         in the accumulator registers (rows 16 w + l/4 and + 8 of warp w)
//   O (64 x D) += P V               wgmma RS, P re-packed as the register operand, V an MN-major
//                                   operand, one m64n128 product per two 64-column parts and k16 step
//
// The matmuls overlap the softmax inside each warpgroup: iteration t issues S_t = Q K_t^T and then
// O += P_{t-1} V_{t-1}, waits for S_t only, computes its softmax while P V still runs, then waits
// for it and rescales O. K and V have kStages buffers each (3, or 2 at D = 256 for shared memory),
// V one tile behind K: iteration t loads K_{t+kStages-1} and V_{t+kStages-2} with cp.async
// (128B-swizzled, made visible to the wgmma proxy by a fence), so every load has kStages - 1 whole
// iterations to land (kWs = false; the warp-specialised form below has its own rings). The loads
// are cp.async, or bulk tensor copies in the kTma forms (docs/cuda.md).
#pragma once

#include "dkv_fwd.cuh"
#include "dkv_wgmma.cuh"

namespace dkv {

// kWs = false: every thread loads (cp.async) and computes, a block barrier per key tile. kWs = true
// (warp-specialised; at D = 64 and 128 the default, with kTma): a third warpgroup only loads, handing tiles over
// through mbarriers (full: landed, empty: both consumer warpgroups are done with it), K and V each in a
// ring of their own, so that K_t's buffer is refilled once S_t is computed rather than a tile later with
// V_t's; the two consumer warpgroups take turns at issuing their matmuls (ping-pong, named barriers),
// one's softmax under the other's matmuls; the producer gives registers back (setmaxnreg) for the
// consumers' accumulators. With one ring for both, the consumers spent a third of their time waiting
// for loads (Nsight Compute at (8, 16K, 512): benchmarks/results/raw/profile_h200_fwd_ws_rings.log).
//
// kTma = true (DUALKV_CUDA_WGMMA=3, the default at d = 64 / 128; on an H200 its kernel takes 13-25% less
// time than the cp.async form's: benchmarks/results/raw/profile_h200_fwd_tma.log): the warp-specialised
// form with one producer thread filling the rings by bulk tensor copies (TMA boxes of 64 columns x 128
// rows, 128B-swizzled by the copy engine, completing on the full barriers' transaction counts) instead
// of 128 threads' cp.async; rows past a tile's valid ones are loaded as they are (masked, as with
// cp.async's zeros; rows past the tensor land as zeros). At d = 192 / 256 / 512 (DUALKV_CUDA_WGMMA=3, the
// default there too) kTma is the in-turn form's: thread 0 issues load group j (K_j and V_{j-1}, Q with
// K_0) as boxes of the tiles' own heights (Q 128 rows, or 64 at 512; K / V 64, or 32) onto group j's
// mbarrier, and every thread waits there for the group its iteration reads instead of on its cp.async
// groups; the block barrier per key tile stays (a buffer is refilled once every thread is done with it).
//
// kSplitK (head dim 512, the in-turn form only): a warpgroup's 64 x 512 fp32 O would take 256 registers
// a thread, so both warpgroups work on the SAME 64 query rows and split the head dim instead. Warpgroup
// w holds O's columns 256 w .. 256 w + 255 and computes the partial S over those columns of Q and K
// (m64n32k16 on 32-key tiles: Q and two K / V buffers take 192 KB); the two partials meet in shared
// memory (element e of thread t at [e][t]: no bank conflicts) and each warpgroup adds the other's to
// its own, so both hold the same S (fp32 addition commutes) and run the same online softmax, then
// O[:, their half] += P V[:, their half]. The tensor work per warpgroup is the same as a whole-head
// warpgroup's on half the rows; one more block barrier a key tile.
//
// kWideN (DUALKV_CUDA_FWD_BLOCK_N=176; the TMA warp-specialised form at d = 128 only): key tiles of 176
// rows instead of 128 (S an m64n176 product, 88 accumulator registers a thread), so that every
// per-tile cost (the barriers, the ping-pong hand-over, the row maxima's shuffles, the rescale check)
// is paid for 1.375x the keys. K and V then have two buffers each (three would need 296 KB), and the
// producer keeps 24 registers so that each consumer has 240. A prompt's last tile is partial more
// often (P = 4096 is 23 full tiles and one of 48 keys).
//
// kPersist (DUALKV_CUDA_FWD_PERSISTENT=1; the TMA warp-specialised form at d = 64 / 128): one block per SM
// walks query tiles one after another, taking them from a counter (p.work_counter, zeroed) in the order
// of the grid of per-tile blocks (query_tile_of_work). The producer thread fetches the next tile and
// hands it to the consumers through a slot of two (work_full / work_empty), and its K / V rings run on
// across tiles (a block's key tiles are numbered on from one query tile to the next), so that the next
// tile's first keys load while the consumers finish this one. Q has one buffer: the producer loads the
// next tile's Q (with its first K) once both consumers have computed this tile's last S (q_empty). A
// block is launched and its barriers set up once, not once per query tile.
template <int kHeadDim_, bool kWs_ = false, bool kTma_ = false, bool kWideN_ = false, bool kPersist_ = false,
          bool kMerge_ = false>
struct FwdSm90 {
  static constexpr int kHeadDim = kHeadDim_, kWarpGroups = 2;
  static constexpr bool kWideN = kWideN_, kPersist = kPersist_, kMerge = kMerge_;
  static_assert(!kMerge || kWideN_, "the merged key walk: the 176-key tiles");
  static_assert(!kWideN || (kHeadDim_ == 128 && kWs_ && kTma_), "176-key tiles: the TMA warp-specialised form at d = 128");
  static_assert(!kPersist || (kHeadDim_ <= 128 && kWs_ && kTma_), "the persistent forward: the TMA warp-specialised form");
  static constexpr bool kSplitK = kHeadDim == 512;
  static constexpr int kBlockM = kSplitK ? 64 : 64 * kWarpGroups;
  static constexpr bool kWs = kWs_, kTma = kTma_;
  static_assert(!kSplitK || !kWs, "the d = 512 forward: the in-turn form");
  static_assert(!kTma || (kWs ? kHeadDim <= 128 : kHeadDim >= 192),
                "the TMA forward: warp-specialised at head dims 64 / 128, in turn at 192 / 256 / 512");
  static constexpr int kThreads = 128 * (kWarpGroups + (kWs ? 1 : 0));
  static constexpr int kBlockN = kWideN ? 176 : kHeadDim <= 128 ? 128 : kSplitK ? 32 : 64;
  static_assert(!kMerge || kBlockN % kMergeBoxRows == 0, "the merged walk loads a key tile as boxes of kMergeBoxRows");
  static constexpr int kParts = kHeadDim / 64;             // 64-column swizzled sub-tiles per row
  static constexpr int kMyParts = kSplitK ? kParts / 2 : kParts;  // O's parts a warpgroup holds
  static constexpr int kQTile = kBlockM * kHeadDim;        // elements
  static constexpr int kKvTile = kBlockN * kHeadDim;
  static constexpr int kStages = kHeadDim >= 256 || kWideN ? 2 : 3;  // buffers of K and of V
  // (kWs) the consumers' registers a thread; the producer warpgroup keeps the rest of the block's allocation.
  static constexpr int kConsumerRegs = kWideN ? sm90::kTmaConsumerRegs : sm90::kConsumerRegs;
  static constexpr int kProducerRegs = kWideN ? sm90::kTmaProducerRegs : sm90::kProducerRegs;
  // (kSplitK) the two warpgroups' partial S, fp32.
  static constexpr int kExchangeBytes = kSplitK ? 2 * 64 * kBlockN * 4 : 0;
  // Tiles, (kSplitK) the exchange, then (kWs) the full and empty mbarriers of each K and each V stage or
  // (kTma in turn) the full mbarrier of each stage, (kPersist) q_empty, work_full[2], work_empty[2] and
  // the two work slots, + 1024 bytes of alignment.
  static constexpr int kSmemBytes = (kQTile + 2 * kStages * kKvTile) * 2 + kExchangeBytes +
                                    (kWs ? 32 * kStages : kTma ? 8 * kStages : 0) + (kPersist ? 64 : 0) + 1024;
  static_assert(kHeadDim % 64 == 0 && kParts >= 1 && (kParts <= 4 || kSplitK), "head dim: 64, 128, 192, 256 or 512");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 / H200 block");
  static_assert(!kTma || !kWs || (kBlockM <= 256 && kBlockN <= 256), "(kTma, kWs) a box is at most 256 rows: one per Q, K or V part");
};

template <class E, int D, bool kWs, bool kTma = false, bool kWideN = false, bool kPersist = false, bool kMerge = false>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS((FwdSm90<D, kWs, kTma, kWideN, kPersist, kMerge>::kThreads))
    dkv_fwd_sm90_kernel(const DKV_GRID_CONSTANT FwdParams p) {
  using K = FwdSm90<D, kWs, kTma, kWideN, kPersist, kMerge>;
  constexpr int kParts = K::kParts, kMyParts = K::kMyParts, kBlockM = K::kBlockM, kBlockN = K::kBlockN;
  constexpr bool kSplitK = K::kSplitK;
  const int W = p.window;

  // Consumer threads 0 .. 255 (kWs: threads 128 .. 383; the producer warpgroup is 0 .. 127).
  const int tid = thread_idx() - (kWs ? 128 : 0), lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);
  const int g = lane >> 2, tq = lane & 3;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(sm90::dynamic_smem_1024());
  constexpr int kStages = K::kStages;
  uint16_t* sK0 = sQ + K::kQTile;  // K buffers, then V buffers; tile t in buffer t % kStages
  auto sK = [&](int t) { return sK0 + (t % kStages) * K::kKvTile; };
  auto sV = [&](int t) { return sK0 + (kStages + t % kStages) * K::kKvTile; };
  char* after_tiles = reinterpret_cast<char*>(sK0 + 2 * kStages * K::kKvTile);
  // (kWs) K and V have rings of their own: K_t is free once S_t is computed, V_t only once P_t V_t is,
  // a tile later, so each ring refills as soon as its own buffer is read. (kTma in turn) full_k[j %
  // kStages] is load group j's barrier (the groups below).
  uint64_t* full_k = reinterpret_cast<uint64_t*>(after_tiles + K::kExchangeBytes);
  uint64_t* empty_k = full_k + kStages;
  uint64_t* full_v = empty_k + kStages;
  uint64_t* empty_v = full_v + kStages;
  // (kPersist) Q's buffer free (both consumers computed a tile's last S), the work slots' barriers, the slots.
  uint64_t* q_empty = empty_v + kStages;
  uint64_t* work_full = q_empty + 1;
  uint64_t* work_empty = work_full + 2;
  int* work_slot = reinterpret_cast<int*>(work_empty + 2);
  // (kSplitK) partial S: this warpgroup's at mine[e * 128], the other's at theirs[e * 128].
  float* s_exchange = reinterpret_cast<float*>(after_tiles);
  float* mine = s_exchange + wg * 64 * kBlockN + (tid & 127);
  const float* theirs = s_exchange + (wg ^ 1) * 64 * kBlockN + (tid & 127);

  // The query tile of work item `item` of this block; s = -1 once there is none. A per-tile block has one
  // (query_tile); with kPersist the producer thread takes item `item` from the counter and hands it over
  // through slot item % 2, which both consumers free once they have read it.
  auto tile_of = [&](int item) -> QueryTile {
    if constexpr (kPersist) {
      const int slot = item % 2;
      if (tid < 0) {
        if (item >= 2) sm90::mbar_wait(&work_empty[slot], (item / 2 - 1) & 1);
        work_slot[slot] = atomic_add_i32(p.work_counter, 1);
        sm90::mbar_arrive(&work_full[slot]);
      }
      sm90::mbar_wait(&work_full[slot], (item / 2) & 1);
      const int w = work_slot[slot];
      if (tid >= 0) sm90::mbar_arrive(&work_empty[slot]);
      return query_tile_of_work<kBlockM>(p, p.q_tile_prefix, p.q_seg_order, w);
    } else {
      return query_tile<kBlockM>(p, p.q_tile_prefix, p.q_seg_order);
    }
  };
  // (kMerge, DUALKV_CUDA_FWD_MERGE=1) one key range where the context has keys: TwoRegionWalk in dkv_fwd.cuh.
  auto walk_of = [&](const QueryTile& qt) {
    return make_walk<kBlockN, kMerge>(qt.q0, qt.m_valid, qt.ctx_len, qt.ctx_row0, qt.row0, W);
  };

  // Loads by kLoaders threads (all 256, or the producer's 128), thread index `lt`.
  constexpr int kLoaders = kWs ? 128 : K::kThreads;
  auto load_k = [&](const TwoRegionWalk& walk, int hk, int t, int lt) {
    const KvTile kt = walk.tile<kBlockN, kMerge>(t);
    sm90::load_tile_sw128_async<D, kLoaders, kBlockN>(sK(t), kt.ctx ? p.k_ctx : p.k, kt.row, hk, kt.valid, lt);
  };
  auto load_v = [&](const TwoRegionWalk& walk, int hk, int t, int lt) {
    const KvTile kt = walk.tile<kBlockN, kMerge>(t);
    sm90::load_tile_sw128_async<D, kLoaders, kBlockN>(sV(t), kt.ctx ? p.v_ctx : p.v, kt.row, hk, kt.valid, lt);
  };

  // (kWs) The producer warpgroup loads and the consumers compute, each in a loop of its own over the
  // block's query tiles (one, or with kPersist as many as the counter hands out). The rings' barriers
  // are set up once a block. The key tiles a block walks are numbered on from one query tile to the next
  // (tile t of a walk is ring tile base + t), so with kPersist the rings run on across query tiles.
  if constexpr (kWs) {
    sm90::init_ring(full_k, empty_k, kStages, kTma ? 1 : 128);
    sm90::init_ring(full_v, empty_v, kStages, kTma ? 1 : 128);
    if constexpr (kPersist) {
      if (thread_idx() == 0) {
        sm90::mbar_init(q_empty, 256);
        for (int i = 0; i < 2; ++i) {
          sm90::mbar_init(&work_full[i], 1);
          sm90::mbar_init(&work_empty[i], 256);
        }
      }
      block_sync();
    }
    // The producer refills ring tile r's buffer once the consumers freed ring tile r - kStages there.
    auto wait_empty = [&](uint64_t* empty, int r) {
      if (r >= kStages) sm90::mbar_wait(&empty[r % kStages], (r / kStages - 1) & 1);
    };
    // (kTma) K or V tile kt into dst by bulk tensor copies: one box of kBlockN rows per part, or (merged
    // walk, the tile where the context ends) 16-row boxes, kt.split rows of the context then the own keys.
    auto load_keys = [&](uint16_t* dst, const TmaDesc& whole, const TmaDesc& whole_ctx, const TmaDesc& rows16,
                         const TmaDesc& rows16_ctx, const KvTile& kt, int hk, uint64_t* bar) {
      if (kMerge && kt.split > 0) {
        constexpr int kRows = kMergeBoxRows;  // the boxes of tma_k16 / tma_v16
        for (int b = 0; b < kBlockN / kRows; ++b) {
          const bool from_ctx = kRows * b < kt.split;
          const int row = from_ctx ? kt.row + kRows * b : kt.own_row + kRows * b - kt.split;
          for (int part = 0; part < kParts; ++part)
            sm90::tma_load_box(dst + part * kBlockN * 64 + kRows * b * 64, from_ctx ? rows16_ctx : rows16, 64 * part, hk, row, bar);
        }
      } else {
        sm90::tma_load_tile<kParts>(dst, kt.ctx ? whole_ctx : whole, hk, kt.row, kBlockN, bar);
      }
    };
    if (tid < 0) {  // the producer warpgroup
      sm90::setmaxnreg_dec<K::kProducerRegs>();
      if constexpr (kTma) {  // one thread, bulk tensor copies
        if (thread_idx() != 0) return;
        int base = 0;
        for (int item = 0; kPersist || item < 1; ++item) {
          const QueryTile qt = tile_of(item);
          if (qt.s < 0) break;
          const TwoRegionWalk walk = walk_of(qt);
          const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
          for (int t = 0; t < n_tiles; ++t) {
            const int r = base + t;
            const KvTile kt = walk.tile<kBlockN, kMerge>(t);
            wait_empty(empty_k, r);
            // (kPersist) Q's buffer is free once both consumers computed the previous query tile's last S.
            if (kPersist && t == 0 && item > 0) sm90::mbar_wait(q_empty, (item - 1) & 1);
            sm90::mbar_arrive_expect_tx(&full_k[r % kStages], (K::kKvTile + (t == 0 ? K::kQTile : 0)) * 2);
            if (t == 0) sm90::tma_load_tile<kParts>(sQ, p.tma_q, qt.h, qt.row0 + qt.q0, kBlockM, &full_k[r % kStages]);
            load_keys(sK(r), p.tma_k, p.tma_k_ctx, p.tma_k16, p.tma_k_ctx16, kt, qt.hk, &full_k[r % kStages]);
            wait_empty(empty_v, r);
            sm90::mbar_arrive_expect_tx(&full_v[r % kStages], K::kKvTile * 2);
            load_keys(sV(r), p.tma_v, p.tma_v_ctx, p.tma_v16, p.tma_v_ctx16, kt, qt.hk, &full_v[r % kStages]);
          }
          base += n_tiles;
        }
      } else {  // Q with K_0, then K_t and V_t, each once its buffer is free (one query tile)
        const QueryTile qt = tile_of(0);
        if (qt.s < 0) return;
        const TwoRegionWalk walk = walk_of(qt);
        const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
        const int lt = thread_idx();
        // One cp.async group per load, in the order K_0 (with Q), V_0, K_1, V_1, ...: group 2 t + v. A load
        // is marked full once this thread's copies of it have landed (cp.async groups complete in order):
        // before each load the producer marks every group but the newest, then waits for the buffer.
        int announced = 0;  // groups 0 .. announced - 1 are marked full
        auto announce = [&](int upto) {
          sm90::fence_smem_to_async_proxy();  // this thread's copies, for the wgmma that reads them
          for (; announced <= upto; ++announced)
            sm90::mbar_arrive(announced % 2 ? &full_v[(announced / 2) % kStages] : &full_k[(announced / 2) % kStages]);
        };
        auto wait_free = [&](uint64_t* empty, int t, int newest) {
          if (newest >= 1) {
            cp_async_wait<1>();
            announce(newest - 1);
          }
          wait_empty(empty, t);
        };
        sm90::load_tile_sw128_async<D, kLoaders, kBlockM>(sQ, p.q, qt.row0 + qt.q0, qt.h, qt.m_valid, lt);
        for (int t = 0; t < n_tiles; ++t) {
          wait_free(empty_k, t, 2 * t - 1);
          load_k(walk, qt.hk, t, lt);
          cp_async_commit();
          wait_free(empty_v, t, 2 * t);
          load_v(walk, qt.hk, t, lt);
          cp_async_commit();
        }
        cp_async_wait<0>();
        announce(2 * n_tiles - 1);
      }
      return;
    }
    sm90::setmaxnreg_inc<K::kConsumerRegs>();
    if (wg == 1) sm90::named_arrive<256>(5);  // the ping-pong's first turn is consumer 0's (below)
  }

  int base = 0;
  for (int item = 0; kPersist || item < 1; ++item) {  // the consumers (kWs), or every thread
    const QueryTile qt = tile_of(item);
    if (qt.s < 0) break;
    const int row0 = qt.row0, ctx_len = qt.ctx_len, q0 = qt.q0, m_valid = qt.m_valid, h = qt.h, hk = qt.hk;
    const TwoRegionWalk walk = walk_of(qt);
    const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
    const int qpos_lo = ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

    // (kTma in turn; thread 0) load group j by bulk tensor copies onto full_k[j % kStages]: K_j (j < n_tiles)
    // and V_{j-1} (0 < j <= n_tiles), Q with K_0. Rows past a tile's valid ones are loaded as they are
    // (masked), rows past the tensor land as zeros.
    auto issue_group = [&](int j) {
      uint64_t* bar = &full_k[j % kStages];
      const bool with_k = j < n_tiles, with_v = j > 0 && j <= n_tiles;
      sm90::mbar_arrive_expect_tx(bar, ((with_k + with_v) * K::kKvTile + (j == 0 ? K::kQTile : 0)) * 2);
      if (j == 0) sm90::tma_load_tile<kParts>(sQ, p.tma_q, h, row0 + q0, kBlockM, bar);
      if (with_k) {
        const KvTile kt = walk.tile<kBlockN, kMerge>(j);
        sm90::tma_load_tile<kParts>(sK(j), kt.ctx ? p.tma_k_ctx : p.tma_k, hk, kt.row, kBlockN, bar);
      }
      if (with_v) {
        const KvTile kt = walk.tile<kBlockN, kMerge>(j - 1);
        sm90::tma_load_tile<kParts>(sV(j - 1), kt.ctx ? p.tma_v_ctx : p.tma_v, hk, kt.row, kBlockN, bar);
      }
    };
    if constexpr (!kWs && kTma) {
      sm90::init_copy_barriers(full_k, kStages);
      block_sync();
      if (tid == 0) {
        for (int j = 0; j < kStages - 1 && j <= n_tiles; ++j) issue_group(j);
      }
    } else if constexpr (!kWs) {
      // One cp.async group per step: group 0 = Q and K_0, group j = K_j and V_{j-1} (prologue j < kStages - 1,
      // then iteration j - kStages + 1): iteration t needs group t.
      sm90::load_tile_sw128_async<D, kLoaders, kBlockM>(sQ, p.q, row0 + q0, h, m_valid, tid);
      load_k(walk, hk, 0, tid);  // n_tiles >= 1: a query always sees its own key
      cp_async_commit();
      for (int j = 1; j < kStages - 1; ++j) {
        if (j < n_tiles) load_k(walk, hk, j, tid);
        if (j - 1 < n_tiles) load_v(walk, hk, j - 1, tid);
        cp_async_commit();
      }
    }

    // Descriptors are built once a query tile and advanced by byte offsets (sm90::desc_advance). This warpgroup's 64
    // query rows start 64 rows (8 KB) into every 128-row part of Q; (kSplitK) its columns start kMyParts
    // parts into Q, K and V.
    const uint32_t my_cols = kSplitK ? wg * kMyParts : 0;  // the first part of this warpgroup's columns
    const uint64_t desc_q = sm90::smem_desc_sw128(reinterpret_cast<const char*>(sQ) +
                                                  (kSplitK ? my_cols * kBlockM * 128 : wg * 64 * 128));
    const uint64_t desc_k = sm90::smem_desc_sw128(reinterpret_cast<const char*>(sK(0)) + my_cols * kBlockN * 128);
    const uint64_t desc_v =
        sm90::smem_desc_sw128_mn(reinterpret_cast<const char*>(sV(0)) + my_cols * kBlockN * 128, kBlockN * 128);
    constexpr uint32_t kKvTileBytes = K::kKvTile * 2;
    auto issue_qk = [&](float (&s)[kBlockN / 2], int r) {  // r: the ring tile
      const uint64_t dk = sm90::desc_advance(desc_k, (r % kStages) * kKvTileBytes);
#pragma unroll
      for (int k = 0; k < kMyParts * 4; ++k) {  // part k / 4, 32 bytes per k16 step inside it
        const uint64_t da = sm90::desc_advance(desc_q, (k / 4) * kBlockM * 128 + (k % 4) * 32);
        const uint64_t db = sm90::desc_advance(dk, (k / 4) * kBlockN * 128 + (k % 4) * 32);
        sm90::wgmma_ss_k_major<E, kBlockN>(s, da, db, k > 0);
      }
    };
    float o[kMyParts][32];
    uint32_t pa[kBlockN / 16][4] = {};
    auto issue_pv = [&](int r) {
      const uint64_t dv = sm90::desc_advance(desc_v, (r % kStages) * kKvTileBytes);
#pragma unroll
      for (int k = 0; k < kBlockN / 16; ++k)  // keys 16 k .. 16 k + 15: rows 2048 bytes apart per step
        sm90::wgmma_rs_mn_parts<E, kMyParts>(o, pa[k], sm90::desc_advance(dv, k * 2048), kBlockN * 128);
    };

    const ScoreFn score = make_score_fn(p.scale, p.softcap);
    for (int part = 0; part < kMyParts; ++part)
      for (int i = 0; i < 32; ++i) o[part][i] = 0.f;
    float m_run[2] = {kNegInf, kNegInf}, l_run[2] = {0.f, 0.f};
    const int wg_row0 = kSplitK ? 0 : 64 * wg;
    const int row_in_tile[2] = {wg_row0 + 16 * warp + g, wg_row0 + 16 * warp + g + 8};

    constexpr float kMaxLag = 8.f;  // log2 units: a probability before the final division is at most 2^8
    // Softmax of S (in place: S becomes exp2(x - m)) and the factors alpha that rescale O and l. Without
    // softcap the scores stay raw and the scale goes into the exponent, one FFMA per score
    // (exp2(raw * scale_log2 - m), m in scaled units; the scale is positive, so the raw row maximum
    // scales to the scaled one); with softcap, x = cap * tanh(raw * scale / cap) in log2 units.
    auto softmax = [&](float (&s)[kBlockN / 2], int t, float (&alpha)[2]) {
      const KvTile kt = walk.tile<kBlockN, kMerge>(t);
      // (merged walk) the first tile's kt.lead rows come before the walk's first key
      const int lead = kMerge ? kt.lead : 0;
      const bool need_mask = lead > 0 || kt.valid < kBlockN || kt.kpos0 + kt.valid - 1 > qpos_lo || qpos_hi - kt.kpos0 >= W;
      with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
        constexpr bool kCap = decltype(cap)::value;
        const float sl = kCap ? 1.f : score.scale_log2;
#pragma unroll
        for (int e = 0; e < kBlockN / 2; ++e) {  // s[4 j + 2 r + c]: row r, column 8 j + 2 tq + c
          float x = s[e];
          if constexpr (kCap) x = score.capped(x);
          if constexpr (decltype(mask)::value) {
            const int col = 8 * (e / 4) + 2 * tq + (e % 2), kpos = kt.kpos0 + col;
            const int qpos = qpos_lo + row_in_tile[(e / 2) % 2];
            if (col < lead || col >= kt.valid || kpos > qpos || qpos - kpos >= W) x = kNegInf;
          }
          s[e] = x;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // rows g (r = 0) and g + 8 (r = 1); a quad of lanes shares a row
          float mx = kNegInf;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
          mx = fmaxf(mx, shfl_xor(mx, 1));
          mx = fmaxf(mx, shfl_xor(mx, 2));
          // The running maximum moves only when this tile raises it by more than kMaxLag: the
          // probabilities are then below 2^kMaxLag (the division by l at the end is exact whatever
          // maximum was subtracted), and O and l are rescaled only on the few tiles where it moved.
          const float m_tile = mx * sl;
          const float m_new = m_tile > m_run[r] + kMaxLag ? m_tile : m_run[r];
          const float m_use = m_new == kNegInf ? 0.f : m_new;
          alpha[r] = fast_exp2(m_run[r] - m_use);
          m_run[r] = m_new;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const float e = fast_exp2(fmaf(s[4 * j + 2 * r + c], sl, -m_use));
              s[4 * j + 2 * r + c] = e;
              sum += e;
            }
          l_run[r] = l_run[r] * alpha[r] + sum;
        }
      });
    };

    // (kWs) Ping-pong: the consumers take turns at issuing their products (named barrier 5 + wg: its
    // 128 threads wait there until the other consumer's 128 have arrived), so that one's softmax runs
    // under the other's matmuls instead of both softmaxes at once. Consumer 1 lets consumer 0 go first
    // (before the first query tile); each has n_tiles + 1 turns a query tile (the last issues the final
    // P V), and consumer 0 takes one more turn at the end, to meet consumer 1's last arrival.
    auto my_turn = [&] {
      if constexpr (kWs) sm90::named_sync<256>(5 + wg);
    };
    auto your_turn = [&] {
      if constexpr (kWs) sm90::named_arrive<256>(5 + (wg ^ 1));
    };

    float s[kBlockN / 2];
    for (int t = 0; t < n_tiles; ++t) {
      const int r = base + t;  // the ring tile (t in the in-turn forms)
      // K_t and V_{t-1} (group t) have landed, and every warpgroup is done with K_{t-1} and V_{t-2},
      // whose buffers the loads below refill (kWs: the producer does that).
      if constexpr (kWs) {
        sm90::mbar_wait(&full_k[r % kStages], (r / kStages) & 1);  // K_t (and Q) have landed
        if (t > 0) sm90::mbar_wait(&full_v[(r - 1) % kStages], ((r - 1) / kStages) & 1);  // V_{t-1}
      } else if constexpr (kTma) {
        block_sync();  // every thread is done with group t - 1's buffers, which group t + kStages - 1 refills
        if (tid == 0 && t + kStages - 1 <= n_tiles) issue_group(t + kStages - 1);
        sm90::mbar_wait(&full_k[t % kStages], (t / kStages) & 1);  // group t: K_t and V_{t-1}
      } else {
        cp_async_wait<kStages - 2>();
        sm90::fence_smem_to_async_proxy();
        block_sync();
        if (t + kStages - 1 < n_tiles) load_k(walk, hk, t + kStages - 1, tid);
        if (t + kStages - 2 < n_tiles) load_v(walk, hk, t + kStages - 2, tid);
        cp_async_commit();
      }

      my_turn();
      sm90::wgmma_fence();
      issue_qk(s, r);
      sm90::wgmma_commit();
      if (t > 0) {
        issue_pv(r - 1);
        sm90::wgmma_commit();
        your_turn();
        sm90::wgmma_wait<1>();  // S_t is ready; P_{t-1} V_{t-1} may still run
      } else {
        your_turn();
        sm90::wgmma_wait<0>();
      }
      sm90::fence_operand<kBlockN / 2>(s);
      if constexpr (kSplitK) {  // S_t = this warpgroup's partial + the other's
#pragma unroll
        for (int e = 0; e < kBlockN / 2; ++e) mine[e * 128] = s[e];
        block_sync();
#pragma unroll
        for (int e = 0; e < kBlockN / 2; ++e) s[e] += theirs[e * 128];
      }
      if constexpr (kWs) sm90::mbar_arrive(&empty_k[r % kStages]);  // S_t is computed: K_t is read
      if constexpr (kPersist) {
        if (t == n_tiles - 1) sm90::mbar_arrive(q_empty);  // and Q, the last time for this query tile
      }
      float alpha[2];
      softmax(s, t, alpha);
      sm90::wgmma_wait<0>();
      sm90::fence_operand(pa);
#pragma unroll
      for (int part = 0; part < kMyParts; ++part) sm90::fence_operand<32>(o[part]);
      // Rescale O only where a row maximum moved (alpha == 1 exactly otherwise: with the lag above a
      // later key tile seldom moves it); the warp takes the branch together, so a stable warp skips them.
      if (warp_any(alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int part = 0; part < kMyParts; ++part)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            o[part][4 * j] *= alpha[0];
            o[part][4 * j + 1] *= alpha[0];
            o[part][4 * j + 2] *= alpha[1];
            o[part][4 * j + 3] *= alpha[1];
          }
      }
      if constexpr (kWs) {
        if (t > 0) sm90::mbar_arrive(&empty_v[(r - 1) % kStages]);  // P_{t-1} V_{t-1} is computed
      }
      c_to_a<E, kBlockN>(pa, reinterpret_cast<const float(&)[kBlockN / 8][4]>(s));
    }
    const int r_last = base + n_tiles - 1;
    if constexpr (kWs) {
      sm90::mbar_wait(&full_v[r_last % kStages], (r_last / kStages) & 1);  // V_{n-1}
    } else if constexpr (kTma) {
      sm90::mbar_wait(&full_k[n_tiles % kStages], (n_tiles / kStages) & 1);  // group n: V_{n-1}
    } else {  // V_{n-1}: group n
      cp_async_wait<kStages - 2>();
      sm90::fence_smem_to_async_proxy();
      block_sync();
    }
    my_turn();
    sm90::wgmma_fence();
    issue_pv(r_last);
    sm90::wgmma_commit();
    your_turn();
    sm90::wgmma_wait<0>();
    for (int part = 0; part < kMyParts; ++part) sm90::fence_operand<32>(o[part]);
    if constexpr (kPersist) sm90::mbar_arrive(&empty_v[r_last % kStages]);  // the ring runs on: V_{n-1} is read

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
        for (int part = 0; part < kMyParts; ++part)
          for (int j = 0; j < 8; ++j)
            store_u32(dst + 64 * (my_cols + part) + 8 * j + 2 * tq,
                      pack2<E>(o[part][4 * j + 2 * r] * inv, o[part][4 * j + 2 * r + 1] * inv));
        if (tq == 0 && (!kSplitK || wg == 0)) {
          p.lse[static_cast<int64_t>(h) * p.total_q + qrow] = l > 0.f ? (m_run[r] + fast_log2(l)) * kLn2 : kNegInf;
        }
      }
    }
    base += n_tiles;
  }  // the query tiles of this block
  if constexpr (kWs) {
    if (wg == 0) sm90::named_sync<256>(5);  // consumer 1's last arrival
  }
}

}  // namespace dkv
