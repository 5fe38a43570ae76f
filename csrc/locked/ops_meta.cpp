// The Meta kernels of the public ops (ops.cpp), the version-locked library's:
// torch.compile and torch.export trace with SymInts, which only ATen has. They
// run the same rule functions as the real kernels (linear/checks.cpp), so a
// traced or compiled model refuses the same inputs with the same errors. The
// stable core registers Python fake kernels instead (register_fake in
// cublas_guard_ext/_native/core_twins/stable_core.py and stable_core_grouped.py).
#include "linear/linear_op.h"
#include "moe/grouped_op.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

namespace cublas_guard {
namespace {

// Sizes as SymInts: under torch.compile(dynamic=...) and torch.export a batch
// dim is symbolic and must stay so (no sizes(), no guard on it).
c10::SymDimVector linear_output_shape(const at::Tensor& x, const c10::SymInt& out_features) {
  c10::SymDimVector shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = out_features;
  return shape;
}

// Meta kernels run the same rule functions as the real ones, so a traced or
// compiled model refuses the same inputs with the same errors.
at::Tensor scan_meta(const at::Tensor& x) {
  check_scannable(x);
  return at::empty({kScanFields}, x.options().dtype(at::kLong));
}

at::Tensor linear_meta(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       c10::string_view layer, int64_t mode, bool /*scan_grad*/) {
  parse_mode(mode);
  check_linear_args(x, weight, bias, std::string(layer));
  return at::empty_symint(linear_output_shape(x, weight.sym_size(0)), weight.options());
}

at::Tensor grad_input_meta(const at::Tensor& grad_output, const at::Tensor& weight, c10::string_view layer) {
  check_grad_args(grad_output, weight, weight.sym_size(0), "weight", std::string(layer));
  return at::empty_symint(linear_output_shape(grad_output, weight.sym_size(1)), weight.options());
}

at::Tensor grad_weight_meta(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view layer) {
  check_grad_args(grad_output, x, grad_output.sym_size(-1), "input", std::string(layer));
  return at::empty_symint({grad_output.sym_size(-1), x.sym_size(-1)}, x.options());
}

void check_features_meta(const at::Tensor& x, int64_t in_features, c10::string_view layer) {
  check_input(x, in_features, std::string(layer));
}

GroupedNames grouped_names(c10::string_view layer, c10::string_view parameter) {
  return {std::string(layer), std::string(parameter)};
}

at::Tensor grouped_linear_meta(const at::Tensor& x, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                               c10::string_view layer, c10::string_view parameter, int64_t mode,
                               bool transposed) {
  parse_mode(mode);
  check_grouped_args(x, weight, bias, offs, transposed, grouped_names(layer, parameter));
  return at::empty_symint({x.sym_size(0), weight.sym_size(transposed ? 2 : 1)}, weight.options());
}

at::Tensor grouped_grad_input_meta(const at::Tensor& grad_output, const at::Tensor& weight,
                                   const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                                   bool transposed) {
  const GroupedNames names = grouped_names(layer, parameter);
  if (weight.dim() != 3) raise_shape(weight, "weight", "[experts, ., .]", names.label());
  check_grouped_grad_args(grad_output, weight, "weight", weight.sym_size(transposed ? 2 : 1), offs, names);
  return at::empty_symint({grad_output.sym_size(0), weight.sym_size(transposed ? 1 : 2)}, weight.options());
}

at::Tensor grouped_grad_weight_meta(const at::Tensor& grad_output, const at::Tensor& x,
                                    const at::Tensor& offs, c10::string_view layer,
                                    c10::string_view parameter, bool transposed) {
  check_grouped_grad_args(grad_output, x, "input", grad_output.sym_size(-1), offs,
                          grouped_names(layer, parameter));
  const c10::SymInt out_features = grad_output.sym_size(1), in_features = x.sym_size(1);
  if (transposed) return at::empty_symint({offs.sym_size(0), in_features, out_features}, x.options());
  return at::empty_symint({offs.sym_size(0), out_features, in_features}, x.options());
}

void guard_values_meta(const at::Tensor& /*t*/, c10::string_view /*layer*/, int64_t /*role*/, int64_t mode) {
  parse_mode(mode);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, Meta, m) {
  using namespace cublas_guard;
  m.impl("scan", &scan_meta);
  m.impl("linear", &linear_meta);
  m.impl("linear_grad_input", &grad_input_meta);
  m.impl("linear_grad_weight", &grad_weight_meta);
  m.impl("check_features", &check_features_meta);
  m.impl("grouped_linear", &grouped_linear_meta);
  m.impl("grouped_linear_grad_input", &grouped_grad_input_meta);
  m.impl("grouped_linear_grad_weight", &grouped_grad_weight_meta);
  m.impl("guard_values", &guard_values_meta);
}
