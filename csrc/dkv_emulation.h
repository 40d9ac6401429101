// Host emulation of the few warp-level instructions the DualKV kernels use, so that the kernel
// sources can be compiled as plain C++ (-DDKV_EMULATE) and run on a CPU, one OS thread per CUDA
// thread, to check fragment layouts, masking and index arithmetic against the PyTorch reference.
//
// Semantics follow the PTX ISA: mma.sync.m16n8k16 (row.col), ldmatrix / stmatrix.m8n8.x4 (.trans), cp.async
// with zero fill (copies are deferred until cp.async.wait_group, as on the hardware, so a missing
// wait reads stale shared memory), cp.reduce.async.bulk .add.f32 (likewise deferred, to its
// cp.async.bulk.wait_group), shfl.sync.bfly, bar.sync, and wgmma.mma_async m64nNk16 with
// 128-byte-swizzled shared-memory operands (executed at issue: a missing wgmma.wait_group is not
// caught; the layouts are those csrc/dkv_wgmma.cuh documents, checked on a GPU by
// tests/gpu/test_wgmma_gpu.py). Every warp collective waits for all 32
// lanes (a divergent collective deadlocks instead of silently passing). Slow by design: a debugging
// tool for small shapes, never a product path.
#pragma once

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef void* cudaStream_t;
typedef int cudaError_t;
#define cudaSuccess 0

namespace dkv_emu {

struct Warp {
  std::unique_ptr<std::barrier<>> bar;
  const void* ptr[32];
  uint32_t reg[32][6];
  float val[32];
};

// A warpgroup (4 warps) for wgmma: each thread's accumulator array and register A fragment.
struct WarpGroup {
  std::unique_ptr<std::barrier<>> bar;
  float* d[128];
  uint32_t a[128][4];
};

// The block's named barriers (bar.sync id, count): made at first use, each with its thread count.
struct NamedBarriers {
  std::mutex m;
  std::map<int, std::pair<int, std::unique_ptr<std::barrier<>>>> bars;
  std::barrier<>& get(int id, int count) {
    if (id <= 0 || id > 15 || count % 32 != 0) throw std::runtime_error("emulated named barrier: bad id or count");
    std::lock_guard<std::mutex> lock(m);
    auto& slot = bars[id];
    if (!slot.second) slot = {count, std::make_unique<std::barrier<>>(count)};
    if (slot.first != count) throw std::runtime_error("emulated named barrier: one id used with two thread counts");
    return *slot.second;
  }
};

struct PendingCopy {
  void* dst;
  const void* src;
  int bytes;
  int src_bytes;
};

// cp.reduce.async.bulk ... .add.f32 of `count` floats, run when a bulk wait_group retires its group.
struct PendingReduce {
  float* dst;
  const float* src;
  int count;
};

struct Thread {
  int tid = 0, lane = 0;
  dim3 block, grid, bdim;
  Warp* warp = nullptr;
  WarpGroup* wg = nullptr;  // null when the block is not a multiple of 128 threads
  std::barrier<>* block_bar = nullptr;
  NamedBarriers* named = nullptr;
  unsigned char* smem = nullptr;
  std::vector<std::vector<PendingCopy>> groups;  // committed groups, oldest first
  std::vector<PendingCopy> open;                 // copies not yet committed
  std::vector<std::vector<PendingReduce>> bulk_groups;  // committed bulk groups, oldest first
  std::vector<PendingReduce> bulk_open;                 // bulk reductions not yet committed
  std::map<uint64_t*, int64_t> tma_bytes;               // bulk tensor copies' bytes still to land, per mbarrier
};

inline thread_local Thread self;

inline void warp_sync() { self.warp->bar->arrive_and_wait(); }
inline void block_sync() { self.block_bar->arrive_and_wait(); }

// Misaligned operands fault on the device (cudaErrorMisalignedAddress); here they throw at the call.
inline void require_aligned(const void* p, uintptr_t align, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    throw std::runtime_error(std::string("emulated ") + what + ": address not " + std::to_string(align) + "-byte aligned");
}

inline void run_copy(const PendingCopy& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, c.src_bytes);
  if (c.bytes > c.src_bytes) std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, c.bytes - c.src_bytes);
}
inline void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  require_aligned(dst, bytes, "cp.async destination");
  if (src_bytes > 0) require_aligned(src, bytes, "cp.async source");
  self.open.push_back({dst, src, bytes, src_bytes});
}
inline void cp_commit() {
  self.groups.push_back(std::move(self.open));
  self.open.clear();
}
inline void cp_wait(int n) {
  while (static_cast<int>(self.groups.size()) > n) {
    for (const auto& c : self.groups.front()) run_copy(c);
    self.groups.erase(self.groups.begin());
  }
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lane l supplies the address of row (l % 8) of
// matrix l / 8; lane l receives, from matrix i, row l / 4, columns 2(l % 4), 2(l % 4) + 1
// (transposed: column l / 4, rows 2(l % 4), 2(l % 4) + 1), the lower column/row in the low half.
inline void ldmatrix_x4(uint32_t (&r)[4], const void* addr, bool trans) {
  require_aligned(addr, 16, "ldmatrix row");
  Warp& w = *self.warp;
  const int l = self.lane;
  w.ptr[l] = addr;
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      const uint16_t* row = static_cast<const uint16_t*>(w.ptr[8 * i + l / 4]);
      lo = row[2 * (l % 4)];
      hi = row[2 * (l % 4) + 1];
    } else {
      const uint16_t* r0 = static_cast<const uint16_t*>(w.ptr[8 * i + 2 * (l % 4)]);
      const uint16_t* r1 = static_cast<const uint16_t*>(w.ptr[8 * i + 2 * (l % 4) + 1]);
      lo = r0[l / 4];
      hi = r1[l / 4];
    }
    r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  warp_sync();
}

// stmatrix.sync.aligned.m8n8.x4(.trans).shared.b16, ldmatrix's inverse: lane l supplies the address
// of row (l % 8) of matrix l / 8; lane l's register i holds, of matrix i, row l / 4, columns
// 2(l % 4), 2(l % 4) + 1 (transposed: column l / 4 of rows 2(l % 4), 2(l % 4) + 1), low half first.
inline void stmatrix_x4(const uint32_t (&r)[4], void* addr, bool trans) {
  require_aligned(addr, 16, "stmatrix row");
  Warp& w = *self.warp;
  const int l = self.lane;
  w.ptr[l] = addr;
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    const uint16_t lo = static_cast<uint16_t>(r[i] & 0xffffu), hi = static_cast<uint16_t>(r[i] >> 16);
    if (!trans) {
      uint16_t* row = static_cast<uint16_t*>(const_cast<void*>(w.ptr[8 * i + l / 4]));
      row[2 * (l % 4)] = lo;
      row[2 * (l % 4) + 1] = hi;
    } else {
      static_cast<uint16_t*>(const_cast<void*>(w.ptr[8 * i + 2 * (l % 4)]))[l / 4] = lo;
      static_cast<uint16_t*>(const_cast<void*>(w.ptr[8 * i + 2 * (l % 4) + 1]))[l / 4] = hi;
    }
  }
  warp_sync();
}

inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}
inline float fp16_to_float(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}
inline uint16_t float_to_fp16(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: g = lane / 4, t = lane % 4.
// A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..);
// B: b0 (k = 2t..2t+1, n = g), b1 (k = 2t+8.., n = g); C/D: c0,c1 (g, 2t..), c2,c3 (g+8, 2t..).
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf16) {
  Warp& w = *self.warp;
  const int l = self.lane;
  for (int i = 0; i < 4; ++i) w.reg[l][i] = a[i];
  w.reg[l][4] = b[0];
  w.reg[l][5] = b[1];
  warp_sync();
  auto half_of = [&](uint32_t reg, int hi) -> float {
    uint16_t h = static_cast<uint16_t>(hi ? reg >> 16 : reg & 0xffffu);
    return bf16 ? bf16_to_float(h) : fp16_to_float(h);
  };
  auto A = [&](int row, int k) {
    int lane = (row % 8) * 4 + (k % 8) / 2;
    int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return half_of(w.reg[lane][reg], k % 2);
  };
  auto B = [&](int k, int n) {
    int lane = n * 4 + (k % 8) / 2;
    return half_of(w.reg[lane][4 + (k >= 8 ? 1 : 0)], k % 2);
  };
  const int g = l / 4, t = l % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
    float acc = d[i];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[i] = acc;
  }
  warp_sync();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// Shared-memory byte offset of a pointer into this block's (1024-byte-aligned) shared memory.
inline uint32_t smem_offset(const void* p) {
  return static_cast<uint32_t>(static_cast<const unsigned char*>(p) - self.smem);
}

// Element at byte offset `logical` of a 128B-swizzled operand: 16-byte chunk bits [4:6] XOR row bits [7:9].
inline uint16_t sw128_load(uint32_t logical) {
  const uint32_t physical = logical ^ (((logical >> 7) & 7u) << 4);
  uint16_t v;
  std::memcpy(&v, self.smem + physical, 2);
  return v;
}

struct SmemDesc {
  uint32_t start, lbo, sbo;
};
inline SmemDesc decode_desc(uint64_t desc) {
  if ((desc >> 62) != 1) throw std::runtime_error("emulated wgmma: only 128-byte-swizzled operands (layout type 1)");
  return {static_cast<uint32_t>(desc & 0x3FFF) << 4, static_cast<uint32_t>((desc >> 16) & 0x3FFF) << 4,
          static_cast<uint32_t>((desc >> 32) & 0x3FFF) << 4};
}

// wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{bf16,f16}: d (64 x n) = A (64 x 16) B (16 x n) (+ d).
// A: this thread's register fragment `a` (the mma.sync m16n8k16 A layout of its warp's 16 rows), or,
// when `a` is null, the K-major operand of `desc_a`. B: K-major (n rows of 16) or, with trans_b,
// MN-major (16 rows of n). Accumulator: d[4j + i] of thread 32w + l at row 16w + l/4 + 8(i/2),
// column 8j + 2(l%4) + i%2. All 128 threads of the warpgroup call it.
inline void wgmma(float* d, int n, const uint32_t* a, uint64_t desc_a, uint64_t desc_b, bool accumulate,
                  bool trans_b, bool bf16) {
  if (self.wg == nullptr) throw std::runtime_error("emulated wgmma: the block is not made of whole warpgroups");
  WarpGroup& g = *self.wg;
  const int t = self.tid % 128;
  g.d[t] = d;
  if (a != nullptr)
    for (int i = 0; i < 4; ++i) g.a[t][i] = a[i];
  g.bar->arrive_and_wait();
  if (t == 0) {
    auto half = [&](uint16_t h) { return bf16 ? bf16_to_float(h) : fp16_to_float(h); };
    const SmemDesc da = a == nullptr ? decode_desc(desc_a) : SmemDesc{}, db = decode_desc(desc_b);
    auto A = [&](int r, int k) -> float {
      if (a != nullptr) {
        const int rr = r % 16, lane = (rr % 8) * 4 + (k % 8) / 2, reg = (rr >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        const uint32_t v = g.a[(r / 16) * 32 + lane][reg];
        return half(static_cast<uint16_t>(k % 2 ? v >> 16 : v & 0xffffu));
      }
      return half(sw128_load(da.start + (r / 8) * da.sbo + (r % 8) * 128 + k * 2));
    };
    auto B = [&](int k, int c) -> float {
      if (trans_b) return half(sw128_load(db.start + (c / 64) * db.lbo + (k / 8) * db.sbo + (k % 8) * 128 + (c % 64) * 2));
      return half(sw128_load(db.start + (c / 8) * db.sbo + (c % 8) * 128 + k * 2));
    };
    auto acc = [&](int r, int c) -> float& {
      const int lane = (r % 8) * 4 + (c % 8) / 2, i = (r % 16 >= 8 ? 2 : 0) + c % 2;
      return g.d[(r / 16) * 32 + lane][4 * (c / 8) + i];
    };
    std::vector<float> out(64 * n);
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < n; ++c) {
        float sum = accumulate ? acc(r, c) : 0.f;
        for (int k = 0; k < 16; ++k) sum += A(r, k) * B(k, c);
        out[r * n + c] = sum;
      }
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < n; ++c) acc(r, c) = out[r * n + c];
  }
  g.bar->arrive_and_wait();
}

inline float shfl_xor(float v, int mask) {
  Warp& w = *self.warp;
  w.val[self.lane] = v;
  warp_sync();
  float r = w.val[self.lane ^ mask];
  warp_sync();
  return r;
}

// mbarrier on an 8-byte shared-memory word: bit 63 the phase, bits 32-62 the expected arrivals,
// bits 0-31 the arrivals still pending in this phase. A phase completes when its last arrival comes;
// try_wait.parity(P) answers whether the phase of parity P has completed (the current phase differs).
inline void mbar_init(uint64_t* bar, int count) {
  require_aligned(bar, 8, "mbarrier");
  std::atomic_ref<uint64_t>(*bar).store((static_cast<uint64_t>(count) << 32) | static_cast<uint32_t>(count));
}
inline void mbar_arrive(uint64_t* bar) {
  require_aligned(bar, 8, "mbarrier");
  std::atomic_ref<uint64_t> word(*bar);
  uint64_t v = word.load();
  for (;;) {
    const uint64_t phase = v >> 63, expected = (v >> 32) & 0x7FFFFFFFu, pending = v & 0xFFFFFFFFu;
    if (pending == 0) throw std::runtime_error("emulated mbarrier: more arrivals than expected");
    const uint64_t next = pending == 1 ? (((phase ^ 1) << 63) | (expected << 32) | expected)
                                       : ((phase << 63) | (expected << 32) | (pending - 1));
    if (word.compare_exchange_weak(v, next)) return;
  }
}
inline void mbar_wait_parity(uint64_t* bar, int parity) {
  require_aligned(bar, 8, "mbarrier");
  std::atomic_ref<uint64_t> word(*bar);
  while (static_cast<int>(word.load() >> 63) == parity) std::this_thread::yield();
}

// Bulk reduce-add from shared to global memory (cp.reduce.async.bulk, bulk_group): deferred until a
// cp.async.bulk.wait_group retires its group (the latest the hardware may read the shared source), so
// a source overwritten before that wait is caught; the adds are atomic (other threads and blocks add
// to the same rows). A thread that exits with reductions pending is an error, as on the device.
inline void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
  require_aligned(dst, 16, "bulk reduction destination");
  require_aligned(src, 16, "bulk reduction source");
  if (bytes % 16 != 0) throw std::runtime_error("emulated bulk reduction: size not a multiple of 16 bytes");
  self.bulk_open.push_back({dst, src, bytes / 4});
}
inline void bulk_commit() {
  self.bulk_groups.push_back(std::move(self.bulk_open));
  self.bulk_open.clear();
}
inline void bulk_wait(int n) {
  while (static_cast<int>(self.bulk_groups.size()) > n) {
    for (const auto& r : self.bulk_groups.front())
      for (int i = 0; i < r.count; ++i) std::atomic_ref<float>(r.dst[i]).fetch_add(r.src[i]);
    self.bulk_groups.erase(self.bulk_groups.begin());
  }
}

// Bulk tensor copies (TMA) completing on an mbarrier. mbarrier.arrive.expect_tx by this thread announces
// `bytes`; each copy lands at once (synchronously) and counts them down; the arrival itself is made when
// they have all landed, so waiters see the phase complete only with the data in place (on the device
// the phase completes when the arrival and the transaction count are both done). A copy onto a
// barrier this thread announced nothing on, or more bytes than announced, is an error.
//
// The emulated descriptors (dkv::TmaDesc words), word 7 their kind. Kind 0, a 3-D view of 16-bit
// elements: 0 the base pointer, 1 the row stride, 2 the head stride (elements), 3 rows, 4 heads, 5
// columns, 6 box rows; a box is 64 columns (128 bytes) of one head by `box rows` rows, written
// 128B-swizzled (chunk c of row r at c ^ (r % 8)); rows or heads outside the tensor read as zeros, as
// the device's out-of-bounds fill does. Kind 1, a flat fp32 vector: 0 the base pointer, 1 its length,
// 2 the box length; a box starts at a multiple of 4 elements (16 bytes); elements past the end read
// as zeros.
constexpr uint64_t kTmaBox3d = 0, kTmaVec = 1;
inline void tma_expect_tx(uint64_t* bar, int bytes) {
  require_aligned(bar, 8, "mbarrier");
  self.tma_bytes[bar] += bytes;
}
// A copy of `bytes` onto `bar` has landed: count them down; the announced arrival once all have.
inline void tma_landed(uint64_t* bar, int64_t bytes) {
  auto it = self.tma_bytes.find(bar);
  if (it == self.tma_bytes.end() || it->second < bytes)
    throw std::runtime_error("emulated bulk tensor copy: more bytes than the mbarrier was told to expect");
  if ((it->second -= bytes) == 0) {
    self.tma_bytes.erase(it);
    mbar_arrive(bar);
  }
}
inline void tma_load_box(void* dst, const uint64_t* desc, int col, int head, int row, uint64_t* bar) {
  require_aligned(dst, 1024, "bulk tensor copy destination (128B swizzle)");
  const auto* base = reinterpret_cast<const uint16_t*>(desc[0]);
  const int64_t row_stride = static_cast<int64_t>(desc[1]), head_stride = static_cast<int64_t>(desc[2]);
  const int64_t rows = static_cast<int64_t>(desc[3]), heads = static_cast<int64_t>(desc[4]), cols = static_cast<int64_t>(desc[5]);
  const int box_rows = static_cast<int>(desc[6]);
  if (desc[7] != kTmaBox3d) throw std::runtime_error("emulated bulk tensor copy: a box copy from a vector's descriptor");
  if (col % 8 != 0 || col < 0 || col + 64 > cols) throw std::runtime_error("emulated bulk tensor copy: box columns outside the tensor");
  auto* out = static_cast<unsigned char*>(dst);
  for (int r = 0; r < box_rows; ++r) {
    const int64_t gr = static_cast<int64_t>(row) + r;
    const bool inside = gr >= 0 && gr < rows && head >= 0 && head < heads;
    for (int c = 0; c < 8; ++c) {
      unsigned char* d = out + r * 128 + ((c ^ (r & 7)) << 4);
      if (inside)
        std::memcpy(d, base + gr * row_stride + head * head_stride + col + 8 * c, 16);
      else
        std::memset(d, 0, 16);
    }
  }
  tma_landed(bar, static_cast<int64_t>(box_rows) * 128);
}
inline void tma_load_vec(float* dst, const uint64_t* desc, int start, uint64_t* bar) {
  require_aligned(dst, 128, "bulk tensor copy destination");
  if (desc[7] != kTmaVec) throw std::runtime_error("emulated bulk tensor copy: a vector copy from a box descriptor");
  const auto* base = reinterpret_cast<const float*>(desc[0]);
  const int64_t n = static_cast<int64_t>(desc[1]), box = static_cast<int64_t>(desc[2]);
  // On an H200 a box at an element not 16-byte aligned stopped the kernel (illegal instruction).
  if (start < 0 || start % 4 != 0 || box * 4 % 16 != 0)
    throw std::runtime_error("emulated bulk tensor copy: a vector box not starting or ending on 16 bytes");
  for (int64_t i = 0; i < box; ++i) dst[i] = start + i < n ? base[start + i] : 0.f;
  tma_landed(bar, box * 4);
}

// bar.sync id, count (ids 1 .. 15; 0 is the block's barrier).
inline void named_sync(int id, int count) {
  self.named->get(id, count).arrive_and_wait();
}

// bar.arrive id, count: counts towards the barrier's current phase without waiting for it.
inline void named_arrive(int id, int count) {
  (void)self.named->get(id, count).arrive();
}

// bar.sync over the 128 threads of this thread's warpgroup.
inline void warpgroup_sync() {
  if (self.wg == nullptr) throw std::runtime_error("emulated warpgroup barrier: the block is not made of whole warpgroups");
  self.wg->bar->arrive_and_wait();
}

// __any_sync over the whole warp.
inline bool warp_any(bool pred) {
  Warp& w = *self.warp;
  w.val[self.lane] = pred ? 1.f : 0.f;
  warp_sync();
  bool any = false;
  for (int l = 0; l < 32; ++l) any = any || w.val[l] != 0.f;
  warp_sync();
  return any;
}

// Runs every block of the grid in turn, each with one OS thread per CUDA thread.
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  if (nthreads % 32 != 0) throw std::runtime_error("emulated launch: block size must be a multiple of 32");
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::vector<unsigned char> smem(smem_bytes + 1024, 0xCD);  // garbage, as on the device
        unsigned char* smem_base = smem.data() + (1024 - reinterpret_cast<uintptr_t>(smem.data()) % 1024) % 1024;
        std::barrier<> block_bar(nthreads);
        NamedBarriers named;
        std::vector<Warp> warps(nthreads / 32);
        for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
        std::vector<WarpGroup> groups(nthreads % 128 == 0 ? nthreads / 128 : 0);
        for (auto& wg : groups) wg.bar = std::make_unique<std::barrier<>>(128);
        std::vector<std::thread> threads;
        threads.reserve(nthreads);
        for (int t = 0; t < nthreads; ++t) {
          threads.emplace_back([&, t] {
            self = Thread{};
            self.tid = t;
            self.lane = t % 32;
            self.block = dim3(bx, by, bz);
            self.grid = grid;
            self.bdim = block;
            self.warp = &warps[t / 32];
            self.wg = groups.empty() ? nullptr : &groups[t / 128];
            self.block_bar = &block_bar;
            self.named = &named;
            self.smem = smem_base;
            body();
            cp_commit();
            cp_wait(0);
            if (!self.bulk_open.empty() || !self.bulk_groups.empty())
              throw std::runtime_error("emulated bulk reduction: a thread exited before waiting for it");
            if (!self.tma_bytes.empty())
              throw std::runtime_error("emulated mbarrier: a thread exited with announced bytes that never landed");
          });
        }
        for (auto& th : threads) th.join();
      }
}

}  // namespace dkv_emu
