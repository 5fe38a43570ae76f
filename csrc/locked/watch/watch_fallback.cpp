// The hook of watch: the boxed fallback on TESTING_ONLY_GenericMode that every
// dispatched op of a watching thread goes through. Before the op: the pending
// async finding, the record's flag, the module of the autograd node the op
// will make, first-sight scans of inputs no watched op wrote (and with
// verify_inputs, the rescans). The op, with cuBLAS/CUDA failures re-raised
// typed. After the op: one scan launch per output (watch_device.cpp). See
// watch.h for the whole design.
#include "locked/watch/watch.h"
#include "locked/watch/watch_device.h"

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

namespace {

struct KernelDepthScope {
  int saved = tls_kernel_depth;
  explicit KernelDepthScope(bool kernel) {
    if (kernel) tls_kernel_depth = std::min(tls_kernel_depth, tls_depth);
  }
  ~KernelDepthScope() { tls_kernel_depth = saved; }
};

struct FallbackDepthScope {
  std::vector<c10::IValue>& saved;
  explicit FallbackDepthScope(std::vector<c10::IValue>& s) : saved(s) { ++tls_depth; }
  ~FallbackDepthScope() {
    saved.clear();
    --tls_depth;
  }
};

// A guarded layer (SafeLinear) refused an input: if one carries a tag, its
// origin is the finding (raised in place of the layer's error).
void refused(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
             const std::vector<c10::IValue>& args) {
  // The guarded layers' own ops only: an error passing through an outer op is theirs.
  if (!starts_with(op.schema().name(), "cublas_guard::")) return;
  bool raise_now = false;
  {
    SessionLock lock(*s.mu);
    const uint32_t origin = input_origin(s, info, args);
    if (origin < kFirstOrigin) return;
    const bool was_pending = s.pending;
    reached(s, origin, "the input of " + op_display_name(op.schema()) + ", which refused it");
    raise_now = s.pending && !was_pending;  // async too: the layer raises now anyway
  }
  run_after_unlock(s);
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
  const OpInfo& info = op_info(op);
  if (info.skip) {
    poll(s);  // an acquire load of each record's flag
    if (s.pending) raise_pending(s);  // async: the next watched op reports the first finding
    KernelDepthScope kernel(true);
    op.redispatchBoxed(after, stack);
    return;
  }
  if (tls_saved_args.size() <= static_cast<size_t>(tls_depth)) tls_saved_args.resize(tls_depth + 1);
  std::vector<c10::IValue>& saved = tls_saved_args[tls_depth];
  FallbackDepthScope depth(saved);
  const size_t n = std::min(info.num_args, stack->size());
  saved.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());

  int64_t seq_index = -1;  // this op's node's index into seq_module and the seq tags
  int64_t first_seq = 0;   // the ring's next number now: the scans of the ops it runs come after
  {
    SessionLock lock(*s.mu);  // one lock for the poll and the hooks before the op
    poll_locked(s);           // an acquire load of each record's flag
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
    tags_before(s, info, saved);
    first_seq = s.tags->next_seq;
    // Consequence mode: a value that turns finite at a float8 cast never reaches the
    // loss, so the cast is its sink (report="birth" raised at the birth already).
    if (info.float8_step != 0 && consequence) {
      const at::Tensor* input = nullptr;
      const std::string where = float8_swallow(info, saved, &input);
      if (input != nullptr) tags_reached(s, *input, where);
    }
    if (s.verify) verify_before(s, op, info, saved);
  }
  if (s.pending) raise_pending(s);  // async: the next watched op reports the first finding
  if (s.verify) run_after_unlock(s);  // a sync verify finding: before the op runs

  try {
    KernelDepthScope kernel(!info.composite);
    const c10::impl::ExcludeDispatchKeyGuard seal(
        info.sealed || !info.composite ? c10::DispatchKeySet(kWatchKey) : c10::DispatchKeySet());
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

  // An op that returns only views and writes nothing (view, t, expand, split):
  // no output to scan, nothing new in the record; its node's module is kept above.
  if (!s.verify && info.written_args.empty() &&
      std::none_of(info.scan_return.begin(), info.scan_return.end(), [](uint8_t r) { return r != 0; })) {
    run_after_unlock(s);  // a birth's stack or a finding the poll read
    return;
  }
  {
    SessionLock lock(*s.mu);
    if (s.verify) {
      for (int a : info.written_args)
        for_each_tensor(saved[a], [&](const at::Tensor& t) { verify_written(s, t); });
    }
    tags_after(s, op, info, saved, *stack, seq_index, first_seq);
  }
  run_after_unlock(s);  // a sync finding, a birth's stack: after the lock
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
