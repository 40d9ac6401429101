// Launcher templates, included by the per-head-dim translation units (dkv_fwd_hdim*.cu,
// dkv_bwd_hdim*.cu) which instantiate exactly what the binding's dispatch calls.
#pragma once

#include "dkv_bwd.cuh"
#include "dkv_launch.h"

#ifdef DKV_EMULATE
#define DKV_LAUNCH(kernel, grid, block, smem, stream, params) \
  dkv_emu::launch(grid, block, smem, [&] { kernel(params); })
#else
#define DKV_LAUNCH(kernel, grid, block, smem, stream, params) kernel<<<grid, block, smem, stream>>>(params)
#endif

namespace dkv {

// Raises the kernel's dynamic shared-memory limit once per process (above 48 KB needs opting in).
template <class Kernel>
inline cudaError_t allow_smem(Kernel kernel, int bytes) {
#ifdef DKV_EMULATE
  (void)kernel;
  (void)bytes;
  return cudaSuccess;
#else
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
#endif
}

inline cudaError_t last_error() {
#ifdef DKV_EMULATE
  return cudaSuccess;
#else
  return cudaGetLastError();
#endif
}

// Blocks of a persistent kernel: every SM filled to the kernel's occupancy.
template <class Kernel>
inline int persistent_blocks(Kernel kernel, int threads, int smem) {
#ifdef DKV_EMULATE
  (void)kernel;
  (void)threads;
  (void)smem;
  return 3;
#else
  int dev = 0, sms = 1, per_sm = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  return sms * (per_sm > 0 ? per_sm : 1);
#endif
}

// Launches kKernel (traits K: kThreads, kSmemBytes) on one block per (query tile, head), the grid's
// tile count an upper bound that blocks past the device-side count leave at once. The shared-memory
// limit is raised on the first call: the static belongs to this instantiation, one per kernel.
template <class K, auto kKernel, class Params>
cudaError_t launch_tiles(const Params& p, cudaStream_t stream) {
  static const cudaError_t attr = allow_smem(kKernel, K::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  if (p.grid_tiles == 0 || p.nheads == 0) return cudaSuccess;
  DKV_LAUNCH(kKernel, dim3(p.grid_tiles, p.nheads), dim3(K::kThreads), K::kSmemBytes, stream, p);
  return last_error();
}

// Launches the persistent kKernel on as many blocks as fill every SM (they take work items from a
// counter until none is left).
template <class K, auto kKernel, class Params>
cudaError_t launch_persistent(const Params& p, cudaStream_t stream) {
  static const cudaError_t attr = allow_smem(kKernel, K::kSmemBytes);
  if (attr != cudaSuccess) return attr;
  static const int blocks = persistent_blocks(kKernel, K::kThreads, K::kSmemBytes);
  DKV_LAUNCH(kKernel, dim3(blocks), dim3(K::kThreads), K::kSmemBytes, stream, p);
  return last_error();
}

template <class E, int D>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  constexpr TileConfig c = fwd_config(D);
  using K = FwdTraits<D, c.block_m, c.block_n, c.dsplit, c.mtiles>;
  return launch_tiles<K, &dkv_fwd_kernel<E, K>>(p, stream);
}

template <class E, int D>
cudaError_t run_dq(const BwdParams& p, cudaStream_t stream) {
  constexpr TileConfig c = dq_config(D);
  using K = DqTraits<D, c.block_m, c.block_n, c.dsplit, c.mtiles>;
  return launch_tiles<K, &dkv_dq_kernel<E, K>>(p, stream);
}

template <class E, int D>
cudaError_t run_dkdv(const BwdParams& p, cudaStream_t stream) {
  constexpr TileConfig c = dkdv_config(D);
  using K = DkdvTraits<D, c.block_m, c.block_n, c.dsplit>;
  return launch_persistent<K, &dkv_dkdv_kernel<E, K>>(p, stream);
}

#define DKV_INSTANTIATE_FWD(D)                                                      \
  template cudaError_t run_fwd<Fp16, D>(const FwdParams&, cudaStream_t);            \
  template cudaError_t run_fwd<Bf16, D>(const FwdParams&, cudaStream_t);

#define DKV_INSTANTIATE_BWD(D)                                                      \
  template cudaError_t run_dq<Fp16, D>(const BwdParams&, cudaStream_t);             \
  template cudaError_t run_dq<Bf16, D>(const BwdParams&, cudaStream_t);             \
  template cudaError_t run_dkdv<Fp16, D>(const BwdParams&, cudaStream_t);           \
  template cudaError_t run_dkdv<Bf16, D>(const BwdParams&, cudaStream_t);

}  // namespace dkv
