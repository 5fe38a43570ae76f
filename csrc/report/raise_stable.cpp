// How a report is raised in the stable core. Only std::runtime_error crosses
// the stable ABI (torch turns it into a RuntimeError with the message), so the
// Python wrappers of the core's ops translate: the payload line names the kind
// and so the typed class (cublas_guard_ext/errors/parse.py). What the typed
// exception also carries, the failing call's tensors (the capsule's GEMM
// buffers and operands, report/call_scope.h), cannot ride in a message: they
// are kept here, per thread (the buffers copied: their memory dies with the
// call), until Python takes them (take_failure_context) or the next failure
// replaces them.
#ifdef CUBLAS_GUARD_STABLE
#include "core/registration.h"
#include "report/call_scope.h"
#include "report/error_report.h"

#include <stdexcept>

namespace cublas_guard {

namespace {

struct FailureContext {
  std::vector<std::string> names;  // "buffer:<name>" or "operand:<name>"
  std::vector<Tensor> tensors;
  std::string phase;
  int64_t call_number = 0;
};

thread_local FailureContext tls_failure;

[[noreturn]] void raise_with_context(const ErrorReport& report, const std::string& text) {
  FailureContext context;
  for (const auto& entry : report.attached()) {
    if (!entry.second.defined()) continue;
    context.names.push_back("buffer:" + entry.first);
    // The GEMM's buffers are views of memory the failing call owns (its output
    // among them), freed as the exception unwinds it: Python reads a copy.
    context.tensors.push_back(torch::stable::clone(entry.second));
  }
  if (const GuardedCall* call = current_guarded_call()) {
    for (int i = 0; i < 3; ++i) {
      if (call->names[i] != nullptr && call->tensors[i] != nullptr && call->tensors[i]->defined()) {
        context.names.push_back(std::string("operand:") + call->names[i]);
        context.tensors.push_back(*call->tensors[i]);
      }
    }
    context.phase = call->phase;
    context.call_number = call->number;
  }
  tls_failure = std::move(context);
  throw std::runtime_error(text);
}

// [names..., "phase:<phase>", "call_number:<n>"]: what take_failure_tensors' list holds.
std::vector<std::string> failure_names() {
  std::vector<std::string> out = tls_failure.names;
  out.push_back("phase:" + tls_failure.phase);
  out.push_back("call_number:" + std::to_string(tls_failure.call_number));
  return out;
}

std::vector<Tensor> take_failure_tensors() {
  std::vector<Tensor> out = std::move(tls_failure.tensors);
  tls_failure = FailureContext{};
  return out;
}

}  // namespace

void ErrorReport::raise_value_error(const std::string& summary) const {
  raise_with_context(*this, message(summary));
}
void ErrorReport::raise_type_error(const std::string& summary) const {
  raise_with_context(*this, message(summary));
}
void ErrorReport::raise_runtime_error(const std::string& summary) const {
  raise_with_context(*this, message(summary));
}
void ErrorReport::raise_out_of_memory(const std::string& summary) const {
  raise_with_context(*this, message(summary));
}

// No interpreter is reached from the stable core: Python translates (above).
void throw_python_error_if_possible(const std::string& /*message*/, const ErrorReport* /*report*/) {}

}  // namespace cublas_guard

// The failing call's context, read once by the translation in Python: first the
// names, then the tensors (which clears it).
CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("failure_names() -> str[]");
  m.def("take_failure_tensors() -> Tensor[]");
}
CG_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "failure_names", &cublas_guard::failure_names);
  CG_IMPL(m, "take_failure_tensors", &cublas_guard::take_failure_tensors);
}
#endif  // CUBLAS_GUARD_STABLE
