// The grouped linear's argument rules, each written once: the real kernels
// and the Meta kernels (locked/ops_meta.cpp; the core's Python fake kernels through
// grouped_argument_rules, ops.cpp) call these, so a traced or compiled model
// refuses the same inputs with the same typed errors. Shapes are compared as
// SymInts (a token count traced dynamic stays symbolic). The rules on the
// offsets' values (group_ends) need the values, so only real kernels run them,
// on the host, before anything is written.
#include "moe/grouped_op.h"

#include <algorithm>
#include <string>

namespace cublas_guard {

namespace {

// The offsets broke a rule on their values or dtype: GroupOffsetsError.
[[noreturn]] void raise_offsets(const GroupedNames& names, const char* reason, int64_t expert,
                                const std::vector<int64_t>& ends, int64_t rows, const std::string& summary) {
  ErrorReport report("group_offsets");
  report.add("layer", names.label()).add("experts_module", names.module).add("parameter", names.parameter);
  report.add("reason", reason).add("num_tokens", rows);
  if (expert >= 0) report.add("expert", expert);
  // At most the first 64 ends: enough to see the pattern, a bounded payload.
  const auto shown = static_cast<int64_t>(std::min<size_t>(ends.size(), 64));
  report.add("offsets", std::vector<int64_t>(ends.begin(), ends.begin() + shown));
  report.raise_value_error("layer '" + names.label() + "': " + summary);
}

// Offsets of a dtype that cannot hold group ends.
void check_offsets_dtype(const Tensor& offs, const GroupedNames& names) {
  if (offs.scalar_type() == kInt || offs.scalar_type() == kLong) return;
  const std::string layer = names.label();
  ErrorReport report("group_offsets");
  report.add("layer", layer).add("experts_module", names.module).add("parameter", names.parameter);
  report.add("reason", "dtype").add("dtype", dtype_name(offs.scalar_type()));
  report.raise_value_error("layer '" + layer + "': offsets dtype is " + dtype_name(offs.scalar_type()) +
                           ", expected int32 (or int64) group ends");
}

template <typename T>
void read_ends(const Tensor& host, std::vector<int64_t>& out) {
  const T* data = data_as<T>(host);
  const int64_t stride = host.stride(0);
  for (int64_t i = 0; i < host.size(0); ++i) out[i] = static_cast<int64_t>(data[i * stride]);
}

}  // namespace

std::string GroupedNames::label() const { return parameter.empty() ? module : module + "." + parameter; }

std::string GroupedNames::expert_label(int64_t expert) const {
  return label() + "[" + std::to_string(expert) + "]";
}

ExpertShape expert_shape(const Tensor& weight, bool transposed) {
  return {weight.size(0), weight.size(transposed ? 2 : 1), weight.size(transposed ? 1 : 2)};
}

Tensor expert_weight(const Tensor& weight, int64_t expert, bool transposed) {
  Tensor w = row(weight, expert);
  return transposed ? transposed_view(w) : w;
}

void check_grouped_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                        const Tensor& offs, bool transposed, const GroupedNames& names) {
  const std::string layer = names.label();
  if (!is_guarded_dtype(weight.scalar_type())) raise_dtype_error(weight, "weight", layer);
  if (weight.dim() != 3) {
    raise_shape(weight, "weight",
                transposed ? "[experts, in_features, out_features]" : "[experts, out_features, in_features]",
                layer);
  }
  if (is_guarded_dtype(x.scalar_type()) && x.scalar_type() != weight.scalar_type()) {
    raise_dtype_mismatch(x, "input", weight, "weight", layer);
  }
  const SymSize in_features = sym_size_at(weight, transposed ? 1 : 2);
  check_input(x, in_features, layer);
  if (x.dim() != 2)
    raise_shape(x, "input", "[tokens, " + sym_str(in_features) + "] (sorted by expert)", layer);
  if (!same_device(x, weight)) raise_device_mismatch(x, "input", weight, "weight", layer);
  check_offsets_dtype(offs, names);
  if (offs.dim() != 1 || sym_size_at(offs, 0) != sym_size_at(weight, 0)) {
    raise_shape(offs, "offsets",
                "[" + sym_str(sym_size_at(weight, 0)) + "] (one group end per expert of the weight)", layer);
  }
  if (!same_device(offs, x)) raise_device_mismatch(offs, "offsets", weight, "weight", layer);
  if (bias.has_value() && bias->defined()) {
    const Tensor& b = *bias;
    if (!is_guarded_dtype(b.scalar_type())) raise_dtype_error(b, "bias", layer);
    if (b.scalar_type() != weight.scalar_type()) raise_dtype_mismatch(b, "bias", weight, "weight", layer);
    const SymSize out_features = sym_size_at(weight, transposed ? 2 : 1);
    if (b.dim() != 2 || sym_size_at(b, 0) != sym_size_at(weight, 0) || sym_size_at(b, 1) != out_features) {
      raise_shape(b, "bias", "[" + sym_str(sym_size_at(weight, 0)) + ", " + sym_str(out_features) + "]",
                  layer);
    }
    if (!same_device(b, weight)) raise_device_mismatch(b, "bias", weight, "weight", layer);
  }
}

void check_grouped_grad_args(const Tensor& grad_output, const Tensor& other, const char* other_name,
                             const SymSize& expected_width, const Tensor& offs, const GroupedNames& names) {
  const std::string layer = names.label();
  check_grad_args(grad_output, other, expected_width, other_name, layer);
  if (grad_output.dim() != 2) raise_shape(grad_output, "grad_output", "[tokens, features]", layer);
  check_offsets_dtype(offs, names);
  if (offs.dim() != 1) raise_shape(offs, "offsets", "[experts]", layer);
  if (!same_device(offs, grad_output)) {
    raise_device_mismatch(offs, "offsets", grad_output, "grad_output", layer);
  }
}

std::vector<int64_t> group_ends(const Tensor& offs, int64_t rows, const GroupedNames& names) {
  // One copy to the host (a synchronization on a device): the per-expert GEMMs
  // need the sizes there anyway (grouped_common.cpp).
  const Tensor host = to_cpu(offs);
  std::vector<int64_t> ends(static_cast<size_t>(host.size(0)));
  if (host.scalar_type() == kInt) {
    read_ends<int32_t>(host, ends);
  } else {
    read_ends<int64_t>(host, ends);
  }
  int64_t previous = 0;
  for (size_t e = 0; e < ends.size(); ++e) {
    const auto expert = static_cast<int64_t>(e);
    if (ends[e] < previous) {
      if (e == 0) {
        raise_offsets(names, "negative", expert, ends, rows,
                      "offsets[0] = " + std::to_string(ends[e]) + " is negative: group ends count rows");
      }
      raise_offsets(names, "descending", expert, ends, rows,
                    "offsets are not ascending: expert " + std::to_string(e) + " ends at row " +
                        std::to_string(ends[e]) + ", before expert " + std::to_string(e - 1) + "'s end " +
                        std::to_string(previous));
    }
    previous = ends[e];
  }
  if (!ends.empty() && ends.back() > rows) {
    // The first expert whose group runs past the rows.
    const auto past = std::find_if(ends.begin(), ends.end(), [rows](int64_t end) { return end > rows; });
    const auto expert = static_cast<int64_t>(past - ends.begin());
    raise_offsets(names, "past_tokens", expert, ends, rows,
                  "offsets run past the input: expert " + std::to_string(expert) + " ends at row " +
                      std::to_string(*past) + " but the input has " + std::to_string(rows) + " rows");
  }
  return ends;
}

}  // namespace cublas_guard
