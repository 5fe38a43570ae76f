// The guarded linear, device-independent: checks, scans, the async record,
// the row-major-as-column-major GEMM plan and its error report. The CPU and
// CUDA kernels differ only in their LinearBackend.
#include "guard.h"
#include "linear/param_cache.h"
#include "report/call_scope.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace cublas_guard {

namespace {

// ---------------------------------------------------------------------------
// Layer names <-> ids, and per-layer call counters, for async reports.
// ---------------------------------------------------------------------------
class LayerRegistry {
 public:
  // Returns (layer id, this call's number for the layer, counting from 1).
  // Forward and backward calls are counted apart.
  std::pair<int64_t, int64_t> next_call(const std::string& layer, bool backward) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ids_.find(layer);
    if (it == ids_.end()) {
      it = ids_.emplace(layer, static_cast<int64_t>(names_.size())).first;
      names_.push_back(layer);
      calls_.push_back({0, 0});
    }
    return {it->second, ++calls_[it->second][backward ? 1 : 0]};
  }
  // A new layer took this name: its calls count from 1 again.
  void reset(const std::string& layer) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ids_.find(layer);
    if (it != ids_.end()) calls_[it->second] = {0, 0};
  }
  std::string name(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return id >= 0 && id < static_cast<int64_t>(names_.size()) ? names_[id] : "<unknown layer>";
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> names_;
  std::vector<std::array<int64_t, 2>> calls_;
};

LayerRegistry& layers() {
  static LayerRegistry registry;
  return registry;
}

struct RegisteredRecord {
  c10::Device device;
  AsyncRecord* record;
  int* claim;
  RecordHooks hooks;
};

std::mutex& records_mutex() {
  static std::mutex m;
  return m;
}
std::vector<RegisteredRecord>& records() {
  static std::vector<RegisteredRecord> all;
  return all;
}

// The records again, for the check every guarded call makes first: read without
// the lock and without copying the list (issue 12). Registration publishes a
// record's address, then the count; past kMaxFastRecords every check takes the
// locked path.
constexpr size_t kMaxFastRecords = 64;
std::array<std::atomic<AsyncRecord*>, kMaxFastRecords> fast_records{};
std::atomic<size_t> fast_record_count{0};
std::atomic<bool> fast_records_overflow{false};

// Whether some record may hold a finding (a flag set): false means nothing to raise.
bool any_record_flagged() {
  if (fast_records_overflow.load(std::memory_order_acquire)) return true;
  const size_t n = fast_record_count.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    const AsyncRecord* record = fast_records[i].load(std::memory_order_relaxed);
    if (__atomic_load_n(&record->flag, __ATOMIC_ACQUIRE) != 0) return true;
  }
  return false;
}

const char* role_name(int64_t role) {
  switch (role) {
    case kRoleInput: return "input";
    case kRoleWeight: return "weight";
    case kRoleBias: return "bias";
    case kRoleGradOutput: return "grad_output";
    default: return "tensor";
  }
}

[[noreturn]] void raise_recorded(const AsyncRecord& rec, const c10::Device& device) {
  const std::string layer = layers().name(rec.layer_id);
  ErrorReport report("non_finite");
  report.add("layer", layer).add("role", role_name(rec.role));
  report.add("nan_count", rec.nan_count).add("posinf_count", rec.posinf_count);
  report.add("neginf_count", rec.neginf_count).add("first_bad_index", rec.first_bad_index);
  const int64_t ndim = std::min<int64_t>(rec.ndim, kRecordMaxDims);
  std::vector<int64_t> shape(rec.shape, rec.shape + ndim);
  if (rec.ndim <= kRecordMaxDims) {
    std::vector<int64_t> coords(ndim, 0);
    int64_t rest = rec.first_bad_index;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      const int64_t size = std::max<int64_t>(shape[d], 1);
      coords[d] = rest % size;
      rest /= size;
    }
    report.add("first_bad_coords", coords);
    report.add("shape", shape);
  }
  report.add("ndim", rec.ndim).add("numel", rec.numel);
  report.add("deferred", true).add("call", rec.call_id).add("device", device.str());
  report.add("pass", rec.role == kRoleGradOutput ? "backward" : "forward");
  if (rec.replay != 0) report.add("replay", rec.replay);  // a CUDA graph replay of that call
  const std::string replay =
      rec.replay > 0 ? ", replay " + std::to_string(rec.replay) : (rec.replay < 0 ? ", a replay" : "");
  report.raise_value_error("layer '" + layer + "' (call " + std::to_string(rec.call_id) + replay +
                           "): " + role_name(rec.role) + " had " + std::to_string(rec.nan_count) + " NaN, " +
                           std::to_string(rec.posinf_count) + " +Inf, " + std::to_string(rec.neginf_count) +
                           " -Inf (recorded asynchronously, reported now)");
}

// A tensor to scan and the role it plays in the error message.
struct ScanJob {
  const at::Tensor* tensor;
  TensorRole role;
};

void fill_target(AsyncTarget& target, const at::Tensor& t, TensorRole role, int64_t layer_id, int64_t call_id,
                 AsyncRecord* record, int* claim) {
  target.record = record;
  target.claim = claim;
  target.layer_id = layer_id;
  target.call_id = call_id;
  target.role = role;
  target.numel = t.numel();
  target.ndim = t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kRecordMaxDims); ++d) {
    target.shape[d] = t.size(d);
  }
}

bool first_role_is_backward(const std::vector<ScanJob>& jobs) {
  return !jobs.empty() && jobs.front().role == kRoleGradOutput;
}

// Async mode inside a CUDA graph capture. A capture records the scan kernels
// and runs none of them: every replay scans whatever the tensors hold then.
// So a captured call must scan the parameters whatever the clean-parameter
// cache says (a weight written between replays, by an optimizer step or a
// copy_, is seen by the replay's scan, never by the cache), and it proves
// nothing clean (no scan ran), so it marks nothing. The call's number is
// baked into the graph; its replays are counted on the device (the first scan
// increments, the others read).
struct CaptureState {
  bool captured = false;
  int64_t* replays = nullptr;
};

CaptureState capture_state(const LinearBackend& be, GuardMode mode, c10::Device device) {
  CaptureState state;
  if (mode == GuardMode::kAsync && be.capture_replay_counter != nullptr) {
    state.captured = be.capture_replay_counter(device, &state.replays);
  }
  return state;
}

// Whether a parameter (weight, bias) is scanned in this call: always in a
// capture, else only when the cache does not know it clean.
bool must_scan_parameter(const CaptureState& capture, const at::Tensor& t) {
  return capture.captured || !parameter_known_clean(t);
}

// Scans the jobs. Sync: one host synchronization for all of them, then raise
// for the first bad one. Async: enqueue scans that fill the record if needed.
//
// With `prefill_out`, the first job's scan (the input's) also writes
// `prefill_bias` into every row of it, in the same launch.
void guard_values(const LinearBackend& be, GuardMode mode, const std::string& layer,
                  const std::vector<ScanJob>& jobs, const CaptureState& capture = {},
                  at::Tensor* prefill_out = nullptr, const at::Tensor* prefill_bias = nullptr) {
  if (jobs.empty()) return;
  auto scan_job = [&](int64_t i, at::Tensor slot, const AsyncTarget* target) {
    if (i == 0 && prefill_out != nullptr) {
      be.scan_into_prefilling(*jobs[0].tensor, std::move(slot), target, layer, *prefill_out, *prefill_bias);
    } else {
      be.scan_into(*jobs[i].tensor, std::move(slot), target, layer);
    }
  };
  const at::Tensor& first = *jobs.front().tensor;
  const auto n = static_cast<int64_t>(jobs.size());
  if (mode == GuardMode::kSync) {
    at::Tensor results = at::empty({n, kScanFields}, first.options().dtype(at::kLong));
    for (int64_t i = 0; i < n; ++i) scan_job(i, results[i], nullptr);
    at::Tensor host = be.fetch(results, layer);
    const int64_t* counts = host.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      raise_if_non_finite(*jobs[i].tensor, counts + i * kScanFields, role_name(jobs[i].role), layer);
    }
  } else {
    AsyncRecord* record = nullptr;
    int* claim = nullptr;
    be.async_slot(first.device(), &record, &claim);
    const auto ids = layers().next_call(layer, first_role_is_backward(jobs));
    for (int64_t i = 0; i < n; ++i) {
      AsyncTarget target;
      fill_target(target, *jobs[i].tensor, jobs[i].role, ids.first, ids.second, record, claim);
      target.captured = capture.captured;
      target.counts_replay = capture.captured && i == 0;
      target.replays = capture.replays;
      // No result tensor: nothing reads it; the record is the async report.
      scan_job(i, at::Tensor(), &target);
    }
  }
  if (capture.captured) return;  // recorded, not run: nothing is known clean
  for (const auto& job : jobs) {
    if (job.role == kRoleWeight || job.role == kRoleBias) mark_parameter_clean(*job.tensor);
  }
}

// A pointer `elements` elements of `element_size` bytes further on.
const void* advance(const void* p, int64_t elements, int64_t element_size) {
  return static_cast<const char*>(p) + elements * element_size;
}
void* advance(void* p, int64_t elements, int64_t element_size) {
  return static_cast<char*>(p) + elements * element_size;
}

std::string chunk_text(int64_t n0, int64_t n_len, int64_t n, int64_t k0, int64_t k_len, int64_t k) {
  return "n " + std::to_string(n0) + ".." + std::to_string(n0 + n_len) + " of " + std::to_string(n) + ", k " +
         std::to_string(k0) + ".." + std::to_string(k0 + k_len) + " of " + std::to_string(k);
}

// Piece sizes for a GEMM beyond the 32-bit limit L. Every argument must be <= L,
// and, with the 32-bit API, no operand may span more than L elements (some
// cuBLAS(Lt) releases failed on a 32-bit call whose operand spans >= 2^31
// elements, although each argument fits). An operand stored column-major as
// [inner x outer] with leading dimension ld spans (outer - 1) * ld + inner
// elements: with every step <= L, capping the outer step at (L - inner) / ld + 1
// brings it within L, and since steps only shrink, every operand stays within.
// When an argument no split can shrink (m, lda, ldb, ldc) is beyond L the call
// goes to the 64-bit API, and only n and k are kept within L.
struct GemmSteps {
  int64_t m, n, k;
};
GemmSteps gemm_steps(const GemmCall& whole, int64_t limit) {
  GemmSteps s{whole.m, std::min(whole.n, limit), std::min(whole.k, limit)};
  if (std::max({whole.m, whole.lda, whole.ldb, whole.ldc}) > limit) return s;  // the 64-bit API
  const auto cap = [limit](int64_t& outer, int64_t inner, int64_t ld) {
    outer = std::max<int64_t>(1, std::min(outer, (limit - inner) / ld + 1));
  };
  // op(A) is m x k: stored [m x k] (lda), or [k x m] when transposed.
  if (whole.trans_a) cap(s.m, s.k, whole.lda);
  else cap(s.k, s.m, whole.lda);
  // op(B) is k x n: stored [k x n] (ldb), or [n x k] when transposed.
  if (whole.trans_b) cap(s.k, s.n, whole.ldb);
  else cap(s.n, s.k, whole.ldb);
  cap(s.n, s.m, whole.ldc);  // C is stored [m x n]
  return s;
}

// out[P x Q] (contiguous, row-major) = beta * out + L[P x R] * Rm[R x Q], as the
// column-major product out^T = Rm^T * L^T that cuBLAS computes.
// `roles` names left, right and out for error reports.
//
// Beyond cuBLAS's 32-bit limit: n (the rows of the row-major output, i.e. the
// batch in forward) is split into independent pieces and k (the reduction,
// the batch in grad_weight) into pieces accumulated with beta = 1; m too when
// an operand would span more than the limit (gemm_steps). m beyond the limit
// and the leading dimensions cannot be split (ldc >= m; a leading dimension is
// a stride), so a call still beyond the limit uses cuBLAS's 64-bit API.
//
// `bias` (forward, BiasHandling::kBiasInGemm): Q elements the GEMM adds to every
// output row; each piece with k0 = 0 gets its m range of them.
void matmul_into(const LinearBackend& be, at::Tensor& out, const at::Tensor& left, const at::Tensor& right,
                 double beta, const char* purpose, const std::array<const char*, 3>& roles,
                 const std::string& layer, const void* bias = nullptr) {
  const int64_t P = left.size(0), R = left.size(1), Q = right.size(1);
  if (P == 0 || Q == 0) return;
  if (R == 0) {  // an empty sum: nothing for cuBLAS to do
    if (bias != nullptr) {
      out.copy_(at::from_blob(const_cast<void*>(bias), {Q}, out.options()).expand_as(out));
    } else if (beta == 0.0) {
      out.zero_();
    }
    return;
  }
  const bool fit_limit = !(be.has_64bit_api && gemm_64bit_allowed());
  const ColumnMajorView lv = as_column_major(left, fit_limit);
  const ColumnMajorView rv = as_column_major(right, fit_limit);
  GemmCall whole;
  whole.dtype = out.scalar_type();
  const GemmNames names = be.gemm_names(whole.dtype);
  whole.routine = names.routine;
  whole.data_type = names.data_type;
  whole.compute_type = names.compute_type;
  whole.trans_a = !rv.transposed;
  whole.trans_b = !lv.transposed;
  whole.m = Q;
  whole.n = P;
  whole.k = R;
  whole.a = rv.data;
  whole.lda = rv.ld;
  whole.b = lv.data;
  whole.ldb = lv.ld;
  whole.c = out.data_ptr();
  whole.ldc = Q;
  whole.alpha = 1.0;
  whole.beta = beta;
  whole.purpose = purpose;

  GemmContext ctx;
  ctx.layer = layer;
  ctx.operand_a = &right;
  ctx.operand_b = &left;
  ctx.operand_c = &out;
  ctx.roles[0] = roles[1];  // A is the right factor, B the left one (out^T = R^T L^T)
  ctx.roles[1] = roles[0];
  ctx.roles[2] = roles[2];

  const GemmSteps steps = gemm_steps(whole, gemm_size_limit());
  const bool split = steps.m < whole.m || steps.n < whole.n || steps.k < whole.k;
  const int64_t es = out.element_size();
  for (int64_t m0 = 0; m0 < whole.m; m0 += steps.m) {
    for (int64_t n0 = 0; n0 < whole.n; n0 += steps.n) {
      for (int64_t k0 = 0; k0 < whole.k; k0 += steps.k) {
        GemmCall piece = whole;
        piece.m = std::min(steps.m, whole.m - m0);
        piece.n = std::min(steps.n, whole.n - n0);
        piece.k = std::min(steps.k, whole.k - k0);
        piece.a = advance(whole.a,
                          whole.trans_a ? k0 + m0 * whole.lda    // op(A): rows m0..,
                                        : m0 + k0 * whole.lda,
                          es);  //   columns k0..
        piece.b = advance(whole.b,
                          whole.trans_b ? n0 + k0 * whole.ldb    // op(B): rows k0..,
                                        : k0 + n0 * whole.ldb,
                          es);  //   columns n0..
        piece.c = advance(whole.c, m0 + n0 * whole.ldc, es);
        piece.beta = k0 == 0 ? whole.beta : 1.0;  // later k pieces accumulate
        piece.bias = bias != nullptr && k0 == 0 ? advance(bias, m0, es) : nullptr;  // added once
        if (split) {
          piece.chunk = (steps.m < whole.m ? "m " + std::to_string(m0) + ".." + std::to_string(m0 + piece.m) +
                                                 " of " + std::to_string(whole.m) + ", "
                                           : std::string()) +
                        chunk_text(n0, piece.n, whole.n, k0, piece.k, whole.k);
        }
        plan_gemm_call(piece, be.has_64bit_api, layer);
        if (piece.use_64bit) piece.routine = names.routine_64;
        const int status = be.gemm(piece, ctx);
        if (status != 0) raise_gemm_failure(status, piece, ctx);
      }
    }
  }
}

// Allocations in a guarded call that run out of memory are reported with the
// device's numbers and the request (torch raises its own OOM otherwise).
template <typename Fn>
auto reporting_oom(const LinearBackend& be, c10::Device device, const std::string& layer, const char* stage,
                   int64_t bytes, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError& e) {
    ErrorReport report("out_of_memory");
    report.add("layer", layer).add("stage", stage).add("bytes_requested", bytes);
    std::string detail = e.what_without_backtrace();
    detail = detail.substr(0, detail.find('\n'));
    report.add("detail", detail);
    if (be.memory_info != nullptr) be.memory_info(report, device);
    report.raise_out_of_memory("layer '" + layer + "': out of memory during " + stage);
  }
}

// [..., cols] -> [rows, cols], a view whenever the strides allow. The row count
// is explicit: reshape({-1, 0}) is ambiguous for empty tensors.
at::Tensor flatten_rows(const at::Tensor& t, int64_t cols) {
  if (t.dim() == 2 && t.size(1) == cols) return t;  // already [rows, cols]: no reshape dispatch
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return t.reshape({rows, cols});
}

std::vector<int64_t> with_last(c10::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = last;
  return out;
}

}  // namespace

void register_async_record(c10::Device device, AsyncRecord* record, int* claim, RecordHooks hooks) {
  std::lock_guard<std::mutex> lock(records_mutex());
  records().push_back(RegisteredRecord{device, record, claim, hooks});
  const size_t n = fast_record_count.load(std::memory_order_relaxed);
  if (n < kMaxFastRecords) {
    fast_records[n].store(record, std::memory_order_relaxed);
    fast_record_count.store(n + 1, std::memory_order_release);
  } else {
    fast_records_overflow.store(true, std::memory_order_release);
  }
}

void raise_if_async_recorded(bool synchronize) {
  // Without a synchronization to run, a record whose flag is clear has nothing to report.
  if (!synchronize && !any_record_flagged()) return;
  std::vector<RegisteredRecord> snapshot;
  {
    std::lock_guard<std::mutex> lock(records_mutex());
    snapshot = records();
  }
  for (const auto& reg : snapshot) {
    if (synchronize && reg.hooks.synchronize != nullptr) reg.hooks.synchronize(reg.device);
    // The writer stores the fields, fences, then the flag: seeing the flag
    // means the fields are complete. Taking the flag atomically makes one
    // reader (thread) the owner of the report; the claim stays set, so no new
    // writer touches the fields until they are copied.
    if (__atomic_exchange_n(&reg.record->flag, int64_t{0}, __ATOMIC_ACQ_REL) == 0) continue;
    const AsyncRecord copy = *reg.record;
    // Free the claim for the next finding (async_record.h): a host store, after
    // the copy, that no CUDA call can fail or misorder, so the report taken
    // here is always raised and the claim never stays taken.
    __atomic_store_n(&reg.record->epoch, copy.epoch + 1, __ATOMIC_RELEASE);
    forget_clean_parameters();  // a recorded parameter must be scanned again
    raise_recorded(copy, reg.device);
  }
}

at::Tensor linear_forward(const LinearBackend& be, const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, const std::string& layer,
                          int64_t mode_value) {
  const GuardedCallScope scope("forward", "input", &x, "weight", &weight, "bias",
                               bias.has_value() ? &*bias : nullptr);
  const GuardMode mode = parse_mode(mode_value);
  raise_if_async_recorded(/*synchronize=*/false);
  check_linear_args(x, weight, bias, layer);
  const bool has_bias = bias.has_value() && bias->defined();
  if (mode == GuardMode::kSync) be.check_pending_error(layer);
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  const at::Tensor x2d = flatten_rows(x, in_features);
  const int64_t bytes = x2d.size(0) * out_features * weight.element_size();
  at::Tensor out = reporting_oom(be, weight.device(), layer, "the forward GEMM's output", bytes,
                                 [&] { return at::empty({x2d.size(0), out_features}, weight.options()); });
  // How the bias enters (BiasHandling): a broadcast copy and beta = 1 (torch's
  // addmm fallback), the GEMM's epilogue (beta = 0), or the backend's prefill
  // (beta = 1), fused into the input's scan when one runs: at most one launch
  // of ours before the GEMM.
  BiasHandling handling = BiasHandling::kBiasByCopy;
  if (has_bias && out.numel() > 0) {
    handling = be.bias_handling != nullptr ? be.bias_handling(out.scalar_type()) : BiasHandling::kBiasByCopy;
    if (handling == BiasHandling::kBiasInGemm && bias->stride(0) != 1)
      handling = BiasHandling::kBiasByBackend;
  }
  const bool prefill_in_scan = handling == BiasHandling::kBiasByBackend && mode != GuardMode::kOff;
  if (mode != GuardMode::kOff) {
    const CaptureState capture = capture_state(be, mode, x.device());
    std::vector<ScanJob> jobs{{&x, kRoleInput}};
    if (must_scan_parameter(capture, weight)) jobs.push_back({&weight, kRoleWeight});
    if (has_bias && must_scan_parameter(capture, *bias)) jobs.push_back({&*bias, kRoleBias});
    guard_values(be, mode, layer, jobs, capture, prefill_in_scan ? &out : nullptr,
                 prefill_in_scan ? &*bias : nullptr);
  }
  double beta = 0.0;
  const void* gemm_bias = nullptr;
  if (handling == BiasHandling::kBiasByCopy && has_bias && out.numel() > 0) {
    out.copy_(bias->expand_as(out));
    beta = 1.0;
  } else if (handling == BiasHandling::kBiasByBackend) {
    if (!prefill_in_scan) be.prefill_bias(out, *bias, layer);
    beta = 1.0;
  } else if (handling == BiasHandling::kBiasInGemm) {
    gemm_bias = bias->data_ptr();
  }
  reporting_oom(be, weight.device(), layer, "the forward GEMM's output", bytes, [&] {
    matmul_into(be, out, x2d, weight.t(), beta, "forward", {"input", "weight^T", "output"}, layer, gemm_bias);
    return 0;
  });
  if (x.dim() == 2) return out;  // already the output's shape
  return out.view(with_last(x.sizes(), out_features));
}

at::Tensor linear_grad_input(const LinearBackend& be, const at::Tensor& grad_output, const at::Tensor& weight,
                             const std::string& layer) {
  const GuardedCallScope scope("grad_input", "grad_output", &grad_output, "weight", &weight);
  check_grad_args(grad_output, weight, weight.size(0), "weight", layer);
  const at::Tensor g2d = flatten_rows(grad_output, weight.size(0));
  const int64_t bytes = g2d.size(0) * weight.size(1) * weight.element_size();
  return reporting_oom(be, weight.device(), layer, "the input gradient", bytes, [&] {
    at::Tensor grad_input = at::empty({g2d.size(0), weight.size(1)}, weight.options());
    matmul_into(be, grad_input, g2d, weight, 0.0, "grad_input", {"grad_output", "weight", "grad_input"},
                layer);
    return grad_input.view(with_last(grad_output.sizes(), weight.size(1)));
  });
}

at::Tensor linear_grad_weight(const LinearBackend& be, const at::Tensor& grad_output, const at::Tensor& x,
                              const std::string& layer) {
  const GuardedCallScope scope("grad_weight", "grad_output", &grad_output, "input", &x);
  TORCH_CHECK_VALUE(x.dim() >= 1 && grad_output.dim() == x.dim(), "cublas_guard_ext: layer '", layer,
                    "': grad_output ", grad_output.sizes(), " and input ", x.sizes(),
                    " must have the same number of dims");
  const int64_t out_features = grad_output.size(-1), in_features = x.size(-1);
  check_grad_args(grad_output, x, out_features, "input", layer);
  const at::Tensor g2d = flatten_rows(grad_output, out_features);
  const at::Tensor x2d = flatten_rows(x, in_features);
  TORCH_CHECK_VALUE(g2d.size(0) == x2d.size(0), "cublas_guard_ext: layer '", layer, "': grad_output ",
                    grad_output.sizes(), " and input ", x.sizes(), " disagree on the batch size");
  const int64_t bytes = out_features * in_features * x.element_size();
  return reporting_oom(be, x.device(), layer, "the weight gradient", bytes, [&] {
    at::Tensor grad_weight = at::empty({out_features, in_features}, x.options());
    matmul_into(be, grad_weight, g2d.t(), x2d, 0.0, "grad_weight", {"grad_output^T", "input", "grad_weight"},
                layer);
    return grad_weight;
  });
}

void guard_tensor(const LinearBackend& be, const at::Tensor& t, const std::string& layer, int64_t role,
                  int64_t mode_value) {
  const GuardMode mode = parse_mode(mode_value);
  TORCH_CHECK_VALUE(role >= kRoleInput && role <= kRoleGradOutput, "cublas_guard_ext: unknown tensor role ",
                    role);
  if (mode == GuardMode::kOff) return;
  raise_if_async_recorded(/*synchronize=*/false);
  if (!is_guarded_dtype(t.scalar_type())) raise_dtype_error(t, role_name(role), layer);
  if (mode == GuardMode::kSync) be.check_pending_error(layer);
  guard_values(be, mode, layer, {{&t, static_cast<TensorRole>(role)}}, capture_state(be, mode, t.device()));
}

void check_features(const LinearBackend& be, const at::Tensor& x, int64_t in_features,
                    const std::string& layer) {
  check_input(x, in_features, layer);
  be.check_pending_error(layer);
  guard_values(be, GuardMode::kSync, layer, {{&x, kRoleInput}});
}

at::Tensor scan(const LinearBackend& be, const at::Tensor& x) {
  check_scannable(x);
  at::Tensor out = at::empty({kScanFields}, x.options().dtype(at::kLong));
  be.scan_into(x, out, nullptr, "scan");
  return out;
}

}  // namespace cublas_guard

// The package's private entry points (cublas_guard_ext.nn): the per-name call
// counters (the optimizer-step hook is param_cache.cpp's).
TORCH_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  // SafeLinear calls it when an instance takes a name (async reports count calls per name).
  m.def("reset_layer_calls(str layer) -> ()",
        [](c10::string_view layer) { cublas_guard::layers().reset(std::string(layer)); });
}
