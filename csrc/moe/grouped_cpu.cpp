// The grouped linear's CPU kernels: the device-independent body
// (grouped_common.cpp) on the linear op's CPU backend (torch's CPU BLAS behind
// the same GEMM plan), so every rule, scan and report of the op runs on CPU.
#include "moe/grouped_op.h"

#include "core/registration.h"

#include <string>

namespace cublas_guard {
namespace {

GroupedNames names_of(StringArg layer, StringArg parameter) {
  return {std::string(layer), std::string(parameter)};
}

Tensor grouped_linear_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const Tensor& offs, StringArg layer, StringArg parameter, int64_t mode,
                         bool transposed) {
  return grouped_linear_forward(cpu_backend(), x, weight, bias, offs, names_of(layer, parameter), mode,
                                transposed);
}

Tensor grouped_grad_input_op(const Tensor& grad_output, const Tensor& weight, const Tensor& offs,
                             StringArg layer, StringArg parameter, bool transposed) {
  return grouped_linear_grad_input(cpu_backend(), grad_output, weight, offs, names_of(layer, parameter),
                                   transposed);
}

Tensor grouped_grad_weight_op(const Tensor& grad_output, const Tensor& x, const Tensor& offs, StringArg layer,
                              StringArg parameter, bool transposed) {
  return grouped_linear_grad_weight(cpu_backend(), grad_output, x, offs, names_of(layer, parameter),
                                    transposed);
}

}  // namespace
}  // namespace cublas_guard

CG_LIBRARY_IMPL(cublas_guard, CPU, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "grouped_linear", &grouped_linear_op);
  CG_IMPL(m, "grouped_linear_grad_input", &grouped_grad_input_op);
  CG_IMPL(m, "grouped_linear_grad_weight", &grouped_grad_weight_op);
}
