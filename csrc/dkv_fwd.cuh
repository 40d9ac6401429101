// Forward kernel: one block per (query tile of a segment, head). Each block walks TWO physically
// disjoint KV regions in one launch -- the segment's context keys (the group's shared prompt, rows
// of k_ctx or of k) and then the segment's own keys -- with an online softmax carried across both.
// Each region ends with its own partial tile (the 176-key TMA forward can instead walk both as one
// range of logical positions, DUALKV_CUDA_FWD_MERGE=1: TwoRegionWalk below). Masks use logical positions:
//
//     context key j          -> position j            (always causal-visible: j < ctx_len <= qpos)
//     own key i' / query i   -> position ctx_len + i'  (visible iff i' <= i)
//     window W: visible iff qpos - kpos < W
//
// A query tile of segment s = one response (ctx_len = P), BLOCK_N = 4, x = visible:
//
//          context (prompt rows)   own rows
//     i0  [ x x x x | x x x x | x x x . ]  ...  [ x . . . ]
//     i1  [ x x x x | x x x x | x x x . ]  ...  [ x x . . ]
//            tile 0    tile 1   partial          own tile (diagonal)
//
// Grid: x = query tiles of all segments (an upper bound from shapes: ceil((T + S (BM-1)) / BM));
// blocks past the device-side tile count exit. y = query heads; GQA reads kv head h / (H / Hkv).
#pragma once

#include "dkv_params.h"
#include "dkv_tile.cuh"

namespace dkv {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kDSplit_, int kMTiles_>
struct FwdTraits {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kDSplit = kDSplit_;
  static constexpr int kMTiles = kMTiles_;  // 16-row m-tiles per warp
  static constexpr int kRowWarps = kBlockM / (16 * kMTiles);
  static constexpr int kWarps = kRowWarps * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDSlice = kHeadDim / kDSplit;
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kSmemBytes = (kBlockM + 4 * kBlockN) * kStride * 2;
  static_assert(kDSlice % 16 == 0, "head-dim slice must be a multiple of 16");
  static_assert(kBlockM % (16 * kMTiles) == 0, "query tile must be whole warps");
};

// Where the keys of tile `ti` live, for one query tile. Context tiles first, then own tiles.
struct KvTile {
  int row;               // the tile's first row in k/v (or k_ctx/v_ctx)
  int valid;             // rows of the tile that exist in the region (merged walk: up to the walk's last key)
  int kpos0;             // logical position of the tile's first key
  bool ctx;              // true: rows of k_ctx / v_ctx
  int lead = 0;          // (merged walk) rows before the walk's first key: masked, loaded as they are
  int split = 0;         // (merged walk) rows from the context, 0 < split < kBlockN where the context ends
  int own_row = 0;       // (merged walk) where split > 0: the row in k / v of the segment's first own key
};

// The key tiles of one query tile. Split (the default): the context tiles, the last one partial, then
// the own tiles. Merged (kMerged, the 176-key TMA forward with DUALKV_CUDA_FWD_MERGE=1; merged_lo is set):
// one range of logical positions [merged_lo, ctx_len + own_hi) in tiles of kBlockN, where the context
// holds keys (n_ctx_tiles of the split walk > 0, so own_lo == 0 and the two ranges meet), so that the
// context's last partial tile runs on into the own keys: one tile with masked rows fewer a query tile
// (benchmarks/tile_waste.py counts what that saves). merged_lo sits up to 15 keys before the context's
// first key (a lead of masked rows) so that the context ends at a multiple of 16 rows into its tile:
// that tile is loaded as 16-row pieces of both regions (2 KB each, a whole number of 128B-swizzle atoms).
struct TwoRegionWalk {
  int ctx_lo, ctx_len, ctx_row0, n_ctx_tiles;
  int own_lo, own_hi, own_row0, n_own_tiles;
  int merged_lo;

  // kMerged: a walk make_walk<kBlockN, true> built (merged where the context has keys, else split).
  // Without it merged_lo is never read, so the split walk's kernels carry none of the merged one's code.
  template <int kBlockN, bool kMerged = false>
  DKV_DEV KvTile tile(int ti) const {
    KvTile t;
    if (kMerged && merged_lo != kSplitWalk) {
      const int k0 = merged_lo + ti * kBlockN;
      t.kpos0 = k0;
      t.valid = imin(kBlockN, ctx_len + own_hi - k0);
      t.lead = imax(0, ctx_lo - k0);
      t.ctx = k0 < ctx_len;
      t.split = k0 < ctx_len && ctx_len - k0 < kBlockN ? ctx_len - k0 : 0;
      t.row = t.ctx ? ctx_row0 + k0 : own_row0 + (k0 - ctx_len);
      t.own_row = own_row0;
    } else if (ti < n_ctx_tiles) {
      const int j0 = ctx_lo + ti * kBlockN;
      t.valid = imin(kBlockN, ctx_len - j0);
      t.kpos0 = j0;
      t.ctx = true;
      t.row = ctx_row0 + j0;
    } else {
      const int i0 = own_lo + (ti - n_ctx_tiles) * kBlockN;
      t.valid = imin(kBlockN, own_hi - i0);
      t.kpos0 = ctx_len + i0;
      t.ctx = false;
      t.row = own_row0 + i0;
    }
    return t;
  }
  static constexpr int kSplitWalk = -2147483647 - 1;
};

// The KV tiles a query tile [q0, q0 + m_valid) of a segment (row0, ctx_len, ctx_row0) must visit;
// kMerged: one key range where the context has keys (TwoRegionWalk; read its tiles with tile<kBlockN,
// true>). Either way n_ctx_tiles + n_own_tiles is the number of tiles.
template <int kBlockN, bool kMerged = false>
DKV_DEV TwoRegionWalk make_walk(int q0, int m_valid, int ctx_len, int ctx_row0, int row0, int window) {
  TwoRegionWalk w;
  const int qpos_lo = ctx_len + q0;
  w.ctx_lo = imax(0, qpos_lo - window + 1);
  w.ctx_len = ctx_len;
  w.ctx_row0 = ctx_row0;
  w.n_ctx_tiles = ctx_len > w.ctx_lo ? ceil_div(ctx_len - w.ctx_lo, kBlockN) : 0;
  w.own_lo = imax(0, q0 - window + 1);
  w.own_hi = q0 + m_valid;
  w.own_row0 = row0;
  w.n_own_tiles = ceil_div(w.own_hi - w.own_lo, kBlockN);
  w.merged_lo = TwoRegionWalk::kSplitWalk;
  if (kMerged && w.n_ctx_tiles > 0) {  // own_lo == 0 here: a window that reaches into the context starts before q0
    constexpr int kRows = kMergeBoxRows;
    w.merged_lo = w.ctx_lo - (kRows - (ctx_len - w.ctx_lo) % kRows) % kRows;  // ctx_len - merged_lo: a multiple of kRows
    w.n_ctx_tiles = ceil_div(ctx_len + w.own_hi - w.merged_lo, kBlockN);
    w.n_own_tiles = 0;
  }
  return w;
}

// Start copying the keys and values of tile `kt` (kv head hk) into sK / sV; rows past kt.valid are zeros.
template <class K>
DKV_DEV void load_kv_tile_async(uint16_t* sK, uint16_t* sV, const KvTile& kt, const AttnArgs& p, int hk, int tid) {
  load_head_rows_async<K::kBlockN, K::kHeadDim, K::kThreads>(sK, kt.ctx ? p.k_ctx : p.k, kt.row, hk, kt.valid, tid);
  load_head_rows_async<K::kBlockN, K::kHeadDim, K::kThreads>(sV, kt.ctx ? p.v_ctx : p.v, kt.row, hk, kt.valid, tid);
}

// The query tile of this block (grid x = query tiles of all segments, y = query heads): segment s,
// its query rows [q0, q0 + m_valid), the head h and its kv head hk; s = -1 for the blocks past the
// device-side tile count, which exit. Later tiles of a segment see more keys: they go first. The
// segments follow seg_order (rank -> segment; tile_prefix is over that order), or their own order
// where it is null: the host puts a context's readers first, so that a head's last blocks are its
// prompt's first tiles, the ones that see fewest keys (query_tiles, dkv_api.cpp).
struct QueryTile {
  int s, row0, n, ctx_len, ctx_row0, q0, m_valid, h, hk;
};

// Query tile `item` (of tile_prefix's order) of head h; s = -1 past the device-side tile count.
template <int kBlockM>
DKV_DEV QueryTile query_tile_at(const AttnArgs& args, const int* tile_prefix, const int* seg_order, int item, int h) {
  const LayoutRef& layout = args.layout;
  QueryTile qt{-1, 0, 0, 0, 0, 0, 0, 0, 0};
  const int S = layout.num_segments;
  qt.h = h;
  qt.hk = qt.h / (args.nheads / args.nheads_kv);
  if (item >= tile_prefix[S]) return qt;
  const int rank = find_bucket(tile_prefix, S, item);
  const int t = tile_prefix[rank + 1] - 1 - item;
  qt.s = seg_order != nullptr ? seg_order[rank] : rank;
  qt.row0 = layout.cu_seqlens[qt.s];
  qt.n = layout.cu_seqlens[qt.s + 1] - qt.row0;
  qt.ctx_len = layout.seg_ctx_len[qt.s];
  qt.ctx_row0 = layout.seg_ctx_start[qt.s];
  qt.q0 = t * kBlockM;
  qt.m_valid = imin(kBlockM, qt.n - qt.q0);
  return qt;
}

template <int kBlockM>
DKV_DEV QueryTile query_tile(const AttnArgs& args, const int* tile_prefix, const int* seg_order) {
  return query_tile_at<kBlockM>(args, tile_prefix, seg_order, block_idx_x(), block_idx_y());
}

// Work item w of a persistent kernel (a counter hands them out in order): the query tiles of head 0 in
// tile_prefix's order, then head 1's, ..., the order in which the grid of per-tile blocks is launched
// (query_tile), so that the blocks running at once read the same prompt keys. s = -1 past the last.
template <int kBlockM>
DKV_DEV QueryTile query_tile_of_work(const AttnArgs& args, const int* tile_prefix, const int* seg_order, int w) {
  const int tiles = tile_prefix[args.layout.num_segments];
  if (tiles <= 0 || w >= tiles * args.nheads) return QueryTile{-1, 0, 0, 0, 0, 0, 0, 0, 0};
  return query_tile_at<kBlockM>(args, tile_prefix, seg_order, w % tiles, w / tiles);
}

template <class E, class K>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(K::kThreads) dkv_fwd_kernel(const DKV_GRID_CONSTANT FwdParams p) {
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kStride = K::kStride, kDSlice = K::kDSlice;
  constexpr int kMT = K::kMTiles;
  const QueryTile qt = query_tile<kBlockM>(p, p.q_tile_prefix, p.q_seg_order);
  if (qt.s < 0) return;
  const int row0 = qt.row0, ctx_len = qt.ctx_len, ctx_row0 = qt.ctx_row0, q0 = qt.q0, m_valid = qt.m_valid;
  const int h = qt.h, hk = qt.hk;
  const int W = p.window;

  const int tid = thread_idx(), lane = tid & 31, warp = tid >> 5;
  const int rw = warp % K::kRowWarps, dsl = warp / K::kRowWarps;
  const int g = lane >> 2, tq = lane & 3;
  const int warp_row0 = rw * 16 * kMT;  // first query row (in the tile) of this warp

  uint16_t* sQ = reinterpret_cast<uint16_t*>(dynamic_smem());
  uint16_t* sK0 = sQ + kBlockM * kStride;
  uint16_t* sV0 = sK0 + 2 * kBlockN * kStride;

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, ctx_len, ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
  const int qpos_lo = ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  auto issue_kv = [&](int ti) {  // tile ti into buffer ti & 1
    const int b = ti & 1;
    load_kv_tile_async<K>(sK0 + b * kBlockN * kStride, sV0 + b * kBlockN * kStride, walk.tile<kBlockN>(ti), p, hk, tid);
  };

  load_head_rows_async<kBlockM, K::kHeadDim, K::kThreads>(sQ, p.q, row0 + q0, h, m_valid, tid);
  issue_kv(0);  // n_tiles >= 1: a query always sees its own key
  cp_async_commit();

  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  float o[kMT][kDSlice / 8][4];
  float m_run[kMT][2], l_run[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
    zero(o[mt]);
    m_run[mt][0] = m_run[mt][1] = kNegInf;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  for (int ti = 0; ti < n_tiles; ++ti) {
    if (ti + 1 < n_tiles) issue_kv(ti + 1);
    cp_async_commit();
    cp_async_wait<1>();
    block_sync();

    const KvTile kt = walk.tile<kBlockN>(ti);
    const uint16_t* sK = sK0 + (ti & 1) * kBlockN * kStride;
    const uint16_t* sV = sV0 + (ti & 1) * kBlockN * kStride;

    float sc[kMT][kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) zero(sc[mt]);
    gemm_ss_m<E, kMT, kBlockN, K::kHeadDim, kStride>(sc, sQ + warp_row0 * kStride, sK, lane);

    const bool need_mask =
        kt.valid < kBlockN || kt.kpos0 + kt.valid - 1 > qpos_lo || qpos_hi - kt.kpos0 >= W;
    uint32_t pa[kMT][kBlockN / 16][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      apply_scores(reinterpret_cast<float(&)[kBlockN / 2]>(sc[mt]), score, need_mask, [&](int e) {
        const int nt = e / 4, i = e % 4;  // sc[mt][nt][i]
        const int col = nt * 8 + 2 * tq + (i & 1);
        const int qpos = qpos_lo + warp_row0 + mt * 16 + g + (i >> 1) * 8;
        const int kpos = kt.kpos0 + col;
        return col >= kt.valid || kpos > qpos || qpos - kpos >= W;
      });
      // Online softmax over rows g (r = 0) and g + 8 (r = 1); the four lanes of a quad share a row.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = kNegInf;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) mx = fmaxf(mx, fmaxf(sc[mt][nt][2 * r], sc[mt][nt][2 * r + 1]));
        mx = fmaxf(mx, shfl_xor(mx, 1));
        mx = fmaxf(mx, shfl_xor(mx, 2));
        const float m_new = fmaxf(m_run[mt][r], mx);
        const float m_use = m_new == kNegInf ? 0.f : m_new;
        const float alpha = fast_exp2(m_run[mt][r] - m_use);
        m_run[mt][r] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          sc[mt][nt][2 * r] = fast_exp2(sc[mt][nt][2 * r] - m_use);
          sc[mt][nt][2 * r + 1] = fast_exp2(sc[mt][nt][2 * r + 1] - m_use);
          sum += sc[mt][nt][2 * r] + sc[mt][nt][2 * r + 1];
        }
        l_run[mt][r] = l_run[mt][r] * alpha + sum;
#pragma unroll
        for (int nt = 0; nt < kDSlice / 8; ++nt) {
          o[mt][nt][2 * r] *= alpha;
          o[mt][nt][2 * r + 1] *= alpha;
        }
      }
      c_to_a<E, kBlockN>(pa[mt], sc[mt]);
    }
    gemm_rs_m<E, kMT, kDSlice, kBlockN, kStride>(o, pa, sV + dsl * kDSlice, lane);
    block_sync();
  }

  uint16_t* out_ptr = static_cast<uint16_t*>(p.out.ptr);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = l_run[mt][r];
      l += shfl_xor(l, 1);
      l += shfl_xor(l, 2);
      const int row = warp_row0 + mt * 16 + g + r * 8;
      if (row < m_valid) {
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const int64_t qrow = row0 + q0 + row;
        uint16_t* dst = out_ptr + p.out.offset(qrow, h) + dsl * kDSlice;
#pragma unroll
        for (int nt = 0; nt < kDSlice / 8; ++nt) {
          store_u32(dst + nt * 8 + 2 * tq, pack2<E>(o[mt][nt][2 * r] * inv, o[mt][nt][2 * r + 1] * inv));
        }
        if (dsl == 0 && tq == 0) {
          p.lse[static_cast<int64_t>(h) * p.total_q + qrow] = l > 0.f ? (m_run[mt][r] + fast_log2(l)) * kLn2 : kNegInf;
        }
      }
    }
  }
}

}  // namespace dkv
