// Backward kernels.
//
//   dkv_bwd_prep_kernel   dsum = rowsum(dout * out), lse_log2 = lse * log2(e)        (H, T) fp32
//   dkv_dq_kernel         query-parallel, the forward's two-region walk: dQ accumulated in
//                         registers over every visible key, written directly (no atomics)
//   dkv_dkdv_kernel       key-parallel, persistent with a dynamic work counter: an item is a key
//                         tile (BLOCK_N keys of one kv head) and the query tiles that read it, for
//                         every query head of the GQA group; dK/dV accumulate in registers
//   dkv_convert_kernel    casts the fp32 context accumulators to the input dtype, once
//   dkv_convert_dq_kernel scales and casts the fp32 dQ workspace of the sm_90 dK/dV kernel that
//                         computes dQ too (dkv_bwd_sm90.cuh), once
//
// Context (shared prompt) keys are read by the N responses of the group. Default mode: one item per
// (reader chunk, context tile), a chunk being consecutive responses (BwdParams::chunk_end; one
// response where the prompt is longer than 32768 keys), partial dK/dV added with fp32 atomics into a
// workspace, then the convert kernel casts once; response keys (read by their own segment only) are
// written directly.
// Deterministic mode: one item per key tile walks the owner segment AND every reader segment of the
// region, so each key row has one writer and no atomics are needed.
#pragma once

#include "dkv_fwd.cuh"

namespace dkv {

// ----------------------------------------------------------------------------------------------
// dsum = rowsum(dout * out) and lse_log2 = lse * log2(e) of every (row, head) pair. Eight lanes take a
// pair (16 bytes of out and of dout per lane and step), 32 pairs a block, in (head, row) order: a
// block's dsum / lse_log2 writes are one contiguous run. (One warp a pair, its lanes half idle at
// d = 128, took 0.41 ms at 33K rows x 32 heads on an H200.)
constexpr int kPrepLanes = 8, kPrepPairs = 256 / kPrepLanes;

template <class E>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_bwd_prep_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  const int tid = thread_idx(), sub = tid % kPrepLanes;
  const int64_t i = static_cast<int64_t>(block_idx_x()) * kPrepPairs + tid / kPrepLanes;  // h * total_q + t
  const bool valid = i < static_cast<int64_t>(p.total_q) * p.nheads;
  float acc = 0.f;
  if (valid) {
    const int h = static_cast<int>(i / p.total_q), t = static_cast<int>(i % p.total_q);
    const uint16_t* o = static_cast<const uint16_t*>(p.out.ptr) + p.out.offset(t, h);
    const uint16_t* d = static_cast<const uint16_t*>(p.dout.ptr) + p.dout.offset(t, h);
    for (int c = sub; c < p.head_dim / 8; c += kPrepLanes) {
      uint32_t a[4], b[4];
      load_16B(a, o + c * 8);
      load_16B(b, d + c * 8);
#pragma unroll
      for (int j = 0; j < 4; ++j) acc += lo_f<E>(a[j]) * lo_f<E>(b[j]) + hi_f<E>(a[j]) * hi_f<E>(b[j]);
    }
  }
#pragma unroll
  for (int m = kPrepLanes / 2; m >= 1; m >>= 1) acc += shfl_xor(acc, m);  // within the pair's lanes
  if (valid && sub == 0) {
    p.dsum[i] = acc;
    p.lse_log2[i] = p.lse[i] * kLog2e;
  }
}

// ----------------------------------------------------------------------------------------------
// dq: one block per (query tile, head), same grid and two-region walk as the forward.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kDSplit_, int kMTiles_>
struct DqTraits : FwdTraits<kHeadDim_, kBlockM_, kBlockN_, kDSplit_, kMTiles_> {
  using Base = FwdTraits<kHeadDim_, kBlockM_, kBlockN_, kDSplit_, kMTiles_>;
  static constexpr int kSmemBytes = (2 * kBlockM_ + 4 * kBlockN_) * Base::kStride * 2;
};

template <class E, class K>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(K::kThreads) dkv_dq_kernel(const DKV_GRID_CONSTANT BwdParams p) {
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
  const int warp_row0 = rw * 16 * kMT;

  uint16_t* sQ = reinterpret_cast<uint16_t*>(dynamic_smem());
  uint16_t* sdO = sQ + kBlockM * kStride;
  uint16_t* sK0 = sdO + kBlockM * kStride;
  uint16_t* sV0 = sK0 + 2 * kBlockN * kStride;

  const TwoRegionWalk walk = make_walk<kBlockN>(q0, m_valid, ctx_len, ctx_row0, row0, W);
  const int n_tiles = walk.n_ctx_tiles + walk.n_own_tiles;
  const int qpos_lo = ctx_len + q0, qpos_hi = qpos_lo + m_valid - 1;

  auto issue_kv = [&](int ti) {  // tile ti into buffer ti & 1
    const int b = ti & 1;
    load_kv_tile_async<K>(sK0 + b * kBlockN * kStride, sV0 + b * kBlockN * kStride, walk.tile<kBlockN>(ti), p, hk, tid);
  };

  load_head_rows_async<kBlockM, K::kHeadDim, K::kThreads>(sQ, p.q, row0 + q0, h, m_valid, tid);
  load_head_rows_async<kBlockM, K::kHeadDim, K::kThreads>(sdO, p.dout, row0 + q0, h, m_valid, tid);
  issue_kv(0);
  cp_async_commit();

  // Row statistics of rows g and g + 8 of each of this warp's m-tiles.
  float lse2[kMT][2], dsum[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + g + r * 8;
      const int64_t i = static_cast<int64_t>(h) * p.total_q + row0 + q0 + row;
      lse2[mt][r] = row < m_valid ? p.lse_log2[i] : 0.f;
      dsum[mt][r] = row < m_valid ? p.dsum[i] : 0.f;
    }
  }

  const ScoreFn score = make_score_fn(p.scale, p.softcap);
  float dq[kMT][kDSlice / 8][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) zero(dq[mt]);

  for (int ti = 0; ti < n_tiles; ++ti) {
    if (ti + 1 < n_tiles) issue_kv(ti + 1);
    cp_async_commit();
    cp_async_wait<1>();
    block_sync();

    const KvTile kt = walk.tile<kBlockN>(ti);
    const uint16_t* sK = sK0 + (ti & 1) * kBlockN * kStride;
    const uint16_t* sV = sV0 + (ti & 1) * kBlockN * kStride;

    float sc[kMT][kBlockN / 8][4], dp[kMT][kBlockN / 8][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
      zero(sc[mt]);
      zero(dp[mt]);
    }
    gemm_ss_m<E, kMT, kBlockN, K::kHeadDim, kStride>(sc, sQ + warp_row0 * kStride, sK, lane);
    gemm_ss_m<E, kMT, kBlockN, K::kHeadDim, kStride>(dp, sdO + warp_row0 * kStride, sV, lane);

    const bool need_mask =
        kt.valid < kBlockN || kt.kpos0 + kt.valid - 1 > qpos_lo || qpos_hi - kt.kpos0 >= W;
    uint32_t dsa[kMT][kBlockN / 16][4];
    with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1;
            bool masked = false;
            if constexpr (decltype(mask)::value) {
              const int col = nt * 8 + 2 * tq + (i & 1);
              const int qpos = qpos_lo + warp_row0 + mt * 16 + g + r * 8;
              const int kpos = kt.kpos0 + col;
              masked = col >= kt.valid || kpos > qpos || qpos - kpos >= W;
            }
            const float raw = sc[mt][nt][i];
            float ds;
            if constexpr (decltype(cap)::value) {
              const float th = tanh_f(raw * score.cap_inv_scale);
              ds = fast_exp2(score.cap_log2 * th - lse2[mt][r]) * (dp[mt][nt][i] - dsum[mt][r]) * (1.f - th * th);
            } else {
              ds = fast_exp2(score.plain(raw) - lse2[mt][r]) * (dp[mt][nt][i] - dsum[mt][r]);
            }
            dp[mt][nt][i] = masked ? 0.f : ds;
          }
        }
      }
    });
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) c_to_a<E, kBlockN>(dsa[mt], dp[mt]);
    gemm_rs_m<E, kMT, kDSlice, kBlockN, kStride>(dq, dsa, sK + dsl * kDSlice, lane);
    block_sync();
  }

  uint16_t* dq_ptr = static_cast<uint16_t*>(p.dq.ptr);
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mt * 16 + g + r * 8;
      if (row < m_valid) {
        uint16_t* dst = dq_ptr + p.dq.offset(row0 + q0 + row, h) + dsl * kDSlice;
#pragma unroll
        for (int nt = 0; nt < kDSlice / 8; ++nt) {
          store_u32(dst + nt * 8 + 2 * tq, pack2<E>(dq[mt][nt][2 * r] * p.scale, dq[mt][nt][2 * r + 1] * p.scale));
        }
      }
    }
  }
}

// ----------------------------------------------------------------------------------------------
// dkdv
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kDSplit_>
struct DkdvTraits {
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kDSplit = kDSplit_;
  static constexpr int kKeyWarps = kBlockN / 16;
  static constexpr int kWarps = kKeyWarps * kDSplit;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kDSlice = kHeadDim / kDSplit;
  static constexpr int kStride = kHeadDim + 8;
  static constexpr int kTileElems = kStride;  // per row
  // K, V tiles; Q, dO double-buffered; lse_log2, dsum double-buffered; the item slot.
  static constexpr int kSmemBytes = (2 * kBlockN + 4 * kBlockM) * kStride * 2 + 4 * kBlockM * 4 + 16;
  static_assert(kDSlice % 16 == 0, "head-dim slice must be a multiple of 16");
};

enum OutMode : int { kOutDirect = 0, kOutAtomic = 1, kOutPerRow = 2 };

// A key tile and who reads it.
struct KvItem {
  int key_row0;   // first row of the tile in its tensor (k or k_ctx)
  int nk;         // rows of the tile
  bool ctx_tensor;  // keys are rows of k_ctx / v_ctx (separate context)
  int owner;      // segment whose own keys these are (-1: none)
  int rd_begin, rd_end;  // reader segments that see the tile as context
  int out_mode;
  int hk;
};

// How one segment r sees the key tile: query rows [i_lo, i_hi) of r can see some key of it.
struct SegView {
  int row0;   // first packed row of segment r
  int i_lo, i_hi, n_tiles;
  int ctx_len;
  int kpos0;  // logical position of key 0 of the tile for r
  int klo, khi;  // keys of the tile that belong to r's view (context range restriction)
};

template <int kBlockM>
DKV_DEV bool make_view(const BwdParams& p, int r, bool own, const KvItem& it, SegView& v) {
  const int row0 = p.layout.cu_seqlens[r];
  const int n = p.layout.cu_seqlens[r + 1] - row0;
  const int c = p.layout.seg_ctx_len[r];
  const int kpos0 = own ? c + (it.key_row0 - row0) : it.key_row0 - p.layout.seg_ctx_start[r];
  const int klo = own ? 0 : imax(0, -kpos0);
  const int khi = own ? it.nk : imin(it.nk, c - kpos0);
  if (khi <= klo || n <= 0) return false;
  const int kfirst = kpos0 + klo;
  const int64_t klast = kpos0 + khi - 1;
  // query i (position c + i) sees some key iff c + i >= kfirst and c + i - klast < W.
  const int i_lo = imax(0, kfirst - c);
  const int64_t hi = klast + static_cast<int64_t>(p.window) - c;
  const int i_hi = static_cast<int>(hi < n ? hi : n);
  if (i_hi <= i_lo) return false;
  v.row0 = row0;
  v.i_lo = i_lo;
  v.i_hi = i_hi;
  v.n_tiles = ceil_div(i_hi - i_lo, kBlockM);
  v.ctx_len = c;
  v.kpos0 = kpos0;
  v.klo = klo;
  v.khi = khi;
  return true;
}

// Walks (reader segments, then the owner segment) x (query heads of the group) x (query tiles).
template <int kBlockM>
struct ReaderCursor {
  int stage;  // 0: readers, 1: owner, 2: done
  int r;      // current segment
  int hl;     // query head within the group
  int t;      // tile within the view
  SegView v;

  // Moves to the first non-empty view at or after (stage, r). The readers come first: the blocks on
  // neighbouring key tiles of one group then sweep the same response query tiles at about the same
  // time (their Q / dO loads and dQ additions meet in L2), and only then their own, unequal, spans.
  DKV_DEV bool seek(const BwdParams& p, const KvItem& it) {
    for (;;) {
      if (stage == 0) {
        if (r < it.rd_end) {
          if (make_view<kBlockM>(p, r, false, it, v)) return true;
          ++r;
          continue;
        }
        stage = 1;
        continue;
      }
      if (stage == 1) {
        if (it.owner >= 0 && make_view<kBlockM>(p, it.owner, true, it, v)) return true;
        stage = 2;
      }
      return false;
    }
  }
  DKV_DEV bool begin(const BwdParams& p, const KvItem& it) {
    stage = 0;
    r = it.rd_begin;
    hl = 0;
    t = 0;
    return seek(p, it);
  }
  DKV_DEV bool advance(const BwdParams& p, const KvItem& it, int rep) {
    if (++t < v.n_tiles) return true;
    t = 0;
    if (++hl < rep) return true;
    hl = 0;
    if (stage == 0) {
      ++r;
    } else {
      stage = 2;
    }
    return seek(p, it);
  }
};

// Everything the compute step needs to know about a loaded query tile.
struct QTileDesc {
  int qpos0;    // logical position of the tile's first query
  int m_valid;  // query rows of the tile
  int kpos0, klo, khi;
};

// The query tile a reader cursor points at: its description, first packed row and query head.
struct ReaderTile {
  QTileDesc desc;
  int row, hq;
};

template <int kBlockM>
DKV_DEV ReaderTile reader_tile(const ReaderCursor<kBlockM>& cur, const KvItem& it, int rep) {
  const int i0 = cur.v.i_lo + cur.t * kBlockM;
  ReaderTile rt;
  rt.desc.m_valid = imin(kBlockM, cur.v.i_hi - i0);
  rt.desc.qpos0 = cur.v.ctx_len + i0;
  rt.desc.kpos0 = cur.v.kpos0;
  rt.desc.klo = cur.v.klo;
  rt.desc.khi = cur.v.khi;
  rt.row = cur.v.row0 + i0;
  rt.hq = it.hk * rep + cur.hl;
  return rt;
}

// The next work item of a persistent dK/dV block, the same for every thread that meets at `sync` (the
// whole block by default; thread 0 fetches it; s_item: a shared slot).
template <class Sync>
DKV_DEV int next_item(const BwdParams& p, int* s_item, Sync&& sync) {
  if (thread_idx() == 0) *s_item = atomic_add_i32(p.work_counter, 1);
  sync();
  const int item = *s_item;
  sync();
  return item;
}
DKV_DEV int next_item(const BwdParams& p, int* s_item) {
  return next_item(p, s_item, [] { block_sync(); });
}

DKV_DEV int segment_of_row(const BwdParams& p, int row) {
  // Largest s with cu_seqlens[s] <= row (empty segments share a start; take the last, non-empty one).
  return find_bucket(p.layout.cu_seqlens, p.layout.num_segments, row);
}

// Context region containing key row `row` of k (packed layout), or -1.
DKV_DEV int region_of_row(const BwdParams& p, int row) {
  const int C = p.layout.num_ctx;
  if (C == 0 || row < p.layout.ctx_key_start[0]) return -1;
  int lo = 0, hi = C;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (p.layout.ctx_key_start[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return row < p.layout.ctx_key_start[lo] + p.layout.ctx_key_len[lo] ? lo : -1;
}

// Segments [begin, end) holding the reader query rows of region c.
DKV_DEV void reader_segments(const BwdParams& p, int c, int& begin, int& end) {
  const int a = p.layout.ctx_reader_start[c], b = p.layout.ctx_reader_end[c];
  if (b <= a) {
    begin = end = 0;
    return;
  }
  begin = segment_of_row(p, a);
  end = segment_of_row(p, b - 1) + 1;
}

template <int kBlockN>
DKV_DEV KvItem decode_item(const BwdParams& p, int item) {
  KvItem it;
  int tile_item;
  if (p.kv_head_major) {  // every tile of kv head 0, then of head 1, ...
    const int n_tiles = p.kv_item_prefix[p.num_item_groups];
    it.hk = item / n_tiles;
    tile_item = item - it.hk * n_tiles;
  } else {  // a tile's kv heads side by side
    it.hk = item % p.nheads_kv;
    tile_item = item / p.nheads_kv;
  }
  const int grp = find_bucket(p.kv_item_prefix, p.num_item_groups, tile_item);
  const int li = tile_item - p.kv_item_prefix[grp];
  const int S = p.layout.num_segments;
  it.rd_begin = it.rd_end = 0;
  it.owner = -1;
  if (grp >= S) {  // deterministic, separate context: tile of region c, walked by all its readers
    const int c = grp - S;
    const int j0 = li * kBlockN;
    it.key_row0 = p.layout.ctx_key_start[c] + j0;
    it.nk = imin(kBlockN, p.layout.ctx_key_len[c] - j0);
    it.ctx_tensor = true;
    reader_segments(p, c, it.rd_begin, it.rd_end);
    it.out_mode = kOutDirect;
    return it;
  }
  const int s = grp;
  const int row0 = p.layout.cu_seqlens[s];
  const int n = p.layout.cu_seqlens[s + 1] - row0;
  const int c_len = p.layout.seg_ctx_len[s];
  const int rd_end = p.deterministic ? s : p.chunk_end[s];
  const int n_ctx_tiles = rd_end > s ? ceil_div(c_len, kBlockN) : 0;
  if (li < n_ctx_tiles) {  // context tile of s's reader chunk, read by its segments alone: atomic partial sums
    const int j0 = li * kBlockN;
    it.key_row0 = p.layout.seg_ctx_start[s] + j0;
    it.nk = imin(kBlockN, c_len - j0);
    it.ctx_tensor = p.ctx_separate;
    it.rd_begin = s;
    it.rd_end = rd_end;
    it.out_mode = kOutAtomic;
    return it;
  }
  const int i0 = (li - n_ctx_tiles) * kBlockN;
  it.key_row0 = row0 + i0;
  it.nk = imin(kBlockN, n - i0);
  it.ctx_tensor = false;
  it.owner = s;
  if (p.ctx_separate) {
    it.out_mode = kOutDirect;
  } else if (p.deterministic) {
    const int c = region_of_row(p, it.key_row0);
    if (c >= 0) reader_segments(p, c, it.rd_begin, it.rd_end);
    it.out_mode = kOutDirect;
  } else {
    it.out_mode = kOutPerRow;
  }
  return it;
}

// Writes the dK / dV of one key row of an item: `pairs(store)` calls store(col, dk0, dk1, dv0, dv1) for
// column pairs (col, col + 1), and store adds them to the fp32 context workspace (a context row read by
// several sequences, default mode) or writes them in the input dtype to dk / dv (dk_ctx / dv_ctx). dK
// is scaled by the softmax scale on the way. The choice is made once per row, outside the pairs loop.
template <class E, class Pairs>
DKV_DEV void store_dkdv_row(const BwdParams& p, const KvItem& it, int row, Pairs&& pairs) {
  const float scale = p.scale;
  if (it.out_mode == kOutAtomic || (it.out_mode == kOutPerRow && region_of_row(p, row) >= 0)) {
    const int64_t base = (static_cast<int64_t>(row) * p.nheads_kv + it.hk) * p.head_dim;
    float* dka = p.dk_accum + base;
    float* dva = p.dv_accum + base;
    pairs([&](int col, float dk0, float dk1, float dv0, float dv1) {
      atomic_add_f32(dka + col, dk0 * scale);
      atomic_add_f32(dka + col + 1, dk1 * scale);
      atomic_add_f32(dva + col, dv0);
      atomic_add_f32(dva + col + 1, dv1);
    });
  } else {
    const TensorRef dkr = it.ctx_tensor ? p.dk_ctx : p.dk;
    const TensorRef dvr = it.ctx_tensor ? p.dv_ctx : p.dv;
    uint16_t* dkp = static_cast<uint16_t*>(dkr.ptr) + dkr.offset(row, it.hk);
    uint16_t* dvp = static_cast<uint16_t*>(dvr.ptr) + dvr.offset(row, it.hk);
    pairs([&](int col, float dk0, float dk1, float dv0, float dv1) {
      store_u32(dkp + col, pack2<E>(dk0 * scale, dk1 * scale));
      store_u32(dvp + col, pack2<E>(dv0, dv1));
    });
  }
}

// One gradient of one key row alone (dK if is_dk, else dV), the same destinations as store_dkdv_row:
// `pairs(store)` calls store(col, g0, g1). (store_dkdv_row keeps its own single pass over both: the
// d = 128 wgmma kernel spills more registers when its epilogue is written through this one.)
template <class E, class Pairs>
DKV_DEV void store_grad_row(const BwdParams& p, const KvItem& it, int row, bool is_dk, Pairs&& pairs) {
  const float scale = is_dk ? p.scale : 1.f;
  if (it.out_mode == kOutAtomic || (it.out_mode == kOutPerRow && region_of_row(p, row) >= 0)) {
    float* acc = (is_dk ? p.dk_accum : p.dv_accum) + (static_cast<int64_t>(row) * p.nheads_kv + it.hk) * p.head_dim;
    pairs([&](int col, float g0, float g1) {
      atomic_add_f32(acc + col, g0 * scale);
      atomic_add_f32(acc + col + 1, g1 * scale);
    });
  } else {
    const TensorRef r = is_dk ? (it.ctx_tensor ? p.dk_ctx : p.dk) : (it.ctx_tensor ? p.dv_ctx : p.dv);
    uint16_t* out = static_cast<uint16_t*>(r.ptr) + r.offset(row, it.hk);
    pairs([&](int col, float g0, float g1) { store_u32(out + col, pack2<E>(g0 * scale, g1 * scale)); });
  }
}

template <class E, class K>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(K::kThreads) dkv_dkdv_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  constexpr int kBlockM = K::kBlockM, kBlockN = K::kBlockN, kStride = K::kStride, kDSlice = K::kDSlice;
  const int tid = thread_idx(), lane = tid & 31, warp = tid >> 5;
  const int kw = warp % K::kKeyWarps, dsl = warp / K::kKeyWarps;
  const int g = lane >> 2, tq = lane & 3;
  const int rep = p.nheads / p.nheads_kv;
  const int W = p.window;
  const int total_items = p.kv_item_prefix[p.num_item_groups] * p.nheads_kv;

  uint16_t* sK = reinterpret_cast<uint16_t*>(dynamic_smem());
  uint16_t* sV = sK + kBlockN * kStride;
  uint16_t* sQ0 = sV + kBlockN * kStride;
  uint16_t* sdO0 = sQ0 + 2 * kBlockM * kStride;
  float* sL0 = reinterpret_cast<float*>(sdO0 + 2 * kBlockM * kStride);
  float* sD0 = sL0 + 2 * kBlockM;
  int* s_item = reinterpret_cast<int*>(sD0 + 2 * kBlockM);

  const ScoreFn score = make_score_fn(p.scale, p.softcap);

  for (;;) {
    const int item = next_item(p, s_item);
    if (item >= total_items) break;
    const KvItem it = decode_item<kBlockN>(p, item);
    load_head_rows_async<kBlockN, K::kHeadDim, K::kThreads>(sK, it.ctx_tensor ? p.k_ctx : p.k, it.key_row0, it.hk, it.nk, tid);
    load_head_rows_async<kBlockN, K::kHeadDim, K::kThreads>(sV, it.ctx_tensor ? p.v_ctx : p.v, it.key_row0, it.hk, it.nk, tid);

    auto issue_q = [&](const ReaderCursor<kBlockM>& cur, int b) -> QTileDesc {
      const ReaderTile rt = reader_tile(cur, it, rep);
      const int m = rt.desc.m_valid;
      load_head_rows_async<kBlockM, K::kHeadDim, K::kThreads>(sQ0 + b * kBlockM * kStride, p.q, rt.row, rt.hq, m, tid);
      load_head_rows_async<kBlockM, K::kHeadDim, K::kThreads>(sdO0 + b * kBlockM * kStride, p.dout, rt.row, rt.hq, m,
                                                              tid);
      const int64_t si = static_cast<int64_t>(rt.hq) * p.total_q + rt.row;
      load_vec_async<kBlockM, K::kThreads>(sL0 + b * kBlockM, p.lse_log2 + si, m, p.lse_log2, tid);
      load_vec_async<kBlockM, K::kThreads>(sD0 + b * kBlockM, p.dsum + si, m, p.dsum, tid);
      return rt.desc;
    };

    float dk[kDSlice / 8][4], dv[kDSlice / 8][4];
    zero(dk);
    zero(dv);

    ReaderCursor<kBlockM> cur;
    bool have = cur.begin(p, it);
    QTileDesc desc{};
    if (have) desc = issue_q(cur, 0);
    cp_async_commit();
    int b = 0;
    while (have) {
      ReaderCursor<kBlockM> nxt = cur;
      const bool have_next = nxt.advance(p, it, rep);
      QTileDesc next_desc{};
      if (have_next) next_desc = issue_q(nxt, b ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
      block_sync();

      const uint16_t* sQ = sQ0 + b * kBlockM * kStride;
      const uint16_t* sdO = sdO0 + b * kBlockM * kStride;
      const float* sL = sL0 + b * kBlockM;
      const float* sD = sD0 + b * kBlockM;

      // S^T (keys x queries) = K Q^T and dP^T = V dO^T for this warp's 16 keys.
      float st[kBlockM / 8][4], dpt[kBlockM / 8][4];
      zero(st);
      zero(dpt);
      gemm_ss<E, kBlockM, K::kHeadDim, kStride>(st, sK + kw * 16 * kStride, sQ, lane);
      gemm_ss<E, kBlockM, K::kHeadDim, kStride>(dpt, sV + kw * 16 * kStride, sdO, lane);

      const int kpos_first = desc.kpos0 + desc.klo, kpos_last = desc.kpos0 + desc.khi - 1;
      const bool need_mask = desc.m_valid < kBlockM || desc.klo > 0 || desc.khi < kBlockN ||
                             kpos_last > desc.qpos0 || desc.qpos0 + desc.m_valid - 1 - kpos_first >= W;
      with_score_mode(score.softcap, need_mask, [&](auto cap, auto mask) {
#pragma unroll
        for (int nt = 0; nt < kBlockM / 8; ++nt) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int col = nt * 8 + 2 * tq + (i & 1);
            const int key = kw * 16 + g + (i >> 1) * 8;
            bool masked = false;
            if constexpr (decltype(mask)::value) {
              const int qpos = desc.qpos0 + col;
              const int kpos = desc.kpos0 + key;
              masked = col >= desc.m_valid || key < desc.klo || key >= desc.khi || kpos > qpos || qpos - kpos >= W;
            }
            const float raw = st[nt][i];
            float pr, ds;
            if constexpr (decltype(cap)::value) {
              const float th = tanh_f(raw * score.cap_inv_scale);
              pr = fast_exp2(score.cap_log2 * th - sL[col]);
              ds = pr * (dpt[nt][i] - sD[col]) * (1.f - th * th);
            } else {
              pr = fast_exp2(score.plain(raw) - sL[col]);
              ds = pr * (dpt[nt][i] - sD[col]);
            }
            st[nt][i] = masked ? 0.f : pr;
            dpt[nt][i] = masked ? 0.f : ds;
          }
        }
      });
      uint32_t pa[kBlockM / 16][4], dsa[kBlockM / 16][4];
      c_to_a<E, kBlockM>(pa, st);
      c_to_a<E, kBlockM>(dsa, dpt);
      gemm_rs<E, kDSlice, kBlockM, kStride>(dv, pa, sdO + dsl * kDSlice, lane);
      gemm_rs<E, kDSlice, kBlockM, kStride>(dk, dsa, sQ + dsl * kDSlice, lane);
      block_sync();

      cur = nxt;
      have = have_next;
      desc = next_desc;
      b ^= 1;
    }
    cp_async_wait<0>();  // an item with no reader still has its K/V load in flight

    // Write this warp's 16 keys x kDSlice columns of dK (scaled) and dV.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = kw * 16 + g + r * 8;
      if (key < it.nk) {
        const int col0 = dsl * kDSlice + 2 * tq;
        store_dkdv_row<E>(p, it, it.key_row0 + key, [&](auto&& store) {
#pragma unroll
          for (int nt = 0; nt < kDSlice / 8; ++nt)
            store(col0 + nt * 8, dk[nt][2 * r], dk[nt][2 * r + 1], dv[nt][2 * r], dv[nt][2 * r + 1]);
        });
      }
    }
    block_sync();  // shared K/V are reloaded by the next item
  }
}

// ----------------------------------------------------------------------------------------------
// Casts the fp32 context accumulators once. Separate context: every row of dk_ctx / dv_ctx.
// Packed layout: the rows of k that lie in a context region (the others were written directly).
template <class E>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_convert_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  const int row = block_idx_x();
  if (row >= p.accum_rows) return;
  if (!p.ctx_separate && region_of_row(p, row) < 0) return;
  const TensorRef dkr = p.ctx_separate ? p.dk_ctx : p.dk;
  const TensorRef dvr = p.ctx_separate ? p.dv_ctx : p.dv;
  const int per_row = p.nheads_kv * p.head_dim;
  const float* dka = p.dk_accum + static_cast<int64_t>(row) * per_row;
  const float* dva = p.dv_accum + static_cast<int64_t>(row) * per_row;
  for (int e = 2 * thread_idx(); e < per_row; e += 2 * 256) {
    const int hk = e / p.head_dim, col = e % p.head_dim;
    uint16_t* dk = static_cast<uint16_t*>(dkr.ptr) + dkr.offset(row, hk) + col;
    uint16_t* dv = static_cast<uint16_t*>(dvr.ptr) + dvr.offset(row, hk) + col;
    store_u32(dk, pack2<E>(dka[e], dka[e + 1]));
    store_u32(dv, pack2<E>(dva[e], dva[e + 1]));
  }
}

// ----------------------------------------------------------------------------------------------
// dQ of the fused wgmma dK/dV kernel: dq (total_q, H, d) = scale * the fp32 workspace dq_accum
// (H, d / 64, total_q, kDqAccumPitch), cast once. A thread takes 4 columns of one (row, head) pair, in
// dq's order (its writes one run); it reads them as one 16-byte load. (Before: a scale pass over the
// whole padded workspace, then a strided cast copy: two passes and twice the bytes.)
constexpr int kDqConvertCols = 4;

template <class E>
DKV_GLOBAL void DKV_LAUNCH_BOUNDS(256) dkv_convert_dq_kernel(const DKV_GRID_CONSTANT BwdParams p) {
  const int64_t i = static_cast<int64_t>(block_idx_x()) * 256 + thread_idx();
  const int per_pair = p.head_dim / kDqConvertCols;
  if (i >= static_cast<int64_t>(p.total_q) * p.nheads * per_pair) return;
  const int c4 = static_cast<int>(i % per_pair);
  const int64_t pair = i / per_pair;  // t * H + h
  const int h = static_cast<int>(pair % p.nheads);
  const int t = static_cast<int>(pair / p.nheads);
  const int col = kDqConvertCols * c4, part = col / 64;
  const int64_t run = (static_cast<int64_t>(h) * (p.head_dim / 64) + part) * p.total_q + t;
  float a[4];
  const int rot = p.late_dq_add ? 8 * (t & 3) : 0;  // (FusedDq::store_rows<true>) packed row t's rotation
  const int pitch = p.late_dq_add ? kDqAccumPitchLate : kDqAccumPitch;
  load_f32x4(a, p.dq_accum + run * pitch + ((col + rot) & 63));
  uint16_t* dst = static_cast<uint16_t*>(p.dq.ptr) + p.dq.offset(t, h) + col;
  store_u32(dst, pack2<E>(a[0] * p.scale, a[1] * p.scale));
  store_u32(dst + 2, pack2<E>(a[2] * p.scale, a[3] * p.scale));
}

}  // namespace dkv
