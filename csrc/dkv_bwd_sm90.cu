// dQ and dK/dV on Hopper warpgroup MMA (dkv_bwd_sm90.cuh, dkv_bwd_sm90_ws.cuh, dkv_bwd_sm90_split.cuh): fp16 and bf16, head dims 64 and 128 in
// schedules 1 .. 6, 8 and 9 (launch_dq_sm90_schedule, launch_dkdv_sm90_schedule); at 192, 256 and 512 both kernels with the warpgroups' roles split
// (one schedule, no dQ inside the dK/dV kernel). The kernels trap unless the unit is built for sm_90a; the
// binding only calls them on an sm_90 device whose code has wgmma (sm90_kernels_built): by default
// (schedule 6 at d = 128, 8 at d = 64), unless DUALKV_CUDA_WGMMA_BWD=0 asks for mma.sync; =2 and =3
// select the overlapped schedule and the dK/dV kernel that also accumulates dQ, =4 the warp-specialised
// dK/dV kernel, =5 both kernels warp-specialised, =6 the warp-specialised dK/dV kernel that also
// accumulates dQ, =8 schedule 5 with S^T and dP^T waited for apart, =9 schedule 6 with dQ deferred a tile.
#include "dkv_bwd_sm90_split.cuh"
#include "dkv_bwd_sm90_ws.cuh"
#include "dkv_launch_impl.cuh"

namespace dkv {

bool sm90_bwd_supports(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 192 || head_dim == 256 || head_dim == 512;
}
bool sm90_bwd_schedules(int head_dim) { return head_dim <= 128; }
int sm90_dq_block_m(int head_dim) { return sm90_bwd_schedules(head_dim) ? 128 : 64; }
int sm90_dkdv_block_n(int head_dim) { return sm90_bwd_schedules(head_dim) ? 128 : 64; }

template <class E, int D, bool kOverlap>
cudaError_t launch_dq_sm90(const BwdParams& p, cudaStream_t stream) {
  using K = DqSm90<D, kOverlap>;
  return launch_tiles<K, &dkv_dq_sm90_kernel<E, D, kOverlap>>(p, stream);
}

template <class E, int D, bool kOverlap, bool kDq = false>
cudaError_t launch_dkdv_sm90(const BwdParams& p, cudaStream_t stream) {
  using K = DkdvSm90<D, kOverlap, kDq>;
  return launch_persistent<K, &dkv_dkdv_sm90_kernel<E, D, kOverlap, kDq>>(p, stream);
}

// p.tma: the forms that load by bulk tensor copies (both kernels at d = 192 / 256 / 512).
template <class E, int D>
cudaError_t launch_dq_sm90_split(const BwdParams& p, cudaStream_t stream) {
  if (p.tma) return launch_tiles<DqSm90Split<D, true>, &dkv_dq_sm90_split_kernel<E, D, true>>(p, stream);
  return launch_tiles<DqSm90Split<D>, &dkv_dq_sm90_split_kernel<E, D>>(p, stream);
}

template <class E, int D>
cudaError_t launch_dkdv_sm90_split(const BwdParams& p, cudaStream_t stream) {
  if (p.tma) return launch_persistent<DkdvSm90Split<D, true>, &dkv_dkdv_sm90_split_kernel<E, D, true>>(p, stream);
  return launch_persistent<DkdvSm90Split<D>, &dkv_dkdv_sm90_split_kernel<E, D>>(p, stream);
}

// schedule: 2 (overlapped), 5 and 8 (warp-specialised: a producer warpgroup loads), else in turn.
template <class E, int D>
cudaError_t launch_dq_sm90_schedule(const BwdParams& p, cudaStream_t stream, int schedule) {
  switch (schedule) {
    case 2: return launch_dq_sm90<E, D, true>(p, stream);
    case 5:
    case 8: return launch_tiles<DqSm90Ws<D>, &dkv_dq_sm90_ws_kernel<E, D>>(p, stream);
    default: return launch_dq_sm90<E, D, false>(p, stream);
  }
}

template <class E>
cudaError_t run_dq_sm90(const BwdParams& p, cudaStream_t stream, int schedule) {
  switch (p.head_dim) {
    case 64: return launch_dq_sm90_schedule<E, 64>(p, stream, schedule);
    case 128: return launch_dq_sm90_schedule<E, 128>(p, stream, schedule);
    case 192: return launch_dq_sm90_split<E, 192>(p, stream);  // one schedule
    case 256: return launch_dq_sm90_split<E, 256>(p, stream);
    case 512: return launch_dq_sm90_split<E, 512>(p, stream);
    default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue: the binding never asks for it
  }
}

// schedule: 1 (in turn), 2 (overlapped), 3 (in turn, dQ accumulated here into p.dq_accum), 4 and 5 (in
// turn, warp-specialised: a producer warpgroup loads), 6 (warp-specialised, dQ accumulated here), 8 (5
// with S^T and dP^T in separate commit groups), 9 (6 with each tile's dQ product deferred by a tile;
// with the TMA producer only, else 6); at 6, 8 and 9, p.tma: the loads as bulk tensor copies.
template <class E, int D>
cudaError_t launch_dkdv_sm90_schedule(const BwdParams& p, cudaStream_t stream, int schedule) {
  switch (schedule) {
    case 2: return launch_dkdv_sm90<E, D, true>(p, stream);
    case 3: return launch_dkdv_sm90<E, D, false, true>(p, stream);
    case 4:
    case 5: return launch_persistent<DkdvSm90Ws<D>, &dkv_dkdv_sm90_ws_kernel<E, D>>(p, stream);
    case 6:
      if (p.late_dq_add)  // (the binding sets it with p.tma only)
        return launch_persistent<DkdvSm90Ws<D, true, false, true, false, true>,
                                 &dkv_dkdv_sm90_ws_kernel<E, D, true, false, true, false, true>>(p, stream);
      if (p.tma) return launch_persistent<DkdvSm90Ws<D, true, false, true>, &dkv_dkdv_sm90_ws_kernel<E, D, true, false, true>>(p, stream);
      return launch_persistent<DkdvSm90Ws<D, true>, &dkv_dkdv_sm90_ws_kernel<E, D, true>>(p, stream);
    case 9:  // 6 with dQ deferred a tile (the TMA producer's form only)
      if (p.tma) return launch_persistent<DkdvSm90Ws<D, true, false, true, true>, &dkv_dkdv_sm90_ws_kernel<E, D, true, false, true, true>>(p, stream);
      return launch_dkdv_sm90_schedule<E, D>(p, stream, 6);
    case 8:  // 5 with S^T and dP^T waited for apart; under a softcap 5 itself
      if (p.softcap > 0.f) return launch_dkdv_sm90_schedule<E, D>(p, stream, 5);
      if (p.tma) return launch_persistent<DkdvSm90Ws<D, false, true, true>, &dkv_dkdv_sm90_ws_kernel<E, D, false, true, true>>(p, stream);
      return launch_persistent<DkdvSm90Ws<D, false, true>, &dkv_dkdv_sm90_ws_kernel<E, D, false, true>>(p, stream);
    default: return launch_dkdv_sm90<E, D, false>(p, stream);
  }
}

template <class E>
cudaError_t run_dkdv_sm90(const BwdParams& p, cudaStream_t stream, int schedule) {
  switch (p.head_dim) {
    case 64: return launch_dkdv_sm90_schedule<E, 64>(p, stream, schedule);
    case 128: return launch_dkdv_sm90_schedule<E, 128>(p, stream, schedule);
    case 192: return launch_dkdv_sm90_split<E, 192>(p, stream);  // one schedule, no dQ inside
    case 256: return launch_dkdv_sm90_split<E, 256>(p, stream);
    case 512: return launch_dkdv_sm90_split<E, 512>(p, stream);
    default: return static_cast<cudaError_t>(1);  // cudaErrorInvalidValue: the binding never asks for it
  }
}

template cudaError_t run_dq_sm90<Fp16>(const BwdParams&, cudaStream_t, int);
template cudaError_t run_dq_sm90<Bf16>(const BwdParams&, cudaStream_t, int);
template cudaError_t run_dkdv_sm90<Fp16>(const BwdParams&, cudaStream_t, int);
template cudaError_t run_dkdv_sm90<Bf16>(const BwdParams&, cudaStream_t, int);

}  // namespace dkv
