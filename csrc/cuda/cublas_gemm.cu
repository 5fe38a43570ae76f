// One checked cuBLAS GEMM on PyTorch's own cuBLAS handle (per thread and
// device, bound to the current stream, with torch's workspace and TF32
// setting), as linear_common.cpp's orchestration asks for it through the
// backend's gemm(): the routine per dtype, torch's reduced-precision and
// accumulation settings, the cuBLASLt bias epilogue's fallback, and what a
// failure's report says (the device, the math mode, the memory).
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
#include "cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>

#include <array>
#include <string>
#include <utility>

namespace cublas_guard {

namespace {

std::string describe_device(int device) {
  const cudaDeviceProp& props = cuda_device_properties(device);
  return "cuda:" + std::to_string(device) + " (" + props.name + ", sm_" + std::to_string(props.major) +
         std::to_string(props.minor) + ")";
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
  return torch_fp16_accumulation() && cuda_device_properties(current_cuda_device()).major >= 7;
}

int64_t element_size(ScalarType dtype) {
  return dtype == kDouble ? 8 : (dtype == kHalf || dtype == kBFloat16) ? 2 : 4;
}

// The math mode torch's own half-precision GEMMs use: reduced-precision
// reductions only when the user allows them (the default allows them).
// DisallowReducedPrecisionDisallowSplitK never gets here: cublasGemmEx cannot
// honour it and gemm_cuda refuses it first (gemm_ex_refused_reduction).
cublasMath_t half_math_mode(ScalarType dtype) {
  const int option = torch_reduction_option(static_cast<int>(dtype));
  if (option == reduction_option::kAllowReducedPrecisionWithSplitK) return CUBLAS_DEFAULT_MATH;
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
  CG_CHECK(!call.use_64bit, "cublas_guard_ext: 64-bit GEMM planned without cuBLAS 12+");
#endif
  switch (call.dtype) {
    case kDouble: {
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
    case kBFloat16:
    case kHalf: {
      // CUBLAS_COMPUTE_32F takes float alpha and beta, CUBLAS_COMPUTE_16F half ones.
      const float alpha = static_cast<float>(call.alpha), beta = static_cast<float>(call.beta);
      const __half halpha = __float2half(alpha), hbeta = __float2half(beta);
      const bool accumulate16 = call.dtype == kHalf && fp16_accumulation();
      const cublasComputeType_t compute = accumulate16 ? CUBLAS_COMPUTE_16F : CUBLAS_COMPUTE_32F;
      const void* alpha_ptr = accumulate16 ? static_cast<const void*>(&halpha) : &alpha;
      const void* beta_ptr = accumulate16 ? static_cast<const void*>(&hbeta) : &beta;
      const cudaDataType_t type = call.dtype == kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
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
void describe_for_report(GemmContext& ctx, int device, cublasHandle_t handle, ScalarType dtype) {
  ctx.device = describe_device(device);
  ctx.gemm_path = gemm_path_name(gemm_path());
  cublasMath_t math = CUBLAS_DEFAULT_MATH;
  if (dtype == kBFloat16 || dtype == kHalf) {
    ctx.math_mode = math_mode_name(half_math_mode(dtype));  // what run_gemm sets
  } else if (cublasGetMathMode(handle, &math) == CUBLAS_STATUS_SUCCESS) {
    ctx.math_mode = math_mode_name(math);
  }
}

}  // namespace

GemmNames gemm_names_cuda(ScalarType dtype) {
  switch (dtype) {
    case kBFloat16: return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16BF", "CUBLAS_COMPUTE_32F"};
    case kHalf:
      return {"cublasGemmEx", "cublasGemmEx_64", "CUDA_R_16F",
              fp16_accumulation() ? "CUBLAS_COMPUTE_16F" : "CUBLAS_COMPUTE_32F"};
    case kDouble: return {"cublasDgemm", "cublasDgemm_64", "CUDA_R_64F", "CUBLAS_COMPUTE_64F"};
    default: return {"cublasSgemm", "cublasSgemm_64", "CUDA_R_32F", "CUBLAS_COMPUTE_32F"};
  }
}

int gemm_cuda(const GemmCall& call, GemmContext& ctx) {
  const int device = current_cuda_device();
  cublasHandle_t handle = nullptr;
  if (const int injected = take_injected_fault(FaultSite::kHandle)) {
    ctx.device = describe_device(device);
    ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(injected));
    ctx.math_mode = "unknown (no handle)";
    ErrorReport report("cublas");
    report.add("layer", ctx.layer).add("status", static_cast<int64_t>(injected));
    report.add("status_name", ctx.status_name).add("stage", "handle");
    report.add("device", ctx.device).add("purpose", call.purpose);
    add_memory_fields(report, cuda_memory_snapshot(device));
    report.raise_runtime_error("layer '" + ctx.layer + "': creating the cuBLAS handle failed with " +
                               ctx.status_name);
  }
  try {
    handle = torch_cublas_handle();
  } catch (const TorchError& e) {
    ctx.device = describe_device(device);
    const std::string what = error_text(e);
    std::string first_line;
    if (out_of_memory_detail(e, first_line)) {
      // torch allocates the handle's workspace through its caching allocator.
      ErrorReport report("out_of_memory");
      report.add("layer", ctx.layer).add("stage", "cuBLAS handle/workspace creation");
      report.add("detail", what);
      add_memory_fields(report, cuda_memory_snapshot(device));
      report.add("device", ctx.device);
      report.raise_out_of_memory("layer '" + ctx.layer +
                                 "': out of GPU memory while creating the cuBLAS handle/workspace");
    }
    // cublasCreate failed: NOT_INITIALIZED (often out of memory, or a broken context).
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
    add_memory_fields(report, cuda_memory_snapshot(device));
    report.raise_runtime_error("layer '" + ctx.layer + "': getting torch's cuBLAS handle failed: " + what);
  }
  const GemmRoute route = first_route(static_cast<int>(call.dtype), gemm_path(), call.bias != nullptr,
                                      call.use_64bit, lt_available());
  const int injected = take_injected_fault(FaultSite::kGemmStatus);
  if (injected != 0 && route != GemmRoute::kLtBias) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(static_cast<cublasStatus_t>(injected));
    ctx.memory = cuda_memory_snapshot(device);
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
      ctx.memory = cuda_memory_snapshot(device);
      return lt.status;
    }
    // cuBLASLt refused the case: cublasGemmEx on the bias prefilled into C.
  }
  if (call.dtype == kBFloat16 || call.dtype == kHalf) {
    // As torch: split-K off needs cuBLASLt, which cublasGemmEx is not.
    const int dtype = static_cast<int>(call.dtype);
    const char* refused = gemm_ex_refused_reduction(dtype, torch_reduction_option(dtype));
    if (refused != nullptr) raise_gemm_ex_reduction_refused(call, refused, ctx.layer);
  }
  if (call.bias != nullptr) {
    prefill_columns_cuda(call.c, call.bias, call.m, call.n, call.ldc, element_size(call.dtype), ctx.layer);
    fallback = call;
    fallback.bias = nullptr;
    fallback.beta = 1.0;
    to_run = &fallback;
  }
  const cublasStatus_t status = run_gemm(handle, *to_run);
  if (status != CUBLAS_STATUS_SUCCESS) {
    describe_for_report(ctx, device, handle, call.dtype);
    ctx.status_name = cublasGetStatusName(status);
    ctx.memory = cuda_memory_snapshot(device);
  }
  return static_cast<int>(status);
}

}  // namespace cublas_guard
