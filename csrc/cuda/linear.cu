// The CUDA backend of the linear op: the backend table linear_common.cpp's
// orchestration runs (the GEMM itself is cublas_gemm.cu's, the scan scan.cu's,
// the async record async_slot.cu's), the CUDA error attribution (an error an
// earlier kernel left is reported as that, not blamed on our launch or call),
// the launch checks, sync mode's fetch of scan results, and the CUDA kernels
// of the cublas_guard ops, registered for both builds (core/registration.h).
#include "core/registration.h"
#include "cuda/cuda_backend.h"
#include "report/pending_errors.h"

#include <cublas_v2.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

namespace cublas_guard {

#ifdef __CUDA_ARCH_LIST__
#define CUBLAS_GUARD_ARCHS_STR2(...) #__VA_ARGS__
#define CUBLAS_GUARD_ARCHS_STR(...) CUBLAS_GUARD_ARCHS_STR2(__VA_ARGS__)
#define CUBLAS_GUARD_ARCHS CUBLAS_GUARD_ARCHS_STR(__CUDA_ARCH_LIST__)
#endif

// pending_errors.h keeps the codes as ints so that its logic runs in the CPU build too.
static_assert(cuda_code::kNotReady == cudaErrorNotReady && cuda_code::kAssert == cudaErrorAssert &&
                  cuda_code::kStreamCaptureUnsupported == cudaErrorStreamCaptureUnsupported &&
                  cuda_code::kECCUncorrectable == cudaErrorECCUncorrectable &&
                  cuda_code::kIllegalAddress == cudaErrorIllegalAddress &&
                  cuda_code::kLaunchTimeout == cudaErrorLaunchTimeout &&
                  cuda_code::kHardwareStackError == cudaErrorHardwareStackError &&
                  cuda_code::kIllegalInstruction == cudaErrorIllegalInstruction &&
                  cuda_code::kMisalignedAddress == cudaErrorMisalignedAddress &&
                  cuda_code::kInvalidAddressSpace == cudaErrorInvalidAddressSpace &&
                  cuda_code::kInvalidPc == cudaErrorInvalidPc &&
                  cuda_code::kLaunchFailure == cudaErrorLaunchFailure,
              "pending_errors.h's cuda_code values must match cudaError_t");

namespace {
// How the forward's bias reaches the output (linear/linear_op.h's BiasHandling): the lt
// path adds it in cuBLASLt's epilogue (bfloat16/float16); otherwise (the
// legacy path's GEMMs, and float32/float64 on both paths) our prefill writes
// it, fused into the input's scan when one runs (one launch of ours before
// the GEMM, beta = 1), alone in off mode: no full-size broadcast copy.
BiasHandling bias_handling_cuda(ScalarType dtype) {
  if (gemm_path() == GemmPath::kLt && (dtype == kBFloat16 || dtype == kHalf) && lt_available()) {
    return BiasHandling::kBiasInGemm;
  }
  return BiasHandling::kBiasByBackend;
}

// The real runtime behind pending_errors.h's decisions (current device and stream).
const CudaErrorProbe& cuda_probe() {
  static const CudaErrorProbe probe{[] { return static_cast<int>(cudaGetLastError()); },
                                    [] { return static_cast<int>(cudaStreamQuery(current_cuda_stream())); },
                                    [](bool* capturing) {
                                      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
                                      const cudaError_t err =
                                          cudaStreamIsCapturing(current_cuda_stream(), &status);
                                      *capturing = status != cudaStreamCaptureStatusNone;
                                      return static_cast<int>(err);
                                    }};
  return probe;
}

}  // namespace

bool is_sticky_context_error(cudaError_t err) { return is_sticky_cuda_error(static_cast<int>(err)); }

void raise_pending_cuda_error(cudaError_t err, const char* stage, const std::string& layer) {
  ErrorReport report("pending_cuda");
  report.add("layer", layer).add("stage", stage);
  report.add("cuda_error", cudaGetErrorName(err)).add("cuda_error_code", static_cast<int64_t>(err));
  report.add("cuda_error_string", cudaGetErrorString(err));
  report.add("sticky", is_sticky_context_error(err));
  const char* blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
  report.add("launch_blocking", blocking != nullptr && std::string(blocking) == "1");
  report.raise_runtime_error("layer '" + layer + "': " + cudaGetErrorName(err) +
                             " left by an earlier CUDA kernel, seen " + stage);
}

void clear_stale_launch_error(const std::string& layer) {
  // cudaGetLastError after a launch returns the thread's last error, which may
  // be older than the launch: a non-sticky one left by someone else's call (a
  // stream query's cudaErrorNotReady) would be blamed on our kernel. Taken
  // here, before the launch: a non-sticky error is cleared (no kernel of ours
  // left it), a sticky one is reported as the earlier kernel's (the
  // pending_errors.h decision sync mode makes before its calls).
  const int stale = take_pending_error(cuda_probe());
  if (stale != cuda_code::kSuccess) {
    raise_pending_cuda_error(static_cast<cudaError_t>(stale), "before a guard kernel's launch", layer);
  }
}

static_assert(cudaErrorInvalidConfiguration == 9, "gemm_route.cpp's raise_launch_limit code");

namespace {
// The current device's launch limits, read once per thread and device.
const LaunchLimits& device_launch_limits() {
  static thread_local int cached_device = -1;
  static thread_local LaunchLimits limits;
  const int device = current_cuda_device();
  if (device != cached_device) {
    const cudaDeviceProp& props = cuda_device_properties(device);
    for (int i = 0; i < 3; ++i) {
      limits.max_grid[i] = props.maxGridSize[i];
      limits.max_block[i] = props.maxThreadsDim[i];
    }
    limits.max_threads_per_block = props.maxThreadsPerBlock;
    limits.max_shared_bytes =
        static_cast<int64_t>(std::max(props.sharedMemPerBlock, props.sharedMemPerBlockOptin));
    cached_device = device;
  }
  return limits;
}
}  // namespace

void check_launch_fits(const char* kernel, dim3 grid, dim3 block, size_t shared_bytes,
                       const std::string& layer) {
  LaunchShape shape;
  shape.grid[0] = grid.x;
  shape.grid[1] = grid.y;
  shape.grid[2] = grid.z;
  shape.block[0] = block.x;
  shape.block[1] = block.y;
  shape.block[2] = block.z;
  shape.shared_bytes = static_cast<int64_t>(shared_bytes);
  std::string rule;
  if (launch_limit_broken(shape, launch_limits_for_testing(device_launch_limits()), rule) != nullptr) {
    raise_launch_limit(kernel, shape, rule, layer);
  }
}

void check_launch(const char* kernel, const std::string& layer) {
  cudaError_t err = cudaGetLastError();
  if (const int injected = take_injected_fault(FaultSite::kLaunch)) {
    err = static_cast<cudaError_t>(injected);
  }
  if (err == cudaSuccess) return;
  if (is_sticky_context_error(err)) raise_pending_cuda_error(err, "at a guard kernel's launch", layer);
  int device = -1;
  cudaGetDevice(&device);
  const cudaDeviceProp* props = device >= 0 ? &cuda_device_properties(device) : nullptr;
  ErrorReport report("cuda_launch");
  report.add("layer", layer).add("kernel", kernel);
  report.add("cuda_error", cudaGetErrorName(err)).add("cuda_error_code", static_cast<int64_t>(err));
  report.add("cuda_error_string", cudaGetErrorString(err));
#ifdef __CUDA_ARCH_LIST__
  report.add("built_archs", CUBLAS_GUARD_ARCHS);
#endif
  if (props != nullptr) {
    report.add("device_name", props->name);
    report.add("compute_capability", std::to_string(props->major) + "." + std::to_string(props->minor));
  }
  report.raise_runtime_error("layer '" + layer + "': launching " + kernel +
                             " failed: " + cudaGetErrorName(err));
}

// Best effort: in a broken context these calls fail too, and the fields stay -1.
MemoryFacts cuda_memory_snapshot(int device) {
  MemoryFacts m;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    m.free_bytes = static_cast<int64_t>(free_bytes);
    m.total_bytes = static_cast<int64_t>(total_bytes);
  } else {
    (void)cudaGetLastError();  // do not leave our probe's error for the next caller
  }
  const TorchCudaMemory torch_memory = torch_cuda_memory(device);
  m.torch_allocated = torch_memory.allocated;
  m.torch_reserved = torch_memory.reserved;
  m.workspace_bytes = torch_memory.cublas_workspace;
  return m;
}

namespace {

void memory_info_cuda(ErrorReport& report, Device device) {
  add_memory_fields(report, cuda_memory_snapshot(device.index()));
  report.add("device", "cuda:" + std::to_string(device.index()));
}

// Sync mode's results land in a pinned buffer of the calling thread (one
// asynchronous copy and a stream synchronization: no pageable staging, no
// allocation per call); the caller reads them before its next fetch.
struct PinnedResults {
  int64_t* data = nullptr;
  int64_t capacity = 0;  // int64 elements
  ~PinnedResults() {
    if (data != nullptr) (void)cudaFreeHost(data);
  }
};

Tensor fetch_cuda(const Tensor& results, const std::string& layer) {
  static thread_local PinnedResults pinned;
  const int64_t count = results.numel();
  CG_INTERNAL_ASSERT(results.is_contiguous() && results.scalar_type() == kLong);
  if (count > pinned.capacity) {
    if (pinned.data != nullptr) CG_CUDA_CHECK(cudaFreeHost(pinned.data));
    pinned.data = nullptr;
    pinned.capacity = 0;
    const int64_t capacity = std::max<int64_t>(64, count);
    void* host = nullptr;
    CG_CUDA_CHECK(cudaHostAlloc(&host, sizeof(int64_t) * capacity, cudaHostAllocPortable));
    pinned.data = static_cast<int64_t*>(host);
    pinned.capacity = capacity;
  }
  const cudaStream_t stream = current_cuda_stream();
  cudaError_t err = cudaMemcpyAsync(pinned.data, results.data_ptr(), sizeof(int64_t) * count,
                                    cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) {
    // Our scan kernels cannot fault (every access is in bounds), so a sticky
    // error surfacing at this synchronization was left by an earlier kernel.
    const int sticky =
        is_sticky_context_error(err) ? static_cast<int>(err) : sticky_error_behind_failure(cuda_probe());
    if (sticky != cudaSuccess) {
      raise_pending_cuda_error(static_cast<cudaError_t>(sticky),
                               "while waiting for the input scan (stream synchronize)", layer);
    }
    (void)cudaGetLastError();
    CG_CUDA_CHECK(err);
  }
  return from_blob(pinned.data, sizes_of(results), strides_of(results), kLong, cpu_device());
}

void check_pending_error_cuda(const std::string& layer) {
  // Only a sticky error is an earlier kernel's; a stray non-sticky one (say
  // cudaErrorNotReady from someone's stream query) is cleared, not reported.
  cudaError_t err = static_cast<cudaError_t>(take_pending_error(cuda_probe()));
  if (err != cudaSuccess) raise_pending_cuda_error(err, "before the guarded call", layer);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  err = cudaStreamIsCapturing(current_cuda_stream(), &capture);
  if (err != cudaSuccess) raise_pending_cuda_error(err, "before the guarded call", layer);
  if (capture != cudaStreamCaptureStatusNone) {
    ErrorReport report("graph_capture");
    report.add("layer", layer);
    report.raise_runtime_error("layer '" + layer +
                               "': sync mode reads scan results on the host, which a CUDA graph "
                               "capture cannot do; use mode='async' or mode='off' inside graphs");
  }
}

// A CUDA error torch raised inside a guarded call (an allocation, a copy)
// after an earlier kernel broke the context: report it as what it is.
template <typename Fn>
auto attributing_cuda_errors(const std::string& layer, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const TorchError& e) {
    raise_if_earlier_cuda_error(e, layer);
    throw;
  }
}

}  // namespace

void raise_if_earlier_cuda_error(const TorchError& e, const std::string& layer) {
  const std::string what = error_text(e);
  if (what.find(kPayloadMarker) != std::string::npos) return;  // already one of ours
  // Queries the stream (not while it is captured) and clears what the query
  // leaves: a busy stream's cudaErrorNotReady must not reach the next call.
  const int err = sticky_error_behind_failure(cuda_probe());
  if (err != cudaSuccess) {
    raise_pending_cuda_error(static_cast<cudaError_t>(err), "during the guarded call", layer);
  }
}

const LinearBackend& cuda_backend() {
  static const LinearBackend backend{scan_cuda_into,
                                     fetch_cuda,
                                     gemm_cuda,
                                     check_pending_error_cuda,
                                     async_slot_cuda,
                                     memory_info_cuda,
                                     /*has_64bit_api=*/CUBLAS_VER_MAJOR >= 12,
                                     gemm_names_cuda,
                                     capture_replay_counter_cuda,
                                     bias_handling_cuda,
                                     prefill_bias_cuda,
                                     scan_cuda_into_prefilling};
  return backend;
}

namespace {

// Compile-time facts and, when a GPU is visible, the runtime versions.
std::string cuda_build_info() {
  std::string out = "\"cuda_compiled_version\": " + std::to_string(CUDART_VERSION) +
                    ", \"cublas_header_version\": " + std::to_string(CUBLAS_VERSION);
#ifdef __CUDA_ARCH_LIST__
  out += ", \"built_archs\": \"" CUBLAS_GUARD_ARCHS "\"";
#endif
  int runtime = 0, driver = 0, major = 0, minor = 0, patch = 0;
  if (cudaRuntimeGetVersion(&runtime) == cudaSuccess) {
    out += ", \"cudart_runtime_version\": " + std::to_string(runtime);
  }
  if (cudaDriverGetVersion(&driver) == cudaSuccess) {
    out += ", \"driver_version\": " + std::to_string(driver);
  }
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS) {
    out += ", \"cublas_runtime_version\": \"" + std::to_string(major) + "." + std::to_string(minor) + "." +
           std::to_string(patch) + "\"";
  }
  (void)cudaGetLastError();  // a failed query (no driver) must not linger
  return out;
}

const bool cuda_build_info_registered = (set_cuda_build_info(&cuda_build_info), true);

// The layer's device when it is a CUDA device; else the input's (the checks
// then report the mismatch).
int guard_device(const Tensor& preferred, const Tensor& other) {
  return device_index(preferred.is_cuda() ? preferred : other);
}

// The kernels, named functions with core/tensor_api.h's types (the stable
// core boxes them: TORCH_BOX).
Tensor scan_op(const Tensor& x) {
  const CudaDeviceGuard guard(device_index(x));
  return scan(cuda_backend(), x);
}

Tensor linear_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, StringArg layer,
                 int64_t mode, bool /*scan_grad: autograd's business*/) {
  const CudaDeviceGuard guard(guard_device(weight, x));
  const std::string name(layer);
  return attributing_cuda_errors(name,
                                 [&] { return linear_forward(cuda_backend(), x, weight, bias, name, mode); });
}

Tensor grad_input_op(const Tensor& grad_output, const Tensor& weight, StringArg layer) {
  const CudaDeviceGuard guard(guard_device(weight, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(
      name, [&] { return linear_grad_input(cuda_backend(), grad_output, weight, name); });
}

Tensor grad_weight_op(const Tensor& grad_output, const Tensor& x, StringArg layer) {
  const CudaDeviceGuard guard(guard_device(x, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(name,
                                 [&] { return linear_grad_weight(cuda_backend(), grad_output, x, name); });
}

void check_features_op(const Tensor& x, int64_t in_features, StringArg layer) {
  const CudaDeviceGuard guard(device_index(x));
  const std::string name(layer);
  attributing_cuda_errors(name, [&] { check_features(cuda_backend(), x, in_features, name); });
}

void guard_values_op(const Tensor& t, StringArg layer, int64_t role, int64_t mode) {
  const CudaDeviceGuard guard(device_index(t));
  const std::string name(layer);
  attributing_cuda_errors(name, [&] { guard_tensor(cuda_backend(), t, name, role, mode); });
}

}  // namespace

const LinearKernels& cuda_linear_kernels() {
  static const LinearKernels kernels{linear_op, grad_input_op, grad_weight_op, guard_values_op};
  return kernels;
}

}  // namespace cublas_guard

CG_LIBRARY_IMPL(cublas_guard, CUDA, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "scan", &scan_op);
  CG_IMPL(m, "linear", &linear_op);
  CG_IMPL(m, "linear_grad_input", &grad_input_op);
  CG_IMPL(m, "linear_grad_weight", &grad_weight_op);
  CG_IMPL(m, "check_features", &check_features_op);
  CG_IMPL(m, "guard_values", &guard_values_op);
}
