// Host entry points of the kernels (no torch, no CUDA device code): the torch binding calls these.
// Each returns the launch status; the binding turns a failure into a clear error.
#pragma once

#include "dkv_params.h"

#ifdef DKV_EMULATE
#include "dkv_emulation.h"
#else
#include <cuda_runtime_api.h>
#endif

namespace dkv {

struct Fp16;
struct Bf16;

// Forward for one head dim (E = Fp16 / Bf16, D in 64, 96, 128, 192, 256, 512).
template <class E, int D>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream);
// Forward on Hopper warpgroup MMA (fp16 / bf16, head dims 64 / 128 / 192 / 256 / 512; blocks of 128 query
// rows, 64 at 512).
// form: 1 in turn, 2 warp-specialised, 3 with bulk tensor copies (p.tma_* filled): warp-specialised at
// head dims 64 / 128, in turn at 192 / 256 / 512. wide (form 3 at head dim 128 only): 176-key tiles.
template <class E>
cudaError_t run_fwd_sm90(const FwdParams& p, cudaStream_t stream, int form, bool wide = false);
bool sm90_forward_supports(int head_dim);
int sm90_fwd_block_m(int head_dim);  // query rows of the wgmma forward's tiles: 128, or 64 at head dim 512
// its key tiles' rows: 128 up to head dim 128 (176 when wide), 64 at 192 / 256, 32 at 512
int sm90_fwd_block_n(int head_dim, bool wide = false);
// (form 3) Fills `d` for a (rows, heads, cols) tensor of 16-bit elements (strides in elements, rows and
// heads 16-byte aligned): a 3-D view (cols, heads, rows) read in boxes of 64 columns x box_rows rows,
// 128B-swizzled. Returns 0, a driver error code, or -1 when the driver has no cuTensorMapEncodeTiled.
int encode_tma_desc(TmaDesc& d, void* ptr, bool bf16, int64_t rows, int64_t heads, int64_t cols, int64_t row_stride,
                    int64_t head_stride, int box_rows);
// (the dK/dV kernel's bulk tensor copies, BwdParams::tma) Fills `d` for a flat fp32 vector of n elements
// (16-byte aligned) read in boxes of `box` elements; returns as encode_tma_desc.
int encode_tma_vec(TmaDesc& d, float* ptr, int64_t n, int box);
bool sm90_kernels_built(cudaStream_t stream);  // the wgmma kernels were compiled for sm_90a (checked once)
constexpr int kSm90BlockM = 128;  // the wgmma forward's query tile (but 64 at d = 512) and its TMA box
// Backward on Hopper warpgroup MMA (fp16 / bf16, head dims 64 / 128 / 192 / 256): dQ on query tiles of
// sm90_dq_block_m rows, dK/dV on key tiles of sm90_dkdv_block_n (128 at head dims 64 / 128, 64 at
// 192 / 256, where there is one schedule and no dQ inside the dK/dV kernel).
template <class E>
cudaError_t run_dq_sm90(const BwdParams& p, cudaStream_t stream, int schedule);  // 1 .. 5 (not called at 3)
// dK/dV: schedules 1 .. 6, 8 and 9 (3, 6 and 9: dQ inside); p.tma (tensor maps filled) at 6, 8 and 9 asks
// for the warp-specialised kernel's loads as bulk tensor copies (9 without it runs as 6).
template <class E>
cudaError_t run_dkdv_sm90(const BwdParams& p, cudaStream_t stream, int schedule);
bool sm90_bwd_supports(int head_dim);
bool sm90_bwd_schedules(int head_dim);  // schedules 2 .. 5 exist (head dims 64 / 128)
int sm90_dq_block_m(int head_dim);
int sm90_dkdv_block_n(int head_dim);
constexpr int kSm90DkdvQueryRows = 64;  // query rows of the dK/dV kernels' reader tiles at head dims 64 / 128
constexpr int kSm90DqKeyRows512 = 16;    // (BwdParams::tma) key rows of the split dQ kernel's tiles at d = 512
constexpr int kSm90DkdvReaderRows512 = 16;  // (BwdParams::tma_q_reader) query rows of the split dK/dV kernel's reader tiles at d = 512
constexpr int kSm90DkdvVecBox = 68;     // (BwdParams::tma) floats of an lse_log2 / dsum copy (DkdvSm90Ws::kVecBox)
// Backward: dq kernel and dkdv kernel for one head dim.
template <class E, int D>
cudaError_t run_dq(const BwdParams& p, cudaStream_t stream);
template <class E, int D>
cudaError_t run_dkdv(const BwdParams& p, cudaStream_t stream);
// Head-dim independent backward pieces: dsum / lse_log2 before, the fp32 -> dtype casts after.
template <class E>
cudaError_t run_bwd_prep(const BwdParams& p, cudaStream_t stream);
template <class E>
cudaError_t run_bwd_convert(const BwdParams& p, cudaStream_t stream);
// dq = scale * the fused dK/dV kernel's fp32 dQ workspace (BwdParams::dq_accum), cast once.
template <class E>
cudaError_t run_convert_dq(const BwdParams& p, cudaStream_t stream);

}  // namespace dkv
