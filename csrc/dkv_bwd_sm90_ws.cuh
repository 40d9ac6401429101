// The warp-specialised dK/dV kernel on Hopper warpgroup MMA (sm_90a), head dims 64 and 128: a producer
// warpgroup loads (cp.async or bulk tensor copies), two consumer warpgroups compute, dQ optionally
// accumulated inside (schedules 4, 5, 6, 8 and 9 of DUALKV_CUDA_WGMMA_BWD; dkv_bwd_sm90.cu launches
// it). The pieces it shares with the in-turn kernels (work items, reader tiles, the products of a
// warpgroup, the fused dQ staging) are in dkv_bwd_sm90.cuh.
#pragma once

#include "dkv_bwd_sm90.cuh"

namespace dkv {

// The dK/dV kernel warp-specialised (DUALKV_CUDA_WGMMA_BWD=4 and 5, the default at d = 128; d = 64 /
// 128): warpgroup 0 only loads,
// warpgroups 1 and 2 compute as the in-turn kernel above (each its 64 keys of the 128-key tile). The
// producer fetches the items, loads an item's K / V once the consumers are done with the previous
// item's (kv_empty), then its reader query tiles into a ring of kStages buffers, each with a slot
// saying what it holds (full: landed, empty: both consumers are done with it). So the consumers
// never meet at a block barrier: they drift apart, one's element-wise step under the other's
// products, and the load addressing leaves their registers (setmaxnreg).
//
// kDq = true (DUALKV_CUDA_WGMMA_BWD=6): dQ is accumulated here too (FusedDq), as schedule 3 does in
// the in-turn kernel, so no dQ kernel runs. Each consumer writes its dS into one of two buffers (the
// tiles alternate) with four transposing stmatrix, issues dV, meets the other at a named barrier
// (they alone: the producer goes on), issues its dQ product (committed with dV) and then dK, and
// stages and adds dQ while dK still runs; the tile's packed row and query head travel in its slot.
// The ring has 2 buffers instead of 3 to make room for the dS tiles and the dQ staging.
//
// kSplit = true (DUALKV_CUDA_WGMMA_BWD=8, the default at d = 64 until 6 overtook it; no softcap: the
// launcher runs 5 under one, since P^T's 1 - tanh^2 factor would have to stay live): S^T and dP^T go in separate commit
// groups, and P^T is computed while dP^T still runs; dS^T = P^T (dP^T - D) once it has landed. On an
// H200 the d = 64 dK/dV kernel 6% faster, at d = 128 it was 1-5% slower, and with dQ inside (6) no
// faster (benchmarks/results/raw/profile_h200_split.log).
//
// kTma = true (DUALKV_CUDA_BWD_TMA=1, schedules 6 and 8): one producer thread fills the ring by bulk
// tensor copies instead of 128 threads' cp.async, as the TMA forward does: an item's K / V (boxes of
// 64 columns x 128 rows) ride on its first reader tile's full barrier with that tile's Q / dO (64
// rows) and lse_log2 / dsum, all counted as the barrier's transaction bytes. The copy engine reads the
// flat lse_log2 / dsum from a 16-byte aligned start only (a box at an unaligned element stopped the
// kernel on an H200), so each is a run of kVecBox = 68 floats from the tile's first row rounded down
// to a multiple of 4, and the tile's rows start vec_off (its slot says) into it. Rows past a tile's
// valid queries or keys are loaded as they are: the element-wise step masks them (P^T and dS^T are 0
// there), where the cp.async loads filled zeros.
//
// kDefer = true (DUALKV_CUDA_WGMMA_BWD=9, with kDq and kTma): a tile's dQ product is issued with the
// next tile's dV / dK (the registers are those of schedule 6: issued with this tile's S^T / dP^T, the
// dQ accumulators would not fit beside them, ptxas spilled 212 and serialised the products), and
// staged and added once they are done. A consumer then waits for the other's dS of a tile a whole
// tile after it was written (the other's arrival on ds_full[other][tile parity]), where schedule 6
// meets at a named barrier every tile, so the two drift apart and one's element-wise step runs under
// the other's products. A dS buffer is written again once both consumers' products that read it are
// done (ds_empty[parity]); an item's last dQ is issued before its K / V are released. At d = 64 each
// consumer's dQ reads only its own dS, and there is nothing to wait for.
//
// kLateAdd = true (schedule 6 with the TMA producer, by default; DUALKV_CUDA_BWD_LATE_DQ_ADD=0 turns it
// off): a tile's dQ staging stores are issued while dK runs, as in 6, but its reduce-add waits for the
// next tile: the fence each thread runs after storing that tile's dS also covers its staging stores,
// and the consumers' meeting after it stands in for the staging's barrier. The staging has two buffers
// (tile t's in buffer t % 2), at pitch 64 to fit (226.6 KiB at d = 128), and each warpgroup's issuer
// waits for the reads of its adds before the last one just before the meeting, which so stands in for
// the barrier before the stores too. Each tile has two barriers and one proxy fence (its MEMBAR waits
// for the thread's stores) fewer. The pending tile's head, row and rows travel to the next tile; the
// last one is added (fence, barrier, reduce-add) at the end. Packed row t's staged columns are rotated
// by 8 (t % 4) (FusedDq::store_rows<true>): at pitch 64 unrotated a half-warp's 4 rows hit the same
// banks, and the backward took 1.07-1.13x the per-tile add's time on an H100, against 0.94-0.96x
// rotated (benchmarks/results/raw/cuda_bwd_late_dq_add_s48b.log). With one buffer (first tried) a
// tile's stores waited for the add issued just before them: 1.09-1.15x (raw/cuda_bwd_late_dq_add_s48.log).
template <int kHeadDim_, bool kDq_ = false, bool kSplit_ = false, bool kTma_ = false, bool kDefer_ = false,
          bool kLateAdd_ = false>
struct DkdvSm90Ws {
  static constexpr bool kDq = kDq_, kSplit = kSplit_, kTma = kTma_, kDefer = kDefer_, kLateAdd = kLateAdd_;
  static_assert(!kLateAdd || (kDq && !kDefer), "(kLateAdd) schedule 6's dQ add, split around the next tile's products");
  static_assert(!kTma || kDq || kSplit, "(kTma) the bulk-tensor-copy producer: schedules 6 and 8");
  static_assert(!kDefer || (kDq && kTma), "(kDefer) the deferred dQ: schedule 6 with the TMA producer");
  static_assert(!(kDq && kSplit), "the split waits only without dQ (schedule 8; with dQ it measured no faster)");
  static constexpr int kHeadDim = kHeadDim_, kBlockN = 128, kBlockM = 64, kThreads = 384, kStages = kDq ? 2 : 3;
  static constexpr int kParts = kHeadDim / 64;
  static constexpr int kKvTile = kBlockN * kHeadDim, kQTile = kBlockM * kHeadDim;  // elements
  // What a ring buffer holds: a reader tile of `item` (kTile), the item's last (kLast), or the end;
  // (kDq) the tile's first packed row and query head.
  // (kTma) vec_off: where the tile's rows start in its lse_log2 / dsum buffers.
  struct alignas(16) SlotPlain {
    QTileDesc desc;
    int item, flags, vec_off = 0;
  };
  struct alignas(16) SlotWithRows {
    QTileDesc desc;
    int item, flags, row, hq, vec_off = 0;
  };
  using Slot = std::conditional_t<kDq, SlotWithRows, SlotPlain>;
  static constexpr int kTile = 1, kLast = 2, kDone = 4;
  // Shared memory, in bytes from the 1024-aligned base: K, V; the Q and dO buffers; (kDq) two dS tiles
  // and both consumers' dQ staging; the lse_log2 and dsum buffers; the full, empty and kv_empty
  // barriers (8-byte aligned); the slots (16-byte aligned); the producer's item; then the base's
  // alignment slack.
  static constexpr int kOffQ = 2 * kKvTile * 2, kOffDo = kOffQ + kStages * kQTile * 2;
  static constexpr int kOffDs = kOffDo + kStages * kQTile * 2, kDsBytes = kDq ? 2 * kBlockM * kBlockN * 2 : 0;
  // The dQ staging's row pitch (floats) and buffers: kLateAdd's two fit at pitch 64 (d = 128: 226.6 KiB)
  static constexpr int kStagePitch = kLateAdd ? kDqAccumPitchLate : kDqAccumPitch, kStageBufs = kLateAdd ? 2 : 1;
  static constexpr int kOffStage = kOffDs + kDsBytes, kStageBytes = kDq ? kStageBufs * 2 * kBlockM * kStagePitch * 4 : 0;
  // lse_log2 / dsum buffers of kVecPitch floats (kTma: a kVecBox-float run, 128-byte aligned apart).
  static constexpr int kVecBox = kBlockM + 4, kVecPitch = kTma ? 96 : kBlockM;
  static_assert(kVecBox == kSm90DkdvVecBox, "the binding's lse_log2 / dsum maps have boxes of kVecBox floats");
  static constexpr int kOffL = kOffStage + kStageBytes, kOffD = kOffL + kStages * kVecPitch * 4;
  static constexpr int kOffBars = kOffD + kStages * kVecPitch * 4;
  // (kDefer) ds_full[consumer][tile parity], ds_empty[tile parity]
  static constexpr int kBars = 2 * kStages + 1 + (kDefer ? 6 : 0);
  static constexpr int kOffSlots = kOffBars + (kBars * 8 + 15) / 16 * 16;
  static constexpr int kOffItem = kOffSlots + kStages * static_cast<int>(sizeof(Slot));
  static constexpr int kSmemBytes = kOffItem + 16 + 1024;
  static_assert(kOffQ % 1024 == 0 && kOffDo % 1024 == 0 && kQTile * 2 % 1024 == 0,
                "128-byte-swizzled tiles start on 1024-byte boundaries");
  static_assert(kOffBars % 8 == 0 && kOffSlots % 16 == 0, "mbarriers 8-byte, slots 16-byte aligned");
  static_assert(kOffDs % 1024 == 0 && kOffStage % 16 == 0, "dS tiles 1024-byte, the staging 16-byte aligned");
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the warp-specialised dK/dV kernel: head dim 64 or 128");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory of one H100 / H200 block");
  static_assert(!kTma || (kOffL % 128 == 0 && kOffD % 128 == 0 && kVecPitch * 4 % 128 == 0 && kVecBox <= kVecPitch),
                "(kTma) the lse_log2 / dsum buffers: bulk tensor copy destinations, 128-byte aligned");
  // (kTma) the bytes a reader tile's copies bring (Q, dO, lse_log2, dsum), and an item's K and V.
  static constexpr int kTileTxBytes = 2 * kQTile * 2 + 2 * kVecBox * 4, kKvTxBytes = 2 * kKvTile * 2;
};

template <class E, int D, bool kDq = false, bool kSplit = false, bool kTma = false, bool kDefer = false,
          bool kLateAdd = false>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(384) dkv_dkdv_sm90_ws_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  using K = DkdvSm90Ws<D, kDq, kSplit, kTma, kDefer, kLateAdd>;
  using Slot = typename K::Slot;
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kParts = K::kParts, kStages = K::kStages;
  const int rep = p.nheads / p.nheads_kv;
  const int W = p.window;
  const int total_items = p.kv_item_prefix[p.num_item_groups] * p.nheads_kv;

  char* smem = reinterpret_cast<char*>(sm90::dynamic_smem_1024());
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sV = sK + K::kKvTile;
  uint16_t* sQ0 = reinterpret_cast<uint16_t*>(smem + K::kOffQ);    // buffer b at sQ0 + b * kQTile
  uint16_t* sdO0 = reinterpret_cast<uint16_t*>(smem + K::kOffDo);  // buffer b at sdO0 + b * kQTile
  uint16_t* sDs0 = reinterpret_cast<uint16_t*>(smem + K::kOffDs);  // (kDq) tile t's dS at (t % 2) * 64 * 128
  float* sStage = reinterpret_cast<float*>(smem + K::kOffStage);    // (kDq)
  float* sL0 = reinterpret_cast<float*>(smem + K::kOffL);
  float* sD0 = reinterpret_cast<float*>(smem + K::kOffD);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + K::kOffBars);
  uint64_t* empty = full + kStages;
  uint64_t* kv_empty = empty + kStages;
  uint64_t* ds_full = kv_empty + 1;   // (kDefer) [consumer * 2 + tile parity]: its dS of the tile is stored
  uint64_t* ds_empty = ds_full + 4;  // (kDefer) [tile parity]: both consumers' dQ products that read it are done
  Slot* slots = reinterpret_cast<Slot*>(smem + K::kOffSlots);
  int* s_item = reinterpret_cast<int*>(smem + K::kOffItem);

  if (thread_idx() == 0) {
    sm90::mbar_init(kv_empty, 256);
    if constexpr (kDefer) {
      for (int i = 0; i < 4; ++i) sm90::mbar_init(&ds_full[i], 128);
      for (int i = 0; i < 2; ++i) sm90::mbar_init(&ds_empty[i], 256);
    }
  }
  sm90::init_ring(full, empty, kStages, kTma ? 1 : 128);

  // The 24 / 240 split where the consumers need 240 (d = 128 with TMA); at d = 64 they fit in 232 and
  // the one producer thread, which then has a tile to issue twice as often, keeps 40 (at 24 it spills).
  constexpr bool kWideSplit = kTma && D == 128;
  if (thread_idx() < 128) {  // the producer warpgroup (kTma: its first thread alone, bulk tensor copies)
    sm90::setmaxnreg_dec<kWideSplit ? sm90::kTmaProducerRegs : sm90::kProducerRegs>();
    if (kTma && thread_idx() != 0) return;
    const int pt = thread_idx();
    int n_slots = 0;  // slots published so far: slot i goes to buffer i % kStages
    auto open_slot = [&]() -> int {  // the next buffer, once the consumers are done with its last use
      const int b = n_slots % kStages;
      if (n_slots >= kStages) sm90::mbar_wait(&empty[b], (n_slots / kStages - 1) & 1);
      return b;
    };
    // A slot's description is written before the arrival that publishes it (its release).
    auto write_slot = [&](int b, const ReaderTile& rt, int item, int flags, int vec_off) {
      if constexpr (kDq)
        slots[b] = Slot{rt.desc, item, flags, rt.row, rt.hq, vec_off};
      else
        slots[b] = Slot{rt.desc, item, flags, vec_off};
    };
    // Buffer b published: (cp.async) once this thread's copies (K / V and the tile) have landed; (kTma)
    // only an end or an item without readers, which have no copies.
    auto publish = [&](int b, const ReaderTile& rt, int item, int flags) {
      if (pt == 0) write_slot(b, rt, item, flags, 0);
      if constexpr (!kTma) {
        cp_async_wait<0>();
        sm90::fence_smem_to_async_proxy();  // for the wgmma that read them
      }
      sm90::mbar_arrive(&full[b]);
      ++n_slots;
    };
    for (int n_items = 0;; ++n_items) {
      const int item = next_item(p, s_item, [] {
        if constexpr (!kTma) sm90::warpgroup_sync(0);  // the producer warpgroup (kTma: this thread alone)
      });
      if (n_items > 0) sm90::mbar_wait(kv_empty, (n_items - 1) & 1);  // K / V of the last item are read
      if (item >= total_items) {
        publish(open_slot(), ReaderTile{}, item, K::kDone);
        break;
      }
      const KvItem it = decode_item<kBlockN>(p, item);
      ReaderCursor<kBlockM> cur;
      bool have = cur.begin(p, it);
      if (!have) {
        publish(open_slot(), ReaderTile{}, item, K::kLast);  // no reader: the consumers store zeros
        continue;
      }
      if constexpr (kTma) {  // every copy of a tile (and, with the first, the item's K / V) onto its full
        for (bool first = true; have; first = false) {
          const int b = open_slot();
          const ReaderTile rt = reader_tile(cur, it, rep);
          have = cur.advance(p, it, rep);
          const int si = rt.hq * p.total_q + rt.row;  // the binding keeps nheads * total_q below 2^31
          write_slot(b, rt, item, K::kTile | (have ? 0 : K::kLast), si & 3);
          uint64_t* bar = &full[b];
          sm90::mbar_arrive_expect_tx(bar, K::kTileTxBytes + (first ? K::kKvTxBytes : 0));
          if (first) {
            sm90::tma_load_tile<kParts>(sK, it.ctx_tensor ? p.tma_k_ctx : p.tma_k, it.hk, it.key_row0, kBlockN, bar);
            sm90::tma_load_tile<kParts>(sV, it.ctx_tensor ? p.tma_v_ctx : p.tma_v, it.hk, it.key_row0, kBlockN, bar);
          }
          sm90::tma_load_tile<kParts>(sQ0 + b * K::kQTile, p.tma_q, rt.hq, rt.row, kBlockM, bar);
          sm90::tma_load_tile<kParts>(sdO0 + b * K::kQTile, p.tma_dout, rt.hq, rt.row, kBlockM, bar);
          sm90::tma_load_vec(sL0 + b * K::kVecPitch, p.tma_lse_log2, si & ~3, bar);
          sm90::tma_load_vec(sD0 + b * K::kVecPitch, p.tma_dsum, si & ~3, bar);
          ++n_slots;
        }
      } else {
        load_item_kv<D, 128, kBlockN>(p, it, sK, sV, pt);
        cp_async_commit();
        while (have) {
          const int b = open_slot();
          const ReaderTile rt = load_reader_tile<D, 128>(p, cur, it, rep, sQ0 + b * K::kQTile, sdO0 + b * K::kQTile,
                                                         sL0 + b * K::kVecPitch, sD0 + b * K::kVecPitch, pt);
          cp_async_commit();
          have = cur.advance(p, it, rep);
          publish(b, rt, item, K::kTile | (have ? 0 : K::kLast));
        }
      }
    }
    return;
  }

  sm90::setmaxnreg_inc<kWideSplit ? sm90::kTmaConsumerRegs : sm90::kConsumerRegs>();
  const int tid = thread_idx() - 128, lane = tid & 31, warp = (tid >> 5) & 3, wg = warp_uniform(tid >> 7);  // wg: consumer 0 / 1
  const int g = lane >> 2, tq = lane & 3;
  const DkdvProducts<E, D, kBlockM, kBlockN> products(sK, sV, sQ0, sdO0, wg);
  // kSplit: no softcap (the launcher runs schedule 5 under one), so no 1 - tanh^2 factor to keep.
  const ScoreFn score = make_score_fn(p.scale, kSplit ? 0.f : p.softcap);
  DkdvWarpgroup<E, D, kBlockM, kBlockN> w(wg, warp, g);
  FusedDq<E, D, kBlockM, kBlockN, K::kStagePitch> fdq;  // (kDq)
  int n_tiles = 0;                      // (kDq) tiles computed: their dS alternate between two buffers
  // (kDefer) the computed tile whose dQ product is still to come: its index, packed row, head, rows.
  struct PendingDq {
    int t = -1, row = 0, hq = 0, m_valid = 0;
  } pend;
  bool add_dq = false;                // (kDefer) dQ of pend: its product is done, to be staged and added
  // (kLateAdd) the staged tile whose fence, barrier and reduce-add are still to come (m_valid < 0: none)
  int late_hq = 0, late_row = 0, late_m = -1;
  auto issue_pending_dq = [&] {       // (not committed) once the other consumer's dS of the tile is stored
    if constexpr (kParts == 2)
      if (pend.t >= 0) sm90::mbar_wait(&ds_full[(1 - wg) * 2 + (pend.t & 1)], (pend.t >> 1) & 1);
    fdq.issue(sDs0 + (pend.t & 1) * kBlockM * kBlockN, sK, wg);
  };
  auto pending_dq_done = [&] {  // after the wait that ends its product: its dS buffer is free (this consumer's part)
    sm90::fence_operand<32>(fdq.dq);
    if constexpr (kParts == 2) sm90::mbar_arrive(&ds_empty[pend.t & 1]);
    add_dq = true;
  };
  auto add_pending_dq = [&] {
    fdq.add(p, sStage, wg, warp, g, tq, pend.hq, pend.row, pend.m_valid);
    add_dq = false;
    pend.t = -1;
  };

  for (int n_slots = 0;;) {  // one item a pass
    w.zero_dkdv();
    Slot slot;
    for (;;) {  // its slots
      const int b = warp_uniform(n_slots % kStages);
      sm90::mbar_wait(&full[b], (n_slots / kStages) & 1);
      slot = slots[b];
      if (slot.flags & K::kTile) {
        // S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q (as dkv_dkdv_sm90_kernel).
        sm90::wgmma_fence();
        if constexpr (kSplit) {  // each its own commit group: P^T while dP^T still runs
          products.issue_s(w.st, b);
          sm90::wgmma_commit();
          products.issue_dp(w.dpt, b);
          sm90::wgmma_commit();
          sm90::wgmma_wait<1>();  // S^T; dP^T may still run
          sm90::fence_operand<32>(w.st);
          w.tile_p(slot.desc, sL0 + b * K::kVecPitch + slot.vec_off, tq, W, score);
          sm90::wgmma_wait<0>();
          sm90::fence_operand<32>(w.dpt);
          w.tile_ds_from_p(sD0 + b * K::kVecPitch + slot.vec_off, tq);
        } else {
          products.issue_ss(w.st, w.dpt, b);
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          w.pin_ss();
          w.tile_ds(slot.desc, sL0 + b * K::kVecPitch + slot.vec_off, sD0 + b * K::kVecPitch + slot.vec_off, tq, W, score);
        }
        w.pack();
        uint16_t* sDs = sDs0 + (n_tiles & 1) * kBlockM * kBlockN;
        if constexpr (kDq) {
          // (kDefer, d = 128) the buffer's last tile, two back: both consumers' products that read it are done
          if constexpr (kDefer && kParts == 2)
            if (n_tiles >= 2) sm90::mbar_wait(&ds_empty[n_tiles & 1], ((n_tiles >> 1) - 1) & 1);
          fdq.store_ds(sDs, w.dsa, wg, warp, lane);
          sm90::fence_smem_to_async_proxy();  // this thread's dS stores, for the other consumer's wgmma
          if constexpr (kDefer && kParts == 2) sm90::mbar_arrive(&ds_full[wg * 2 + (n_tiles & 1)]);
        }
        sm90::wgmma_fence();
        if constexpr (kDq && !kDefer) {
          // dV, then dQ once both consumers' dS are stored (a tile later the other buffer: its readers
          // are done), then dK in a group of its own: dQ is staged and added while dK still runs.
          products.issue_dv(w.dv, w.pa, b);
          // (kLateAdd) the adds before the last have read their buffers (the one tile t's stores go to)
          if constexpr (kLateAdd)
            if ((thread_idx() & 127) == 0) sm90::bulk_wait_read<0>();
          sm90::named_sync<256>(4);
          if constexpr (kLateAdd) {  // the previous tile's staging: fenced with this tile's dS, met since
            if (late_m >= 0) fdq.issue_add(p, fdq.staging(sStage, wg, (n_tiles - 1) & 1), wg, late_hq, late_row, late_m);
          }
          fdq.issue(sDs, sK, wg);
          sm90::wgmma_commit();
          products.issue_dk(w.dk, w.dsa, b);
          sm90::wgmma_commit();
          sm90::wgmma_wait<1>();
          sm90::fence_operand<32>(fdq.dq);
          if constexpr (kLateAdd) {  // the buffer's last add has read it: waited for before the meeting
            float* stage = fdq.staging(sStage, wg, n_tiles & 1);
            fdq.template store_rows<true>(stage, warp, g, tq, slot.row);
            late_hq = slot.hq, late_row = slot.row, late_m = slot.desc.m_valid;
          } else {
            fdq.add(p, sStage, wg, warp, g, tq, slot.hq, slot.row, slot.desc.m_valid);
          }
          sm90::wgmma_wait<0>();
          w.pin_rs();
        } else {
          products.issue_rs(w.dk, w.dv, w.pa, w.dsa, b);
          // (kDefer) the previous tile's dQ, with this tile's dV / dK. Issued at an item's first tile too,
          // with nothing pending, and its result dropped: a branch around it made ptxas serialise
          // every product of the kernel.
          if constexpr (kDefer) issue_pending_dq();
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          w.pin_rs();
        }
        if constexpr (kDefer) {
          if (pend.t >= 0) pending_dq_done();
        }
        if constexpr (kDq) ++n_tiles;
      }
      if (!(slot.flags & K::kDone)) sm90::mbar_arrive(&empty[b]);
      if constexpr (kDefer) {
        if (add_dq) add_pending_dq();
        if (slot.flags & K::kTile) pend = PendingDq{n_tiles - 1, slot.row, slot.hq, slot.desc.m_valid};
        if ((slot.flags & K::kLast) && pend.t >= 0) {  // the item's last dQ, before its K is released
          sm90::wgmma_fence();
          issue_pending_dq();
          sm90::wgmma_commit();
          sm90::wgmma_wait<0>();
          pending_dq_done();
          add_pending_dq();
        }
      }
      ++n_slots;
      if (slot.flags & (K::kLast | K::kDone)) break;
    }
    if (slot.flags & K::kDone) break;
    sm90::mbar_arrive(kv_empty);  // K / V are read: the producer may load the next item's
    store_dkdv_rows<E, kParts>(p, decode_item<kBlockN>(p, slot.item), w.key_in_tile, tq, w.dk, w.dv);
  }
  if constexpr (kLateAdd) {
    if (late_m >= 0) fdq.commit(p, fdq.staging(sStage, wg, (n_tiles - 1) & 1), wg, late_hq, late_row, late_m);
  }
  if constexpr (kDq) sm90::bulk_wait<0>();  // the dQ rows this thread added
}

}  // namespace dkv
