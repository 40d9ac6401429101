// Forward kernels for head dim 512 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_FWD(512)
}  // namespace dkv
