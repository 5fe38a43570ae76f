// The argument rules. Each rule lives here once; the CPU, CUDA and Meta
// kernels all call these functions, and Python only translates what they raise.
#include "linear/linear_op.h"

#include <algorithm>
#include <string>

namespace cublas_guard {

namespace {

std::string dtype_name(at::ScalarType t) { return c10::toString(t); }

}  // namespace

[[noreturn]] void raise_shape(const at::Tensor& t, const char* role, const std::string& expected,
                              const std::string& layer) {
  ErrorReport report("shape_mismatch");
  report.add("layer", layer).add("role", role).add("shape", t.sym_sizes());
  report.add("expected_shape", expected).add("reason", "operand");
  report.raise_value_error("layer '" + layer + "': " + role + " of shape " + c10::str(t.sym_sizes()) +
                           ", expected " + expected);
}

[[noreturn]] void raise_device_mismatch(const at::Tensor& t, const char* role, const at::Tensor& anchor,
                                        const char* anchor_name, const std::string& layer) {
  ErrorReport report("device_mismatch");
  report.add("layer", layer).add("role", role).add("anchor", anchor_name);
  report.add("input_device", t.device().str()).add("weight_device", anchor.device().str());
  report.add("shape", t.sym_sizes());
  report.raise_runtime_error("layer '" + layer + "': " + role + " is on " + t.device().str() + " but " +
                             anchor_name + " is on " + anchor.device().str());
}

bool is_guarded_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kDouble;
}

void raise_dtype_error(const at::Tensor& t, const char* role, const std::string& layer) {
  ErrorReport report("dtype");
  report.add("layer", layer).add("role", role).add("dtype", dtype_name(t.scalar_type()));
  report.add("reason", "unsupported").add("expected", "Float, BFloat16, Half, Double");
  describe_tensor(report, "tensor", t);
  report.raise_type_error("layer '" + layer + "': " + role + " dtype is " + dtype_name(t.scalar_type()) +
                          ", but the guarded linear takes float32, bfloat16, float16 or float64");
}

void raise_dtype_mismatch(const at::Tensor& t, const char* role, const at::Tensor& anchor,
                          const char* anchor_role, const std::string& layer) {
  ErrorReport report("dtype");
  report.add("layer", layer).add("role", role).add("dtype", dtype_name(t.scalar_type()));
  report.add("reason", "mismatch").add("other_role", anchor_role);
  report.add("other_dtype", dtype_name(anchor.scalar_type()));
  describe_tensor(report, "tensor", t);
  report.raise_type_error("layer '" + layer + "': " + role + " dtype " + dtype_name(t.scalar_type()) +
                          " differs from " + anchor_role + " dtype " + dtype_name(anchor.scalar_type()));
}

void check_scannable(const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_guarded_dtype(t.scalar_type()),
                   "cublas_guard_ext.scan: expected a float32, bfloat16, float16 or float64 "
                   "tensor, got ",
                   t.scalar_type());
}

void check_input(const at::Tensor& x, const c10::SymInt& in_features, const std::string& layer) {
  if (!is_guarded_dtype(x.scalar_type())) raise_dtype_error(x, "input", layer);
  // Sizes are read as SymInts: under torch.compile / torch.export with dynamic
  // shapes this compares (and so guards) the last dim only, never the batch dims.
  if (x.dim() == 0 || x.sym_size(-1) != in_features) {
    ErrorReport report("shape_mismatch");
    report.add("layer", layer).add("role", "input").add("shape", x.sym_sizes());
    report.add("expected_last_dim", in_features);
    report.add("reason", x.dim() == 0 ? "zero_dim" : "last_dim");
    report.raise_value_error("layer '" + layer + "': input of shape " + c10::str(x.sym_sizes()) +
                             (x.dim() == 0 ? " is 0-d" : " has last dim " + c10::str(x.sym_size(-1))) +
                             ", expected last dim == in_features == " + c10::str(in_features));
  }
}

void check_linear_args(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       const std::string& layer) {
  if (!is_guarded_dtype(weight.scalar_type())) raise_dtype_error(weight, "weight", layer);
  if (weight.dim() != 2) raise_shape(weight, "weight", "[out_features, in_features]", layer);
  if (is_guarded_dtype(x.scalar_type()) && x.scalar_type() != weight.scalar_type()) {
    raise_dtype_mismatch(x, "input", weight, "weight", layer);
  }
  check_input(x, weight.sym_size(1), layer);
  if (x.device() != weight.device()) raise_device_mismatch(x, "input", weight, "weight", layer);
  if (bias.has_value() && bias->defined()) {
    const at::Tensor& b = *bias;
    if (!is_guarded_dtype(b.scalar_type())) raise_dtype_error(b, "bias", layer);
    if (b.scalar_type() != weight.scalar_type()) raise_dtype_mismatch(b, "bias", weight, "weight", layer);
    if (b.dim() != 1 || b.sym_size(0) != weight.sym_size(0)) {
      raise_shape(b, "bias", "[" + c10::str(weight.sym_size(0)) + "] (out_features)", layer);
    }
    if (b.device() != weight.device()) raise_device_mismatch(b, "bias", weight, "weight", layer);
  }
}

void check_grad_args(const at::Tensor& grad_output, const at::Tensor& other, const c10::SymInt& expected_last,
                     const char* other_name, const std::string& layer) {
  if (!is_guarded_dtype(grad_output.scalar_type())) raise_dtype_error(grad_output, "grad_output", layer);
  if (!is_guarded_dtype(other.scalar_type())) raise_dtype_error(other, other_name, layer);
  if (grad_output.scalar_type() != other.scalar_type()) {
    raise_dtype_mismatch(grad_output, "grad_output", other, other_name, layer);
  }
  if (grad_output.dim() < 1 || grad_output.sym_size(-1) != expected_last) {
    raise_shape(grad_output, "grad_output", "[..., " + c10::str(expected_last) + "]", layer);
  }
  if (grad_output.device() != other.device()) {
    raise_device_mismatch(grad_output, "grad_output", other, other_name, layer);
  }
}

void raise_if_non_finite(const at::Tensor& scanned, const int64_t* counts, const char* role,
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
  const double value = scanned.reshape({-1})[first].item<double>();
  report.add("first_bad_value", value);
  report.add("shape", scanned.sizes());
  report.add("numel", scanned.numel());
  // +/-Inf alone in float16 is most likely an overflow: the message needs the dtype to say so.
  report.add("dtype", dtype_name(scanned.scalar_type()));
  report.raise_value_error("layer '" + layer + "': " + role + " has " + std::to_string(counts[kNanCount]) +
                           " NaN, " + std::to_string(counts[kPosInfCount]) + " +Inf, " +
                           std::to_string(counts[kNegInfCount]) + " -Inf; first at flat index " +
                           std::to_string(first) + " " + c10::str(c10::IntArrayRef(coords)));
}

}  // namespace cublas_guard
