// The grouped linear's CPU kernels: the device-independent body
// (grouped_common.cpp) on the linear op's CPU backend (torch's CPU BLAS behind
// the same GEMM plan), so every rule, scan and report of the op runs on CPU.
#include "moe/grouped_op.h"

#include <torch/library.h>

#include <string>

namespace cublas_guard {
namespace {

GroupedNames names_of(c10::string_view layer, c10::string_view parameter) {
  return {std::string(layer), std::string(parameter)};
}

at::Tensor grouped_linear_op(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                             c10::string_view layer, c10::string_view parameter, int64_t mode,
                             bool transposed) {
  return grouped_linear_forward(cpu_backend(), x, weight, bias, offs, names_of(layer, parameter), mode,
                                transposed);
}

at::Tensor grouped_grad_input_op(const at::Tensor& grad_output, const at::Tensor& weight,
                                 const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                                 bool transposed) {
  return grouped_linear_grad_input(cpu_backend(), grad_output, weight, offs, names_of(layer, parameter),
                                   transposed);
}

at::Tensor grouped_grad_weight_op(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& offs,
                                  c10::string_view layer, c10::string_view parameter, bool transposed) {
  return grouped_linear_grad_weight(cpu_backend(), grad_output, x, offs, names_of(layer, parameter),
                                    transposed);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, CPU, m) {
  using namespace cublas_guard;
  m.impl("grouped_linear", &grouped_linear_op);
  m.impl("grouped_linear_grad_input", &grouped_grad_input_op);
  m.impl("grouped_linear_grad_weight", &grouped_grad_weight_op);
}
