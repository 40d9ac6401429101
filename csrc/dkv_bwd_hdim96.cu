// Backward kernels (dq, dkdv) for head dim 96 (fp16 and bf16).
#include "dkv_launch_impl.cuh"

namespace dkv {
DKV_INSTANTIATE_BWD(96)
}  // namespace dkv
