// Forward kernels for head dim 256 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_FWD(256)
}  // namespace dkv
