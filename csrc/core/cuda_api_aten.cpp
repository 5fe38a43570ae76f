// cuda_api.h in the version-locked library: ATen's and c10's own CUDA
// facilities, the calls the CUDA sources made before the core had a stable
// build (so its behaviour is unchanged).
#ifndef CUBLAS_GUARD_STABLE
#include "core/cuda_api.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/version.h>

// torch's separate cuBLASLt workspace (getCUDABlasLtWorkspace): torch 2.7+.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
#define CUBLAS_GUARD_HAS_LT 1
#else
#define CUBLAS_GUARD_HAS_LT 0
#endif

namespace cublas_guard {

std::string error_text(const TorchError& e) { return e.what_without_backtrace(); }

int current_cuda_device() { return c10::cuda::current_device(); }

cudaStream_t current_cuda_stream(int device) {
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
}

const cudaDeviceProp& cuda_device_properties(int device) {
  return *at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(device));
}

// As c10::cuda::CUDAStreamCaptureModeGuard (its checks: an error on entry, a warning on exit).
RelaxedCaptureModeGuard::RelaxedCaptureModeGuard() {
  C10_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&previous_));
}
RelaxedCaptureModeGuard::~RelaxedCaptureModeGuard() {
  C10_CUDA_CHECK_WARN(cudaThreadExchangeStreamCaptureMode(&previous_));
}

cublasHandle_t torch_cublas_handle() { return at::cuda::getCurrentCUDABlasHandle(); }

bool cublas_lt_supported() { return CUBLAS_GUARD_HAS_LT != 0; }

cublasStatus_t cublas_lt_handle(int /*device: the current one*/, cublasLtHandle_t* handle) {
#if CUBLAS_GUARD_HAS_LT
  *handle = at::cuda::getCurrentCUDABlasLtHandle();
  return CUBLAS_STATUS_SUCCESS;
#else
  *handle = nullptr;
  return CUBLAS_STATUS_NOT_SUPPORTED;
#endif
}

LtWorkspace cublas_lt_workspace(int /*device*/, cudaStream_t /*stream: torch keys it by its current one*/) {
  LtWorkspace workspace;
#if CUBLAS_GUARD_HAS_LT
  workspace.data = at::cuda::getCUDABlasLtWorkspace();
  workspace.bytes = at::cuda::getCUDABlasLtWorkspaceSize();
#endif
  return workspace;
}

TorchCudaMemory torch_cuda_memory(int device) {
  TorchCudaMemory m;
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    m.allocated = stats.allocated_bytes[0].current;
    m.reserved = stats.reserved_bytes[0].current;
    m.cublas_workspace = static_cast<int64_t>(at::cuda::getChosenWorkspaceSize());
  } catch (const c10::Error&) {
  }
  return m;
}

}  // namespace cublas_guard
#endif  // !CUBLAS_GUARD_STABLE
