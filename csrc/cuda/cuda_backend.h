// Declarations shared by the two CUDA translation units (scan.cu, linear.cu).
#pragma once

#include "guard.h"

#include <cuda_runtime.h>

#include <string>

namespace cublas_guard {

// Fused NaN/+Inf/-Inf scan on the current stream (see scan.cu).
void scan_cuda_into(const at::Tensor& t, at::Tensor out_slot, const AsyncTarget* target,
                    const std::string& layer);

// The async record of `device`: pinned host memory mapped into the device's
// address space, and a device-memory claim word. Allocated on first use.
void async_slot_cuda(c10::Device device, AsyncRecord** record, int** claim);

// After every launch: turns cudaGetLastError() into a report. An error that
// belongs to an earlier kernel (a sticky context error) is reported as such.
void check_launch(const char* kernel, const std::string& layer);

// True for the errors that mean the context was already broken by some
// earlier kernel (device-side assert, illegal address, ...), not by this call.
bool is_sticky_context_error(cudaError_t err);

// Raises the PendingCudaError report for `err`, seen at `stage`.
[[noreturn]] void raise_pending_cuda_error(cudaError_t err, const char* stage,
                                          const std::string& layer);

}  // namespace cublas_guard
