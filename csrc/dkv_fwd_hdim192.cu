// Forward kernels for head dim 192 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_FWD(192)
}  // namespace dkv
