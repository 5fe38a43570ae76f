// Which CUDA error a guarded call reports as "left by an earlier kernel", and
// which ones it clears: the decision logic of cuda/linear.cu, kept free of the
// CUDA headers so the CPU build compiles it and its tests run on any machine
// (against a model of the runtime's last-error rules, the test op
// cublas_guard::_simulate_cuda_errors in pending_errors.cpp).
//
// The CUDA runtime's rules this relies on:
//  * cudaGetLastError returns the thread's last error and resets it, except a
//    sticky one (a kernel fault broke the context): that one every later call
//    returns again, and nothing clears it.
//  * cudaPeekAtLastError never resets: a non-sticky error found with it would be
//    reported by every later call of the thread.
//  * cudaStreamQuery on a busy stream returns cudaErrorNotReady and leaves it as
//    the thread's last error; on a stream being captured it fails and
//    invalidates the capture.
#pragma once

namespace cublas_guard {

// cudaError_t values, as plain ints (linear.cu static_asserts each against the
// CUDA headers).
namespace cuda_code {
constexpr int kSuccess = 0;
constexpr int kNotReady = 600;
constexpr int kStreamCaptureUnsupported = 900;
constexpr int kECCUncorrectable = 214;
constexpr int kIllegalAddress = 700;
constexpr int kLaunchTimeout = 702;
constexpr int kAssert = 710;
constexpr int kHardwareStackError = 714;
constexpr int kIllegalInstruction = 715;
constexpr int kMisalignedAddress = 716;
constexpr int kInvalidAddressSpace = 717;
constexpr int kInvalidPc = 718;
constexpr int kLaunchFailure = 719;
}  // namespace cuda_code

// True for the errors that mean the context was broken by some earlier kernel
// (device-side assert, illegal address, ...): the only ones reported as
// "left by an earlier CUDA kernel".
bool is_sticky_cuda_error(int code);

// The runtime calls the decisions need (linear.cu passes the real ones, on the
// current device and stream).
struct CudaErrorProbe {
  int (*get_last_error)();                   // cudaGetLastError
  int (*stream_query)();                     // cudaStreamQuery(current stream)
  int (*stream_is_capturing)(bool* capturing);  // cudaStreamIsCapturing(current stream)
};

// Sync mode, before a guarded call: the sticky error to report, or 0. A
// non-sticky error found is cleared: no kernel of ours left it, and peeking
// would report it from every later call of the thread.
int take_pending_error(const CudaErrorProbe& probe);

// torch raised inside a guarded call: the sticky error behind it, or 0 (then
// torch's own error stands). Queries the stream unless it is being captured,
// and clears what the query leaves (cudaErrorNotReady on a busy stream) and any
// other non-sticky error found.
int sticky_error_behind_failure(const CudaErrorProbe& probe);

}  // namespace cublas_guard
