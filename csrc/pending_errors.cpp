// The decisions of pending_errors.h, and a test op that runs them against a
// model of the CUDA runtime's last-error rules (any build, no GPU needed).
#include "pending_errors.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace cublas_guard {

bool is_sticky_cuda_error(int code) {
  switch (code) {
    case cuda_code::kAssert:
    case cuda_code::kIllegalAddress:
    case cuda_code::kLaunchFailure:
    case cuda_code::kHardwareStackError:
    case cuda_code::kIllegalInstruction:
    case cuda_code::kMisalignedAddress:
    case cuda_code::kInvalidAddressSpace:
    case cuda_code::kInvalidPc:
    case cuda_code::kLaunchTimeout:
    case cuda_code::kECCUncorrectable:
      return true;
    default:
      return false;
  }
}

int take_pending_error(const CudaErrorProbe& probe) {
  const int err = probe.get_last_error();  // resets a non-sticky error
  return is_sticky_cuda_error(err) ? err : cuda_code::kSuccess;
}

int sticky_error_behind_failure(const CudaErrorProbe& probe) {
  int err = probe.get_last_error();  // torch has usually reset its own error already
  if (is_sticky_cuda_error(err)) return err;
  bool capturing = false;
  err = probe.stream_is_capturing(&capturing);
  if (is_sticky_cuda_error(err)) return err;
  if (err != cuda_code::kSuccess) {
    (void)probe.get_last_error();
    return cuda_code::kSuccess;  // status unknown: do not risk a query
  }
  if (capturing) return cuda_code::kSuccess;  // a query would invalidate the capture
  // A sticky error surfaces at any call; a busy stream answers cudaErrorNotReady.
  err = probe.stream_query();
  if (is_sticky_cuda_error(err)) return err;
  if (err != cuda_code::kSuccess) (void)probe.get_last_error();  // leave nothing behind
  return cuda_code::kSuccess;
}

namespace {

// The runtime as pending_errors.h describes it, for one thread and one stream.
struct FakeCuda {
  int last = 0;          // the thread's last (non-sticky) error
  int context = 0;       // a sticky error: the context is broken
  bool busy = false;     // work still queued on the stream
  bool capturing = false;
  bool capture_invalidated = false;
  int queries = 0;
};
thread_local FakeCuda* fake = nullptr;

int fake_get_last_error() {
  const int err = fake->context != 0 ? fake->context : fake->last;
  fake->last = 0;
  return err;
}

int fake_stream_query() {
  ++fake->queries;
  int err = cuda_code::kSuccess;
  if (fake->context != 0) {
    err = fake->context;
  } else if (fake->capturing) {
    fake->capture_invalidated = true;
    err = cuda_code::kStreamCaptureUnsupported;
  } else if (fake->busy) {
    err = cuda_code::kNotReady;
  }
  if (err != cuda_code::kSuccess) fake->last = err;
  return err;
}

int fake_stream_is_capturing(bool* capturing) {
  if (fake->context != 0) return fake->context;
  *capturing = fake->capturing;
  return cuda_code::kSuccess;
}

// Runs one decision ("before": a sync-mode call's check; "failure": after torch
// raised inside a call) on the modelled state, then the next sync-mode call's
// check on what it left. Returns {reported, last error left (peeked), stream
// queries made, capture invalidated, what the next call's check reports}.
std::vector<int64_t> simulate_cuda_errors(c10::string_view stage, int64_t last_error,
                                          int64_t context_error, bool stream_busy,
                                          bool capturing) {
  FakeCuda state;
  state.last = static_cast<int>(last_error);
  state.context = static_cast<int>(context_error);
  state.busy = stream_busy;
  state.capturing = capturing;
  fake = &state;
  const CudaErrorProbe probe{fake_get_last_error, fake_stream_query, fake_stream_is_capturing};
  int reported = 0;
  const std::string which(stage);
  if (which == "before") {
    reported = take_pending_error(probe);
  } else if (which == "failure") {
    reported = sticky_error_behind_failure(probe);
  } else {
    fake = nullptr;
    TORCH_CHECK_VALUE(false, "cublas_guard_ext: stage must be 'before' or 'failure', got '", which, "'");
  }
  const int left = state.context != 0 ? state.context : state.last;
  const int next = take_pending_error(probe);
  fake = nullptr;
  return {reported, left, state.queries, state.capture_invalidated ? 1 : 0, next};
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_FRAGMENT(cublas_guard, m) {
  m.def(
      "_simulate_cuda_errors(str stage, int last_error, int context_error, bool stream_busy, "
      "bool capturing) -> int[]",
      &cublas_guard::simulate_cuda_errors);
}
