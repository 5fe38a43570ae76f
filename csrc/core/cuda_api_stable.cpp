// cuda_api.h in the stable core: LibTorch's stable C ABI for what it has (the
// current stream, torch's cuBLAS handle, the device guard, allocation), the
// CUDA runtime and cuBLASLt for the rest. Compiled with -DUSE_CUDA, without
// which the shim does not declare aoti_torch_get_current_cuda_stream. Never
// run on a GPU yet.
#ifdef CUBLAS_GUARD_STABLE
#include "core/cuda_api.h"

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <string>
#include <unordered_map>

namespace cublas_guard {

namespace {
constexpr int kMaxDevices = 64;  // as the async records (cuda/async_slot.cu)

void check_device_index(int device) {
  CG_CHECK(device >= 0 && device < kMaxDevices, "cublas_guard_ext: unsupported CUDA device index ", device);
}
}  // namespace

std::string error_text(const TorchError& e) { return e.what(); }

int current_cuda_device() {
  int device = -1;
  CG_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

cudaStream_t current_cuda_stream(int device) {
  void* stream = nullptr;
  CG_SHIM(aoti_torch_get_current_cuda_stream(static_cast<int32_t>(device), &stream));
  return static_cast<cudaStream_t>(stream);
}

const cudaDeviceProp& cuda_device_properties(int device) {
  check_device_index(device);
  static std::array<std::once_flag, kMaxDevices> read;
  static std::array<cudaDeviceProp, kMaxDevices> properties;
  // A failed read throws and leaves the flag unset: the next call tries again.
  std::call_once(read[device],
                 [device] { CG_CUDA_CHECK(cudaGetDeviceProperties(&properties[device], device)); });
  return properties[device];
}

RelaxedCaptureModeGuard::RelaxedCaptureModeGuard() {
  CG_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&previous_));
}
RelaxedCaptureModeGuard::~RelaxedCaptureModeGuard() {
  (void)cudaThreadExchangeStreamCaptureMode(&previous_);  // a destructor does not throw
}

cublasHandle_t torch_cublas_handle() {
  void* handle = nullptr;
  CG_SHIM(torch_get_current_cuda_blas_handle(&handle));
  return static_cast<cublasHandle_t>(handle);
}

bool cublas_lt_supported() { return true; }

cublasStatus_t cublas_lt_handle(int device, cublasLtHandle_t* handle) {
  // One per device, shared by every thread and stream: a cuBLASLt handle holds
  // no stream (each cublasLtMatmul names its own) and cuBLASLt's functions may
  // be called from several threads with one handle. Never destroyed: at exit
  // the CUDA context may already be gone (torch keeps its handles likewise).
  check_device_index(device);
  static std::array<std::atomic<cublasLtHandle_t>, kMaxDevices> handles{};
  static std::mutex creating;
  *handle = handles[device].load(std::memory_order_acquire);
  if (*handle != nullptr) return CUBLAS_STATUS_SUCCESS;
  std::lock_guard<std::mutex> lock(creating);
  *handle = handles[device].load(std::memory_order_acquire);
  if (*handle != nullptr) return CUBLAS_STATUS_SUCCESS;
  const CudaDeviceGuard guard(device);
  cublasLtHandle_t created = nullptr;
  const cublasStatus_t status = cublasLtCreate(&created);
  if (status != CUBLAS_STATUS_SUCCESS) return status;  // not kept: the next call tries again
  handles[device].store(created, std::memory_order_release);
  *handle = created;
  return CUBLAS_STATUS_SUCCESS;
}

namespace {

// The workspace's size: what torch gives its own cuBLASLt calls
// (CUBLASLT_WORKSPACE_SIZE in KiB, 1024 when unset or unreadable, as
// aten/src/ATen/cuda/CublasHandlePool.cpp parses it). The bias-epilogue GEMM
// then asks the heuristic with the limit torch's addmm asks with, and gets the
// algorithm torch would run for the same call. Read once, as torch does.
size_t lt_workspace_bytes() {
  static const size_t bytes = [] {
    size_t kib = 1024;
    if (const char* value = std::getenv("CUBLASLT_WORKSPACE_SIZE")) {
      char* end = nullptr;
      const long long parsed = std::strtoll(value, &end, 10);
      if (end != value && parsed >= 0) kib = static_cast<size_t>(parsed);
    }
    return kib * 1024;
  }();
  return bytes;
}

Tensor device_bytes(int device, size_t bytes) {
  const int64_t size = static_cast<int64_t>(bytes), stride = 1;
  AtenTensorHandle out = nullptr;
  CG_SHIM(aoti_torch_empty_strided(1, &size, &stride, static_cast<int32_t>(kByte),
                                   aoti_torch_device_type_cuda(), static_cast<int32_t>(device), &out));
  return Tensor(out);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // unknown: take the graph-safe allocation
  }
  return status != cudaStreamCaptureStatusNone;
}

struct StreamKey {
  int device;
  cudaStream_t stream;
  bool operator==(const StreamKey& o) const { return device == o.device && stream == o.stream; }
};
struct StreamKeyHash {
  size_t operator()(const StreamKey& k) const {
    return std::hash<const void*>()(k.stream) ^ static_cast<size_t>(k.device);
  }
};

}  // namespace

LtWorkspace cublas_lt_workspace(int device, cudaStream_t stream) {
  // Per device AND stream: two streams running cuBLASLt calls at once must
  // not share scratch memory. The block is allocated while `stream` is
  // current, so torch's allocator orders it on that stream. Inside a capture
  // the call takes a workspace of its own from the graph's pool (a replay on
  // another stream must not share one with eager calls), as the scan's
  // partials do (cuda/scan.cu).
  LtWorkspace workspace;
  workspace.bytes = lt_workspace_bytes();
  if (stream_is_capturing(stream)) {
    workspace.owner = device_bytes(device, workspace.bytes);
    workspace.data = workspace.owner.data_ptr();
    return workspace;
  }
  static thread_local StreamKey last_key{-1, nullptr};
  static thread_local void* last = nullptr;
  if (last != nullptr && last_key == StreamKey{device, stream}) {
    workspace.data = last;
    return workspace;
  }
  static std::mutex mutex;
  static auto* kept = new std::unordered_map<StreamKey, Tensor, StreamKeyHash>();  // for the process
  std::lock_guard<std::mutex> lock(mutex);
  auto it = kept->find(StreamKey{device, stream});
  if (it == kept->end())
    it = kept->emplace(StreamKey{device, stream}, device_bytes(device, workspace.bytes)).first;
  last_key = StreamKey{device, stream};
  last = it->second.data_ptr();
  workspace.data = last;
  return workspace;
}

TorchCudaMemory torch_cuda_memory(int /*device*/) {
  return TorchCudaMemory{};  // the caching allocator's statistics have no stable shim
}

}  // namespace cublas_guard
#endif  // CUBLAS_GUARD_STABLE
