// Hopper (sm_90a) warpgroup MMA building blocks of the wgmma kernels (dkv_fwd_sm90.cuh): shared-
// memory matrix descriptors for 128-byte-swizzled tiles, and m64n64k16 / m64n128k16 bf16 or fp16
// wgmma with fp32 accumulators, operands from shared memory (SS) or A from registers (RS); tests/gpu/test_wgmma_gpu.py checks every helper against torch on an sm_90 GPU, and
// under -DDKV_EMULATE they run on the CPU emulation (csrc/emulation/emulate.py --wgmma).
//
// Tile layout (the copy engine's 128B swizzle): a tile of rows x 64 bf16 elements, 128 bytes per
// row, row r at byte r * 128 of a 1024-byte-aligned base, and the 16-byte chunk c (elements 8c to
// 8c + 7) of row r stored at chunk position c ^ (r % 8) (``sw128_offset``). Eight rows (1024 bytes)
// form one swizzle atom; atoms follow each other.
//
//   A or B "K-major" (the contraction dim contiguous: Q rows, K rows): one k16 step is 32 bytes of
//   every row, so step s starts at base + 32 s; atoms of 8 rows are 1024 bytes apart (SBO).
//   B "MN-major" (the output dim contiguous: V rows = keys, with head-dim columns; transposed
//   operand): one k16 step is 16 rows, so step s starts at base + 2048 s; its two 8-row atoms are
//   1024 bytes apart. With 64 columns there is one atom along N, so one of the two offsets goes
//   unused; ``smem_desc_sw128_mn64`` sets both to 1024.
//
// Accumulator layout (m64nN, fp32, one warpgroup of 4 warps): thread t = 32 w + l holds, for each
// 8-column block j, d[4j + i] at row 16 w + l / 4 + 8 (i / 2), column 8 j + 2 (l % 4) + (i % 2): the
// mma.sync m16n8 layout stacked over the four warps, so ``c_to_a`` of dkv_tile.cuh turns two column
// blocks of an accumulator into the register A operand of the next wgmma (P of S = Q K^T into P V).
#pragma once

#include <cstdint>

#include "dkv_device.cuh"
#include "dkv_params.h"

namespace dkv {
namespace sm90 {

// Byte offset of element (row, col) of a 128B-swizzled tile of 64-element rows (bf16 / fp16).
DKV_DEV uint32_t sw128_offset(int row, int col) {
  return static_cast<uint32_t>(row * 128 + (((col >> 3) ^ (row & 7)) << 4) + (col & 7) * 2);
}

// 64-bit shared-memory matrix descriptor: start address, leading / stride byte offsets (all in
// 16-byte units, 14 bits each), layout type 1 = 128-byte swizzle (bits 62-63).
DKV_DEV uint64_t smem_desc_sw128(const void* smem_ptr, uint32_t lbo_bytes = 16, uint32_t sbo_bytes = 1024) {
#if defined(DKV_EMULATE)
  const uint32_t addr = dkv_emu::smem_offset(smem_ptr);
#elif defined(__CUDA_ARCH__)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
#else
  const uint32_t addr = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(smem_ptr));
#endif
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((addr >> 4) & 0x3FFF);
  desc |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;
  return desc;
}

// The descriptor of the same layout `bytes` further on (the start address field is in 16-byte units;
// the caller keeps the address inside shared memory, so the 14-bit field does not overflow).
DKV_DEV uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// The first 1024-byte-aligned address of this block's dynamic shared memory (swizzle atoms need
// it); allocate 1024 bytes more than the tiles take.
DKV_DEV unsigned char* dynamic_smem_1024() {
  unsigned char* p = dynamic_smem();
#if defined(DKV_EMULATE)
  const uint32_t off = dkv_emu::smem_offset(p);
#elif defined(__CUDA_ARCH__)
  const uint32_t off = static_cast<uint32_t>(__cvta_generic_to_shared(p));
#else
  const uint32_t off = 0;
#endif
  return p + ((1024 - off % 1024) % 1024);
}

// An MN-major operand of 64 columns (one swizzle atom wide), k16 step starting at smem_ptr.
DKV_DEV uint64_t smem_desc_sw128_mn64(const void* smem_ptr) { return smem_desc_sw128(smem_ptr, 1024, 1024); }

// An MN-major operand wider than one swizzle atom (128 columns for m64n128): its 64-column atoms
// (the tile's parts) `part_bytes` apart, the leading byte offset; 8-row groups 1024 bytes apart.
DKV_DEV uint64_t smem_desc_sw128_mn(const void* smem_ptr, uint32_t part_bytes) {
  return smem_desc_sw128(smem_ptr, part_bytes, 1024);
}

// Rows [row, row + kRows) of one head of a (rows, heads, kHeadDim) tensor into kRows x 64-column
// swizzled parts, part c at dst + c * kRows * 64 (rows past `valid` read as zeros). When the block's
// threads cover whole rows, each thread keeps one 16-byte column chunk and steps down the rows by a
// multiple of 8, so its swizzled position repeats and the addresses are a pointer add per copy.
template <int kHeadDim, int kThreads, int kRows>
DKV_DEV void load_tile_sw128_async(uint16_t* dst, const TensorRef& t, int64_t row, int head, int valid, int tid) {
  const uint16_t* base = static_cast<const uint16_t*>(t.ptr);
  constexpr int kChunks = kHeadDim / 8;  // chunks of 8 elements per row
  if constexpr (kThreads % kChunks == 0 && (kThreads / kChunks) % 8 == 0 && kRows % (kThreads / kChunks) == 0) {
    constexpr int kRowStep = kThreads / kChunks;
    const int c = tid % kChunks, r0 = tid / kChunks;
    const uint16_t* src = base + t.offset(row + r0, head) + c * 8;
    const int64_t step = kRowStep * t.row_stride;
    uint16_t* d = dst + (c / 8) * kRows * 64 + sw128_offset(r0, (c % 8) * 8) / 2;
#pragma unroll
    for (int k = 0; k < kRows / kRowStep; ++k) {
      const bool ok = r0 + k * kRowStep < valid;
      cp_async_16(d + k * kRowStep * 64, ok ? src + k * step : base, ok);
    }
  } else {
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const bool ok = r < valid;
      const uint16_t* src = ok ? base + t.offset(row + r, head) + c * 8 : base;
      cp_async_16(dst + (c / 8) * kRows * 64 + sw128_offset(r, (c % 8) * 8) / 2, src, ok);
    }
  }
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DKV_HAS_WGMMA 1
#else
#define DKV_HAS_WGMMA 0
#endif

// Bulk reduce-add of fp32 from shared to global memory (cp.reduce.async.bulk, sm_90): `bytes` a
// multiple of 16, both addresses 16-byte aligned; asynchronous, in this thread's bulk group. Shared
// memory written by ordinary stores must be fenced for the async proxy (fence_smem_to_async_proxy)
// before the thread that issues it reads it. bulk_wait_read<N>: the sources of all but this thread's
// newest N groups have been read (they may be overwritten); bulk_wait<N>: their adds are done.
DKV_DEV void bulk_reduce_add_f32(float* gmem, const float* smem, int bytes) {
#if defined(DKV_EMULATE)
  dkv_emu::bulk_reduce_add_f32(gmem, smem, bytes);
#elif DKV_HAS_WGMMA
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem))), "r"(bytes)
               : "memory");
#else
  (void)gmem, (void)smem, (void)bytes;
#endif
}

DKV_DEV void bulk_commit() {
#if defined(DKV_EMULATE)
  dkv_emu::bulk_commit();
#elif DKV_HAS_WGMMA
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

template <int N>
DKV_DEV void bulk_wait_read() {
#if defined(DKV_EMULATE)
  dkv_emu::bulk_wait(N);
#elif DKV_HAS_WGMMA
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}

template <int N>
DKV_DEV void bulk_wait() {
#if defined(DKV_EMULATE)
  dkv_emu::bulk_wait(N);
#elif DKV_HAS_WGMMA
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A barrier over the 128 threads of warpgroup wg (named barrier 1 + wg; 0 is the block's).
DKV_DEV void warpgroup_sync(int wg) {
#if defined(DKV_EMULATE)
  (void)wg;
  dkv_emu::warpgroup_sync();
#elif DKV_HAS_WGMMA
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
#else
  (void)wg;
#endif
}

// A barrier over kThreads threads (a multiple of 32) at named barrier `id` (0 is the block's; the
// warpgroups' are 1 .. 3).
template <int kThreads>
DKV_DEV void named_sync(int id) {
#if defined(DKV_EMULATE)
  dkv_emu::named_sync(id, kThreads);
#elif DKV_HAS_WGMMA
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
#else
  (void)id;
#endif
}

// Arrive at named barrier `id` (kThreads in all) without waiting: the other side's named_sync completes
// once these threads and its own have arrived.
template <int kThreads>
DKV_DEV void named_arrive(int id) {
#if defined(DKV_EMULATE)
  dkv_emu::named_arrive(id, kThreads);
#elif DKV_HAS_WGMMA
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
#else
  (void)id;
#endif
}

// mbarrier (shared-memory arrival barrier with phases) for producer / consumer pipelines: init by one
// thread before a block_sync; arrive (release); wait until the phase of the given parity completed
// (acquire). Phase r of a barrier completes with its count-th arrival; its parity is r % 2.
DKV_DEV void mbar_init(uint64_t* bar, int count) {
#if defined(DKV_EMULATE)
  dkv_emu::mbar_init(bar, count);
#elif DKV_HAS_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(count)
               : "memory");
#else
  (void)bar, (void)count;
#endif
}

DKV_DEV void mbar_arrive(uint64_t* bar) {
#if defined(DKV_EMULATE)
  dkv_emu::mbar_arrive(bar);
#elif DKV_HAS_WGMMA
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
               : "memory");
#else
  (void)bar;
#endif
}

DKV_DEV void mbar_wait(uint64_t* bar, int parity) {
#if defined(DKV_EMULATE)
  dkv_emu::mbar_wait_parity(bar, parity);
#elif DKV_HAS_WGMMA
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
#endif
}

// Bulk tensor copies (TMA): the issuing thread arrives on `bar` announcing the bytes its phase also
// waits for (mbarrier.arrive.expect_tx), then issues boxes that count them down as they land.
// tma_load_box copies one box of a TmaDesc (a 3-D view: head-dim columns, heads, rows; the box 64
// columns of one head by the map's box rows) to 128B-swizzled shared memory at `dst` (1024-byte
// aligned), starting at (col, head, row); rows outside the tensor land as zeros.
DKV_DEV void mbar_arrive_expect_tx(uint64_t* bar, int bytes) {
#if defined(DKV_EMULATE)
  dkv_emu::tma_expect_tx(bar, bytes);
#elif DKV_HAS_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(bar))),
               "r"(bytes)
               : "memory");
#else
  (void)bar, (void)bytes;
#endif
}

DKV_DEV void tma_load_box(void* dst, const TmaDesc& desc, int col, int head, int row, uint64_t* bar) {
#if defined(DKV_EMULATE)
  dkv_emu::tma_load_box(dst, desc.words, col, head, row, bar);
#elif DKV_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(reinterpret_cast<uint64_t>(&desc)), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(col), "r"(head),
      "r"(row)
      : "memory");
#else
  (void)dst, (void)desc, (void)col, (void)head, (void)row, (void)bar;
#endif
}

// tma_load_tile copies a tile of `rows` rows of kParts 64-column parts, part-major (each part rows x
// 128 bytes at dst + part * rows * 64 elements), as one box per part of a map whose box height is
// `rows`.
template <int kParts>
DKV_DEV void tma_load_tile(uint16_t* dst, const TmaDesc& map, int head, int row, int rows, uint64_t* bar) {
  for (int part = 0; part < kParts; ++part) tma_load_box(dst + part * rows * 64, map, 64 * part, head, row, bar);
}

// tma_load_vec copies one box of a flat fp32 TmaDesc (a 1-D view, the box the map's box length) to
// shared memory at `dst` (128-byte aligned), starting at element `start`, a multiple of 4 (16 bytes:
// on an H200 an unaligned start stopped the kernel with an illegal instruction); elements past the
// end land as zeros.
DKV_DEV void tma_load_vec(float* dst, const TmaDesc& desc, int start, uint64_t* bar) {
#if defined(DKV_EMULATE)
  dkv_emu::tma_load_vec(dst, desc.words, start, bar);
#elif DKV_HAS_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(dst))),
      "l"(reinterpret_cast<uint64_t>(&desc)), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(start)
      : "memory");
#else
  (void)dst, (void)desc, (void)start, (void)bar;
#endif
}

// A producer / consumer ring of `stages` buffers: full[i] completes when the producer warpgroup's 128
// threads have arrived (buffer i landed; `full_count` 1 when one thread fills it by bulk tensor
// copies), empty[i] when both consumer warpgroups' 256 threads have (buffer i read). Thread 0
// initialises; the block barrier makes them visible before any use.
DKV_DEV void init_ring(uint64_t* full, uint64_t* empty, int stages, int full_count = 128) {
  if (thread_idx() == 0) {
    for (int st = 0; st < stages; ++st) {
      mbar_init(&full[st], full_count);
      mbar_init(&empty[st], 256);
    }
#if !defined(DKV_EMULATE) && DKV_HAS_WGMMA
    if (full_count == 1) asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // for the copy engine
#endif
  }
  block_sync();
}

// n mbarriers that bulk tensor copies complete (one arrival: the issuing thread's expect_tx), by thread
// 0; the caller's block barrier makes them visible before any use.
DKV_DEV void init_copy_barriers(uint64_t* bars, int n) {
  if (thread_idx() == 0) {
    for (int i = 0; i < n; ++i) mbar_init(&bars[i], 1);
#if !defined(DKV_EMULATE) && DKV_HAS_WGMMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // for the copy engine
#endif
  }
}

// Warp-specialised register budgets: a warpgroup gives registers back (dec) or takes them (inc); every
// warp of the warpgroup executes it.
//
// The warp-specialised kernels' split: the producer warpgroup keeps 40 registers a thread, each of the
// two consumer warpgroups takes 232. setmaxnreg only moves registers within the block's launch
// allocation: 384 threads under __launch_bounds__(384) hold 168 each (64 K / 384, rounded down to 8),
// 64512 in all. A split asking for more leaves inc waiting for registers that never come: 48 and 232
// (65536) hung the block on an H200.
//
// The TMA dK/dV kernels' producer is one thread issuing bulk tensor copies and needs few registers:
// at d = 128 its warpgroup keeps 24 and each consumer takes 240 (the whole allocation), which leaves
// their consumers with no spilled registers (232 spilled 7-10); at d = 64 the consumers fit in 232 and
// the producer, issuing a tile twice as often, keeps 40. The TMA forward's consumers spill
// nothing at 232, so it keeps the first split.
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
constexpr int kTmaProducerRegs = 24, kTmaConsumerRegs = 240;
constexpr bool split_fits(int producer, int consumer) {  // multiples of 8, within the block's allocation
  return producer % 8 == 0 && consumer % 8 == 0 && 128 * producer + 256 * consumer <= 384 * 168;
}
static_assert(split_fits(kProducerRegs, kConsumerRegs) && split_fits(kTmaProducerRegs, kTmaConsumerRegs),
              "setmaxnreg split: multiples of 8 within the 384-thread block's allocation");
template <int kRegs>
DKV_DEV void setmaxnreg_dec() {
#if DKV_HAS_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
DKV_DEV void setmaxnreg_inc() {
#if DKV_HAS_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}

// Make this CTA's shared-memory stores (st.shared, cp.async) visible to the async proxy wgmma reads
// through; follow it with a barrier so every thread's stores are covered.
DKV_DEV void fence_smem_to_async_proxy() {
#if DKV_HAS_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Order earlier register writes of accumulators / A fragments before the next wgmma reads them.
DKV_DEV void wgmma_fence() {
#if DKV_HAS_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

DKV_DEV void wgmma_commit() {
#if DKV_HAS_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Wait until at most N committed groups are still in flight.
template <int N>
DKV_DEV void wgmma_wait() {
#if DKV_HAS_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// The 16 accumulator registers of an m64n32 fp32 tile as asm operands.
#define DKV_WGMMA_D16(d)                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])

#define DKV_WGMMA_DREGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"

// The 32 accumulator registers of an m64n64 fp32 tile as asm operands.
#define DKV_WGMMA_D32(d)                                                                                          \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define DKV_WGMMA_DREGS                                                                                           \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64) = A (64 x 16, descriptor, K-major) * B (16 x 64, descriptor) + (accumulate ? d : 0),
// E = Bf16 or Fp16 inputs, fp32 accumulators.
// kTransB = 0: B stored K-major (64 rows of N, k contiguous: S = Q K^T with K rows);
// kTransB = 1: B stored MN-major (16 rows of k, n contiguous: O = P V with V rows).
template <class E, int kTransB>
DKV_DEV void wgmma_m64n64k16_ss(float (&d)[32], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DKV_WGMMA_DREGS ", %32, %33, p, 1, 1, 0, %35;\n}\n"
        : DKV_WGMMA_D32(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DKV_WGMMA_DREGS ", %32, %33, p, 1, 1, 0, %35;\n}\n"
        : DKV_WGMMA_D32(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 64, nullptr, desc_a, desc_b, accumulate, kTransB != 0, E::kIsBf16);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// d (64 x 64) = A (64 x 16, registers: the mma.sync m16n8k16 A fragment of this warp's 16 rows) *
// B (16 x 64, descriptor) + (accumulate ? d : 0).
template <class E, int kTransB>
DKV_DEV void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DKV_WGMMA_DREGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : DKV_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DKV_WGMMA_DREGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : DKV_WGMMA_D32(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 64, a, 0, desc_b, accumulate, kTransB != 0, E::kIsBf16);
#else
  (void)d, (void)a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// d (64 x 16) = A (64 x 16, descriptor, K-major) * B (16 x 16, descriptor, K-major: 16 rows of N)
// + (accumulate ? d : 0): the d = 512 backward's 16-key / 16-query score tiles. 2 column blocks.
template <class E>
DKV_DEV void wgmma_m64n16k16_ss(float (&d)[8], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 16, nullptr, desc_a, desc_b, accumulate, false, E::kIsBf16);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// d (64 x 32) = A (64 x 16, descriptor, K-major) * B (16 x 32, descriptor, K-major: 32 rows of N)
// + (accumulate ? d : 0): S of a 32-key tile (the d = 512 forward). Same layout, 4 column blocks.
template <class E>
DKV_DEV void wgmma_m64n32k16_ss(float (&d)[16], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 " DKV_WGMMA_DREGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D16(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " DKV_WGMMA_DREGS16 ", %16, %17, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D16(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 32, nullptr, desc_a, desc_b, accumulate, false, E::kIsBf16);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// The 64 accumulator registers of an m64n128 fp32 tile.
#define DKV_WGMMA_D64(d)                                                                                          \
  DKV_WGMMA_D32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),    \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),     \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),     \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),     \
      "+f"(d[63])

#define DKV_WGMMA_DREGS64                                                                                         \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// d (64 x 128) = A (64 x 16, descriptor, K-major) * B (16 x 128, descriptor, K-major: 128 rows of N,
// 8-row atoms 1024 bytes apart) + (accumulate ? d : 0). Same accumulator layout as m64n64, with
// 16 column blocks (d[4j + i], j < 16).
template <class E>
DKV_DEV void wgmma_m64n128k16_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DKV_WGMMA_DREGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D64(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DKV_WGMMA_DREGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D64(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 128, nullptr, desc_a, desc_b, accumulate, false, E::kIsBf16);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// The 88 accumulator registers of an m64n176 fp32 tile.
#define DKV_WGMMA_D88(d) \
  DKV_WGMMA_D64(d), \
      "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
      "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
      "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])

#define DKV_WGMMA_DREGS88 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
  "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, " \
  "%66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"

// d (64 x 176) = A (64 x 16, descriptor, K-major) * B (16 x 176, descriptor, K-major: 176 rows of N,
// 8-row atoms 1024 bytes apart) + (accumulate ? d : 0): S of the forward's 176-key tiles
// (DUALKV_CUDA_FWD_BLOCK_N=176). Same accumulator layout, 22 column blocks.
template <class E>
DKV_DEV void wgmma_m64n176k16_ss(float (&d)[88], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 " DKV_WGMMA_DREGS88 ", %88, %89, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D88(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.f16.f16 " DKV_WGMMA_DREGS88 ", %88, %89, p, 1, 1, 0, 0;\n}\n"
        : DKV_WGMMA_D88(d)
        : "l"(desc_a), "l"(desc_b), "r"(static_cast<int>(accumulate)));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 176, nullptr, desc_a, desc_b, accumulate, false, E::kIsBf16);
#else
  (void)d, (void)desc_a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// d (64 x 128) = A (64 x 16, registers, as in m64n64k16_rs) * B (16 x 128, descriptor) + (accumulate ? d : 0);
// kTransB = 1: B MN-major, two 64-column atoms (smem_desc_sw128_mn). One instruction where two
// m64n64 would read the A fragment twice.
template <class E, int kTransB>
DKV_DEV void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b, bool accumulate) {
#if DKV_HAS_WGMMA
  if constexpr (E::kIsBf16)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DKV_WGMMA_DREGS64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : DKV_WGMMA_D64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
  else
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DKV_WGMMA_DREGS64
        ", {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : DKV_WGMMA_D64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(static_cast<int>(accumulate)), "n"(kTransB));
#elif defined(DKV_EMULATE)
  dkv_emu::wgmma(d, 128, a, 0, desc_b, accumulate, kTransB != 0, E::kIsBf16);
#else
  (void)d, (void)a, (void)desc_b, (void)accumulate;
  __trap();  // wgmma needs sm_90a
#endif
}

// acc (64 x 64 kParts, as kParts m64n64 accumulators side by side: part c = columns 64 c ..) += A B
// for one k16 step, B MN-major with its parts part_bytes apart starting at desc_b (smem_desc_sw128_mn):
// one m64n128 per pair of parts, m64n64 for an odd one out (head dims 64 and 192). The layouts agree:
// register 4 j + i of an m64n128 tile is register 4 (j % 8) + i of part 2 pp + j / 8.
template <class E, int kParts>
DKV_DEV void wgmma_rs_mn_parts(float (&acc)[kParts][32], const uint32_t (&a)[4], uint64_t desc_b, uint32_t part_bytes) {
#pragma unroll
  for (int pp = 0; pp < kParts / 2; ++pp)
    wgmma_m64n128k16_rs<E, 1>(reinterpret_cast<float(&)[64]>(acc[2 * pp]), a, desc_advance(desc_b, 2 * pp * part_bytes),
                              true);
  if constexpr (kParts % 2 == 1)
    wgmma_m64n64k16_rs<E, 1>(acc[kParts - 1], a, desc_advance(desc_b, (kParts - 1) * part_bytes), true);
}

// S (64 x kN) = A B^T with B K-major (kN = 16, 32, 64, 128 or 176): one wgmma per call.
template <class E, int kN>
DKV_DEV void wgmma_ss_k_major(float (&d)[kN / 2], uint64_t desc_a, uint64_t desc_b, bool accumulate) {
  static_assert(kN == 16 || kN == 32 || kN == 64 || kN == 128 || kN == 176,
                "wgmma_ss_k_major: N is 16, 32, 64, 128 or 176");
  if constexpr (kN == 16)
    wgmma_m64n16k16_ss<E>(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 32)
    wgmma_m64n32k16_ss<E>(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 64)
    wgmma_m64n64k16_ss<E, 0>(d, desc_a, desc_b, accumulate);
  else if constexpr (kN == 128)
    wgmma_m64n128k16_ss<E>(d, desc_a, desc_b, accumulate);
  else
    wgmma_m64n176k16_ss<E>(d, desc_a, desc_b, accumulate);
}

// Make a descriptor opaque to the compiler at this point, so that the descriptors derived from it in
// an unrolled loop are computed where they are used instead of hoisted out of the enclosing loop and
// held in registers for its whole duration (two registers each, 16-64 of them per block of wgmmas).
DKV_DEV uint64_t desc_here(uint64_t desc) {
#if DKV_HAS_WGMMA
  asm volatile("" : "+l"(desc));
#endif
  return desc;
}

// Pin accumulator registers in place between a wgmma's issue and its wait: the compiler must neither
// read them early nor move them while the asynchronous MMA still writes them.
template <int kN>
DKV_DEV void fence_operand(float (&d)[kN]) {
#if DKV_HAS_WGMMA
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
#else
  (void)d;
#endif
}

// The same for register A fragments: called after the wait that ends the wgmma reading them, it keeps
// them live (and unmoved) until then, so no temporary takes their registers while the MMA reads them.
template <int kSteps>
DKV_DEV void fence_operand(uint32_t (&a)[kSteps][4]) {
#if DKV_HAS_WGMMA
#pragma unroll
  for (int k = 0; k < kSteps; ++k)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[k][i])::"memory");
#else
  (void)a;
#endif
}

#undef DKV_WGMMA_D16
#undef DKV_WGMMA_DREGS16
#undef DKV_WGMMA_D32
#undef DKV_WGMMA_DREGS
#undef DKV_WGMMA_D64
#undef DKV_WGMMA_DREGS64

}  // namespace sm90
}  // namespace dkv
