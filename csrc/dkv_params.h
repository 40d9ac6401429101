// Plain parameter structs shared by the torch binding and the kernels (no torch, no CUDA headers),
// and the tile sizes of every kernel, in one place so that the binding's work decomposition
// (tile prefix sums) always matches the kernels.
#pragma once

#include <cstdint>

namespace dkv {

// A (rows, heads, headdim) tensor with a contiguous last dimension; strides in elements.
struct TensorRef {
  void* ptr = nullptr;
  int64_t row_stride = 0;
  int64_t head_stride = 0;

  // Element offset of (row, head, 0).
  constexpr int64_t offset(int64_t row, int64_t head) const { return row * row_stride + head * head_stride; }
};

// The int32 metadata of the op (see dualkv.core.reference.AttnMeta), device pointers.
struct LayoutRef {
  const int* cu_seqlens = nullptr;      // (S+1,)
  const int* seg_ctx_start = nullptr;   // (S,) first context row of each segment (in k_ctx, or in k)
  const int* seg_ctx_len = nullptr;     // (S,)
  const int* ctx_key_start = nullptr;   // (C,) context regions, sorted, disjoint
  const int* ctx_key_len = nullptr;     // (C,)
  const int* ctx_reader_start = nullptr;  // (C,) contiguous query rows that read region c as context
  const int* ctx_reader_end = nullptr;    // (C,)
  int num_segments = 0;
  int num_ctx = 0;
};

struct AttnArgs {
  TensorRef q, k, v;
  TensorRef k_ctx, v_ctx;  // == k, v for the packed layout (context keys are rows of k, v)
  bool ctx_separate = false;
  LayoutRef layout;
  int total_q = 0;    // rows of q, k, v
  int total_ctx = 0;  // rows of k_ctx (== total_q for the packed layout)
  int nheads = 0;
  int nheads_kv = 0;
  int head_dim = 0;
  float scale = 1.f;
  float softcap = 0.f;  // 0: none
  int window = 0;       // kNoWindow: none
};

constexpr int kNoWindow = 1 << 30;

// A bulk-tensor-copy (TMA) descriptor: on a device the driver's 128-byte CUtensorMap, built by the
// binding, of a 3-D view (head-dim columns, heads, rows) of q, k, v or dout, or of a flat fp32 vector
// (lse_log2, dsum); in the CPU emulation the same view's fields (dkv_emulation.h, tma_load_box /
// tma_load_vec). Opaque to the kernels, which only pass its address.
struct alignas(64) TmaDesc {
  uint64_t words[16] = {};
};

// (the merged key walk) rows of the boxes of tma_k16 / tma_v16 and the context's: the walk starts so that
// the context ends a multiple of these rows into its tile (dkv_fwd.cuh, TwoRegionWalk).
constexpr int kMergeBoxRows = 16;

struct FwdParams : AttnArgs {
  // (DUALKV_CUDA_WGMMA=3) boxes of 64 columns x 128 rows of q, k, v, k_ctx, v_ctx.
  TmaDesc tma_q, tma_k, tma_v, tma_k_ctx, tma_v_ctx;
  // (merge_walk) k, v, k_ctx, v_ctx in boxes of kMergeBoxRows (16) rows: the key tile where the context ends and the
  // segment's own keys begin is loaded as 16-row pieces of both (dkv_fwd.cuh, TwoRegionWalk).
  TmaDesc tma_k16, tma_v16, tma_k_ctx16, tma_v_ctx16;
  int merge_walk = 0;                // (DUALKV_CUDA_FWD_MERGE) run the 176-key TMA forward's merged-walk kernel
  TensorRef out;
  float* lse = nullptr;              // (H, total_q)
  const int* q_tile_prefix = nullptr;  // (S+1,) prefix of ceil(len_s / kBlockM), segments in q_seg_order
  const int* q_seg_order = nullptr;    // (S,) rank -> segment, or null: the segments' own order
  int grid_tiles = 0;                // upper bound of the number of query tiles
  int* work_counter = nullptr;       // (DUALKV_CUDA_FWD_PERSISTENT) the persistent forward's tile counter (zeroed)
};

// Row pitch (floats) of BwdParams::dq_accum: 64 columns and 8 of padding; a warpgroup's staged rows
// in shared memory have the same pitch, so a tile's rows copy to the workspace as one run. The
// staging's 8-byte stores put 4 rows in a half-warp: at 72 their banks start 8 words apart, no
// conflict (at 68, 4 apart: 2-way; 72 made the ws dK/dV kernel with dQ inside 4-6% faster on an H200,
// benchmarks/results/raw/profile_h200_pitch72.log).
constexpr int kDqAccumPitch = 72;
// The late dQ add's pitch (DkdvSm90Ws::kLateAdd, BwdParams::late_dq_add): two staging buffers fit only
// unpadded, and packed row t's columns are rotated by 8 (t % 4) instead (FusedDq::store_rows<true>).
constexpr int kDqAccumPitchLate = 64;

struct BwdParams : AttnArgs {
  TensorRef out, dout;
  const float* lse = nullptr;  // (H, total_q) natural log
  float* lse_log2 = nullptr;   // (H, total_q) workspace: lse * log2(e)
  float* dsum = nullptr;       // (H, total_q) workspace: rowsum(dout * out)
  TensorRef dq, dk, dv, dk_ctx, dv_ctx;
  float* dk_accum = nullptr;   // (ctx rows, Hkv, d) fp32 context-gradient accumulators
  float* dv_accum = nullptr;
  float* dq_accum = nullptr;   // (H, d / 64, total_q, kDqAccumPitch) fp32 dQ workspace of the fused
                               // wgmma dK/dV kernel (zeroed; columns 64 .. pitch - 1 are padding)
  const int* q_tile_prefix = nullptr;   // dq kernel: (S+1,) prefix of ceil(len_s / kBlockM), segments in q_seg_order
  const int* q_seg_order = nullptr;     // (S,) rank -> segment, or null: the segments' own order
  int grid_tiles = 0;
  const int* kv_item_prefix = nullptr;  // dkdv kernel: prefix over the item groups
  // dkdv kernel, default (atomic) mode: (S,) the end of segment s's reader chunk. chunk_end[s] > s: s
  // leads a chunk, and its context tiles are walked by segments s .. chunk_end[s] - 1 (consecutive,
  // reading the same context); chunk_end[s] == s: s is inside another segment's chunk and has no
  // context items of its own.
  const int* chunk_end = nullptr;
  int num_item_groups = 0;              // S, or S + C (deterministic, separate context)
  bool kv_head_major = false;           // decode_item: every tile of kv head 0, then head 1, ... (else a tile's
                                        // kv heads side by side); DUALKV_CUDA_BWD_ITEM_ORDER
  int* work_counter = nullptr;          // dynamic scheduler of the dkdv kernel (zeroed)
  bool deterministic = false;
  int accum_rows = 0;  // rows of dk_accum / dv_accum
  // (DUALKV_CUDA_BWD_TMA=1: the wgmma backward's loads as bulk tensor copies) boxes of 64 columns x 64
  // rows of q / dout, x the key tiles' rows of k, v, k_ctx, v_ctx; (head dims 64 / 128) runs of
  // kSm90DkdvVecBox (68) floats of lse_log2 / dsum viewed flat (nheads * total_q), from 16-byte aligned
  // starts; q / dout in the split dK/dV kernel's reader boxes (tma_q_reader / tma_dout_reader: 16 rows
  // at head dim 512, else copies of tma_q / tma_dout).
  bool tma = false;
  // (schedule 6 with tma, DUALKV_CUDA_BWD_LATE_DQ_ADD unset or 1) DkdvSm90Ws::kLateAdd, which stages and adds
  // dq_accum's rows at kDqAccumPitchLate (else kDqAccumPitch), their columns rotated (FusedDq::store_rows<true>)
  bool late_dq_add = false;
  TmaDesc tma_q, tma_dout, tma_k, tma_v, tma_k_ctx, tma_v_ctx, tma_lse_log2, tma_dsum, tma_q_reader, tma_dout_reader;
};

// ---- tile sizes (rows of a query tile = 16 * row warps; kDSplit warps share a row group) ----
struct TileConfig {
  int block_m;  // query rows per tile
  int block_n;  // key rows per tile
  int dsplit;   // warps splitting the head dim of the accumulators
  int mtiles;   // 16-row m-tiles per warp (2: every K/V fragment read from shared memory feeds 2 MMAs)
};

constexpr TileConfig fwd_config(int d) {
  return d <= 64    ? TileConfig{128, 64, 1, 2}
         : d <= 128 ? TileConfig{128, 32, 1, 2}
         : d <= 192 ? TileConfig{64, 64, 1, 1}
         : d <= 256 ? TileConfig{64, 32, 1, 1}
                    : TileConfig{64, 32, 2, 1};
}
constexpr TileConfig dq_config(int d) {
  return d <= 64    ? TileConfig{128, 64, 1, 2}
         : d <= 128 ? TileConfig{128, 32, 1, 2}
         : d <= 256 ? TileConfig{64, 32, 1, 1}
                    : TileConfig{32, 32, 2, 1};
}
// dkdv: block_n keys per item (16 per key warp), block_m queries per inner step.
constexpr TileConfig dkdv_config(int d) {
  return d <= 64 ? TileConfig{64, 64, 1, 1} : d <= 128 ? TileConfig{32, 64, 1, 1} : d <= 256 ? TileConfig{32, 64, 2, 1}
                                                                                           : TileConfig{32, 32, 4, 1};
}

constexpr bool supported_head_dim(int d) {
  return d == 64 || d == 96 || d == 128 || d == 192 || d == 256 || d == 512;
}

}  // namespace dkv
