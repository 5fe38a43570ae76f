// The value scans of a guarded call: which tensors are scanned (the
// clean-parameter cache, CUDA graph captures), and how, by mode: sync scans
// all of them with one host synchronization and raises for the first bad one;
// async enqueues scans that fill the device's record (report/async_record.h)
// only when they find something.
#include "linear/value_scans.h"

#include "linear/param_cache.h"
#include "report/async_registry.h"

#include <algorithm>
#include <utility>

namespace cublas_guard {

namespace {

void fill_target(AsyncTarget& target, const Tensor& t, TensorRole role, int64_t layer_id, int64_t call_id,
                 AsyncRecord* record, int* claim) {
  target.record = record;
  target.claim = claim;
  target.layer_id = layer_id;
  target.call_id = call_id;
  target.role = role;
  target.numel = t.numel();
  target.ndim = t.dim();
  for (int64_t d = 0; d < std::min<int64_t>(t.dim(), kRecordMaxDims); ++d) {
    target.shape[d] = t.size(d);
  }
}

bool first_role_is_backward(const std::vector<ScanJob>& jobs) {
  return !jobs.empty() && jobs.front().role == kRoleGradOutput;
}

}  // namespace

CaptureState capture_state(const LinearBackend& be, GuardMode mode, Device device) {
  CaptureState state;
  if (mode == GuardMode::kAsync && be.capture_replay_counter != nullptr) {
    state.captured = be.capture_replay_counter(device, &state.replays);
  }
  return state;
}

bool must_scan_parameter(const CaptureState& capture, const Tensor& t) {
  return capture.captured || !parameter_known_clean(t);
}

void guard_values(const LinearBackend& be, GuardMode mode, const std::string& layer,
                  const std::vector<ScanJob>& jobs, const CaptureState& capture, Tensor* prefill_out,
                  const Tensor* prefill_bias) {
  if (jobs.empty()) return;
  auto scan_job = [&](int64_t i, Tensor slot, const AsyncTarget* target) {
    if (i == 0 && prefill_out != nullptr) {
      be.scan_into_prefilling(*jobs[0].tensor, std::move(slot), target, layer, *prefill_out, *prefill_bias);
    } else {
      be.scan_into(*jobs[i].tensor, std::move(slot), target, layer);
    }
  };
  const Tensor& first = *jobs.front().tensor;
  const auto n = static_cast<int64_t>(jobs.size());
  if (mode == GuardMode::kSync) {
    Tensor results = empty({n, kScanFields}, kLong, first);
    for (int64_t i = 0; i < n; ++i) scan_job(i, row(results, i), nullptr);
    Tensor host = be.fetch(results, layer);
    const int64_t* counts = data_as<int64_t>(host);
    for (int64_t i = 0; i < n; ++i) {
      raise_if_non_finite(*jobs[i].tensor, counts + i * kScanFields, tensor_role_name(jobs[i].role), layer);
    }
  } else {
    AsyncRecord* record = nullptr;
    int* claim = nullptr;
    be.async_slot(first.device(), &record, &claim);
    const auto ids = next_layer_call(layer, first_role_is_backward(jobs));
    for (int64_t i = 0; i < n; ++i) {
      AsyncTarget target;
      fill_target(target, *jobs[i].tensor, jobs[i].role, ids.first, ids.second, record, claim);
      target.captured = capture.captured;
      target.counts_replay = capture.captured && i == 0;
      target.replays = capture.replays;
      // No result tensor: nothing reads it; the record is the async report.
      scan_job(i, Tensor(), &target);
    }
  }
  if (capture.captured) return;  // recorded, not run: nothing is known clean
  for (const auto& job : jobs) {
    if (job.role == kRoleWeight || job.role == kRoleBias) mark_parameter_clean(*job.tensor);
  }
}

}  // namespace cublas_guard
