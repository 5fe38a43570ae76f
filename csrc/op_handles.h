// Typed dispatcher handles for the guarded ops, looked up once. Calling an op
// through its handle runs every dispatch key (Autograd, Autocast, Python
// modes, the backend) as torch.ops does, without torch.ops' per-call schema
// parsing. The files that re-enter the dispatcher (autograd, autocast, the
// fast eager entry) share these, so a schema lives in one place besides its
// TORCH_LIBRARY def.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

namespace cublas_guard {

using LinearSignature = at::Tensor(const at::Tensor&, const at::Tensor&,
                                   const c10::optional<at::Tensor>&, c10::string_view, int64_t,
                                   bool);
using GradGemmSignature = at::Tensor(const at::Tensor&, const at::Tensor&, c10::string_view);
using GuardValuesSignature = void(const at::Tensor&, c10::string_view, int64_t, int64_t);

inline const c10::TypedOperatorHandle<LinearSignature>& linear_handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cublas_guard::linear", "")
                             .typed<LinearSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<GradGemmSignature>& grad_input_handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cublas_guard::linear_grad_input", "")
                             .typed<GradGemmSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<GradGemmSignature>& grad_weight_handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cublas_guard::linear_grad_weight", "")
                             .typed<GradGemmSignature>();
  return op;
}

inline const c10::TypedOperatorHandle<GuardValuesSignature>& guard_values_handle() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("cublas_guard::guard_values", "")
                             .typed<GuardValuesSignature>();
  return op;
}

}  // namespace cublas_guard
