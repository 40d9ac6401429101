// The bulk-tensor-copy (TMA) descriptors the binding builds for the wgmma kernels (dkv_launch.h:
// encode_tma_desc, encode_tma_vec): the driver's cuTensorMapEncodeTiled, found through the runtime (no
// link against libcuda); in the CPU emulation the views' fields (dkv_emulation.h, tma_load_box).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "dkv_launch.h"

#ifdef DKV_EMULATE
#include "dkv_emulation.h"
#else
#include <cuda.h>
#include <cudaTypedefs.h>
#endif

namespace dkv {

#ifndef DKV_EMULATE
// The driver's encoder, found once through the runtime (no link against libcuda); null without one.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    return err == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
                                                                      : nullptr;
  }();
  return encode;
}
#endif

#ifdef DKV_EMULATE
// DUALKV_EMULATE_TMA_ENCODE_FAILS=1: the emulated encoders fail as a driver without the encoder would
// (status 1), so that the CPU emulation checks what the binding does then.
bool emulated_encoder_fails() {
  const char* v = std::getenv("DUALKV_EMULATE_TMA_ENCODE_FAILS");
  return v != nullptr && std::string(v) == "1";
}
#endif

int encode_tma_desc(TmaDesc& d, void* ptr, bool bf16, int64_t rows, int64_t heads, int64_t cols, int64_t row_stride,
                    int64_t head_stride, int box_rows) {
  d = TmaDesc{};
#ifdef DKV_EMULATE
  if (emulated_encoder_fails()) return 1;
  (void)bf16;  // the emulated copy moves 16-bit elements of either type (dkv_emulation.h, tma_load_box)
  const int64_t fields[7] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)), row_stride, head_stride, rows, heads, cols,
                             box_rows};
  for (int i = 0; i < 7; ++i) d.words[i] = static_cast<uint64_t>(fields[i]);
  return 0;
#else
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return -1;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride) * 2, static_cast<cuuint64_t>(row_stride) * 2};  // bytes
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)}, element_strides[3] = {1, 1, 1};
  const CUresult res = encode(reinterpret_cast<CUtensorMap*>(d.words), bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                              3, ptr, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? 0 : static_cast<int>(res);
#endif
}

int encode_tma_vec(TmaDesc& d, float* ptr, int64_t n, int box) {
  d = TmaDesc{};
#ifdef DKV_EMULATE
  if (emulated_encoder_fails()) return 1;
  const int64_t fields[3] = {static_cast<int64_t>(reinterpret_cast<uintptr_t>(ptr)), n, box};
  for (int i = 0; i < 3; ++i) d.words[i] = static_cast<uint64_t>(fields[i]);
  d.words[7] = dkv_emu::kTmaVec;
  return 0;
#else
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return -1;
  const cuuint64_t dims[1] = {static_cast<cuuint64_t>(n)}, no_strides[1] = {0};
  const cuuint32_t boxes[1] = {static_cast<cuuint32_t>(box)}, element_strides[1] = {1};
  const CUresult res = encode(reinterpret_cast<CUtensorMap*>(d.words), CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, ptr, dims,
                              no_strides, boxes, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                              CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? 0 : static_cast<int>(res);
#endif
}

}  // namespace dkv
