// The hot path of watch: the boxed fallback on TESTING_ONLY_GenericMode that
// every dispatched op of a watching thread goes through. It records the
// module of the autograd node an op will make, pre-checks in-place
// arguments, runs the op (re-raising cuBLAS/CUDA failures typed), and scans
// the outputs that may hold new values; only a non-finite output takes the
// bad path (judge). See watch.h for the whole design.
#include "watch/watch.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
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

void watch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  const c10::DispatchKeySet after =
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWatchKey);
  Session* sp = current_session();
  if (sp == nullptr) {
    op.redispatchBoxed(after, stack);
    return;
  }
  Session& s = *sp;
  ++s.ops_seen;
  if (s.pending) raise_pending(s);  // async: the next watched op reports the first finding
  const OpInfo& info = op_info(op);
  if (info.skip) {
    KernelDepthGuard kernel(true);
    op.redispatchBoxed(after, stack);
    return;
  }
  // Forward: the module this op's autograd node (if any) will belong to.
  if (tls_session == sp && c10::GradMode::is_enabled()) {
    const uint64_t seq = at::sequence_number::peek();
    if (seq >= s.seq_base) {
      const uint64_t i = seq - s.seq_base;
      if (i >= s.seq_module.size()) s.seq_module.resize(i + 1, -1);
      s.seq_module[i] = s.module_stack.empty() ? -1 : s.module_stack.back();
    }
  }
  if (tls_saved_args.size() <= static_cast<size_t>(tls_depth)) tls_saved_args.resize(tls_depth + 1);
  std::vector<c10::IValue>& saved = tls_saved_args[tls_depth];
  DepthGuard depth(saved);
  const size_t n = std::min(info.num_args, stack->size());
  saved.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());

  // In-place arguments (tensors or lists): were their values finite before
  // the op? Known (the last scan of the same storage and version) or scanned.
  bool inplace_bad_before = false;
  for (int a : info.inplace_args) {
    for_each_tensor(saved[a], [&](const at::Tensor& t) {
      if (!inplace_bad_before && readable(t) && scan_known(s, t).bad()) inplace_bad_before = true;
    });
  }

  try {
    KernelDepthGuard kernel(!info.composite);
    op.redispatchBoxed(after, stack);
  } catch (python_error& e) {
    pybind11::gil_scoped_acquire gil;
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
    if (message.find(kPayloadMarker) != std::string::npos || !mentions_cuda_failure(message)) throw;
    pybind11::gil_scoped_acquire gil;
    reraise_typed(s, op, info, saved, nullptr, message);
  }

  for (int a : info.written_args) {
    for_each_tensor(saved[a], [&](const at::Tensor& t) { forget(s, t); });
  }
  // An output produced by the op's own kernel is always scanned (a kernel may
  // have written a buffer an inner op scanned); a composite op's output was
  // produced by the inner ops the fallback saw, so their scan is reused.
  auto check_output = [&](const at::Tensor& t, int64_t index) {
    if (!readable(t)) return;
    bool known = false;
    if (finite_by_construction(s, info, saved, inplace_bad_before, t, known)) {
      ++s.scans_saved;
      if (known) remember(s, t, true);
      return;
    }
    const Counts c = info.composite ? scan_known(s, t) : scan_fresh(s, t);
    if (c.bad()) {
      // a known-bad result's counts were not kept: count them for the report
      const Counts full = c.nan + c.posinf + c.neginf > 0 ? c : scan_values(s, t);
      judge(s, op, info, saved, inplace_bad_before, t, index, full);
    }
  };
  if (info.scan_written_args) {
    // Ops that return nothing (the _foreach_*_ family): the arguments they
    // wrote are their outputs.
    for (int a : info.written_args) {
      for_each_tensor(saved[a], [&](const at::Tensor& t) { check_output(t, a); });
    }
    return;
  }
  const size_t num_returns = info.scan_return.size();
  if (stack->size() < num_returns) return;
  for (size_t r = 0; r < num_returns; ++r) {
    if (!info.scan_return[r]) continue;
    const c10::IValue& out = (*stack)[stack->size() - num_returns + r];
    for_each_tensor(out, [&](const at::Tensor& t) { check_output(t, static_cast<int64_t>(r)); });
  }
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
