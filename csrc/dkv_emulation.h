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
// tests/gpu/test_wgmma_gpu.py), and thread block clusters (launch_cluster: the blocks of a cluster run
// at once; barrier.cluster, mapa, st.async and mbarrier arrivals into a peer's shared memory,
// multicast bulk tensor copies; csrc/dkv_cluster.cuh). Every warp collective waits for all 32
// lanes (a divergent collective deadlocks instead of silently passing). Slow by design: a debugging
// tool for small shapes, never a product path.
#pragma once

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
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

// The blocks of one cluster, run at once: each block's shared memory (at the same size), the cluster's
// barrier (barrier.cluster over all their threads) and each block's threads still running (a block's
// shared memory may not be reached from a peer once the block has exited).
struct Cluster {
  size_t smem_bytes = 0;
  std::vector<unsigned char*> smem;  // one per block: its size is the cluster's
  std::unique_ptr<std::barrier<>> bar;
  std::unique_ptr<std::atomic<int>[]> running;
};

struct Thread {
  int tid = 0, lane = 0;
  dim3 block, grid, bdim;
  Cluster* cluster = nullptr;
  int cta_rank = 0;                                         // %cluster_ctarank
  std::optional<std::barrier<>::arrival_token> cluster_arrival;  // barrier.cluster.arrive without its wait yet
  Warp* warp = nullptr;
  WarpGroup* wg = nullptr;  // null when the block is not a multiple of 128 threads
  std::barrier<>* block_bar = nullptr;
  NamedBarriers* named = nullptr;
  unsigned char* smem = nullptr;
  std::vector<std::vector<PendingCopy>> groups;  // committed groups, oldest first
  std::vector<PendingCopy> open;                 // copies not yet committed
  std::vector<std::vector<PendingReduce>> bulk_groups;  // committed bulk groups, oldest first
  std::vector<PendingReduce> bulk_open;                 // bulk reductions not yet committed
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
// A wait that sees no completion for kWaitLimit ends the process with a message (a phase that never
// completes would otherwise hang the emulation for good).
constexpr std::chrono::seconds kWaitLimit{300};
inline void mbar_wait_parity(uint64_t* bar, int parity) {
  require_aligned(bar, 8, "mbarrier");
  std::atomic_ref<uint64_t> word(*bar);
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t spins = 1; static_cast<int>(word.load() >> 63) == parity; ++spins) {
    std::this_thread::yield();
    if (spins % (1 << 20) == 0 && std::chrono::steady_clock::now() - start > kWaitLimit)
      throw std::runtime_error("emulated mbarrier: a phase did not complete in " + std::to_string(kWaitLimit.count()) +
                               " s (a deadlock: arrivals or transaction bytes that never come)");
  }
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

// Bulk tensor copies (TMA) and st.async completing on an mbarrier: its transaction count. An
// arrival with expect_tx announces `bytes`; each copy lands at once (synchronously) and counts them
// down; the announcing arrivals of a phase are made when its count is back at zero, so waiters see
// the phase complete only with the data in place (on the device the phase completes when the arrivals
// and the transaction count are both done). Bytes may land before they are announced when a cluster
// peer sends them (st.async, multicast copies): the count goes below zero until the announcement.
// A copy of this block's own onto a barrier nobody announced the bytes on, or more bytes than
// announced, is an error; so are bytes still expected when the launch ends.
//
// The emulated descriptors (dkv::TmaDesc words), word 7 their kind. Kind 0, a 3-D view of 16-bit
// elements: 0 the base pointer, 1 the row stride, 2 the head stride (elements), 3 rows, 4 heads, 5
// columns, 6 box rows; a box is 64 columns (128 bytes) of one head by `box rows` rows, written
// 128B-swizzled (chunk c of row r at c ^ (r % 8)); rows or heads outside the tensor read as zeros, as
// the device's out-of-bounds fill does. Kind 1, a flat fp32 vector: 0 the base pointer, 1 its length,
// 2 the box length; a box starts at a multiple of 4 elements (16 bytes); elements past the end read
// as zeros.
constexpr uint64_t kTmaBox3d = 0, kTmaVec = 1;

struct Transactions {
  int64_t bytes = 0;  // announced and not yet landed (below zero: landed before their announcement)
  int arrivals = 0;   // announcing arrivals waiting for the count to reach zero
};
struct TransactionTable {
  std::mutex m;
  std::map<const uint64_t*, Transactions> bars;
};
inline TransactionTable& transactions() {
  static TransactionTable table;
  return table;
}

inline void tma_expect_tx(uint64_t* bar, int bytes) {
  require_aligned(bar, 8, "mbarrier");
  TransactionTable& t = transactions();
  std::lock_guard<std::mutex> lock(t.m);
  Transactions& tx = t.bars[bar];
  tx.bytes += bytes;
  if (tx.bytes == 0) {  // a peer's bytes all came first
    t.bars.erase(bar);
    mbar_arrive(bar);
  } else {
    ++tx.arrivals;
  }
}
// `bytes` have landed in the shared memory of `bar`'s block. `own`: a copy this block issued onto its
// own barrier, which must have been announced first.
inline void complete_tx(uint64_t* bar, int64_t bytes, bool own) {
  TransactionTable& t = transactions();
  std::lock_guard<std::mutex> lock(t.m);
  Transactions& tx = t.bars[bar];
  if (own && tx.bytes < bytes) {
    t.bars.erase(bar);
    throw std::runtime_error("emulated bulk tensor copy: more bytes than the mbarrier was told to expect");
  }
  tx.bytes -= bytes;
  if (tx.bytes == 0) {
    const int arrivals = tx.arrivals;
    t.bars.erase(bar);
    for (int i = 0; i < arrivals; ++i) mbar_arrive(bar);
  }
}
inline void tma_landed(uint64_t* bar, int64_t bytes) { complete_tx(bar, bytes, true); }
// The barriers in [lo, hi) whose transactions never finished (and forgets them): at a launch's end.
inline int unfinished_transactions(const unsigned char* lo, const unsigned char* hi) {
  TransactionTable& t = transactions();
  std::lock_guard<std::mutex> lock(t.m);
  int n = 0;
  for (auto it = t.bars.begin(); it != t.bars.end();) {
    const auto* p = reinterpret_cast<const unsigned char*>(it->first);
    if (p >= lo && p < hi) {
      ++n;
      it = t.bars.erase(it);
    } else {
      ++it;
    }
  }
  return n;
}

// One box of a kind-0 descriptor into 128B-swizzled shared memory at `dst`; returns its bytes.
inline int64_t copy_box(void* dst, const uint64_t* desc, int col, int head, int row) {
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
  return static_cast<int64_t>(box_rows) * 128;
}
inline void tma_load_box(void* dst, const uint64_t* desc, int col, int head, int row, uint64_t* bar) {
  tma_landed(bar, copy_box(dst, desc, col, head, row));
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

// Thread block clusters. A shared-memory address of this block mapped to the same offset in the
// block of rank `rank` of its cluster (mapa); the cluster's barrier, split into its arrival and its wait
// (barrier.cluster.arrive / .wait: the wait completes once every thread of the cluster has arrived).
inline unsigned char* map_shared_rank(const void* p, int rank) {
  const Cluster& c = *self.cluster;
  const auto* q = static_cast<const unsigned char*>(p);
  if (q < self.smem || q >= self.smem + c.smem_bytes)
    throw std::runtime_error("emulated mapa: the address is not in this block's shared memory");
  if (rank < 0 || rank >= static_cast<int>(c.smem.size())) throw std::runtime_error("emulated mapa: no block of that rank in the cluster");
  return c.smem[rank] + (q - self.smem);
}
// The rank of the block whose shared memory holds `p` (an address mapa returned); its threads must
// still be running.
inline int peer_of(const void* p, const char* what) {
  const Cluster& c = *self.cluster;
  const auto* q = static_cast<const unsigned char*>(p);
  for (size_t r = 0; r < c.smem.size(); ++r)
    if (q >= c.smem[r] && q < c.smem[r] + c.smem_bytes) {
      if (c.running[r].load() == 0)
        throw std::runtime_error(std::string("emulated ") + what + ": the target block of the cluster has exited");
      return static_cast<int>(r);
    }
  throw std::runtime_error(std::string("emulated ") + what + ": the address is in no shared memory of this cluster");
}
inline void cluster_arrive() {
  if (self.cluster_arrival) throw std::runtime_error("emulated barrier.cluster: arrived twice without waiting");
  self.cluster_arrival.emplace(self.cluster->bar->arrive());
}
inline void cluster_wait() {
  if (!self.cluster_arrival) throw std::runtime_error("emulated barrier.cluster: a wait without an arrival");
  self.cluster->bar->wait(std::move(*self.cluster_arrival));
  self.cluster_arrival.reset();
}
// st.async.shared::cluster.mbarrier::complete_tx::bytes of `bytes` (4, 8 or 16) to a peer's shared
// memory, counted down on the peer's mbarrier `bar` (both addresses from map_shared_rank).
inline void st_async(void* dst, const void* src, int bytes, uint64_t* bar) {
  require_aligned(dst, bytes, "st.async destination");
  require_aligned(bar, 8, "mbarrier");
  const int r = peer_of(dst, "st.async");
  if (peer_of(bar, "st.async's mbarrier") != r)
    throw std::runtime_error("emulated st.async: the data and the mbarrier are in different blocks");
  std::memcpy(dst, src, bytes);
  complete_tx(bar, bytes, false);
}
// mbarrier.arrive.release.cluster on a barrier of any block of the cluster (an address from map_shared_rank).
inline void mbar_arrive_cluster(uint64_t* bar) {
  (void)peer_of(bar, "mbarrier arrival");
  mbar_arrive(bar);
}
// A multicast bulk tensor copy: the box lands at dst's offset in every block of `mask` and counts down
// the mbarrier at bar's offset in each of them.
inline void tma_load_box_multicast(void* dst, const uint64_t* desc, int col, int head, int row, uint64_t* bar,
                                   uint16_t mask) {
  const Cluster& c = *self.cluster;
  const int size = static_cast<int>(c.smem.size());
  if (mask == 0 || (mask >> size) != 0) throw std::runtime_error("emulated multicast copy: a mask outside the cluster");
  for (int r = 0; r < size; ++r) {
    if (!(mask >> r & 1)) continue;
    auto* peer_bar = reinterpret_cast<uint64_t*>(map_shared_rank(bar, r));
    (void)peer_of(peer_bar, "multicast copy");
    complete_tx(peer_bar, copy_box(map_shared_rank(dst, r), desc, col, head, row), r == self.cta_rank);
  }
}

// One block's state while it runs: shared memory (garbage, as on the device), barriers, warps.
struct Block {
  std::vector<unsigned char> smem_buf;
  unsigned char* smem = nullptr;
  std::barrier<> block_bar;
  NamedBarriers named;
  std::vector<Warp> warps;
  std::vector<WarpGroup> groups;
  Block(size_t smem_bytes, int nthreads) : smem_buf(smem_bytes + 1024, 0xCD), block_bar(nthreads), warps(nthreads / 32) {
    smem = smem_buf.data() + (1024 - reinterpret_cast<uintptr_t>(smem_buf.data()) % 1024) % 1024;
    for (auto& w : warps) w.bar = std::make_unique<std::barrier<>>(32);
    groups = std::vector<WarpGroup>(nthreads % 128 == 0 ? nthreads / 128 : 0);
    for (auto& wg : groups) wg.bar = std::make_unique<std::barrier<>>(128);
  }
};

// Runs the grid cluster by cluster (clusters of cluster_x consecutive blocks along x, which must divide
// grid.x), the blocks of a cluster at once, each block with one OS thread per CUDA thread.
inline void launch_cluster(dim3 grid, dim3 block, int cluster_x, size_t smem_bytes, const std::function<void()>& body) {
  const int nthreads = static_cast<int>(block.x * block.y * block.z);
  if (nthreads % 32 != 0) throw std::runtime_error("emulated launch: block size must be a multiple of 32");
  if (cluster_x < 1 || cluster_x > 8 || grid.x % cluster_x != 0)
    throw std::runtime_error("emulated launch: the cluster size must be 1 .. 8 and divide the grid's x");
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx0 = 0; bx0 < grid.x; bx0 += cluster_x) {
        std::vector<std::unique_ptr<Block>> blocks;
        Cluster cluster;
        cluster.smem_bytes = smem_bytes;
        cluster.bar = std::make_unique<std::barrier<>>(cluster_x * nthreads);
        cluster.running = std::make_unique<std::atomic<int>[]>(cluster_x);
        for (int r = 0; r < cluster_x; ++r) {
          blocks.push_back(std::make_unique<Block>(smem_bytes, nthreads));
          cluster.smem.push_back(blocks.back()->smem);
          cluster.running[r].store(nthreads);
        }
        std::vector<std::thread> threads;
        threads.reserve(cluster_x * nthreads);
        for (int r = 0; r < cluster_x; ++r)
          for (int t = 0; t < nthreads; ++t) {
            threads.emplace_back([&, r, t] {
              Block& b = *blocks[r];
              self = Thread{};
              self.tid = t;
              self.lane = t % 32;
              self.block = dim3(bx0 + r, by, bz);
              self.grid = grid;
              self.bdim = block;
              self.cluster = &cluster;
              self.cta_rank = r;
              self.warp = &b.warps[t / 32];
              self.wg = b.groups.empty() ? nullptr : &b.groups[t / 128];
              self.block_bar = &b.block_bar;
              self.named = &b.named;
              self.smem = b.smem;
              body();
              cp_commit();
              cp_wait(0);
              if (!self.bulk_open.empty() || !self.bulk_groups.empty())
                throw std::runtime_error("emulated bulk reduction: a thread exited before waiting for it");
              if (self.cluster_arrival)
                throw std::runtime_error("emulated barrier.cluster: a thread exited between its arrival and its wait");
              cluster.running[r].fetch_sub(1);
            });
          }
        for (auto& th : threads) th.join();
        int unfinished = 0;
        for (int r = 0; r < cluster_x; ++r) unfinished += unfinished_transactions(cluster.smem[r], cluster.smem[r] + smem_bytes);
        if (unfinished > 0)
          throw std::runtime_error("emulated mbarrier: the launch ended with a transaction count not at zero (bytes "
                                   "announced that never landed, or landed and never announced)");
      }
}

// Runs every block of the grid in turn (clusters of one block).
inline void launch(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  launch_cluster(grid, block, 1, smem_bytes, body);
}

}  // namespace dkv_emu
