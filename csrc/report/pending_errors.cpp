// The decisions of pending_errors.h (testing.cpp runs them against a model of
// the CUDA runtime, any build, no GPU needed).
#include "report/pending_errors.h"

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
    case cuda_code::kECCUncorrectable: return true;
    default: return false;
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

}  // namespace cublas_guard
