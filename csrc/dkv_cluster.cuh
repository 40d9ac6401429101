// Thread block clusters on Hopper (sm_90a): the blocks of a cluster run at once on neighbouring
// multiprocessors and can reach each other's shared memory (distributed shared memory). The building
// blocks a cluster kernel needs, each with its twin in the CPU emulation (dkv_emulation.h), checked by
// the kernels of dkv_cluster_check.cuh on both (csrc/emulation/emulate.py --cluster,
// tests/gpu/test_cluster_gpu.py):
//
//   cluster_rank()                 this block's rank in its cluster (%cluster_ctarank)
//   cluster_arrive / cluster_wait  barrier.cluster split in two (release / acquire): the wait returns once
//                                  every thread of every block of the cluster has arrived; cluster_sync
//                                  both. A block must not exit while a peer may still reach its shared
//                                  memory, so a kernel that uses a peer's ends with cluster_sync.
//   RemoteSmem remote(p, rank)     the address p of this block's shared memory at the same offset in
//                                  block `rank` (mapa.shared::cluster)
//   st_async_f32x4(dst, v, bar)    16 bytes into a peer's shared memory, counted down on the peer's
//                                  mbarrier `bar` as transaction bytes (st.async ... complete_tx)
//   mbar_arrive_remote(bar)        an arrival on a peer's mbarrier (release at cluster scope)
//   tma_load_box_multicast(...)    one bulk tensor copy landing at the same offset in every block of
//                                  `mask`, counting down the mbarrier at the same offset in each
//   fence_mbar_init_cluster()      makes mbarrier inits visible to the cluster (before its barrier)
//
// A block announces the bytes its own mbarrier will receive (mbar_arrive_expect_tx, dkv_wgmma.cuh);
// a peer's bytes may land before the announcement: the phase completes when the arrivals are all in and
// the transaction count is back at zero.
#pragma once

#include <cstdint>

#include "dkv_wgmma.cuh"

#ifdef DKV_EMULATE
#define DKV_CLUSTER_DIMS(x)
#else
#define DKV_CLUSTER_DIMS(x) __cluster_dims__(x, 1, 1)
#endif

namespace dkv {
namespace sm90 {

DKV_DEV int cluster_rank() {
#if defined(DKV_EMULATE)
  return dkv_emu::self.cta_rank;
#elif DKV_HAS_WGMMA
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return static_cast<int>(r);
#else
  return 0;
#endif
}

DKV_DEV void cluster_arrive() {
#if defined(DKV_EMULATE)
  dkv_emu::cluster_arrive();
#elif DKV_HAS_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#endif
}

DKV_DEV void cluster_wait() {
#if defined(DKV_EMULATE)
  dkv_emu::cluster_wait();
#elif DKV_HAS_WGMMA
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

DKV_DEV void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

DKV_DEV void fence_mbar_init_cluster() {
#if !defined(DKV_EMULATE) && DKV_HAS_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// An address in the shared memory of a block of this cluster (the shared::cluster window on the
// device; the host address in the emulation).
struct RemoteSmem {
#ifdef DKV_EMULATE
  unsigned char* p = nullptr;
#else
  uint32_t addr = 0;
#endif
};

DKV_DEV RemoteSmem remote(const void* local, int rank) {
  RemoteSmem r;
#if defined(DKV_EMULATE)
  r.p = dkv_emu::map_shared_rank(local, rank);
#elif DKV_HAS_WGMMA
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(r.addr)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local))), "r"(rank));
#else
  (void)local, (void)rank;
#endif
  return r;
}

// The address `bytes` further on.
DKV_DEV RemoteSmem offset(RemoteSmem r, int bytes) {
#ifdef DKV_EMULATE
  r.p += bytes;
#else
  r.addr += static_cast<uint32_t>(bytes);
#endif
  return r;
}

DKV_DEV void st_async_f32x4(RemoteSmem dst, float a, float b, float c, float d, RemoteSmem bar) {
#if defined(DKV_EMULATE)
  const float v[4] = {a, b, c, d};
  dkv_emu::st_async(dst.p, v, 16, reinterpret_cast<uint64_t*>(bar.p));
#elif DKV_HAS_WGMMA
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(dst.addr),
               "f"(a), "f"(b), "f"(c), "f"(d), "r"(bar.addr)
               : "memory");
#else
  (void)dst, (void)a, (void)b, (void)c, (void)d, (void)bar;
#endif
}

DKV_DEV void mbar_arrive_remote(RemoteSmem bar) {
#if defined(DKV_EMULATE)
  dkv_emu::mbar_arrive_cluster(reinterpret_cast<uint64_t*>(bar.p));
#elif DKV_HAS_WGMMA
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar.addr) : "memory");
#else
  (void)bar;
#endif
}

// tma_load_box (dkv_wgmma.cuh) into every block of `mask` (bit r: rank r), at dst's offset in each, the
// bytes counted on the mbarrier at bar's offset in each. Each receiving block announces them on its own.
DKV_DEV void tma_load_box_multicast(void* dst, const TmaDesc& desc, int col, int head, int row, uint64_t* bar,
                                    uint16_t mask) {
#if defined(DKV_EMULATE)
  dkv_emu::tma_load_box_multicast(dst, desc.words, col, head, row, bar, mask);
#elif DKV_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(reinterpret_cast<uint64_t>(&desc)), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(col), "r"(head),
      "r"(row), "h"(mask)
      : "memory");
#else
  (void)dst, (void)desc, (void)col, (void)head, (void)row, (void)bar, (void)mask;
#endif
}

}  // namespace sm90
}  // namespace dkv
