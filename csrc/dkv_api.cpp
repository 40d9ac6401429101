// Torch binding of the DualKV CUDA kernels: ops torch.ops.dualkv_cuda.fwd / bwd.
//
// Thin launcher layer: checks (clear errors naming the argument), allocation, the work decomposition
// (tile prefix sums computed on the device, never a host sync of the metadata, planned once per layout
// and kept: PlanCache), then the kernels.
// The Python backend (dualkv.core.backends.cuda) is the only caller.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/library.h>

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#ifndef DKV_EMULATE
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "dkv_launch.h"

#ifdef DKV_EMULATE
#define DKV_OPS_NAMESPACE dualkv_cuda_emu
#define DKV_DISPATCH_KEY CPU
#else
#define DKV_OPS_NAMESPACE dualkv_cuda
#define DKV_DISPATCH_KEY CUDA
#endif

namespace dkv {
namespace {

using at::Tensor;

constexpr const char* kOps = "torch.ops.dualkv_cuda";

// Error text built without std::ostream's number inserters: in the GPU build on the H200 machine,
// c10::str of a number (an int, a shape, a dtype's size) ran this library's own copy of
// std::ostream::_M_insert<long> and crashed inside it, so every message with a number segfaulted
// instead of raising (a string goes through c10 unharmed). Integers by std::to_string, doubles by
// snprintf, shapes as [a, b, c], dtypes and devices by c10's own names.
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, const std::string& v) { s += v; }
template <class T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
void append(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void append(std::string& s, const c10::Device& v) { s += v.str(); }
template <class... Args>
std::string error_text(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}
// TORCH_CHECK with its message made by error_text (evaluated only when the check fails).
#define DKV_CHECK(cond, ...) TORCH_CHECK(cond, ::dkv::error_text(__VA_ARGS__))

void check_qkv_like(const Tensor& t, const char* name, const Tensor& q, int64_t heads, int64_t rows) {
  DKV_CHECK(t.dim() == 3, kOps, ": ", name, ": expected a 3-D tensor (tokens, heads, headdim), got shape ", t.sizes());
  DKV_CHECK(t.scalar_type() == q.scalar_type(), kOps, ": ", name, ": expected dtype ", q.scalar_type(), " like q, got ",
              t.scalar_type());
  DKV_CHECK(t.device() == q.device(), kOps, ": ", name, ": expected device ", q.device(), " like q, got ", t.device());
  DKV_CHECK(t.size(2) == q.size(2), kOps, ": ", name, ": expected headdim ", q.size(2), ", got ", t.size(2));
  if (heads >= 0) DKV_CHECK(t.size(1) == heads, kOps, ": ", name, ": expected ", heads, " heads, got ", t.size(1));
  if (rows >= 0) DKV_CHECK(t.size(0) == rows, kOps, ": ", name, ": expected ", rows, " rows, got ", t.size(0));
  DKV_CHECK(t.stride(2) == 1, kOps, ": ", name, ": expected a contiguous last (headdim) dimension, got strides ", t.strides());
  DKV_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0, kOps,
              ": ", name, ": expected 16-byte aligned rows (data pointer and row/head strides multiples of 8 elements), got "
              "strides ", t.strides(), "; pass a .contiguous() tensor");
}

TensorRef ref(const Tensor& t) { return TensorRef{t.data_ptr(), t.stride(0), t.stride(1)}; }

// An encoder's status as an error naming the form that asked for the copies (`what`) and the tensor.
void check_tma_status(int status, const char* what, const char* name, const Tensor& t) {
  const std::string why = status < 0 ? "the driver has no cuTensorMapEncodeTiled"
                                     : "cuTensorMapEncodeTiled failed (CUresult " + std::to_string(status) + ")";
  DKV_CHECK(status == 0, kOps, ": ", what, " (bulk tensor copies): ", name, ": ", why, " for shape ", t.sizes(),
              " and strides ", t.strides());
}

// The bulk-tensor-copy descriptor of a (rows, heads, head dim) tensor read in boxes of 64 columns x
// box_rows rows (the TMA forward, DUALKV_CUDA_WGMMA=3, and dK/dV kernel, DUALKV_CUDA_BWD_TMA=1). The
// 16-byte aligned rows and heads the copy engine needs are what check_qkv_like already asked of q, k,
// v, dout and the context tensors.
int encode_box(TmaDesc& d, const Tensor& t, int box_rows) {  // the encoder's status
  return encode_tma_desc(d, t.data_ptr(), t.scalar_type() == at::kBFloat16, t.size(0), t.size(1), t.size(2), t.stride(0),
                         t.stride(1), box_rows);
}

// The bulk-tensor-copy maps of one kernel launch, the forward's and the dK/dV kernel's alike. When the
// form was asked for by its variable (`asked`), a map the driver cannot build is an error naming the
// form (`what`) and the tensor; by default `built` turns false and the caller runs its cp.async form.
struct TmaMaps {
  bool asked;
  const char* what;
  bool built = true;
  // (rows, heads, head dim) tensor t in boxes of 64 columns x box_rows rows.
  void box(TmaDesc& d, const Tensor& t, const char* name, int box_rows) {
    if (built) note(encode_box(d, t, box_rows), name, t);
  }
  // A contiguous fp32 workspace read flat in boxes of `box` elements.
  void vec(TmaDesc& d, const Tensor& t, const char* name, int box) {
    if (built) note(encode_tma_vec(d, t.data_ptr<float>(), t.numel(), box), name, t);
  }
  // k, v and the context's keys of a launch (FwdParams or BwdParams): k_ctx / v_ctx when separate,
  // else the maps of k / v (context keys are rows of k / v).
  template <class Params>
  void keys(Params& p, const Tensor& k, const Tensor& v, const std::optional<Tensor>& k_ctx,
            const std::optional<Tensor>& v_ctx, int box_rows) {
    keys_into(p.tma_k, p.tma_v, p.tma_k_ctx, p.tma_v_ctx, k, v, k_ctx, v_ctx, box_rows);
  }
  // The same into four given maps (the merged walk's 16-row boxes, FwdParams::tma_k16 ...).
  void keys_into(TmaDesc& dk, TmaDesc& dv, TmaDesc& dk_ctx, TmaDesc& dv_ctx, const Tensor& k, const Tensor& v,
                 const std::optional<Tensor>& k_ctx, const std::optional<Tensor>& v_ctx, int box_rows) {
    box(dk, k, "k", box_rows);
    box(dv, v, "v", box_rows);
    if (k_ctx) {
      box(dk_ctx, *k_ctx, "k_ctx", box_rows);
      box(dv_ctx, *v_ctx, "v_ctx", box_rows);
    } else {
      dk_ctx = dk;
      dv_ctx = dv;
    }
  }
  void note(int status, const char* name, const Tensor& t) {
    if (asked) check_tma_status(status, what, name, t);
    built = status == 0;
  }
};

void check_meta(const Tensor& t, const char* name, const Tensor& q, int64_t n) {
  DKV_CHECK(t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous(), kOps, ": ", name,
              ": expected a contiguous 1-D int32 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  DKV_CHECK(t.device() == q.device(), kOps, ": ", name, ": expected device ", q.device(), ", got ", t.device());
  if (n >= 0) DKV_CHECK(t.size(0) == n, kOps, ": ", name, ": expected ", n, " entries, got ", t.size(0));
}

// Shared checks and the kernel-facing view of the inputs.
AttnArgs make_args(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& k_ctx,
                   const std::optional<Tensor>& v_ctx, const Tensor& cu, const Tensor& seg_ctx_start,
                   const Tensor& seg_ctx_len, const Tensor& ctx_key_start, const Tensor& ctx_key_len,
                   const Tensor& ctx_reader_start, const Tensor& ctx_reader_end, double scale, int64_t window,
                   double softcap) {
  DKV_CHECK(q.dim() == 3, kOps, ": q: expected a 3-D tensor (tokens, heads, headdim), got shape ", q.sizes());
  DKV_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, kOps,
              ": q: expected float16 or bfloat16, got ", q.scalar_type());
#ifdef DKV_EMULATE
  DKV_CHECK(q.device().is_cpu(), kOps, ": q: the emulation build runs on CPU tensors");
#else
  DKV_CHECK(q.is_cuda(), kOps, ": q: expected a CUDA tensor, got device ", q.device());
#endif
  const int64_t T = q.size(0), H = q.size(1), d = q.size(2);
  DKV_CHECK(supported_head_dim(static_cast<int>(d)), kOps, ": q: headdim ", d,
              " is not supported; expected one of 64, 96, 128, 192, 256, 512");
  check_qkv_like(q, "q", q, -1, -1);
  check_qkv_like(k, "k", q, -1, T);
  const int64_t Hkv = k.size(1);
  DKV_CHECK(Hkv >= 1 && H % Hkv == 0, kOps, ": k: expected nheads_k to divide nheads, got ", H, " and ", Hkv);
  check_qkv_like(v, "v", q, Hkv, T);
  DKV_CHECK(k_ctx.has_value() == v_ctx.has_value(), kOps, ": k_ctx/v_ctx: expected both or neither");
  int64_t total_ctx = T;
  if (k_ctx.has_value()) {
    check_qkv_like(*k_ctx, "k_ctx", q, Hkv, -1);
    check_qkv_like(*v_ctx, "v_ctx", q, Hkv, k_ctx->size(0));
    total_ctx = k_ctx->size(0);
  }
  DKV_CHECK(T + total_ctx < (int64_t{1} << 29), kOps, ": q: expected fewer than 2^29 tokens (with the context), got ",
              T + total_ctx);
  check_meta(cu, "cu_seqlens", q, -1);
  DKV_CHECK(cu.size(0) >= 1, kOps, ": cu_seqlens: expected at least one entry");
  const int64_t S = cu.size(0) - 1;
  check_meta(seg_ctx_start, "seg_ctx_start", q, S);
  check_meta(seg_ctx_len, "seg_ctx_len", q, S);
  check_meta(ctx_key_start, "ctx_key_start", q, -1);
  const int64_t C = ctx_key_start.size(0);
  check_meta(ctx_key_len, "ctx_key_len", q, C);
  check_meta(ctx_reader_start, "ctx_reader_start", q, C);
  check_meta(ctx_reader_end, "ctx_reader_end", q, C);
  DKV_CHECK(scale > 0, kOps, ": softmax_scale: expected a positive number, got ", scale);

  AttnArgs a;
  a.q = ref(q);
  a.k = ref(k);
  a.v = ref(v);
  a.ctx_separate = k_ctx.has_value();
  a.k_ctx = a.ctx_separate ? ref(*k_ctx) : a.k;
  a.v_ctx = a.ctx_separate ? ref(*v_ctx) : a.v;
  a.layout.cu_seqlens = cu.data_ptr<int>();
  a.layout.seg_ctx_start = seg_ctx_start.data_ptr<int>();
  a.layout.seg_ctx_len = seg_ctx_len.data_ptr<int>();
  a.layout.ctx_key_start = ctx_key_start.data_ptr<int>();
  a.layout.ctx_key_len = ctx_key_len.data_ptr<int>();
  a.layout.ctx_reader_start = ctx_reader_start.data_ptr<int>();
  a.layout.ctx_reader_end = ctx_reader_end.data_ptr<int>();
  a.layout.num_segments = static_cast<int>(S);
  a.layout.num_ctx = static_cast<int>(C);
  a.total_q = static_cast<int>(T);
  a.total_ctx = static_cast<int>(total_ctx);
  a.nheads = static_cast<int>(H);
  a.nheads_kv = static_cast<int>(Hkv);
  a.head_dim = static_cast<int>(d);
  a.scale = static_cast<float>(scale);
  a.softcap = softcap > 0 ? static_cast<float>(softcap) : 0.f;
  a.window = (window <= 0 || window >= kNoWindow) ? kNoWindow : static_cast<int>(window);
  return a;
}

// (S+1,) int32 prefix sums of ceil(count / block), computed on the device.
Tensor prefix_of(const Tensor& counts, int block) {
  Tensor prefix = at::zeros({counts.size(0) + 1}, counts.options().dtype(at::kInt));
  if (counts.size(0) > 0) {
    Tensor tiles = at::div(counts + (block - 1), block, "floor");
    prefix.slice(0, 1).copy_(at::cumsum(tiles, 0, at::kInt));
  }
  return prefix;
}

Tensor segment_lengths(const Tensor& cu) { return cu.slice(0, 1) - cu.slice(0, 0, -1); }

int grid_tiles_bound(int64_t T, int64_t S, int block) {
  const int64_t bound = (T + S * (block - 1)) / block;
  DKV_CHECK(bound < std::numeric_limits<int>::max(), kOps, ": too many query tiles (", bound, ")");
  return static_cast<int>(bound);
}

cudaStream_t current_stream() {
#ifdef DKV_EMULATE
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream().stream();
#endif
}

void check_launch(cudaError_t err, const char* what) {
#ifdef DKV_EMULATE
  DKV_CHECK(err == cudaSuccess, kOps, ": ", what, " failed");
#else
  DKV_CHECK(err == cudaSuccess, kOps, ": ", what, " launch failed: ", cudaGetErrorString(err));
#endif
}

// An environment variable's value ("" when unset).
std::string env_value(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? "" : value;
}

// The reader chunks of the default (atomic) backward, as BwdParams::chunk_end, computed on the device.
// Consecutive segments that read the same context region form a run; a run is cut into chunks where a
// segment's first row crosses a multiple of `rows` rows from the run's start, and one dK/dV item per
// chunk and context tile walks all of the chunk's readers. With short responses (say 500 rows, 32 query
// tiles over a GQA group of 4 heads) an item a response spends a large share of its time loading its
// K / V and adding its 128 x d partial dK / dV with fp32 atomics; a chunk of 4 does that once.
// rows <= 0: every segment is its own chunk. A segment whose context is longer than kChunkMaxContext
// keys is its own chunk too: on an H200 chunks of 4096 or 8192 rows made the backward 3-4% slower at
// P = 64K and 128K (16 responses of 2K) while they saved 2-5% at P <= 32K
// (benchmarks/results/raw/profile_h200_reader_chunks.log).
constexpr int64_t kChunkMaxContext = 32768;

Tensor reader_chunk_end(const Tensor& cu_seqlens, const Tensor& seg_ctx_start, const Tensor& seg_ctx_len,
                        int64_t rows) {
  const int64_t S = seg_ctx_len.size(0);
  const Tensor idx = at::arange(S, seg_ctx_len.options().dtype(at::kLong));
  if (rows <= 0 || S < 2) return (idx + 1).to(at::kInt);
  const Tensor start = seg_ctx_start.to(at::kLong), len = seg_ctx_len.to(at::kLong);
  // same[s]: s reads the same non-empty context as s - 1 (s continues a run)
  Tensor same = at::zeros({S}, idx.options().dtype(at::kBool));
  same.slice(0, 1).copy_(start.slice(0, 1).eq(start.slice(0, 0, -1)) & len.slice(0, 1).eq(len.slice(0, 0, -1)) &
                         len.slice(0, 1).gt(0));
  const Tensor run_first = std::get<0>(at::cummax(at::where(same, at::zeros_like(idx), idx), 0));
  const Tensor row0 = cu_seqlens.slice(0, 0, -1).to(at::kLong);
  const Tensor bin = at::div(row0 - row0.index_select(0, run_first), rows, "floor");
  Tensor lead = same.logical_not() | len.gt(kChunkMaxContext);
  lead.slice(0, 1).logical_or_(bin.slice(0, 1).ne(bin.slice(0, 0, -1)));
  // next_lead[s]: the first leader after s (S past the last)
  const Tensor lead_at = at::where(lead, idx, at::full_like(idx, S));
  const Tensor min_from = at::flip(std::get<0>(at::cummin(at::flip(lead_at, {0}), 0)), {0});
  Tensor next_lead = at::full_like(idx, S);
  next_lead.slice(0, 0, -1).copy_(min_from.slice(0, 1));
  return at::where(lead, next_lead, idx).to(at::kInt);
}

// DUALKV_CUDA_BWD_CHUNK_ROWS: the query rows of a reader chunk (reader_chunk_end); unset: 8192 (on an H200
// the backward took 0.1-5.5% less time than with none on six layouts up to P = 32K, and 16384 was 1.3%
// slower than none at (16, 32K, 2K): benchmarks/results/raw/profile_h200_reader_chunks.log); 0: none.
// Contexts longer than kChunkMaxContext keys are never chunked.
int64_t reader_chunk_rows() {
  const std::string value = env_value("DUALKV_CUDA_BWD_CHUNK_ROWS");
  if (value.empty()) return 8192;
  char* end = nullptr;
  const long long rows = std::strtoll(value.c_str(), &end, 10);
  DKV_CHECK(end != value.c_str() && *end == '\0' && rows >= 0, kOps,
            ": DUALKV_CUDA_BWD_CHUNK_ROWS: expected a number of rows >= 0 (0: one chunk a segment), got '", value,
            "'");
  return rows;
}

// A kernel-choice environment variable: one of the digits in `allowed` ("0": mma.sync, others a Hopper
// form); unset or empty gives the default, `device_default` on a device and 0 on the CPU emulation (which
// runs mma.sync unless asked, so that its default cases keep checking the sm_80 path), unless the
// emulation is asked for the device's defaults (DUALKV_EMULATE_DEVICE_DEFAULTS=1: what an sm_90 GPU
// would run, checked per head dim by csrc/emulation/emulate.py). Any other value is an error naming the
// variable (a typo must not silently select the default).

int kernel_choice(const char* name, const std::string& allowed = "012", int device_default = 1) {
  const std::string choice = env_value(name);
  std::string listed;
  for (const char c : allowed) listed += listed.empty() ? std::string(1, c) : std::string(", ") + c;
  DKV_CHECK(choice.empty() || (choice.size() == 1 && allowed.find(choice[0]) != std::string::npos), kOps, ": ", name,
              ": expected one of ", listed, " (or unset), got '", choice, "'");
#ifdef DKV_EMULATE
  if (env_value("DUALKV_EMULATE_DEVICE_DEFAULTS") != "1") device_default = 0;
#endif
  return choice.empty() ? device_default : choice[0] - '0';
}

// The query tiles of a launch over (query tiles, heads), in the order the blocks start (query_tile,
// dkv_fwd.cuh): prefix (S+1,) of ceil(len / block) over the segments in `order` (S,), rank -> segment.
// The readers of a context (responses, which see their prompt and themselves) go first, then the
// segments without one (prompts), each segment's tiles from its last: the blocks that see the most
// keys start first and a head ends on its prompt's first tiles, the shortest, instead of on a
// response's tiles, the longest (the tail of a launch). DUALKV_CUDA_TILE_ORDER=0: the segments in
// their own order (order undefined, prefix over the layout as it is).
struct QueryTiles {
  Tensor prefix, order;
};

// DUALKV_CUDA_TILE_ORDER: 1 (unset) the order above, 0 the segments' own.
bool tile_order_by_readers() {
  // Not a kernel form: the CPU emulation takes the device's default too.
  const std::string choice = env_value("DUALKV_CUDA_TILE_ORDER");
  DKV_CHECK(choice.empty() || choice == "0" || choice == "1", kOps,
            ": DUALKV_CUDA_TILE_ORDER: expected one of 0, 1 (or unset), got '", choice, "'");
  return choice != "0";
}

// DUALKV_CUDA_BWD_ITEM_ORDER: how the dK/dV kernels number their (key tile, kv head) items. 1 (unset): kv
// head major, every tile of head 0, then of head 1, ..., so the programs in flight serve one kv head's
// query heads (their dQ adds and Q / dO reads share L2); 0: a tile's kv heads side by side. On an H100
// the d = 128 backward took 0.71-0.97x the time of 0 in all six configs of the kernel table, two sets of
// rounds, (16, 64K, 2K) 336-337 ms against 420-474
// (benchmarks/results/raw/cuda_bwd_item_order_h100_s38.log); on an H200 0.96-0.97x at P >= 16K with 2K
// responses, 1.03x at (28, 4K, 2K) and (8, 16K, 512) (raw/cuda_bwd_item_order_h200_s38.log). Not a kernel
// form: the CPU emulation takes it too.
bool bwd_items_by_kv_head() {
  const std::string choice = env_value("DUALKV_CUDA_BWD_ITEM_ORDER");
  DKV_CHECK(choice.empty() || choice == "0" || choice == "1", kOps,
            ": DUALKV_CUDA_BWD_ITEM_ORDER: expected one of 0, 1 (or unset), got '", choice, "'");
  return choice != "0";
}

QueryTiles query_tiles(const Tensor& seg_len, const Tensor& seg_ctx_len, int block, bool by_readers) {
  QueryTiles tiles;
  if (!by_readers || seg_len.size(0) < 2) {
    tiles.prefix = prefix_of(seg_len, block);
    return tiles;
  }
  const Tensor no_ctx = seg_ctx_len.eq(0).to(at::kInt);
  tiles.order = std::get<1>(at::sort(no_ctx, /*stable=*/true, /*dim=*/0, /*descending=*/false)).to(at::kInt);
  tiles.prefix = prefix_of(seg_len.index_select(0, tiles.order), block);
  return tiles;
}

// Launch metadata that depends on the layout alone (the query-tile order and prefix, the dK/dV work
// items, the reader chunks) takes a few dozen small ATen ops and kernels a call, a large share of a
// call's host time. It is the same for every layer of a micro-batch, so it is kept: keyed by the layout
// tensors it was computed from, the launch's settings (tile sizes, environment choices) and the device
// and stream. A key holds weak references to the tensors, so a freed tensor's address can never be
// taken for a new one's, and their version counters, so an in-place change of a layout tensor computes
// anew. Tensors without a version counter (made under torch.inference_mode) are never cached, and
// nothing is cached or reused while the stream is being captured into a CUDA graph (a plan computed
// then exists only when the graph replays; one reused then must outlive the graph).
// DUALKV_CUDA_PLAN_CACHE=0: no cache (every call computes).
class PlanCache {
 public:
  using Plan = std::vector<Tensor>;

  template <class Compute>
  Plan get(const std::vector<Tensor>& layout, std::vector<int64_t> settings, Compute compute) {
    settings.push_back(static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(current_stream())));
    settings.push_back(layout.front().device().index());
    bool cacheable = enabled() && !capturing();
    for (const Tensor& t : layout) cacheable = cacheable && !t.is_inference();
    if (!cacheable) return compute();
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (matches(*it, layout, settings)) {
        Entry hit = std::move(*it);
        entries_.erase(it);
        entries_.push_front(std::move(hit));
        return entries_.front().plan;
      }
    }
    Entry entry{{}, {}, std::move(settings), compute()};
    for (const Tensor& t : layout) {
      entry.tensors.emplace_back(t.getIntrusivePtr());
      entry.versions.push_back(t._version());
    }
    entries_.push_front(std::move(entry));
    if (entries_.size() > kEntries) entries_.pop_back();
    return entries_.front().plan;
  }

 private:
  static constexpr size_t kEntries = 16;  // layouts in flight at once: a few (policy, reference, SP slices)
  struct Entry {
    std::vector<c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>> tensors;
    std::vector<int64_t> versions;
    std::vector<int64_t> settings;
    Plan plan;
  };

  static bool enabled() {
    const std::string choice = env_value("DUALKV_CUDA_PLAN_CACHE");
    DKV_CHECK(choice.empty() || choice == "0" || choice == "1", kOps,
              ": DUALKV_CUDA_PLAN_CACHE: expected one of 0, 1 (or unset), got '", choice, "'");
    return choice != "0";
  }

  static bool capturing() {
#ifdef DKV_EMULATE
    return false;
#else
    return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#endif
  }

  static bool matches(const Entry& e, const std::vector<Tensor>& layout, const std::vector<int64_t>& settings) {
    if (e.settings != settings || e.tensors.size() != layout.size()) return false;
    for (size_t i = 0; i < layout.size(); ++i) {
      // alive, the same object, unchanged since (a live weak reference keeps the address from reuse)
      if (e.tensors[i].expired() || e.tensors[i]._unsafe_get_target() != layout[i].unsafeGetTensorImpl() ||
          e.versions[i] != layout[i]._version()) {
        return false;
      }
    }
    return true;
  }

  std::mutex mutex_;
  std::deque<Entry> entries_;  // most recently used first
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache();  // never destroyed: its tensors must not be freed at exit,
  return *cache;                              // after the CUDA allocator is gone
}

// The wgmma kernels can run: an sm_90 device whose extension code has wgmma (built for sm_90a), or the
// CPU emulation.
bool hopper_kernels_usable(const Tensor& q) {
#ifdef DKV_EMULATE
  (void)q;
  return true;
#else
  return at::cuda::getDeviceProperties(q.device().index())->major == 9 && sm90_kernels_built(current_stream());
#endif
}

// The wgmma forward (dkv_fwd_sm90.cuh) runs on sm_90 devices for head dims 64 / 128 / 192 / 256 / 512,
// fp16 and bf16, when the extension was built for sm_90a (else the mma.sync forward runs);
// DUALKV_CUDA_WGMMA=0 selects the mma.sync forward, 1 the in-turn wgmma forward (every thread loads by
// cp.async and computes), 2 the warp-specialised one (a producer warpgroup's cp.async, K and V in rings
// of their own), 3 the default: its loads as bulk tensor copies (TMA) from one thread, in the
// warp-specialised form at head dims 64 / 128 (on an H200 its kernel takes 13-25% less time than 2's:
// benchmarks/results/raw/profile_h200_fwd_tma.log) and in the in-turn form at 192 / 256 / 512 (where 2
// measured 1.9x slower than 1). At 512 the in-turn form splits the head dim between the warpgroups and
// has no warp-specialised form: 2 runs 1 there. At 96 no wgmma form runs: 1 and 2 take mma.sync, 3 is
// an error. Returns 0 (mma.sync), 1, 2 or 3.
int use_sm90_forward(const Tensor& q, int head_dim) {
  const int choice = kernel_choice("DUALKV_CUDA_WGMMA", "0123", 3);
  const bool asked = !env_value("DUALKV_CUDA_WGMMA").empty();
  DKV_CHECK(!asked || choice != 3 || sm90_forward_supports(head_dim), kOps,
              ": DUALKV_CUDA_WGMMA=3 (bulk tensor copies): q: expected headdim 64, 128, 192, 256 or 512, got ", head_dim);
  if (choice == 0 || !sm90_forward_supports(head_dim) || !hopper_kernels_usable(q)) return 0;
  return head_dim == 512 && choice == 2 ? 1 : choice;
}

// DUALKV_CUDA_FWD_BLOCK_N: the key tiles of the TMA forward (form 3) at head dim 128, 176 rows (unset, the
// default since 2026-12-05; FwdSm90::kWideN: per-tile costs paid for more keys, two K / V buffers
// instead of three) or 128. On an H100 (benchmarks/results/raw/cuda_fwd_block_n_h100_s39.log, three
// machines, interleaved rounds) 176 took 0.93-0.97x the forward time of 128 at prompts of 32K-128K keys,
// 0.96-0.98x at (8, 16K, 512), level at 8K / 16K and 1.00-1.04x at (28, 4K, 2K), where 4096 keys end in
// a tile of 48. Other head dims keep their tiles whatever it says. Returns whether the 176-key tiles are
// wanted (the maps' box height); fwd_wide_keys says, from that answer, whether they run.
bool fwd_wants_wide_keys(int head_dim) {
  const std::string value = env_value("DUALKV_CUDA_FWD_BLOCK_N");
  DKV_CHECK(value.empty() || value == "128" || value == "176", kOps,
            ": DUALKV_CUDA_FWD_BLOCK_N: expected 128 or 176 (or unset), got '", value, "'");
  bool by_default = true;
#ifdef DKV_EMULATE
  by_default = env_value("DUALKV_EMULATE_DEVICE_DEFAULTS") == "1";  // as kernel_choice's defaults
#endif
  return head_dim == 128 && (value == "176" || (value.empty() && by_default));
}

// Asked for (=176) where another forward runs at head dim 128 (DUALKV_CUDA_WGMMA=0, 1 or 2, tensor maps
// the driver cannot build, a GPU that is not sm_90) it is an error naming it; by default that forward
// keeps its 128-key tiles.
bool fwd_wide_keys(bool wanted, int form) {
  if (!wanted) return false;
  DKV_CHECK(form == 3 || env_value("DUALKV_CUDA_FWD_BLOCK_N").empty(), kOps,
            ": DUALKV_CUDA_FWD_BLOCK_N=176: expected the forward with bulk tensor copies (DUALKV_CUDA_WGMMA=3, "
            "the default on sm_90 with tensor maps), but form ", form, " runs (0: mma.sync)");
  return form == 3;
}

// DUALKV_CUDA_FWD_MERGE: "1" lets the 176-key TMA forward at head dim 128 walk the context and the
// segment's own keys as one range of logical positions (TwoRegionWalk in dkv_fwd.cuh): the context's
// last partial key tile runs on into the own keys, one tile with masked rows fewer per query tile
// (1.053 -> 1.028 scores computed per useful one at (28, 4K, 2K), `python -m benchmarks.tile_waste`).
// The tile where the context ends is loaded as 16-row boxes of both regions (tma_k16 / tma_v16 and the
// context's). "0" or unset: the split walk. Other head dims keep their walk; at head dim 128 where the
// 176-key forward does not run (DUALKV_CUDA_FWD_BLOCK_N=128, DUALKV_CUDA_WGMMA other than 3, tensor maps
// the driver cannot build) it is an error naming it. Opt-in: on an H100 the forward 2.7-3.7% faster at
// (28, 4K, 2K), no clear change at longer prompts (benchmarks/results/cuda_fwd_merge_h100_s45.md).
bool fwd_merge_walk(int head_dim, bool wide) {
  const std::string value = env_value("DUALKV_CUDA_FWD_MERGE");
  DKV_CHECK(value.empty() || value == "0" || value == "1", kOps,
            ": DUALKV_CUDA_FWD_MERGE: expected 0 or 1 (or unset), got '", value, "'");
  if (value != "1" || head_dim != 128) return false;
  DKV_CHECK(wide, kOps,
            ": DUALKV_CUDA_FWD_MERGE=1: expected the forward on 176-key tiles (DUALKV_CUDA_WGMMA=3 with tensor maps, "
            "DUALKV_CUDA_FWD_BLOCK_N unset or 176), but another forward runs at head dim 128");
  return true;
}

// DUALKV_CUDA_FWD_PERSISTENT: "1" runs the TMA forward (form 3) at head dims 64 / 128 persistent, one
// block per SM taking query tiles from a counter (FwdSm90::kPersist: a block's barriers are set up once,
// and its rings load the next tile's first keys while this one finishes); "0" or unset, one block per
// query tile and head. Other head dims keep their forward whatever it says (as DUALKV_CUDA_FWD_BLOCK_N);
// asked for where another forward runs at 64 / 128, it is an error naming it. Opt-in: on an H200 it
// made the forward 1-3% faster on 128-key tiles and 0-3% slower on the default 176-key ones
// (benchmarks/results/raw/cuda_fwd_persistent_h200_s40.log).
bool fwd_persistent(int form, int head_dim) {
  const std::string value = env_value("DUALKV_CUDA_FWD_PERSISTENT");
  DKV_CHECK(value.empty() || value == "0" || value == "1", kOps,
            ": DUALKV_CUDA_FWD_PERSISTENT: expected 0 or 1 (or unset), got '", value, "'");
  if (value != "1" || (head_dim != 64 && head_dim != 128)) return false;
  DKV_CHECK(form == 3, kOps,
            ": DUALKV_CUDA_FWD_PERSISTENT=1: expected the forward with bulk tensor copies (DUALKV_CUDA_WGMMA=3, the "
            "default on sm_90 with tensor maps), but form ", form, " runs at head dim ", head_dim, " (0: mma.sync)");
  return true;
}

// The wgmma backward kernels (dkv_bwd_sm90.cuh: dQ and dK/dV), head dims 64 / 128 / 192 / 256 (at 192 /
// 256 with the warpgroups' roles split, in one schedule), on the same devices. DUALKV_CUDA_WGMMA_BWD
// picks the backward's schedule at 64 / 128: 1 the products of a tile one after the other (1.5x the
// mma.sync backward on an H200, benchmarks/results/cuda_hopper_bwd_h200.md), 2 the next tile's
// products overlapped (slower there), 3 dQ accumulated inside the dK/dV kernel (fp32 bulk reductions
// into a workspace, no dQ kernel; with deterministic=True it falls back to 5), 4 schedule 1
// warp-specialised: a producer warpgroup loads (the backward 3-5% faster than 1 at d = 128 on an H200,
// 3% slower at d = 64: benchmarks/results/attention_h200_ws_vs_in_turn.md), 5 the dQ kernel
// warp-specialised too (its dQ kernel 16-19% faster, the backward 3-6% faster than 4 at d = 128:
// benchmarks/results/attention_h200_ws_dq.md; at d = 64 the backward 5-8% faster than 1:
// benchmarks/results/attention_h200_d64_ws_both.md), 6 dQ accumulated inside the warp-specialised
// dK/dV kernel (as 3 does in the in-turn one; with its staging at pitch 72 the kernel is 6-8% faster
// than 5's two at d = 128 and 2% slower at d = 64: benchmarks/results/raw/profile_h200_pitch72.log; the
// forward+backward 2.3-4.9% faster at d = 128: benchmarks/results/attention_h200_default_sched6.md;
// with deterministic=True it falls back to 5), 8 schedule 5 with S^T and dP^T waited for apart (5
// itself under a softcap; its dK/dV kernel 6% faster than 5's at d = 64, 1-5% slower at d = 128:
// benchmarks/results/raw/profile_h200_split.log), 9 schedule 6 with each tile's dQ product issued a tile
// later, so that the two consumers need not meet every tile (with the TMA producer; under
// DUALKV_CUDA_BWD_TMA=0, or with deterministic=True, as 6 is). 7 (a writer-warp form of 6) was
// removed. The default: 6 at d = 64 and 128 (at d = 64 since 2026-12-02, when its one kernel became
// faster than 8's two: benchmarks/results/raw/profile_h200_early_dq_ab.log, forward+backward in
// benchmarks/results/attention_h200_d64_sched6.md). 0 asks for mma.sync. Returns the schedule that
// runs: 0 (mma.sync), 1 .. 6, 8 or 9 (1 for any wgmma choice at 192 / 256, which have one).
// DUALKV_CUDA_BWD_TMA: 1 (the default) the warp-specialised dK/dV kernel of schedules 6 and 8 (the
// default 6 at head dims 64 and 128; and 9) loads by bulk tensor copies from one producer thread
// (DkdvSm90Ws::kTma; on an H200 the backward takes 5-7% less time than with 0:
// benchmarks/results/attention_h200_tma.md); 0: by its producer warpgroup's cp.async. At head dims
// 192 / 256 / 512 it is the split dQ and dK/dV kernels' form (DqSm90Split::kTma, DkdvSm90Split::kTma:
// thread 0 loads Q / dO, and the dQ kernel's K / V tiles, by bulk tensor copies); 0: every thread's
// cp.async.
// Other schedules and head dims, and tensors of 2^31 or more (head, row) pairs (the copies'
// coordinates are 32-bit), load by cp.async either way.
bool use_bwd_tma(int schedule, int head_dim, int64_t nheads, int64_t total_q) {
  const int choice = kernel_choice("DUALKV_CUDA_BWD_TMA", "01", 1);
  const bool copies = schedule == 6 || schedule == 8 || schedule == 9 || (schedule > 0 && head_dim >= 192);
  return choice == 1 && copies && nheads * total_q < (int64_t{1} << 31);
}

int use_sm90_backward(const Tensor& q, int head_dim) {
  const int choice = kernel_choice("DUALKV_CUDA_WGMMA_BWD", "012345689", 6);
  if (choice == 0 || !sm90_bwd_supports(head_dim) || !hopper_kernels_usable(q)) return 0;
  return sm90_bwd_schedules(head_dim) ? choice : 1;
}

// The reader chunks the default backward takes for a layout (BwdParams::chunk_end: leaders' chunk
// ends, s for the other segments); rows < 0: the DUALKV_CUDA_BWD_CHUNK_ROWS setting. For tests and
// inspection.
Tensor reader_chunks(const Tensor& cu_seqlens, const Tensor& seg_ctx_start, const Tensor& seg_ctx_len, int64_t rows) {
  check_meta(seg_ctx_len, "seg_ctx_len", seg_ctx_len, -1);
  const int64_t S = seg_ctx_len.size(0);
  check_meta(cu_seqlens, "cu_seqlens", seg_ctx_len, S + 1);
  check_meta(seg_ctx_start, "seg_ctx_start", seg_ctx_len, S);
  return reader_chunk_end(cu_seqlens, seg_ctx_start, seg_ctx_len, rows < 0 ? reader_chunk_rows() : rows);
}

// Whether fwd and bwd run the wgmma kernels, forward and backward, for this head dim on CUDA device
// `device` (no tensor needed): the Python backends' "auto" asks it before it prefers this extension.
bool wgmma_path(int64_t device, int64_t head_dim) {
#ifdef DKV_EMULATE
  (void)device;
  const Tensor probe = at::empty({0});
#else
  const Tensor probe = at::empty({0}, at::TensorOptions().device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  const c10::cuda::CUDAGuard guard(probe.device());
#endif
  const int d = static_cast<int>(head_dim);
  return use_sm90_forward(probe, d) > 0 && use_sm90_backward(probe, d) > 0;
}

template <class E>
cudaError_t dispatch_fwd(const FwdParams& p, cudaStream_t st) {
  switch (p.head_dim) {
    case 64: return run_fwd<E, 64>(p, st);
    case 96: return run_fwd<E, 96>(p, st);
    case 128: return run_fwd<E, 128>(p, st);
    case 192: return run_fwd<E, 192>(p, st);
    case 256: return run_fwd<E, 256>(p, st);
    case 512: return run_fwd<E, 512>(p, st);
    default: DKV_CHECK(false, kOps, ": q: unsupported headdim ", p.head_dim);
  }
}

template <class E>
cudaError_t dispatch_dq(const BwdParams& p, cudaStream_t st) {
  switch (p.head_dim) {
    case 64: return run_dq<E, 64>(p, st);
    case 96: return run_dq<E, 96>(p, st);
    case 128: return run_dq<E, 128>(p, st);
    case 192: return run_dq<E, 192>(p, st);
    case 256: return run_dq<E, 256>(p, st);
    case 512: return run_dq<E, 512>(p, st);
    default: DKV_CHECK(false, kOps, ": q: unsupported headdim ", p.head_dim);
  }
}

template <class E>
cudaError_t dispatch_dkdv(const BwdParams& p, cudaStream_t st) {
  switch (p.head_dim) {
    case 64: return run_dkdv<E, 64>(p, st);
    case 96: return run_dkdv<E, 96>(p, st);
    case 128: return run_dkdv<E, 128>(p, st);
    case 192: return run_dkdv<E, 192>(p, st);
    case 256: return run_dkdv<E, 256>(p, st);
    case 512: return run_dkdv<E, 512>(p, st);
    default: DKV_CHECK(false, kOps, ": q: unsupported headdim ", p.head_dim);
  }
}

std::tuple<Tensor, Tensor> fwd(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& k_ctx,
                               const std::optional<Tensor>& v_ctx, const Tensor& cu_seqlens, const Tensor& seg_ctx_start,
                               const Tensor& seg_ctx_len, const Tensor& ctx_key_start, const Tensor& ctx_key_len,
                               const Tensor& ctx_reader_start, const Tensor& ctx_reader_end, double softmax_scale,
                               int64_t window, double softcap) {
  const AttnArgs args = make_args(q, k, v, k_ctx, v_ctx, cu_seqlens, seg_ctx_start, seg_ctx_len, ctx_key_start,
                                  ctx_key_len, ctx_reader_start, ctx_reader_end, softmax_scale, window, softcap);
#ifndef DKV_EMULATE
  const c10::cuda::CUDAGuard guard(q.device());
#endif
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const int sm90 = use_sm90_forward(q, args.head_dim);
  const int block_m = sm90 ? sm90_fwd_block_m(args.head_dim) : fwd_config(args.head_dim).block_m;
  const bool by_readers = tile_order_by_readers();
  const PlanCache::Plan plan = plan_cache().get({cu_seqlens, seg_ctx_len}, {0, block_m, by_readers}, [&] {
    const QueryTiles t = query_tiles(segment_lengths(cu_seqlens), seg_ctx_len, block_m, by_readers);
    return PlanCache::Plan{t.prefix, t.order};
  });
  const QueryTiles tiles{plan[0], plan[1]};

  FwdParams p;
  static_cast<AttnArgs&>(p) = args;
  p.out = ref(out);
  p.lse = lse.data_ptr<float>();
  p.q_tile_prefix = tiles.prefix.data_ptr<int>();
  p.q_seg_order = tiles.order.defined() ? tiles.order.data_ptr<int>() : nullptr;
  p.grid_tiles = grid_tiles_bound(args.total_q, args.layout.num_segments, block_m);
  const cudaStream_t st = current_stream();
  int form = sm90;
  const bool wide_wanted = fwd_wants_wide_keys(args.head_dim);  // read once: the maps and the launch follow it
  if (form == 3) {
    // Asked for (DUALKV_CUDA_WGMMA=3), a map the driver cannot build is an error naming it; by default
    // the forward then runs its cp.async form instead (2 at head dims 64 / 128, else 1). Boxes are the
    // kernel's query and key tiles.
    TmaMaps maps{!env_value("DUALKV_CUDA_WGMMA").empty(), "DUALKV_CUDA_WGMMA=3"};
    maps.box(p.tma_q, q, "q", block_m);
    maps.keys(p, k, v, k_ctx, v_ctx, sm90_fwd_block_n(args.head_dim, wide_wanted));
    if (!maps.built) form = args.head_dim <= 128 ? 2 : 1;
  }
  const bool wide = fwd_wide_keys(wide_wanted, form);
  if (fwd_merge_walk(args.head_dim, wide)) {  // the 16-row boxes of the tile where the context ends
    TmaMaps rows16{true, "DUALKV_CUDA_FWD_MERGE=1"};
    rows16.keys_into(p.tma_k16, p.tma_v16, p.tma_k_ctx16, p.tma_v_ctx16, k, v, k_ctx, v_ctx, kMergeBoxRows);
    p.merge_walk = 1;
  }
  Tensor work_counter;
  if (fwd_persistent(form, args.head_dim)) {
    work_counter = at::zeros({1}, q.options().dtype(at::kInt));
    p.work_counter = work_counter.data_ptr<int>();
  }
  if (form) {
    check_launch(bf16 ? run_fwd_sm90<Bf16>(p, st, form, wide) : run_fwd_sm90<Fp16>(p, st, form, wide),
                 "forward kernel (sm90 wgmma)");
  } else {
    check_launch(bf16 ? dispatch_fwd<Bf16>(p, st) : dispatch_fwd<Fp16>(p, st), "forward kernel");
  }
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> bwd(
    const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& k_ctx,
    const std::optional<Tensor>& v_ctx, const Tensor& out, const Tensor& lse, const Tensor& cu_seqlens,
    const Tensor& seg_ctx_start, const Tensor& seg_ctx_len, const Tensor& ctx_key_start, const Tensor& ctx_key_len,
    const Tensor& ctx_reader_start, const Tensor& ctx_reader_end, double softmax_scale, int64_t window, double softcap,
    bool deterministic) {
  const AttnArgs args = make_args(q, k, v, k_ctx, v_ctx, cu_seqlens, seg_ctx_start, seg_ctx_len, ctx_key_start,
                                  ctx_key_len, ctx_reader_start, ctx_reader_end, softmax_scale, window, softcap);
  const int64_t T = q.size(0), H = q.size(1);
  check_qkv_like(out, "out", q, H, T);
  check_qkv_like(dout, "dout", q, H, T);
  DKV_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == H && lse.size(1) == T &&
                  lse.is_contiguous() && lse.device() == q.device(),
              kOps, ": lse: expected a contiguous float32 (nheads, total_q) = (", H, ", ", T, ") tensor on ", q.device(),
              ", got ", lse.scalar_type(), " of shape ", lse.sizes());
#ifndef DKV_EMULATE
  const c10::cuda::CUDAGuard guard(q.device());
#endif
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor dq = at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  Tensor dk_ctx, dv_ctx;
  if (args.ctx_separate) {
    // Deterministic mode writes only rows inside a context region: rows read by nobody stay zero.
    dk_ctx = deterministic ? at::zeros(k_ctx->sizes(), k.options()) : at::empty(k_ctx->sizes(), k.options());
    dv_ctx = deterministic ? at::zeros(v_ctx->sizes(), v.options()) : at::empty(v_ctx->sizes(), v.options());
  } else {
    dk_ctx = at::empty({0}, q.options());
    dv_ctx = at::empty({0}, q.options());
  }
  // lse_log2 and dsum (H, T), each followed by kVecTail floats that the bulk tensor copies of the
  // dK/dV kernel may read past its last row (zeroed when they run), so that no copy runs off the end.
  constexpr int64_t kVecTail = 128;
  Tensor lse_log2_buf = at::empty({H * T + kVecTail}, f32), dsum_buf = at::empty({H * T + kVecTail}, f32);
  Tensor lse_log2 = lse_log2_buf.narrow(0, 0, H * T).view({H, T});
  Tensor dsum = dsum_buf.narrow(0, 0, H * T).view({H, T});
  Tensor dk_accum, dv_accum;
  const int accum_rows = deterministic ? 0 : args.total_ctx;
  if (accum_rows > 0) {
    dk_accum = at::zeros({accum_rows, args.nheads_kv, args.head_dim}, f32);
    dv_accum = at::zeros({accum_rows, args.nheads_kv, args.head_dim}, f32);
  }

  int sm90 = use_sm90_backward(q, args.head_dim);
  bool fused_dq = sm90 == 3 || sm90 == 6 || sm90 == 9;  // dQ accumulated in the dK/dV kernel, no dQ kernel
  if (fused_dq && deterministic) {  // atomics on dQ are not bit-stable run to run: both kernels ws
    sm90 = 5;
    fused_dq = false;
  }
  Tensor dq_accum;
  if (fused_dq) dq_accum = at::zeros({args.nheads, args.head_dim / 64, T, kDqAccumPitch}, f32);
  const int dq_block = sm90 ? sm90_dq_block_m(args.head_dim) : dq_config(args.head_dim).block_m;
  const int kv_block = sm90 ? sm90_dkdv_block_n(args.head_dim) : dkdv_config(args.head_dim).block_n;
  const bool by_readers = tile_order_by_readers();
  const int64_t chunk_rows = deterministic ? 0 : reader_chunk_rows();
  const PlanCache::Plan plan = plan_cache().get(
      {cu_seqlens, seg_ctx_start, seg_ctx_len, ctx_key_len},
      {1, dq_block, kv_block, by_readers, deterministic, args.ctx_separate, chunk_rows}, [&] {
        const Tensor seg_len = segment_lengths(cu_seqlens);
        const QueryTiles q_tiles = query_tiles(seg_len, seg_ctx_len, dq_block, by_readers);
        // dkdv items per segment: its own key tiles (+ its context tiles, by default); deterministic
        // with a separate context adds one group per context region.
        Tensor per_seg = at::div(seg_len + (kv_block - 1), kv_block, "floor");
        Tensor chunk_end;
        if (!deterministic) {  // a chunk's context tiles are its leader's items
          chunk_end = reader_chunk_end(cu_seqlens, seg_ctx_start, seg_ctx_len, chunk_rows);
          const Tensor leads = chunk_end.gt(at::arange(chunk_end.size(0), chunk_end.options()));
          per_seg = per_seg + at::div(seg_ctx_len + (kv_block - 1), kv_block, "floor") * leads;
        }
        Tensor groups = per_seg;
        if (deterministic && args.ctx_separate) {
          groups = at::cat({per_seg, at::div(ctx_key_len + (kv_block - 1), kv_block, "floor")});
        }
        return PlanCache::Plan{q_tiles.prefix, q_tiles.order, prefix_of(groups, 1), chunk_end};
      });
  const QueryTiles q_tiles{plan[0], plan[1]};
  const Tensor& kv_item_prefix = plan[2];
  const Tensor& chunk_end = plan[3];
  Tensor work_counter = at::zeros({1}, q.options().dtype(at::kInt));

  BwdParams p;
  static_cast<AttnArgs&>(p) = args;
  p.out = ref(out);
  p.dout = ref(dout);
  p.lse = lse.data_ptr<float>();
  p.lse_log2 = lse_log2.data_ptr<float>();
  p.dsum = dsum.data_ptr<float>();
  p.dq = ref(dq);
  p.dk = ref(dk);
  p.dv = ref(dv);
  if (args.ctx_separate) {
    p.dk_ctx = ref(dk_ctx);
    p.dv_ctx = ref(dv_ctx);
  } else {
    p.dk_ctx = p.dk;
    p.dv_ctx = p.dv;
  }
  p.dk_accum = accum_rows > 0 ? dk_accum.data_ptr<float>() : nullptr;
  p.dv_accum = accum_rows > 0 ? dv_accum.data_ptr<float>() : nullptr;
  p.accum_rows = accum_rows;
  p.q_tile_prefix = q_tiles.prefix.data_ptr<int>();
  p.q_seg_order = q_tiles.order.defined() ? q_tiles.order.data_ptr<int>() : nullptr;
  p.grid_tiles = grid_tiles_bound(T, args.layout.num_segments, dq_block);
  p.kv_item_prefix = kv_item_prefix.data_ptr<int>();
  p.chunk_end = deterministic ? nullptr : chunk_end.data_ptr<int>();
  p.num_item_groups = static_cast<int>(kv_item_prefix.size(0) - 1);
  p.kv_head_major = bwd_items_by_kv_head();
  p.work_counter = work_counter.data_ptr<int>();
  p.deterministic = deterministic;
  p.dq_accum = fused_dq ? dq_accum.data_ptr<float>() : nullptr;
  const bool late_dq_add = kernel_choice("DUALKV_CUDA_BWD_LATE_DQ_ADD", "01", 1) == 1;
  p.tma = use_bwd_tma(sm90, args.head_dim, H, T);
  if (p.tma) {
    // As the forward: asked for (DUALKV_CUDA_BWD_TMA=1), a map the driver cannot build is an error
    // naming it; by default the dK/dV kernel then loads by its producer warpgroup's cp.async.
    TmaMaps maps{!env_value("DUALKV_CUDA_BWD_TMA").empty(), "DUALKV_CUDA_BWD_TMA=1"};
    maps.box(p.tma_q, q, "q", kSm90DkdvQueryRows);
    maps.box(p.tma_dout, dout, "dout", kSm90DkdvQueryRows);
    // Key boxes: the dK/dV kernels' key tiles, or at d = 512 the split dQ kernel's 16-key tiles.
    maps.keys(p, k, v, k_ctx, v_ctx, args.head_dim == 512 ? kSm90DqKeyRows512 : sm90_dkdv_block_n(args.head_dim));
    const bool split = args.head_dim >= 192;  // the split kernels: no lse / dsum copies
    if (args.head_dim == 512) {  // the split dK/dV kernel's reader tiles: 16 rows at 512, else the maps above
      maps.box(p.tma_q_reader, q, "q", kSm90DkdvReaderRows512);
      maps.box(p.tma_dout_reader, dout, "dout", kSm90DkdvReaderRows512);
    } else {
      p.tma_q_reader = p.tma_q;
      p.tma_dout_reader = p.tma_dout;
    }
    if (!split) {
      maps.vec(p.tma_lse_log2, lse_log2_buf, "lse_log2", kSm90DkdvVecBox);
      maps.vec(p.tma_dsum, dsum_buf, "dsum", kSm90DkdvVecBox);
    }
    p.tma = maps.built;
    if (p.tma && !split) {  // no copy of a tile's run reads past the vectors' zeroed tails
      lse_log2_buf.narrow(0, H * T, kVecTail).zero_();
      dsum_buf.narrow(0, H * T, kVecTail).zero_();
    }
  }
  // (DUALKV_CUDA_BWD_LATE_DQ_ADD) only schedule 6's kernel with the TMA producer adds late, at
  // kDqAccumPitchLate (dq_accum, allocated at kDqAccumPitch, has room); every other kernel adds at kDqAccumPitch
  p.late_dq_add = late_dq_add && sm90 == 6 && p.tma;

  const cudaStream_t st = current_stream();
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  check_launch(bf16 ? run_bwd_prep<Bf16>(p, st) : run_bwd_prep<Fp16>(p, st), "backward preprocessing kernel");
  if (sm90) {
    if (!fused_dq) {
      check_launch(bf16 ? run_dq_sm90<Bf16>(p, st, sm90) : run_dq_sm90<Fp16>(p, st, sm90), "dq kernel (sm90 wgmma)");
    }
    check_launch(bf16 ? run_dkdv_sm90<Bf16>(p, st, sm90) : run_dkdv_sm90<Fp16>(p, st, sm90), "dk/dv kernel (sm90 wgmma)");
    if (fused_dq) {  // dQ = scale * sum of dS K, cast once
      check_launch(bf16 ? run_convert_dq<Bf16>(p, st) : run_convert_dq<Fp16>(p, st), "dq convert kernel");
    }
  } else {
    check_launch(bf16 ? dispatch_dq<Bf16>(p, st) : dispatch_dq<Fp16>(p, st), "dq kernel");
    check_launch(bf16 ? dispatch_dkdv<Bf16>(p, st) : dispatch_dkdv<Fp16>(p, st), "dk/dv kernel");
  }
  if (accum_rows > 0) {
    check_launch(bf16 ? run_bwd_convert<Bf16>(p, st) : run_bwd_convert<Fp16>(p, st), "context-gradient convert kernel");
  }
  return {dq, dk, dv, dk_ctx, dv_ctx};
}

}  // namespace
}  // namespace dkv

TORCH_LIBRARY(DKV_OPS_NAMESPACE, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_ctx, Tensor? v_ctx, Tensor cu_seqlens, Tensor seg_ctx_start, "
      "Tensor seg_ctx_len, Tensor ctx_key_start, Tensor ctx_key_len, Tensor ctx_reader_start, Tensor ctx_reader_end, "
      "float softmax_scale, int window, float softcap) -> (Tensor, Tensor)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? k_ctx, Tensor? v_ctx, Tensor out, Tensor lse, "
      "Tensor cu_seqlens, Tensor seg_ctx_start, Tensor seg_ctx_len, Tensor ctx_key_start, Tensor ctx_key_len, "
      "Tensor ctx_reader_start, Tensor ctx_reader_end, float softmax_scale, int window, float softcap, "
      "bool deterministic) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("wgmma_path(int device, int head_dim) -> bool", &dkv::wgmma_path);  // no tensor: one kernel for every key
  m.def("reader_chunks(Tensor cu_seqlens, Tensor seg_ctx_start, Tensor seg_ctx_len, int rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(DKV_OPS_NAMESPACE, DKV_DISPATCH_KEY, m) {
  m.impl("fwd", &dkv::fwd);
  m.impl("bwd", &dkv::bwd);
  m.impl("reader_chunks", &dkv::reader_chunks);
}

// Importable as a Python module (setup.py builds dualkv._C); importing it registers the ops.
#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME _C
#endif
#define DKV_STR_(x) #x
#define DKV_STR(x) DKV_STR_(x)
#define DKV_CONCAT_(a, b) a##b
#define DKV_CONCAT(a, b) DKV_CONCAT_(a, b)

PyMODINIT_FUNC DKV_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, DKV_STR(TORCH_EXTENSION_NAME),
                                      "DualKV CUDA kernels; the ops live in torch.ops.dualkv_cuda", -1, nullptr};
  return PyModule_Create(&module);
}
