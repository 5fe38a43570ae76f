// The hot path of watch: the boxed fallback on TESTING_ONLY_GenericMode that
// every dispatched op of a watching thread goes through. It records the
// module of the autograd node an op will make, pre-checks in-place
// arguments, runs the op (re-raising cuBLAS/CUDA failures typed), and scans
// the outputs that may hold new values; only a non-finite output takes the
// bad path (judge). See watch.h for the whole design.
#include "watch/watch.h"
#include "watch/watch_device.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>

namespace cublas_guard {
namespace watch {

struct KernelDepthGuard {
  int saved = tls_kernel_depth;
  explicit KernelDepthGuard(bool kernel) {
    if (kernel) tls_kernel_depth = std::min(tls_kernel_depth, tls_depth);
  }
  ~KernelDepthGuard() { tls_kernel_depth = saved; }
};

struct DepthGuard {
  std::vector<c10::IValue>& saved;
  explicit DepthGuard(std::vector<c10::IValue>& s) : saved(s) { ++tls_depth; }
  ~DepthGuard() {
    saved.clear();
    --tls_depth;
  }
};

namespace {

// Whether a tensor input of the op carries an origin tag.
bool inputs_tagged(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                   uint32_t inplace_origin) {
  if (inplace_origin != kNoOrigin) return true;
  bool tagged = false;
  for (size_t i = 0; i < args.size() && i < info.num_args && !tagged; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& in) { tagged = tagged || origin_of(s, in) != kNoOrigin; });
  }
  return tagged;
}

// Sinks at an op (consequence mode): a tagged value written into a parameter
// or buffer of the watched model, or into any tensor outside the model's
// forward and backward (an optimizer's state, a running total).
void written_sink(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                  const std::vector<c10::IValue>& args, const at::Tensor& t, uint32_t origin) {
  if (info.written_args.empty() || !t.has_storage()) return;
  // Not inside a kernel (its in-place steps write its own buffers), not an
  // intermediate of a graph being built (a result autograd still differentiates).
  if (!trusted() || (t.requires_grad() && !t.is_leaf())) return;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  bool written = false;
  for (int a : info.written_args) {
    for_each_tensor(args[a], [&](const at::Tensor& w) {
      written = written || (w.defined() && w.has_storage() && w.storage().unsafeGetStorageImpl() == key);
    });
  }
  if (!written) return;
  const std::string name = op_display_name(op.schema());
  const auto state = s.state.find(key);
  if (state != s.state.end()) {
    reached(s, origin, "the model's parameter or buffer '" + state->second + "', written by " + name);
  } else if (s.has_model && s.module_stack.empty() && !torch::autograd::get_current_node()) {
    reached(s, origin,
            "a tensor written by " + name +
                " outside the model's forward and backward (state such as an optimizer's)");
  }
}

// verify_inputs: an input the table knows finite (same storage range and
// version) is scanned again; non-finite, no op the watch saw wrote it (a
// write outside stream order, through numpy or .data, another process).
void verify_inputs(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                   const std::vector<c10::IValue>& args) {
  const c10::FunctionSchema& schema = op.schema();
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    bool done = false;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (done || !readable(t)) return;
      const Known* k = lookup(s, t);
      if (k == nullptr || !k->finite) return;
      const c10::FunctionSchema* producer = k->producer;
      const Counts c = scan_values(s, t);
      if (!c.bad()) return;
      done = true;
      remember(s, t, false);
      if (s.mode == kModeAsync && s.pending) return;
      ErrorReport r("watch_from_nowhere");
      r.add("reader", op_display_name(schema)).add("argument", schema.arguments()[i].name());
      r.add("producer", producer != nullptr ? op_display_name(*producer) : std::string("an op"));
      r.add("nan_count", c.nan).add("posinf_count", c.posinf).add("neginf_count", c.neginf);
      r.add("first_bad_index", c.first);
      r.add("shape", t.sizes()).add("dtype", std::string(c10::toString(t.scalar_type())));
      r.add("device", t.device().str());
      add_where(r, s, where_now(s));
      const std::string message = r.message("watch: non-finite values from no op");
      if (s.mode == kModeAsync) {
        s.pending_message = message;
        s.pending = true;
      } else if (tls_deferred.raise.empty()) {
        tls_deferred.raise = message;
      }
    });
  }
}

// A guarded layer (SafeLinear) refused an input: if one carries a tag, its
// origin is the finding (raised in place of the layer's error).
void refused(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
             const std::vector<c10::IValue>& args) {
  // The guarded layers' own ops only: an error passing through an outer op is theirs.
  if (!starts_with(op.schema().name(), "cublas_guard::")) return;
  bool raise_now = false;
  {
    SessionLock lock(s.mu);
    uint32_t origin = kNoOrigin;
    for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
      if (info.is_out_arg[i]) continue;
      for_each_tensor(args[i],
                      [&](const at::Tensor& in) { origin = better_origin(origin, origin_of(s, in)); });
    }
    if (s.device) origin = deferred_input_origin(s, info, args);  // the deferred protocol's tags
    if (origin < kFirstOrigin) return;
    const bool was_pending = s.pending;
    reached(s, origin, "the input of " + op_display_name(op.schema()) + ", which refused it");
    raise_now = s.pending && !was_pending;  // async too: the layer raises now anyway
  }
  run_deferred(s);
  if (raise_now) raise_pending(s);
}

}  // namespace

void watch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::DispatchKeySet after = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWatchKey);
  SessionRef hold;  // a device thread's reference to the forward thread's session
  Session* sp = current_session(hold);
  if (sp == nullptr) {
    op.redispatchBoxed(after, stack);
    return;
  }
  Session& s = *sp;
  const bool consequence = s.report == kReportConsequence;
  ++s.ops_seen;
  if (s.device) deferred_poll(s);  // a plain load of the record's flag
  if (s.pending) raise_pending(s);  // async: the next watched op reports the first finding
  const OpInfo& info = op_info(op);
  if (info.skip) {
    KernelDepthGuard kernel(true);
    op.redispatchBoxed(after, stack);
    return;
  }
  if (tls_saved_args.size() <= static_cast<size_t>(tls_depth)) tls_saved_args.resize(tls_depth + 1);
  std::vector<c10::IValue>& saved = tls_saved_args[tls_depth];
  DepthGuard depth(saved);
  const size_t n = std::min(info.num_args, stack->size());
  saved.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());

  int64_t seq_index = -1;  // this op's node's index into seq_module/seq_origin
  bool inplace_bad_before = false;
  Range inplace_range;  // a single written tensor's bounds before the op (watch_bounds.cpp)
  uint32_t inplace_origin = kNoOrigin;  // their tags (read before the op: writing forgets them)
  {
    SessionLock lock(s.mu);
    // Forward: the module this op's autograd node (if any) will belong to.
    if (tls_session == sp && c10::GradMode::is_enabled()) {
      const uint64_t seq = at::sequence_number::peek();
      if (seq >= s.seq_base) {
        const uint64_t i = seq - s.seq_base;
        seq_index = static_cast<int64_t>(i);
        if (i >= s.seq_module.size()) s.seq_module.resize(i + 1, -1);
        s.seq_module[i] = s.module_stack.empty() ? -1 : s.module_stack.back();
      }
    }
    if (s.device) deferred_before(s, info, saved);  // first-sight scans; tags stay on the device
    if (s.verify) verify_inputs(s, op, info, saved);
    // In-place arguments (tensors or lists): were their values finite before
    // the op? Known (the last scan of the same storage and version) or scanned.
    for (int a : info.inplace_args) {
      if (s.device) break;  // the scan kernel reads their old tags
      for_each_tensor(saved[a], [&](const at::Tensor& t) {
        if (!inplace_bad_before && readable(t)) {
          const Counts c = scan_known(s, t);
          if (c.bad()) {
            inplace_bad_before = true;
          } else if (saved[a].isTensor()) {
            inplace_range = c.range;
          }
        }
        if (consequence) inplace_origin = better_origin(inplace_origin, origin_of(s, t));
      });
    }
  }

  if (s.verify) run_deferred(s);  // a sync verify finding: before the op runs
  try {
    KernelDepthGuard kernel(!info.composite);
    op.redispatchBoxed(after, stack);
  } catch (python_error& e) {
    pybind11::gil_scoped_acquire gil;
    if (e.value != nullptr && consequence && is_guard_error(e.value)) refused(s, op, info, saved);
    if (e.value == nullptr || is_guard_error(e.value)) throw;
    const std::string message = py_str(e.value);
    if (!mentions_cuda_failure(message)) throw;
    reraise_typed(s, op, info, saved, e.value, message);
  } catch (pybind11::error_already_set& e) {
    pybind11::gil_scoped_acquire gil;
    if (is_guard_error(e.value().ptr())) throw;
    const std::string message = py_str(e.value().ptr());
    if (!mentions_cuda_failure(message)) throw;
    reraise_typed(s, op, info, saved, e.value().ptr(), message);
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find(kPayloadMarker) != std::string::npos && consequence) refused(s, op, info, saved);
    if (message.find(kPayloadMarker) != std::string::npos || !mentions_cuda_failure(message)) throw;
    pybind11::gil_scoped_acquire gil;
    reraise_typed(s, op, info, saved, nullptr, message);
  }

  if (s.device) {  // one scan launch per output, decided on the device (watch_device.cpp)
    {
      SessionLock lock(s.mu);
      deferred_after(s, op, info, saved, *stack, seq_index);
    }
    run_deferred(s);
    return;
  }
  {
    SessionLock lock(s.mu);
    const c10::FunctionSchema* outer_producer = tls_producer;
    tls_producer = &op.schema();
    struct RestoreProducer {
      const c10::FunctionSchema* saved;
      ~RestoreProducer() { tls_producer = saved; }
    } restore_producer{outer_producer};
    for (int a : info.written_args) {
      for_each_tensor(saved[a], [&](const at::Tensor& t) { forget(s, t); });
    }
    // An output produced by the op's own kernel is always scanned (a kernel may
    // have written a buffer an inner op scanned); a composite op's output was
    // produced by the inner ops the fallback saw, so their scan is reused.
    uint32_t out_origin = kNoOrigin;
    auto check_output = [&](const at::Tensor& t, int64_t index) {
      if (!readable(t)) return;
      if (info.rule != Rule::kNone && !inplace_bad_before) {
        Range range;  // finite by its inputs' bounds: remembered with its own
        if (bounded_by_construction(s, info, saved, inplace_range, t, range)) {
          ++s.scans_saved;
          remember(s, t, true, range);
          return;
        }
      }
      bool known = false;
      if (finite_by_construction(s, info, saved, inplace_bad_before, t, known)) {
        // consequence: a move of a tagged value is scanned, to carry the tag on
        if (known || !consequence || !inputs_tagged(s, info, saved, inplace_origin)) {
          ++s.scans_saved;
          if (known) remember(s, t, true);
          return;
        }
      }
      const Counts c = info.composite ? scan_known(s, t) : scan_fresh(s, t);
      if (c.bad()) {
        // a known-bad result's counts were not kept: count them for the report
        const Counts full = c.nan + c.posinf + c.neginf > 0 ? c : scan_values(s, t);
        const uint32_t origin = judge(s, op, info, saved, inplace_bad_before, inplace_origin, t, index, full);
        if (consequence && origin != kNoOrigin) {
          out_origin = better_origin(out_origin, origin);
          tag(s, t, origin);
          if (origin >= kFirstOrigin) written_sink(s, op, info, saved, t, origin);
        }
      }
    };
    if (info.scan_written_args) {
      // Ops that return nothing (the _foreach_*_ family): the arguments they
      // wrote are their outputs.
      for (int a : info.written_args) {
        for_each_tensor(saved[a], [&](const at::Tensor& t) { check_output(t, a); });
      }
    } else if (stack->size() >= info.scan_return.size()) {
      const size_t num_returns = info.scan_return.size();
      for (size_t r = 0; r < num_returns; ++r) {
        if (!info.scan_return[r]) continue;
        const c10::IValue& out = (*stack)[stack->size() - num_returns + r];
        for_each_tensor(out, [&](const at::Tensor& t) { check_output(t, static_cast<int64_t>(r)); });
      }
    }
    // The forward op's output tag, under its node's sequence number (seq_origin).
    if (seq_index >= 0 && out_origin != kNoOrigin) {
      if (static_cast<size_t>(seq_index) >= s.seq_origin.size())
        s.seq_origin.resize(seq_index + 1, kNoOrigin);
      s.seq_origin[seq_index] = out_origin;
    }
  }
  run_deferred(s);  // a sync finding, a birth's stack: after the lock
}

std::once_flag fallback_once;
torch::Library* fallback_library = nullptr;

void install_fallback() {
  std::call_once(fallback_once, [] {
    // Registered once and kept: it does nothing unless a watching thread has
    // the key in its thread-local include set.
    fallback_library = new torch::Library(torch::Library::IMPL, "_", kWatchKey, __FILE__, __LINE__);
    fallback_library->fallback(torch::CppFunction::makeFromBoxedFunction<&watch_fallback>());
  });
}

}  // namespace watch
}  // namespace cublas_guard
