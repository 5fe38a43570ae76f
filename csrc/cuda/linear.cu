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
// float16 accumulates in float16 (CUBLAS_COMPUTE_16F) when
// torch.backends.cuda.matmul.allow_fp16_accumulation is set, as torch's hgemm.
// Under CUBLAS_GUARD_GEMM_PATH=lt (gemm_route.h) the forward's bias goes
// through cuBLASLt's epilogue for bfloat16/float16 (lt_gemm.cu; cublasGemmEx
// when cuBLASLt refuses) and through our prefill, fused into the input's scan,
// for float32/float64.
#include "cuda_backend.h"
#include "report/pending_errors.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
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

namespace {
// How the forward's bias reaches the output (linear/linear_op.h's BiasHandling): the lt
// path adds it in cuBLASLt's epilogue (bfloat16/float16); otherwise (the
// legacy path's GEMMs, and float32/float64 on both paths) our prefill writes
// it, fused into the input's scan when one runs (one launch of ours before
// the GEMM, beta = 1), alone in off mode: no full-size broadcast copy.
BiasHandling bias_handling_cuda(at::ScalarType dtype) {
  if (gemm_path() == GemmPath::kLt && (dtype == at::kBFloat16 || dtype == at::kHalf) && lt_available()) {
    return BiasHandling::kBiasInGemm;
  }
  return BiasHandling::kBiasByBackend;
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
  const int device = c10::cuda::current_device();
  if (device != cached_device) {
    const cudaDeviceProp* props = at::cuda::getDeviceProperties(device);
    for (int i = 0; i < 3; ++i) {
      limits.max_grid[i] = props->maxGridSize[i];
      limits.max_block[i] = props->maxThreadsDim[i];
    }
    limits.max_threads_per_block = props->maxThreadsPerBlock;
    limits.max_shared_bytes =
        static_cast<int64_t>(std::max(props->sharedMemPerBlock, props->sharedMemPerBlockOptin));
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
  report.raise_runtime_error("layer '" + layer + "': launching " + kernel +
                             " failed: " + cudaGetErrorName(err));
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
  return "cuda:" + std::to_string(device) + " (" + props->name + ", sm_" + std::to_string(props->major) +
         std::to_string(props->minor) + ")";
}

std::string math_mode_name(cublasMath_t mode) {
  std::string name;
  const int base =
      static_cast<int>(mode) & ~static_cast<int>(CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
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

// torch's hgemm: float16 products accumulate in float16 when the user allows it (sm_70+).
bool fp16_accumulation() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
  return at::globalContext().allowFP16AccumulationCuBLAS() &&
         at::cuda::getCurrentDeviceProperties()->major >= 7;
#else
  return false;
#endif
}

GemmNames gemm_names_cuda(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16BF", "CUBLAS_COMPUTE_32F"};
    case at::kHalf:
      return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16F",
              fp16_accumulation() ? "CUBLAS_COMPUTE_16F" : "CUBLAS_COMPUTE_32F"};
    case at::kDouble: return {"cublasDgemm", "cublasDgemm_64", "CUDA_R_64F", "CUBLAS_COMPUTE_64F"};
    default: return {"cublasSgemm", "cublasSgemm_64", "CUDA_R_32F", "CUBLAS_COMPUTE_32F"};
  }
}

// The math mode torch's own half-precision GEMMs use: reduced-precision
// reductions only when the user allows them (the default allows them).
// DisallowReducedPrecisionDisallowSplitK never gets here: cublasGemmEx cannot
// honour it and gemm_cuda refuses it first (gemm_ex_refused_reduction).
cublasMath_t half_math_mode(at::ScalarType dtype) {
  const auto option = static_cast<at::CuBLASReductionOption>(torch_reduction_option(static_cast<int>(dtype)));
  if (option == at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK) return CUBLAS_DEFAULT_MATH;
  return static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION);
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
        return cublasDgemm_64(handle, op_a, op_b, call.m, call.n, call.k, &alpha, a, call.lda, b, call.ldb,
                              &beta, c, call.ldc);
      }
#endif
      return cublasDgemm(handle, op_a, op_b, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
    }
    case at::kBFloat16:
    case at::kHalf: {
      // CUBLAS_COMPUTE_32F takes float alpha and beta, CUBLAS_COMPUTE_16F half ones.
      const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
      const __half halpha = __float2half(alpha), hbeta = __float2half(beta);
      const bool accumulate16 = call.dtype == at::kHalf && fp16_accumulation();
      const cublasComputeType_t compute = accumulate16 ? CUBLAS_COMPUTE_16F : CUBLAS_COMPUTE_32F;
      const void* alpha_ptr = accumulate16 ? static_cast<const void*>(&halpha) : &alpha;
      const void* beta_ptr = accumulate16 ? static_cast<const void*>(&hbeta) : &beta;
      const cudaDataType_t type = call.dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
      // The math mode is set only when it differs from what torch left on the
      // handle, and given back only then (no calls that change nothing).
      cublasMath_t previous = CUBLAS_DEFAULT_MATH;
      cublasStatus_t status = cublasGetMathMode(handle, &previous);
      if (status != CUBLAS_STATUS_SUCCESS) return status;
      const cublasMath_t wanted = half_math_mode(call.dtype);
      if (wanted != previous) {
        status = cublasSetMathMode(handle, wanted);
        if (status != CUBLAS_STATUS_SUCCESS) return status;
      }
#if CUBLAS_VER_MAJOR >= 12
      if (call.use_64bit) {
        status = cublasGemmEx_64(handle, op_a, op_b, call.m, call.n, call.k, alpha_ptr, call.a, type,
                                 call.lda, call.b, type, call.ldb, beta_ptr, call.c, type, call.ldc, compute,
                                 CUBLAS_GEMM_DEFAULT_TENSOR_OP);
      } else
#endif
      {
        status = cublasGemmEx(handle, op_a, op_b, m, n, k, alpha_ptr, call.a, type, lda, call.b, type, ldb,
                              beta_ptr, call.c, type, ldc, compute, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
      }
      if (wanted == previous) return status;
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
        return cublasSgemm_64(handle, op_a, op_b, call.m, call.n, call.k, &alpha, a, call.lda, b, call.ldb,
                              &beta, c, call.ldc);
      }
#endif
      return cublasSgemm(handle, op_a, op_b, m, n, k, &alpha, a, lda, b, ldb, &beta, c, ldc);
    }
  }
}

// The report's device and math-mode text: built only for a failure: no
// string work on the clean path, which is per-call host cost.
void describe_for_report(GemmContext& ctx, int device, cublasHandle_t handle, at::ScalarType dtype) {
  ctx.device = describe_device(device);
  ctx.gemm_path = gemm_path_name(gemm_path());
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
    static const std::array<std::pair<const char*, int>, 4> known = {{{"CUBLAS_STATUS_NOT_INITIALIZED", 1},
                                                                      {"CUBLAS_STATUS_ALLOC_FAILED", 3},
                                                                      {"CUBLAS_STATUS_ARCH_MISMATCH", 8},
                                                                      {"CUBLAS_STATUS_INTERNAL_ERROR", 14}}};
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
    report.raise_runtime_error("layer '" + ctx.layer + "': getting torch's cuBLAS handle failed: " + what);
  }
  const GemmRoute route = first_route(static_cast<int>(call.dtype), gemm_path(), call.bias != nullptr,
                                      call.use_64bit, lt_available());
  const int injected = take_injected_fault(FaultSite::kGemmStatus);
  if (injected != 0 && route != GemmRoute::kLtBias) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(injected));
    ctx.memory = memory_snapshot(device);
    return injected;  // as if the routine had returned it (tests only)
  }
  const GemmCall* to_run = &call;
  GemmCall fallback;
  if (call.bias != nullptr && route == GemmRoute::kLtBias) {
    // A test's injected status stands for cublasLtMatmul's (every step before it runs).
    const LtAttempt lt = lt_gemm_bias(call, injected);
    if (lt.verdict == LtVerdict::kContinue) return 0;
    if (lt.verdict == LtVerdict::kReport) {
      describe_for_report(ctx, device, handle, call.dtype);
      ctx.api = lt.step;
      ctx.descriptors = lt.descriptors;
      ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(lt.status));
      ctx.memory = memory_snapshot(device);
      return lt.status;
    }
    // cuBLASLt refused the case: cublasGemmEx on the bias prefilled into C.
  }
  if (call.dtype == at::kBFloat16 || call.dtype == at::kHalf) {
    // As torch: split-K off needs cuBLASLt, which cublasGemmEx is not.
    const int dtype = static_cast<int>(call.dtype);
    const char* refused = gemm_ex_refused_reduction(dtype, torch_reduction_option(dtype));
    if (refused != nullptr) raise_gemm_ex_reduction_refused(call, refused, ctx.layer);
  }
  if (call.bias != nullptr) {
    prefill_columns_cuda(call.c, call.bias, call.m, call.n, call.ldc,
                         static_cast<int64_t>(c10::elementSize(call.dtype)), ctx.layer);
    fallback = call;
    fallback.bias = nullptr;
    fallback.beta = 1.0;
    to_run = &fallback;
  }
  const cublasStatus_t status = run_gemm(handle, *to_run);
  if (status != CUBLAS_STATUS_SUCCESS) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(status);
    ctx.memory = memory_snapshot(device);
  }
  return static_cast<int>(status);
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

at::Tensor fetch_cuda(const at::Tensor& results, const std::string& layer) {
  static thread_local PinnedResults pinned;
  const int64_t count = results.numel();
  TORCH_INTERNAL_ASSERT(results.is_contiguous() && results.scalar_type() == at::kLong);
  if (count > pinned.capacity) {
    if (pinned.data != nullptr) C10_CUDA_CHECK(cudaFreeHost(pinned.data));
    pinned.data = nullptr;
    pinned.capacity = 0;
    const int64_t capacity = std::max<int64_t>(64, count);
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(int64_t) * capacity, cudaHostAllocPortable));
    pinned.data = static_cast<int64_t*>(host);
    pinned.capacity = capacity;
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
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
    C10_CUDA_CHECK(err);
  }
  return at::from_blob(pinned.data, results.sizes(), at::TensorOptions().dtype(at::kLong));
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
    raise_if_earlier_cuda_error(e, layer);
    throw;
  }
}

}  // namespace

void raise_if_earlier_cuda_error(const c10::Error& e, const std::string& layer) {
  const std::string what = e.what_without_backtrace();
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
c10::Device guard_device(const at::Tensor& preferred, const at::Tensor& other) {
  return preferred.is_cuda() ? preferred.device() : other.device();
}

at::Tensor scan_op(const at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x.device());
  return scan(cuda_backend(), x);
}

at::Tensor linear_op(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                     c10::string_view layer, int64_t mode, bool /*scan_grad: autograd's business*/) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, x));
  const std::string name(layer);
  return attributing_cuda_errors(name,
                                 [&] { return linear_forward(cuda_backend(), x, weight, bias, name, mode); });
}

at::Tensor grad_input_op(const at::Tensor& grad_output, const at::Tensor& weight, c10::string_view layer) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(
      name, [&] { return linear_grad_input(cuda_backend(), grad_output, weight, name); });
}

at::Tensor grad_weight_op(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view layer) {
  const c10::cuda::CUDAGuard guard(guard_device(x, grad_output));
  const std::string name(layer);
  return attributing_cuda_errors(name,
                                 [&] { return linear_grad_weight(cuda_backend(), grad_output, x, name); });
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
