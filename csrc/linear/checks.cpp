// The argument rules. Each rule lives here once; the CPU, CUDA and Meta
// kernels all call these functions, and Python only translates what they raise.
#include "linear/linear_op.h"

#include <algorithm>
#include <string>

namespace cublas_guard {

[[noreturn]] void raise_shape(const Tensor& t, const char* role, const std::string& expected,
                              const std::string& layer) {
  ErrorReport report("shape_mismatch");
  report.add("layer", layer).add("role", role).add("shape", report_sizes(t));
  report.add("expected_shape", expected).add("reason", "operand");
  report.raise_value_error("layer '" + layer + "': " + role + " of shape " + sizes_str(t) + ", expected " +
                           expected);
}

// `t` (playing `role`) is not on the device of `anchor` (the layer's `anchor_name`).
[[noreturn]] void raise_device_mismatch(const Tensor& t, const char* role, const Tensor& anchor,
                                        const char* anchor_name, const std::string& layer) {
  ErrorReport report("device_mismatch");
  report.add("layer", layer).add("role", role).add("anchor", anchor_name);
  report.add("input_device", device_str(t)).add("weight_device", device_str(anchor));
  report.add("shape", report_sizes(t));
  report.raise_runtime_error("layer '" + layer + "': " + role + " is on " + device_str(t) + " but " +
                             anchor_name + " is on " + device_str(anchor));
}

void raise_dtype_error(const Tensor& t, const char* role, const std::string& layer) {
  ErrorReport report("dtype");
  report.add("layer", layer).add("role", role).add("dtype", dtype_name(t.scalar_type()));
  report.add("reason", "unsupported").add("expected", "Float, BFloat16, Half, Double");
  describe_tensor(report, "tensor", t);
  report.raise_type_error("layer '" + layer + "': " + role + " dtype is " + dtype_name(t.scalar_type()) +
                          ", but the guarded linear takes float32, bfloat16, float16 or float64");
}

void raise_dtype_mismatch(const Tensor& t, const char* role, const Tensor& anchor, const char* anchor_role,
                          const std::string& layer) {
  ErrorReport report("dtype");
  report.add("layer", layer).add("role", role).add("dtype", dtype_name(t.scalar_type()));
  report.add("reason", "mismatch").add("other_role", anchor_role);
  report.add("other_dtype", dtype_name(anchor.scalar_type()));
  describe_tensor(report, "tensor", t);
  report.raise_type_error("layer '" + layer + "': " + role + " dtype " + dtype_name(t.scalar_type()) +
                          " differs from " + anchor_role + " dtype " + dtype_name(anchor.scalar_type()));
}

void check_scannable(const Tensor& t) {
  CG_CHECK_TYPE(is_guarded_dtype(t.scalar_type()),
                "cublas_guard_ext.scan: expected a float32, bfloat16, float16 or float64 "
                "tensor, got ",
                t.scalar_type());
}

void check_input(const Tensor& x, const SymSize& in_features, const std::string& layer) {
  if (!is_guarded_dtype(x.scalar_type())) raise_dtype_error(x, "input", layer);
  // Sizes are read as SymInts: under torch.compile / torch.export with dynamic
  // shapes this compares (and so guards) the last dim only, never the batch dims.
  if (x.dim() == 0 || sym_size_at(x, -1) != in_features) {
    ErrorReport report("shape_mismatch");
    report.add("layer", layer).add("role", "input").add("shape", report_sizes(x));
    report.add("expected_last_dim", in_features);
    report.add("reason", x.dim() == 0 ? "zero_dim" : "last_dim");
    report.raise_value_error("layer '" + layer + "': input of shape " + sizes_str(x) +
                             (x.dim() == 0 ? " is 0-d" : " has last dim " + sym_str(sym_size_at(x, -1))) +
                             ", expected last dim == in_features == " + sym_str(in_features));
  }
}

void check_linear_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                       const std::string& layer) {
  if (!is_guarded_dtype(weight.scalar_type())) raise_dtype_error(weight, "weight", layer);
  if (weight.dim() != 2) raise_shape(weight, "weight", "[out_features, in_features]", layer);
  if (is_guarded_dtype(x.scalar_type()) && x.scalar_type() != weight.scalar_type()) {
    raise_dtype_mismatch(x, "input", weight, "weight", layer);
  }
  check_input(x, sym_size_at(weight, 1), layer);
  if (!same_device(x, weight)) raise_device_mismatch(x, "input", weight, "weight", layer);
  if (bias.has_value() && bias->defined()) {
    const Tensor& b = *bias;
    if (!is_guarded_dtype(b.scalar_type())) raise_dtype_error(b, "bias", layer);
    if (b.scalar_type() != weight.scalar_type()) raise_dtype_mismatch(b, "bias", weight, "weight", layer);
    if (b.dim() != 1 || sym_size_at(b, 0) != sym_size_at(weight, 0)) {
      raise_shape(b, "bias", "[" + sym_str(sym_size_at(weight, 0)) + "] (out_features)", layer);
    }
    if (!same_device(b, weight)) raise_device_mismatch(b, "bias", weight, "weight", layer);
  }
}

void check_grad_args(const Tensor& grad_output, const Tensor& other, const SymSize& expected_last,
                     const char* other_name, const std::string& layer) {
  if (!is_guarded_dtype(grad_output.scalar_type())) raise_dtype_error(grad_output, "grad_output", layer);
  if (!is_guarded_dtype(other.scalar_type())) raise_dtype_error(other, other_name, layer);
  if (grad_output.scalar_type() != other.scalar_type()) {
    raise_dtype_mismatch(grad_output, "grad_output", other, other_name, layer);
  }
  if (grad_output.dim() < 1 || sym_size_at(grad_output, -1) != expected_last) {
    raise_shape(grad_output, "grad_output", "[..., " + sym_str(expected_last) + "]", layer);
  }
  if (!same_device(grad_output, other)) {
    raise_device_mismatch(grad_output, "grad_output", other, other_name, layer);
  }
}

void raise_if_non_finite(const Tensor& scanned, const int64_t* counts, const char* role,
                         const std::string& layer) {
  const int64_t first = counts[kFirstBadIndex];
  if (first < 0) return;
  ErrorReport report("non_finite");
  report.add("layer", layer).add("role", role);
  report.add("nan_count", counts[kNanCount]);
  report.add("posinf_count", counts[kPosInfCount]);
  report.add("neginf_count", counts[kNegInfCount]);
  report.add("first_bad_index", first);
  // Coordinates of the first bad element in the tensor's own (logical) shape.
  std::vector<int64_t> coords(scanned.dim(), 0);
  int64_t rest = first;
  for (int64_t d = scanned.dim() - 1; d >= 0; --d) {
    const int64_t size = std::max<int64_t>(scanned.size(d), 1);
    coords[d] = rest % size;
    rest /= size;
  }
  report.add("first_bad_coords", coords);
  // The error path may afford a one-element copy to say which value it was.
  const double value = element_as_double(scanned, first);
  report.add("first_bad_value", value);
  report.add("shape", sizes_of(scanned));
  report.add("numel", scanned.numel());
  // +/-Inf alone in float16 is most likely an overflow: the message needs the dtype to say so.
  report.add("dtype", dtype_name(scanned.scalar_type()));
  report.raise_value_error("layer '" + layer + "': " + role + " has " + std::to_string(counts[kNanCount]) +
                           " NaN, " + std::to_string(counts[kPosInfCount]) + " +Inf, " +
                           std::to_string(counts[kNegInfCount]) + " -Inf; first at flat index " +
                           std::to_string(first) + " " + list_str(coords));
}

}  // namespace cublas_guard
