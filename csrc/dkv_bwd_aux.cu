// Head-dim independent backward kernels: the dsum / lse_log2 preprocessing and the casts of the fp32
// context-gradient accumulators and of the fused dK/dV kernel's dQ workspace.
#include "dkv_launch_impl.cuh"

namespace dkv {

template <class E>
cudaError_t run_bwd_prep(const BwdParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.total_q) * p.nheads;
  if (rows == 0) return cudaSuccess;
  auto kernel = &dkv_bwd_prep_kernel<E>;
  DKV_LAUNCH(kernel, dim3(static_cast<unsigned>((rows + kPrepPairs - 1) / kPrepPairs)), dim3(256), 0, stream, p);
  return last_error();
}

template <class E>
cudaError_t run_bwd_convert(const BwdParams& p, cudaStream_t stream) {
  if (p.accum_rows == 0) return cudaSuccess;
  auto kernel = &dkv_convert_kernel<E>;
  DKV_LAUNCH(kernel, dim3(p.accum_rows), dim3(256), 0, stream, p);
  return last_error();
}

template <class E>
cudaError_t run_convert_dq(const BwdParams& p, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(p.total_q) * p.nheads * (p.head_dim / kDqConvertCols);
  if (threads == 0) return cudaSuccess;
  auto kernel = &dkv_convert_dq_kernel<E>;
  DKV_LAUNCH(kernel, dim3(static_cast<unsigned>((threads + 255) / 256)), dim3(256), 0, stream, p);
  return last_error();
}

template cudaError_t run_bwd_prep<Fp16>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd_prep<Bf16>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd_convert<Fp16>(const BwdParams&, cudaStream_t);
template cudaError_t run_bwd_convert<Bf16>(const BwdParams&, cudaStream_t);
template cudaError_t run_convert_dq<Fp16>(const BwdParams&, cudaStream_t);
template cudaError_t run_convert_dq<Bf16>(const BwdParams&, cudaStream_t);

}  // namespace dkv
