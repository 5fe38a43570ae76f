// The value scans of a guarded call (value_scans.cpp): the jobs, the state of
// a CUDA graph capture, and the scan of the jobs under a mode.
#pragma once

#include "linear/linear_op.h"

#include <string>
#include <vector>

namespace cublas_guard {

// A tensor to scan and the role it plays in the error message.
struct ScanJob {
  const Tensor* tensor;
  TensorRole role;
};

// Async mode inside a CUDA graph capture. A capture records the scan kernels
// and runs none of them: every replay scans whatever the tensors hold then.
// So a captured call must scan the parameters whatever the clean-parameter
// cache says (a weight written between replays, by an optimizer step or a
// copy_, is seen by the replay's scan, never by the cache), and it proves
// nothing clean (no scan ran), so it marks nothing. The call's number is
// baked into the graph; its replays are counted on the device (the first scan
// increments, the others read).
struct CaptureState {
  bool captured = false;
  int64_t* replays = nullptr;
};

// Whether `device`'s current stream is being captured (async mode only), and
// the replay counter of this call if so.
CaptureState capture_state(const LinearBackend& backend, GuardMode mode, Device device);

// Whether a parameter (weight, bias) is scanned in this call: always in a
// capture, else only when the cache does not know it clean.
bool must_scan_parameter(const CaptureState& capture, const Tensor& t);

// Scans the jobs. Sync: one host synchronization for all of them, then raise
// for the first bad one. Async: enqueue scans that fill the record if needed.
// Parameters scanned (not captured) are marked clean.
//
// With `prefill_out`, the first job's scan (the input's) also writes
// `prefill_bias` into every row of it, in the same launch.
void guard_values(const LinearBackend& backend, GuardMode mode, const std::string& layer,
                  const std::vector<ScanJob>& jobs, const CaptureState& capture = {},
                  Tensor* prefill_out = nullptr, const Tensor* prefill_bias = nullptr);

}  // namespace cublas_guard
