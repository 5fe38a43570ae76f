// Typed dispatcher handles for the guarded ops, looked up once. Calling an op
// through its handle runs every dispatch key (Autograd, Autocast, Python
// modes, the backend) as torch.ops does, without torch.ops' per-call schema
// parsing. The files that re-enter the dispatcher (autograd, autocast, the
// fast eager entry) share these, so a schema lives in one place besides its
// TORCH_LIBRARY def.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace cublas_guard {

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                   c10::string_view, int64_t, bool);
using GradGemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using GuardValuesSignature = void(const at::Tensor&, c10::string_view, int64_t, int64_t);
using ScanSignature = at::Tensor(const at::Tensor&);
using GroupedLinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                          const c10::optional<at::Tensor>&, const at::Tensor&,
                                          c10::string_view, c10::string_view, int64_t, bool);
using GroupedGradSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                        c10::string_view, c10::string_view, bool);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline const c10::TypedOperatorHandle<LinearSignature>& linear_handle() {
  static const auto op = find_op<LinearSignature>("cublas_guard::linear");
  return op;
}
inline const c10::TypedOperatorHandle<GradGemmSignature>& grad_input_handle() {
  static const auto op = find_op<GradGemmSignature>("cublas_guard::linear_grad_input");
  return op;
}
inline const c10::TypedOperatorHandle<GradGemmSignature>& grad_weight_handle() {
  static const auto op = find_op<GradGemmSignature>("cublas_guard::linear_grad_weight");
  return op;
}
inline const c10::TypedOperatorHandle<ScanSignature>& scan_handle() {
  static const auto op = find_op<ScanSignature>("cublas_guard::scan");
  return op;
}
inline const c10::TypedOperatorHandle<GuardValuesSignature>& guard_values_handle() {
  static const auto op = find_op<GuardValuesSignature>("cublas_guard::guard_values");
  return op;
}
inline const c10::TypedOperatorHandle<GroupedLinearSignature>& grouped_linear_handle() {
  static const auto op = find_op<GroupedLinearSignature>("cublas_guard::grouped_linear");
  return op;
}
inline const c10::TypedOperatorHandle<GroupedGradSignature>& grouped_grad_input_handle() {
  static const auto op = find_op<GroupedGradSignature>("cublas_guard::grouped_linear_grad_input");
  return op;
}
inline const c10::TypedOperatorHandle<GroupedGradSignature>& grouped_grad_weight_handle() {
  static const auto op = find_op<GroupedGradSignature>("cublas_guard::grouped_linear_grad_weight");
  return op;
}

}  // namespace cublas_guard
