// The CUDA backend: a direct, checked cuBLAS GEMM on PyTorch's own cuBLAS
// handle (per thread and device, bound to the current stream, with torch's
// workspace and TF32 setting), the CUDA error attribution, and the async
// record in mapped host memory. The orchestration is linear_common.cpp's.
//
// Per dtype, as at::cuda::blas::gemm does it:
//   float32   cublasSgemm (TF32 as torch's allow_tf32 set the handle's math mode)
//   bfloat16  cublasGemmEx, CUDA_R_16BF, CUBLAS_COMPUTE_32F, reduced-precision
//             reductions as torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction says
//   float16   cublasGemmEx, CUDA_R_16F, CUBLAS_COMPUTE_32F, likewise with
//             allow_fp16_reduced_precision_reduction
//   float64   cublasDgemm
// and the _64 variants (cuBLAS 12+) for arguments beyond the 32-bit limit.
#include "cuda_backend.h"
#include "report/pending_errors.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>

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

void check_launch(const char* kernel, const std::string& layer) {
  cudaError_t err = cudaGetLastError();
  if (const int injected = take_injected_fault(FaultSite::kLaunch)) {
    err = static_cast<cudaError_t>(injected);
  }
  if (err == cudaSuccess) return;
  if (is_sticky_context_error(err)) raise_pending_cuda_error(err, "at a guard kernel's launch", layer);
  int device = -1;
  cudaGetDevice(&device);
  cudaDeviceProp* props = device >= 0 ? at::cuda::getDeviceProperties(device) : nullptr;
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
  report.raise_runtime_error("layer '" + layer + "': launching " + kernel + " failed: " +
                             cudaGetErrorName(err));
}

namespace {

// Best effort: in a broken context these calls fail too, and the fields stay -1.
MemoryFacts memory_snapshot(int device) {
  MemoryFacts m;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    m.free_bytes = static_cast<int64_t>(free_bytes);
    m.total_bytes = static_cast<int64_t>(total_bytes);
  } else {
    (void)cudaGetLastError();  // do not leave our probe's error for the next caller
  }
  try {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
    m.torch_allocated = stats.allocated_bytes[0].current;
    m.torch_reserved = stats.reserved_bytes[0].current;
    m.workspace_bytes = static_cast<int64_t>(at::cuda::getChosenWorkspaceSize());
  } catch (const c10::Error&) {
  }
  return m;
}

void memory_info_cuda(ErrorReport& report, c10::Device device) {
  add_memory_fields(report, memory_snapshot(device.index()));
  report.add("device", "cuda:" + std::to_string(device.index()));
}

std::string describe_device(int device) {
  cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
  return "cuda:" + std::to_string(device) + " (" + props->name + ", sm_" +
         std::to_string(props->major) + std::to_string(props->minor) + ")";
}

std::string math_mode_name(cublasMath_t mode) {
  std::string name;
  const int base = static_cast<int>(mode) & ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
  switch (base) {
    case CUBLAS_DEFAULT_MATH: name = "CUBLAS_DEFAULT_MATH"; break;
    case CUBLAS_PEDANTIC_MATH: name = "CUBLAS_PEDANTIC_MATH"; break;
    case CUBLAS_TF32_TENSOR_OP_MATH: name = "CUBLAS_TF32_TENSOR_OP_MATH"; break;
    default: name = "cublasMath_t(" + std::to_string(base) + ")";
  }
  if (static_cast<int>(mode) & static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)) {
    name += " | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION";
  }
  return name;
}

GemmNames gemm_names_cuda(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16:
      return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16BF", "CUBLAS_COMPUTE_32F"};
    case at::kHalf:
      return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16F", "CUBLAS_COMPUTE_32F"};
    case at::kDouble:
      return {"cublasDgemm", "cublasDgemm_64", "CUDA_R_64F", "CUBLAS_COMPUTE_64F"};
    default:
      return {"cublasSgemm", "cublasSgemm_64", "CUDA_R_32F", "CUBLAS_COMPUTE_32F"};
  }
}

// The math mode torch's own half-precision GEMMs use: reduced-precision
// reductions only when the user allows them (the default allows them).
cublasMath_t half_math_mode(at::ScalarType dtype) {
  const at::CuBLASReductionOption option = dtype == at::kBFloat16
                                               ? at::globalContext().allowBF16ReductionCuBLAS()
                                               : at::globalContext().allowFP16ReductionCuBLAS();
  // DisallowReducedPrecisionDisallowSplitK has no cublasGemmEx equivalent
  // (torch needs cuBLASLt for it): reduced precision is disallowed here too.
  if (option == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK) return CUBLAS_DEFAULT_MATH;
  return static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
}

// Runs the planned call with the routine for its dtype (the handle's math mode
// is already what torch chose for float32).
cublasStatus_t run_gemm(cublasHandle_t handle, const GemmCall& call) {
  const cublasOperation_t op_a = call.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = call.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  // plan_gemm_call has checked every argument against the 32-bit limit unless use_64bit.
  const int m = static_cast<int>(call.m), n = static_cast<int>(call.n), k = static_cast<int>(call.k);
  const int lda = static_cast<int>(call.lda), ldb = static_cast<int>(call.ldb);
  const int ldc = static_cast<int>(call.ldc);
#if CUBLAS_VER_MAJOR < 12
  TORCH_INTERNAL_ASSERT(!call.use_64bit, "cublas_guard_ext: 64-bit GEMM planned without cuBLAS 12+");
#endif
  switch (call.dtype) {
    case at::kDouble: {
      const double alpha = call.alpha, beta = call.beta;
      const auto* a = static_cast<const double*>(call.a);
      const auto* b = static_cast<const double*>(call.b);
      auto* c = static_cast<double*>(call.c);
#if CUBLAS_VER_MAJOR >= 12
      if (call.use_64bit) {
        return cublasDgemm_64(handle, op_a, op_b, call.m, call.n, call.k, &alpha, a, call.lda, b,
                              call.ldb, &beta, c, call.ldc);
      }
#endif
      return cublasDgemm(handle, op_a, op_b, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
    }
    case at::kBFloat16:
    case at::kHalf: {
      // CUBLAS_COMPUTE_32F takes float alpha and beta.
      const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
      const cudaDataType_t type = call.dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
      cublasMath_t previous = CUBLAS_DEFAULT_MATH;
      cublasStatus_t status = cublasGetMathMode(handle, &previous);
      if (status != CUBLAS_STATUS_SUCCESS) return status;
      status = cublasSetMathMode(handle, half_math_mode(call.dtype));
      if (status != CUBLAS_STATUS_SUCCESS) return status;
#if CUBLAS_VER_MAJOR >= 12
      if (call.use_64bit) {
        status = cublasGemmEx_64(handle, op_a, op_b, call.m, call.n, call.k, &alpha, call.a, type,
                                 call.lda, call.b, type, call.ldb, &beta, call.c, type, call.ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
      } else
#endif
      {
        status = cublasGemmEx(handle, op_a, op_b, m, n, k, &alpha, call.a, type, lda, call.b, type,
                              ldb, &beta, call.c, type, ldc, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT_TENSOR_OP);
      }
      // Give the handle back as torch left it (it sets TF32 per allow_tf32).
      const cublasStatus_t restored = cublasSetMathMode(handle, previous);
      return status != CUBLAS_STATUS_SUCCESS ? status : restored;
    }
    default: {
      const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
      const auto* a = static_cast<const float*>(call.a);
      const auto* b = static_cast<const float*>(call.b);
      auto* c = static_cast<float*>(call.c);
#if CUBLAS_VER_MAJOR >= 12
      if (call.use_64bit) {
        return cublasSgemm_64(handle, op_a, op_b, call.m, call.n, call.k, &alpha, a, call.lda, b,
                              call.ldb, &beta, c, call.ldc);
      }
#endif
      return cublasSgemm(handle, op_a, op_b, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
    }
  }
}

// The report's device and math-mode text: built only for a failure (issue 12:
// no string work on the clean path).
void describe_for_report(GemmContext& ctx, int device, cublasHandle_t handle, at::ScalarType dtype) {
  ctx.device = describe_device(device);
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  if (dtype == at::kBFloat16 || dtype == at::kHalf) {
    ctx.math_mode = math_mode_name(half_math_mode(dtype));  // what run_gemm sets
  } else if (cublasGetMathMode(handle, &math) == CUBLAS_STATUS_SUCCESS) {
    ctx.math_mode = math_mode_name(math);
  }
}

int gemm_cuda(const GemmCall& call, GemmContext& ctx) {
  const int device = c10::cuda::current_device();
  cublasHandle_t handle = nullptr;
  if (const int injected = take_injected_fault(FaultSite::kHandle)) {
    ctx.device = describe_device(device);
    ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(injected));
    ctx.math_mode = "unknown (no handle)";
    ErrorReport report("cublas");
    report.add("layer", ctx.layer).add("status", static_cast<int64_t>(injected));
    report.add("status_name", ctx.status_name).add("stage", "handle");
    report.add("device", ctx.device).add("purpose", call.purpose);
    add_memory_fields(report, memory_snapshot(device));
    report.raise_runtime_error("layer '" + ctx.layer + "': creating the cuBLAS handle failed with " +
                               ctx.status_name);
  }
  try {
    handle = at::cuda::getCurrentCUDABlasHandle();
  } catch (const c10::OutOfMemoryError& e) {
    // torch allocates the handle's workspace through its caching allocator.
    ctx.device = describe_device(device);
    ErrorReport report("out_of_memory");
    report.add("layer", ctx.layer).add("stage", "cuBLAS handle/workspace creation");
    report.add("detail", e.what_without_backtrace());
    add_memory_fields(report, memory_snapshot(device));
    report.add("device", ctx.device);
    report.raise_out_of_memory("layer '" + ctx.layer +
                               "': out of GPU memory while creating the cuBLAS handle/workspace");
  } catch (const c10::Error& e) {
    // cublasCreate failed: NOT_INITIALIZED (often out of memory, or a broken context).
    ctx.device = describe_device(device);
    const std::string what = e.what_without_backtrace();
    static const std::array<std::pair<const char*, int>, 4> known = {{
        {"CUBLAS_STATUS_NOT_INITIALIZED", 1}, {"CUBLAS_STATUS_ALLOC_FAILED", 3},
        {"CUBLAS_STATUS_ARCH_MISMATCH", 8}, {"CUBLAS_STATUS_INTERNAL_ERROR", 14}}};
    int status = 1;
    for (const auto& k : known) {
      if (what.find(k.first) != std::string::npos) status = k.second;
    }
    ErrorReport report("cublas");
    report.add("layer", ctx.layer).add("status", static_cast<int64_t>(status));
    report.add("status_name", cublasGetStatusName(static_cast<cublasStatus_t>(status)));
    report.add("stage", "handle").add("device", ctx.device).add("detail", what);
    report.add("purpose", call.purpose);
    add_memory_fields(report, memory_snapshot(device));
    report.raise_runtime_error("layer '" + ctx.layer + "': getting torch's cuBLAS handle failed: " +
                               what);
  }
  if (const int injected = take_injected_fault(FaultSite::kGemmStatus)) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(injected));
    ctx.memory = memory_snapshot(device);
    return injected;  // as if the routine had returned it (tests only)
  }

  const cublasStatus_t status = run_gemm(handle, call);
  if (status != CUBLAS_STATUS_SUCCESS) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(status);
    ctx.memory = memory_snapshot(device);
  }
  return static_cast<int>(status);
}

// The real runtime behind pending_errors.h's decisions (current device and stream).
const CudaErrorProbe& cuda_probe() {
  static const CudaErrorProbe probe{
      [] { return static_cast<int>(cudaGetLastError()); },
      [] { return static_cast<int>(cudaStreamQuery(at::cuda::getCurrentCUDAStream())); },
      [](bool* capturing) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        const cudaError_t err = cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &status);
        *capturing = status != cudaStreamCaptureStatusNone;
        return static_cast<int>(err);
      }};
  return probe;
}

at::Tensor fetch_cuda(const at::Tensor& results, const std::string& layer) {
  try {
    return results.to(at::kCPU);
  } catch (const c10::Error&) {
    // Our scan kernels cannot fault (every access is in bounds), so a sticky
    // error surfacing at this synchronization was left by an earlier kernel.
    const int err = sticky_error_behind_failure(cuda_probe());
    if (err != cudaSuccess) {
      raise_pending_cuda_error(static_cast<cudaError_t>(err),
                               "while waiting for the input scan (stream synchronize)", layer);
    }
    throw;
  }
}

void check_pending_error_cuda(const std::string& layer) {
  // Only a sticky error is an earlier kernel's; a stray non-sticky one (say
  // cudaErrorNotReady from someone's stream query) is cleared, not reported.
  cudaError_t err = static_cast<cudaError_t>(take_pending_error(cuda_probe()));
  if (err != cudaSuccess) raise_pending_cuda_error(err, "before the guarded call", layer);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  err = cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(), &capture);
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
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (what.find(kPayloadMarker) != std::string::npos) throw;  // already one of ours
    // Queries the stream (not while it is captured) and clears what the query
    // leaves: a busy stream's cudaErrorNotReady must not reach the next call.
    const int err = sticky_error_behind_failure(cuda_probe());
    if (err != cudaSuccess) {
      raise_pending_cuda_error(static_cast<cudaError_t>(err), "during the guarded call", layer);
    }
    throw;
  }
}

// Replay counters of captured calls, per device: one each, never reused (a
// graph may be replayed at any time), allocated with the claim word.
constexpr int64_t kReplayCounters = 16384;

struct DeviceRecord {
  AsyncRecord* record = nullptr;
  int* claim = nullptr;
  int64_t* replay_counters = nullptr;  // kReplayCounters, zeroed
  int64_t replay_counters_used = 0;
};

std::mutex& slots_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::array<DeviceRecord, 64>& device_slots() {
  static std::array<DeviceRecord, 64> slots;
  return slots;
}

}  // namespace

void async_slot_cuda(c10::Device device, AsyncRecord** record, int** claim) {
  const int index = device.index();
  TORCH_CHECK(index >= 0 && index < 64, "cublas_guard_ext: unsupported CUDA device index ", index);
  std::lock_guard<std::mutex> lock(slots_mutex());
  DeviceRecord& slot = device_slots()[index];
  if (slot.record == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    // One-time allocations, allowed even if the first async call is being captured.
    const c10::cuda::CUDAStreamCaptureModeGuard relaxed(cudaStreamCaptureModeRelaxed);
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(AsyncRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, sizeof(AsyncRecord));
    void* device_view = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, host, 0));
    // With unified addressing (every 64-bit platform CUDA supports) both are one address.
    TORCH_CHECK(device_view == host, "cublas_guard_ext: async mode needs unified virtual addressing");
    // The claim word, then the replay counters (8-byte aligned), all zero. The
    // zeroing is waited for: no later stream is ordered after this one.
    const size_t bytes = sizeof(int64_t) * (1 + kReplayCounters);
    void* device_memory = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&device_memory, bytes));
    C10_CUDA_CHECK(cudaMemset(device_memory, 0, bytes));
    C10_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
    slot.record = static_cast<AsyncRecord*>(host);
    slot.claim = static_cast<int*>(device_memory);
    slot.replay_counters = static_cast<int64_t*>(device_memory) + 1;
    RecordHooks hooks;
    hooks.synchronize = [](c10::Device d) {
      const c10::cuda::CUDAGuard g(d);
      C10_CUDA_CHECK(cudaDeviceSynchronize());
    };
    register_async_record(device, slot.record, slot.claim, hooks);
  }
  *record = slot.record;
  *claim = slot.claim;
}

namespace {

// Async mode, after async_slot_cuda: a captured call gets its own replay counter.
bool capture_replay_counter_cuda(c10::Device device, int64_t** counter) {
  *counter = nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device.index()), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not known to be capturing: count nothing, leave no error behind
    return false;
  }
  if (status == cudaStreamCaptureStatusNone) return false;
  std::lock_guard<std::mutex> lock(slots_mutex());
  DeviceRecord& slot = device_slots()[device.index()];
  if (slot.replay_counters != nullptr && slot.replay_counters_used < kReplayCounters) {
    *counter = slot.replay_counters + slot.replay_counters_used++;
  }
  return true;  // a replay all the same; its number is reported as unknown without a counter
}

const LinearBackend& cuda_backend() {
  static const LinearBackend backend{scan_cuda_into,   fetch_cuda,
                                     gemm_cuda,        check_pending_error_cuda,
                                     async_slot_cuda,  memory_info_cuda,
                                     /*has_64bit_api=*/CUBLAS_VER_MAJOR >= 12,
                                     gemm_names_cuda, capture_replay_counter_cuda};
  return backend;
}

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
    out += ", \"cublas_runtime_version\": \"" + std::to_string(major) + "." +
           std::to_string(minor) + "." + std::to_string(patch) + "\"";
  }
  (void)cudaGetLastError();  // a failed query (no driver) must not linger
  return out;
}

const bool cuda_build_info_registered = (set_cuda_build_info(&cuda_build_info), true);

// The layer's device when it is a CUDA device; else the input's (the checks
// then report the mismatch).
c10::Device guard_device(const at::Tensor& preferred, const at::Tensor& other) {
  return preferred.is_cuda() ? preferred.device() : other.device();
}

at::Tensor scan_op(const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  return scan(cuda_backend(), x);
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& weight,
                     const c10::optional<at::Tensor>& bias, c10::string_view layer, int64_t mode,
                     bool /*scan_grad: autograd's business*/) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, x));
  const std::string name(layer);
  return attributing_cuda_errors(
      name, [&] { return linear_forward(cuda_backend(), x, weight, bias, name, mode); });
}

at::Tensor grad_input_op(const at::Tensor& grad_output, const at::Tensor& weight,
                         c10::string_view layer) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(
      name, [&] { return linear_grad_input(cuda_backend(), grad_output, weight, name); });
}

at::Tensor grad_weight_op(const at::Tensor& grad_output, const at::Tensor& x,
                          c10::string_view layer) {
  const c10::cuda::CUDAGuard guard(guard_device(x, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(
      name, [&] { return linear_grad_weight(cuda_backend(), grad_output, x, name); });
}

void check_features_op(const at::Tensor& x, int64_t in_features, c10::string_view layer) {
  const c10::cuda::CUDAGuard guard(x.device());
  const std::string name(layer);
  attributing_cuda_errors(name, [&] { check_features(cuda_backend(), x, in_features, name); });
}

void guard_values_op(const at::Tensor& t, c10::string_view layer, int64_t role, int64_t mode) {
  const c10::cuda::CUDAGuard guard(t.device());
  const std::string name(layer);
  attributing_cuda_errors(name, [&] { guard_tensor(cuda_backend(), t, name, role, mode); });
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, CUDA, m) {
  using namespace cublas_guard;
  m.impl("scan", &scan_op);
  m.impl("linear", &linear_op);
  m.impl("linear_grad_input", &grad_input_op);
  m.impl("linear_grad_weight", &grad_weight_op);
  m.impl("check_features", &check_features_op);
  m.impl("guard_values", &guard_values_op);
}
