// Forward kernels for head dim 64 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_FWD(64)
}  // namespace dkv
