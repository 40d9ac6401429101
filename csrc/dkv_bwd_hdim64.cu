// Backward kernels (dq, dkdv) for head dim 64 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_BWD(64)
}  // namespace dkv
