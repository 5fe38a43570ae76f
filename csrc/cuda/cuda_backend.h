// Declarations shared by the CUDA translation units (scan.cu, linear.cu,
// cublas_gemm.cu, lt_gemm.cu, async_slot.cu; locked/watch/watch_scan.cu in the locked
// library). Written against core/tensor_api.h and core/cuda_api.h, so that the
// core's CUDA sources compile into both builds.
#pragma once

#include "core/cuda_api.h"
#include "linear/gemm_route.h"
#include "linear/launch_limits.h"
#include "linear/linear_op.h"

#include <cuda_runtime.h>

#include <string>

namespace cublas_guard {

// Fused NaN/+Inf/-Inf scan on the current stream (see scan.cu).
void scan_cuda_into(const Tensor& t, Tensor out_slot, const AsyncTarget* target, const std::string& layer);

// The same scan, whose launch also writes `bias` into every row of the
// contiguous 2-D `out` (CUBLAS_GUARD_GEMM_PATH=lt: one launch before the GEMM).
void scan_cuda_into_prefilling(const Tensor& t, Tensor out_slot, const AsyncTarget* target,
                               const std::string& layer, Tensor& out, const Tensor& bias);
// The prefill alone (off mode): one launch.
void prefill_bias_cuda(Tensor& out, const Tensor& bias, const std::string& layer);
// The column-major C[m x n] (leading dimension ldc) gets bias[r] in each
// column's row r: the fallback of a cuBLASLt call cuBLASLt refused.
void prefill_columns_cuda(void* c, const void* bias, int64_t m, int64_t n, int64_t ldc, int64_t element_size,
                          const std::string& layer);

// One checked cuBLAS GEMM on torch's handle (cublas_gemm.cu), what it runs
// for a dtype, and the device memory at a failure (for reports).
int gemm_cuda(const GemmCall& call, GemmContext& ctx);
GemmNames gemm_names_cuda(ScalarType dtype);
MemoryFacts cuda_memory_snapshot(int device);

// One cuBLASLt bias-epilogue GEMM (lt_gemm.cu), and what became of it: the
// step that stopped it and the descriptors it was given, for a report.
struct LtAttempt {
  int status = 0;  // cublasStatus_t
  LtVerdict verdict = LtVerdict::kContinue;  // kContinue: done
  std::string step;
  std::string descriptors;
};
bool lt_available();
// `injected` != 0 (tests): the status cublasLtMatmul is taken to return; it is not called.
LtAttempt lt_gemm_bias(const GemmCall& call, int injected = 0);

// The async record of `device`: pinned host memory mapped into the device's
// address space, and a device-memory claim word. Allocated on first use.
void async_slot_cuda(Device device, AsyncRecord** record, int** claim);
// Async mode: whether the current stream of `device` is being captured; if
// so, *counter is this call's own replay counter (nullptr when none is left).
bool capture_replay_counter_cuda(Device device, int64_t** counter);

// Before our first launch of a call: clears a stale non-sticky error (it is
// not ours and would be blamed on the launch), reports a sticky one.
void clear_stale_launch_error(const std::string& layer);

// Before every launch of ours: the grid, block and dynamic shared memory
// against the current device's limits (launch_limits.h, lowered by tests'
// set_launch_limits); one that does not fit raises a CudaLaunchError naming
// the kernel and its sizes instead of launching.
void check_launch_fits(const char* kernel, dim3 grid, dim3 block, size_t shared_bytes,
                       const std::string& layer);

// After every launch: turns cudaGetLastError() into a report. An error that
// belongs to an earlier kernel (a sticky context error) is reported as such.
void check_launch(const char* kernel, const std::string& layer);

// True for the errors that mean the context was already broken by some
// earlier kernel (device-side assert, illegal address, ...), not by this call.
bool is_sticky_context_error(cudaError_t err);

// The CUDA backend of the guarded ops (linear.cu): checked cuBLAS on torch's
// handle and current stream, the CUDA scans, the async record.
const LinearBackend& cuda_backend();

// A c10::Error torch raised inside a guarded call (an allocation, a copy):
// when an earlier kernel broke the context, raises PendingCudaError naming it;
// otherwise returns (the caller rethrows).
void raise_if_earlier_cuda_error(const TorchError& e, const std::string& layer);

// Raises the PendingCudaError report for `err`, seen at `stage`.
[[noreturn]] void raise_pending_cuda_error(cudaError_t err, const char* stage, const std::string& layer);

}  // namespace cublas_guard
