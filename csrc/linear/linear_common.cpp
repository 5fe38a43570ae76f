// The guarded linear's entry points, device-independent: the argument checks
// (linear/checks.cpp), the value scans (linear/value_scans.cpp), how the bias
// enters, the GEMM plan (linear/gemm_plan.cpp) and the out-of-memory report.
// The CPU and CUDA kernels differ only in their LinearBackend.
#include "linear/linear_op.h"
#include "linear/reporting_oom.h"
#include "linear/value_scans.h"
#include "report/async_registry.h"
#include "report/call_scope.h"

#include <algorithm>
#include <array>
#include <vector>

namespace cublas_guard {

namespace {

// [..., cols] -> [rows, cols], a view whenever the strides allow. The row count
// is explicit: reshape({-1, 0}) is ambiguous for empty tensors.
Tensor flatten_rows(const Tensor& t, int64_t cols) {
  if (t.dim() == 2 && t.size(1) == cols) return t;  // already [rows, cols]: no reshape dispatch
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.size(d);
  return reshaped(t, {rows, cols});
}

std::vector<int64_t> with_last(const Tensor& t, int64_t last) {
  std::vector<int64_t> out = sizes_of(t);
  out.back() = last;
  return out;
}

}  // namespace

Tensor linear_forward(const LinearBackend& be, const Tensor& x, const Tensor& weight,
                      const std::optional<Tensor>& bias, const std::string& layer, int64_t mode_value) {
  const GuardedCallScope scope("forward", "input", &x, "weight", &weight, "bias",
                               bias.has_value() ? &*bias : nullptr);
  const GuardMode mode = parse_mode(mode_value);
  raise_if_async_recorded(/*synchronize=*/false);
  check_linear_args(x, weight, bias, layer);
  const bool has_bias = bias.has_value() && bias->defined();
  if (mode == GuardMode::kSync) be.check_pending_error(layer);
  const int64_t in_features = weight.size(1), out_features = weight.size(0);
  const Tensor x2d = flatten_rows(x, in_features);
  const int64_t bytes = x2d.size(0) * out_features * weight.element_size();
  Tensor out = reporting_oom(be, weight.device(), layer, "the forward GEMM's output", bytes, [&] {
    return empty({x2d.size(0), out_features}, weight.scalar_type(), weight);
  });
  // How the bias enters (BiasHandling): a broadcast copy and beta = 1 (torch's
  // addmm fallback), the GEMM's epilogue (beta = 0), or the backend's prefill
  // (beta = 1), fused into the input's scan when one runs: at most one launch
  // of ours before the GEMM.
  BiasHandling handling = BiasHandling::kBiasByCopy;
  if (has_bias && out.numel() > 0) {
    handling = be.bias_handling != nullptr ? be.bias_handling(out.scalar_type()) : BiasHandling::kBiasByCopy;
    if (handling == BiasHandling::kBiasInGemm && bias->stride(0) != 1)
      handling = BiasHandling::kBiasByBackend;
  }
  const bool prefill_in_scan = handling == BiasHandling::kBiasByBackend && mode != GuardMode::kOff;
  if (mode != GuardMode::kOff) {
    const CaptureState capture = capture_state(be, mode, x.device());
    std::vector<ScanJob> jobs{{&x, kRoleInput}};
    if (must_scan_parameter(capture, weight)) jobs.push_back({&weight, kRoleWeight});
    if (has_bias && must_scan_parameter(capture, *bias)) jobs.push_back({&*bias, kRoleBias});
    guard_values(be, mode, layer, jobs, capture, prefill_in_scan ? &out : nullptr,
                 prefill_in_scan ? &*bias : nullptr);
  }
  double beta = 0.0;
  const void* gemm_bias = nullptr;
  if (handling == BiasHandling::kBiasByCopy && has_bias && out.numel() > 0) {
    copy_into(out, *bias);  // broadcast over the rows
    beta = 1.0;
  } else if (handling == BiasHandling::kBiasByBackend) {
    if (!prefill_in_scan) be.prefill_bias(out, *bias, layer);
    beta = 1.0;
  } else if (handling == BiasHandling::kBiasInGemm) {
    gemm_bias = bias->data_ptr();
  }
  reporting_oom(be, weight.device(), layer, "the forward GEMM's output", bytes, [&] {
    matmul_into(be, out, x2d, transposed_view(weight), beta, "forward", {"input", "weight^T", "output"},
                layer, gemm_bias);
    return 0;
  });
  if (x.dim() == 2) return out;  // already the output's shape
  return reshaped(out, with_last(x, out_features));
}

Tensor linear_grad_input(const LinearBackend& be, const Tensor& grad_output, const Tensor& weight,
                         const std::string& layer) {
  const GuardedCallScope scope("grad_input", "grad_output", &grad_output, "weight", &weight);
  check_grad_args(grad_output, weight, weight.size(0), "weight", layer);
  const Tensor g2d = flatten_rows(grad_output, weight.size(0));
  const int64_t bytes = g2d.size(0) * weight.size(1) * weight.element_size();
  return reporting_oom(be, weight.device(), layer, "the input gradient", bytes, [&] {
    Tensor grad_input = empty({g2d.size(0), weight.size(1)}, weight.scalar_type(), weight);
    matmul_into(be, grad_input, g2d, weight, 0.0, "grad_input", {"grad_output", "weight", "grad_input"},
                layer);
    return reshaped(grad_input, with_last(grad_output, weight.size(1)));
  });
}

Tensor linear_grad_weight(const LinearBackend& be, const Tensor& grad_output, const Tensor& x,
                          const std::string& layer) {
  const GuardedCallScope scope("grad_weight", "grad_output", &grad_output, "input", &x);
  CG_CHECK_VALUE(x.dim() >= 1 && grad_output.dim() == x.dim(), "cublas_guard_ext: layer '", layer,
                 "': grad_output ", sizes_str(grad_output), " and input ", sizes_str(x),
                 " must have the same number of dims");
  const int64_t out_features = grad_output.size(-1), in_features = x.size(-1);
  check_grad_args(grad_output, x, out_features, "input", layer);
  const Tensor g2d = flatten_rows(grad_output, out_features);
  const Tensor x2d = flatten_rows(x, in_features);
  CG_CHECK_VALUE(g2d.size(0) == x2d.size(0), "cublas_guard_ext: layer '", layer, "': grad_output ",
                 sizes_str(grad_output), " and input ", sizes_str(x), " disagree on the batch size");
  const int64_t bytes = out_features * in_features * x.element_size();
  return reporting_oom(be, x.device(), layer, "the weight gradient", bytes, [&] {
    Tensor grad_weight = empty({out_features, in_features}, x.scalar_type(), x);
    matmul_into(be, grad_weight, transposed_view(g2d), x2d, 0.0, "grad_weight",
                {"grad_output^T", "input", "grad_weight"}, layer);
    return grad_weight;
  });
}

void guard_tensor(const LinearBackend& be, const Tensor& t, const std::string& layer, int64_t role,
                  int64_t mode_value) {
  const GuardMode mode = parse_mode(mode_value);
  CG_CHECK_VALUE(role >= kRoleInput && role <= kRoleGradOutput, "cublas_guard_ext: unknown tensor role ",
                 role);
  if (mode == GuardMode::kOff) return;
  raise_if_async_recorded(/*synchronize=*/false);
  if (!is_guarded_dtype(t.scalar_type())) raise_dtype_error(t, tensor_role_name(role), layer);
  if (mode == GuardMode::kSync) be.check_pending_error(layer);
  guard_values(be, mode, layer, {{&t, static_cast<TensorRole>(role)}}, capture_state(be, mode, t.device()));
}

void check_features(const LinearBackend& be, const Tensor& x, int64_t in_features, const std::string& layer) {
  check_input(x, in_features, layer);
  be.check_pending_error(layer);
  guard_values(be, GuardMode::kSync, layer, {{&x, kRoleInput}});
}

Tensor scan(const LinearBackend& be, const Tensor& x) {
  check_scannable(x);
  Tensor out = empty({kScanFields}, kLong, x);
  be.scan_into(x, out, nullptr, "scan");
  return out;
}

}  // namespace cublas_guard
