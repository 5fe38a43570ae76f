// The one spelling of every CUDA facility the core takes from torch, in two
// builds (core/tensor_api.h says why there are two): the current stream, the
// device guard, device properties, torch's cuBLAS handle, a cuBLASLt handle and
// its workspace, the capture-mode guard, torch's allocator statistics and the
// error checks. ATen's own calls in the version-locked library
// (cuda_api_aten.cpp, behaviour as before the split); in the stable core
// (cuda_api_stable.cpp) LibTorch's stable C ABI where it has the facility and
// the CUDA runtime where it has not:
//   current stream   aoti_torch_get_current_cuda_stream (needs -DUSE_CUDA):
//                    torch's current stream, never the legacy default stream
//   cuBLAS handle    torch_get_current_cuda_blas_handle (torch 2.10+): ATen's
//                    own per-thread handle, bound to the current stream, with
//                    torch's workspace and its TF32 math mode set per call
//   cuBLASLt         no shim: a handle of ours per device (cublasLtCreate),
//                    and a workspace from torch's caching allocator per device
//                    and stream
//   properties       cudaGetDeviceProperties, read once per device
//   memory stats     not reachable: torch's allocated/reserved bytes are -1
// torch's cuBLAS settings (reduced-precision reductions, fp16 accumulation)
// are gemm_route.h's: the stable core is handed them by the package.
// Nothing here has run on a GPU in the stable build yet.
#pragma once

#include "core/tensor_api.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#ifdef CUBLAS_GUARD_STABLE
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/macros.h>
#else
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#endif

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Errors torch raises inside a guarded call: c10::Error in the locked library;
// in the stable core only std::exception crosses the ABI.
// ---------------------------------------------------------------------------
#ifdef CUBLAS_GUARD_STABLE
using TorchError = std::exception;
#else
using TorchError = c10::Error;
#endif
// The error's message without a C++ backtrace (c10::Error's what_without_backtrace).
std::string error_text(const TorchError& e);

// A failed CUDA runtime call raises torch's CUDA error (its text: the error's
// name, the CUDA_LAUNCH_BLOCKING hint); internal invariants raise a RuntimeError.
#ifdef CUBLAS_GUARD_STABLE
#define CG_CUDA_CHECK(expr) STD_CUDA_CHECK(expr)
#define CG_INTERNAL_ASSERT(cond) \
  CG_CHECK(cond, "cublas_guard_ext: internal assert failed at ", __FILE__, ":", __LINE__, ": " #cond)
#else
#define CG_CUDA_CHECK(expr) C10_CUDA_CHECK(expr)
#define CG_INTERNAL_ASSERT(cond) TORCH_INTERNAL_ASSERT(cond)
#endif

// ---------------------------------------------------------------------------
// Devices and streams.
// ---------------------------------------------------------------------------
int current_cuda_device();
// torch's current stream of `device` (a stream torch or the user set), which
// every launch and library call of ours goes to.
cudaStream_t current_cuda_stream(int device);
inline cudaStream_t current_cuda_stream() { return current_cuda_stream(current_cuda_device()); }
// Read once per device, then shared (the pointer stays valid for the process).
const cudaDeviceProp& cuda_device_properties(int device);

// Makes `device` current for the guard's scope (torch's device guard: torch's
// own notion of the current device follows).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) : guard_(static_cast<DeviceIndexType>(device)) {}
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
#ifdef CUBLAS_GUARD_STABLE
  using DeviceIndexType = torch::stable::accelerator::DeviceIndex;
  torch::stable::accelerator::DeviceGuard guard_;
#else
  using DeviceIndexType = c10::DeviceIndex;
  c10::cuda::CUDAGuard guard_;
#endif
};

// This thread's stream-capture mode relaxed for the guard's scope: one-time
// allocations (cudaMalloc, cudaHostAlloc) are then allowed while another
// stream is being captured.
class RelaxedCaptureModeGuard {
 public:
  RelaxedCaptureModeGuard();
  ~RelaxedCaptureModeGuard();
  RelaxedCaptureModeGuard(const RelaxedCaptureModeGuard&) = delete;
  RelaxedCaptureModeGuard& operator=(const RelaxedCaptureModeGuard&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

// ---------------------------------------------------------------------------
// cuBLAS and cuBLASLt.
// ---------------------------------------------------------------------------
// torch's cuBLAS handle of this thread and the current device, bound to the
// current stream, with torch's workspace and torch's float32 math mode (TF32
// when torch.backends.cuda.matmul.allow_tf32 / float32 matmul precision says
// so: torch sets it on every call). Throws TorchError when torch cannot make
// one (cublasCreate failed, or out of memory for its workspace).
cublasHandle_t torch_cublas_handle();

// Whether this build and torch give cuBLASLt a handle and a workspace (the
// locked library needs torch 2.7+; the stable core always has its own).
bool cublas_lt_supported();
// A cuBLASLt handle for `device` (the current one): torch's in the locked
// library, ours in the stable core (created on first use). A status other
// than CUBLAS_STATUS_SUCCESS is cublasLtCreate's.
cublasStatus_t cublas_lt_handle(int device, cublasLtHandle_t* handle);
// The cuBLASLt workspace for a call on `stream` of `device`: torch's in the
// locked library; in the stable core from torch's caching allocator, kept per
// device and stream, or the call's own while `stream` is being captured.
// `owner` keeps that memory alive: hold it until the call is enqueued.
struct LtWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
  Tensor owner;
};
LtWorkspace cublas_lt_workspace(int device, cudaStream_t stream);

// ---------------------------------------------------------------------------
// torch's caching allocator, for an out-of-memory report (-1: unknown).
// ---------------------------------------------------------------------------
struct TorchCudaMemory {
  int64_t allocated = -1, reserved = -1;  // bytes, torch's caching allocator
  int64_t cublas_workspace = -1;          // the cuBLAS workspace torch attaches
};
TorchCudaMemory torch_cuda_memory(int device);

}  // namespace cublas_guard
