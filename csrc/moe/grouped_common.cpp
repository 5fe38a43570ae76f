// The grouped linear's entry points, device-independent: the argument rules
// (grouped_checks.cpp), the value scans, one checked GEMM per non-empty expert
// through matmul_into (the linear op's plan: split within the 32-bit limit,
// each piece checked, a CublasError naming the call), and the rows no group
// covers zeroed. The CPU and CUDA kernels differ only in their LinearBackend.
//
// Why one GEMM per expert. The group sizes must be on the host for any cuBLAS
// route: cublasGemmGroupedBatchedEx takes m/n/k/ld per group as host arrays,
// a strided-batched GEMM needs one size for all groups (padding each to the
// largest), and a per-expert loop needs each size. So the offsets are copied
// to the host once per call (a stream synchronization on CUDA, where torch's
// bf16 grouped_mm has none; its fp32/fp16 path synchronizes too), and then
// each expert is the same checked GEMM the linear op runs, on torch's handle
// and stream, with every status checked. With the sizes known, the scans read
// only the routed rows (below the last group end) and the failing expert is
// named in every report (report/report_place.h).
//
// Sync mode scans the routed rows and the weights (and bias) in one host
// synchronization, then raises naming the expert of the first bad element;
// async mode enqueues the same scans under the parameter's label (an async
// record names no expert: its coordinates do, [expert, ...] for a weight).
// The weight and bias are scanned again only when the clean-parameter cache
// says they changed, as SafeLinear's parameters are.
#include "linear/param_cache.h"
#include "linear/reporting_oom.h"
#include "linear/value_scans.h"
#include "moe/grouped_op.h"
#include "report/call_scope.h"
#include "report/report_place.h"

#include <algorithm>
#include <array>
#include <vector>

namespace cublas_guard {

namespace {

// The rows of `ends`' expert e: [begin, end).
int64_t group_begin(const std::vector<int64_t>& ends, int64_t e) { return e == 0 ? 0 : ends[e - 1]; }

// The expert whose rows hold `row` (rows below the last end only).
int64_t expert_of_row(const std::vector<int64_t>& ends, int64_t row) {
  return std::upper_bound(ends.begin(), ends.end(), row) - ends.begin();
}

// A scan of the call: the routed rows of the input (their row gives the
// expert), or a per-expert parameter (its first dim is the expert).
struct GroupedScanJob {
  Tensor tensor;
  TensorRole role;
};

// The expert of the first bad element `first` (a flat index into job.tensor).
int64_t expert_of(const GroupedScanJob& job, int64_t first, const std::vector<int64_t>& ends) {
  const Tensor& t = job.tensor;
  if (job.role == kRoleInput || job.role == kRoleGradOutput) {
    return expert_of_row(ends, first / std::max<int64_t>(1, t.size(1)));
  }
  return first / std::max<int64_t>(1, t.numel() / std::max<int64_t>(1, t.size(0)));
}

void scan_grouped(const LinearBackend& be, GuardMode mode, const GroupedNames& names,
                  const std::vector<GroupedScanJob>& jobs, const std::vector<int64_t>& ends) {
  if (jobs.empty()) return;
  const std::string label = names.label();
  const CaptureState capture = capture_state(be, mode, jobs.front().tensor.device());
  if (mode == GuardMode::kAsync) {
    std::vector<ScanJob> scans;
    scans.reserve(jobs.size());
    for (const auto& job : jobs) scans.push_back({&job.tensor, job.role});
    guard_values(be, mode, label, scans, capture);
    return;
  }
  const auto n = static_cast<int64_t>(jobs.size());
  Tensor results = empty({n, kScanFields}, kLong, jobs.front().tensor);
  for (int64_t i = 0; i < n; ++i) be.scan_into(jobs[i].tensor, row(results, i), nullptr, label);
  const Tensor host = be.fetch(results, label);
  const int64_t* counts = data_as<int64_t>(host);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t first = counts[i * kScanFields + kFirstBadIndex];
    if (first < 0) continue;
    const int64_t expert = expert_of(jobs[i], first, ends);
    const ReportPlace place{&names.module, &names.parameter, expert, group_begin(ends, expert), ends[expert]};
    const ReportPlaceScope where(&place);
    raise_if_non_finite(jobs[i].tensor, counts + i * kScanFields, tensor_role_name(jobs[i].role),
                        names.expert_label(expert));
  }
  for (const auto& job : jobs) {
    if (job.role == kRoleWeight || job.role == kRoleBias) mark_parameter_clean(job.tensor);
  }
}

// `t`'s rows from `routed` on, zeroed (rows no group covers).
void zero_tail(Tensor& t, int64_t routed) {
  if (routed < t.size(0)) {
    Tensor tail = first_rows(t, routed, t.size(0) - routed);
    zero(tail);
  }
}

int64_t routed_rows(const std::vector<int64_t>& ends) { return ends.empty() ? 0 : ends.back(); }

}  // namespace

Tensor grouped_linear_forward(const LinearBackend& be, const Tensor& x, const Tensor& weight,
                              const std::optional<Tensor>& bias, const Tensor& offs,
                              const GroupedNames& names, int64_t mode_value, bool transposed) {
  const bool has_bias = bias.has_value() && bias->defined();
  const GuardedCallScope scope("forward", "input", &x, "weight", &weight, "bias",
                               has_bias ? &*bias : nullptr);
  const GuardMode mode = parse_mode(mode_value);
  raise_if_async_recorded(/*synchronize=*/false);
  check_grouped_args(x, weight, bias, offs, transposed, names);
  if (mode == GuardMode::kSync) be.check_pending_error(names.label());
  const int64_t rows = x.size(0);
  const std::vector<int64_t> ends = group_ends(offs, rows, names);
  const int64_t routed = routed_rows(ends);
  const ExpertShape shape = expert_shape(weight, transposed);
  const int64_t bytes = rows * shape.out_features * weight.element_size();
  Tensor out = reporting_oom(be, weight.device(), names.label(), "the grouped forward's output", bytes,
                             [&] { return empty({rows, shape.out_features}, weight.scalar_type(), weight); });
  zero_tail(out, routed);
  if (mode != GuardMode::kOff) {
    const CaptureState capture = capture_state(be, mode, x.device());
    std::vector<GroupedScanJob> jobs;
    if (routed > 0) jobs.push_back({first_rows(x, 0, routed), kRoleInput});
    if (must_scan_parameter(capture, weight)) jobs.push_back({weight, kRoleWeight});
    if (has_bias && must_scan_parameter(capture, *bias)) jobs.push_back({*bias, kRoleBias});
    scan_grouped(be, mode, names, jobs, ends);
  }
  for (int64_t e = 0; e < shape.experts; ++e) {
    const int64_t begin = group_begin(ends, e), count = ends[e] - begin;
    if (count == 0) continue;
    const Tensor x_e = first_rows(x, begin, count);
    const Tensor w_e = expert_weight(weight, e, transposed);
    const Tensor b_e = has_bias ? row(*bias, e) : Tensor();
    Tensor out_e = first_rows(out, begin, count);
    const ReportPlace place{&names.module, &names.parameter, e, begin, ends[e]};
    const ReportPlaceScope where(&place);
    const GuardedCallScope expert_call("forward", "input", &x_e, "weight", &w_e, "bias",
                                       has_bias ? &b_e : nullptr);
    const std::string label = names.expert_label(e);
    reporting_oom(be, weight.device(), label, "the grouped forward's GEMM", bytes, [&] {
      matmul_into(be, out_e, x_e, transposed_view(w_e), 0.0, "forward", {"input", "weight^T", "output"},
                  label);
      return 0;
    });
    // The bias after the product, as transformers' experts add it (the same sums, bit for bit).
    if (has_bias) add_into(out_e, b_e);
  }
  return out;
}

Tensor grouped_linear_grad_input(const LinearBackend& be, const Tensor& grad_output, const Tensor& weight,
                                 const Tensor& offs, const GroupedNames& names, bool transposed) {
  const GuardedCallScope scope("grad_input", "grad_output", &grad_output, "weight", &weight);
  if (weight.dim() != 3) raise_shape(weight, "weight", "[experts, ., .]", names.label());
  const ExpertShape shape = expert_shape(weight, transposed);
  check_grouped_grad_args(grad_output, weight, "weight", shape.out_features, offs, names);
  if (offs.size(0) != shape.experts) {
    raise_shape(offs, "offsets", "[" + std::to_string(shape.experts) + "] (one group end per expert)",
                names.label());
  }
  const int64_t rows = grad_output.size(0);
  const std::vector<int64_t> ends = group_ends(offs, rows, names);
  const int64_t bytes = rows * shape.in_features * weight.element_size();
  Tensor grad_input =
      reporting_oom(be, weight.device(), names.label(), "the grouped input gradient", bytes,
                    [&] { return empty({rows, shape.in_features}, weight.scalar_type(), weight); });
  zero_tail(grad_input, routed_rows(ends));
  for (int64_t e = 0; e < shape.experts; ++e) {
    const int64_t begin = group_begin(ends, e), count = ends[e] - begin;
    if (count == 0) continue;
    const Tensor g_e = first_rows(grad_output, begin, count);
    const Tensor w_e = expert_weight(weight, e, transposed);
    Tensor gi_e = first_rows(grad_input, begin, count);
    const ReportPlace place{&names.module, &names.parameter, e, begin, ends[e]};
    const ReportPlaceScope where(&place);
    const GuardedCallScope expert_call("grad_input", "grad_output", &g_e, "weight", &w_e);
    matmul_into(be, gi_e, g_e, w_e, 0.0, "grad_input", {"grad_output", "weight", "grad_input"},
                names.expert_label(e));
  }
  return grad_input;
}

Tensor grouped_linear_grad_weight(const LinearBackend& be, const Tensor& grad_output, const Tensor& x,
                                  const Tensor& offs, const GroupedNames& names, bool transposed) {
  const GuardedCallScope scope("grad_weight", "grad_output", &grad_output, "input", &x);
  check_grouped_grad_args(grad_output, x, "input", sym_size_at(grad_output, -1), offs, names);
  if (x.dim() != 2 || x.size(0) != grad_output.size(0)) {
    raise_shape(x, "input", "[" + std::to_string(grad_output.size(0)) + ", in_features] (grad_output's rows)",
                names.label());
  }
  const int64_t experts = offs.size(0), out_features = grad_output.size(1), in_features = x.size(1);
  const std::vector<int64_t> ends = group_ends(offs, x.size(0), names);
  const int64_t bytes = experts * out_features * in_features * x.element_size();
  Tensor grad_weight =
      reporting_oom(be, x.device(), names.label(), "the grouped weight gradient", bytes, [&] {
        return transposed ? empty({experts, in_features, out_features}, x.scalar_type(), x)
                          : empty({experts, out_features, in_features}, x.scalar_type(), x);
      });
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t begin = group_begin(ends, e), count = ends[e] - begin;
    Tensor gw_e = row(grad_weight, e);
    if (count == 0) {  // no row went to this expert: its gradient is zero, not uninitialized
      zero(gw_e);
      continue;
    }
    const Tensor g_e = first_rows(grad_output, begin, count);
    const Tensor x_e = first_rows(x, begin, count);
    const ReportPlace place{&names.module, &names.parameter, e, begin, ends[e]};
    const ReportPlaceScope where(&place);
    const GuardedCallScope expert_call("grad_weight", "grad_output", &g_e, "input", &x_e);
    const std::string label = names.expert_label(e);
    if (transposed) {  // stored [in, out]: x_e^T g_e
      matmul_into(be, gw_e, transposed_view(x_e), g_e, 0.0, "grad_weight",
                  {"input^T", "grad_output", "grad_weight"}, label);
    } else {
      matmul_into(be, gw_e, transposed_view(g_e), x_e, 0.0, "grad_weight",
                  {"grad_output^T", "input", "grad_weight"}, label);
    }
  }
  return grad_weight;
}

}  // namespace cublas_guard
