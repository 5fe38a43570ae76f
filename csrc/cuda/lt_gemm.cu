// bfloat16/float16 GEMMs with a bias through cuBLASLt's bias epilogue, as
// torch's own addmm runs them (aten/src/ATen/cuda/CUDABlas.cpp,
// gemm_and_bias): torch's cuBLASLt handle and its cuBLASLt workspace (the
// same pointer and size; in the stable core, which cannot reach them, a
// handle of ours and a workspace of torch's default size: core/cuda_api.h),
// the heuristics preference torch sets (maximum
// workspace, the reduced-precision reduction mask from
// allow_{bf16,fp16}_reduced_precision_reduction, the operands' alignments),
// one heuristic result, C = D = the output, beta = 0. float16 accumulates in
// float16 (CUBLAS_COMPUTE_16F, half alpha/beta) when
// torch.backends.cuda.matmul.allow_fp16_accumulation is set, as torch does on
// sm_70+.
//
// Every status is checked. cuBLASLt refusing the case (no algorithm,
// CUBLAS_STATUS_NOT_SUPPORTED, or INVALID_VALUE from the heuristic query:
// gemm_route.h's lt_verdict) sends the call back to cublasGemmEx with the bias
// prefilled; any other failure is reported with the step that failed and the
// descriptors it was given. The descriptors and the heuristic's algorithm (or
// its refusal) are kept per thread by LtPlanKey (shape, dtype, layouts,
// alignments, torch's flags): a repeated call sets the bias pointer and runs.
// D declares the smaller of C's and the bias's alignment (a split piece's C
// is offset). Used only under CUBLAS_GUARD_GEMM_PATH=lt (gemm_route.h). Never
// run on a GPU yet: the GPU check (benchmarks/gpu/) is its first test.
#include "cuda/cuda_backend.h"
#include "linear/gemm_route.h"

#include <cublasLt.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <memory>
#include <string>

namespace cublas_guard {

static_assert(CUBLAS_STATUS_NOT_SUPPORTED == 15 && CUBLAS_STATUS_INVALID_VALUE == 7,
              "gemm_route.cpp's NOT_SUPPORTED and INVALID_VALUE codes");

// torch before 2.7 has no cuBLASLt workspace of its own (core/cuda_api.h):
// the path is then never chosen.
bool lt_available() { return cublas_lt_supported(); }

namespace {

// The descriptors of one plan, destroyed with it (evicted, or a failed set-up).
struct LtDescriptors {
  cublasLtMatmulDesc_t matmul = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t preference = nullptr;
  LtDescriptors() = default;
  LtDescriptors(const LtDescriptors&) = delete;
  LtDescriptors& operator=(const LtDescriptors&) = delete;
  ~LtDescriptors() {
    if (preference != nullptr) (void)cublasLtMatmulPreferenceDestroy(preference);
    if (c != nullptr) (void)cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) (void)cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
    if (matmul != nullptr) (void)cublasLtMatmulDescDestroy(matmul);
  }
};

// What a call of one LtPlanKey needs: its descriptors and the heuristic's
// algorithm, or the knowledge that cuBLASLt refused the case (the call then
// goes straight to cublasGemmEx without asking again).
struct LtPlan {
  std::unique_ptr<LtDescriptors> descriptors;
  cublasLtMatmulHeuristicResult_t heuristic{};
  int refused_status = 0;  // != 0: cuBLASLt's answer when it refused
  std::string refused_step;
};

// Per thread, as torch's cuBLASLt handle.
LtPlanCache<LtPlan>& plan_cache() {
  static thread_local LtPlanCache<LtPlan> cache(kLtPlanCacheCapacity);
  return cache;
}

const char* compute_name(cublasComputeType_t t) {
  return t == CUBLAS_COMPUTE_16F ? "CUBLAS_COMPUTE_16F" : "CUBLAS_COMPUTE_32F";
}
const char* type_name(cudaDataType_t t) {
  return t == CUDA_R_16BF ? "CUDA_R_16BF" : t == CUDA_R_16F ? "CUDA_R_16F" : "CUDA_R_32F";
}
const char* mask_name(uint32_t mask) {
  switch (mask) {
    case CUBLASLT_REDUCTION_SCHEME_NONE: return "CUBLASLT_REDUCTION_SCHEME_NONE";
    case CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE:
      return "CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE";
    default: return "all (not set)";
  }
}

}  // namespace

LtAttempt lt_gemm_bias(const GemmCall& call, int injected) {
  LtAttempt result;
  CG_INTERNAL_ASSERT(call.bias != nullptr && call.beta == 0.0 && !call.use_64bit);
  const bool half = call.dtype == kHalf;
  const int device = current_cuda_device();
  const cudaStream_t stream = current_cuda_stream(device);
  const cudaDataType_t ab_type = half ? CUDA_R_16F : CUDA_R_16BF;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  const float alpha = static_cast<float>(call.alpha), beta = 0.0f;
  const __half halpha = __float2half(alpha), hbeta = __float2half(0.0f);
  const void* alpha_ptr = &alpha;
  const void* beta_ptr = &beta;
  if (half && torch_fp16_accumulation() && cuda_device_properties(device).major >= 7) {
    compute = CUBLAS_COMPUTE_16F;
    scale = CUDA_R_16F;
    alpha_ptr = &halpha;
    beta_ptr = &hbeta;
  }
  // torch's allow_{fp16,bf16}_reduced_precision_reduction (gemm_route.h): 0 allows
  // reduced precision and split-K, 1 disallows reduced precision, 2 also split-K.
  const int reduction = torch_reduction_option(static_cast<int>(call.dtype));
  const bool set_mask = reduction != reduction_option::kAllowReducedPrecisionWithSplitK;
  const uint32_t mask = reduction == reduction_option::kDisallowReducedPrecisionAllowSplitK
                            ? (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE)
                            : CUBLASLT_REDUCTION_SCHEME_NONE;
  const cublasOperation_t trans_a = call.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = call.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
  const LtWorkspace space = cublas_lt_workspace(device, stream);  // held until the call is enqueued
  void* workspace = space.data;
  const size_t workspace_size = space.bytes;
  // D is C here: a split piece's C and bias are offset, so D takes the smaller alignment (gemm_route.h).
  const LtAlignments align =
      lt_alignments(reinterpret_cast<uintptr_t>(call.a), reinterpret_cast<uintptr_t>(call.b),
                    reinterpret_cast<uintptr_t>(call.c), reinterpret_cast<uintptr_t>(call.bias));

  // The report's text, built only for a failure.
  auto describe = [&] {
    auto layout = [&](const char* name, bool t, int64_t rows, int64_t cols, int64_t ld) {
      return std::string(name) + " layout(" + type_name(ab_type) + ", rows " +
             std::to_string(t ? cols : rows) + ", cols " + std::to_string(t ? rows : cols) + ", ld " +
             std::to_string(ld) + ")";
    };
    return std::string("matmul desc(") + compute_name(compute) + ", scale " + type_name(scale) + ", TRANSA " +
           (call.trans_a ? "T" : "N") + ", TRANSB " + (call.trans_b ? "T" : "N") +
           ", EPILOGUE CUBLASLT_EPILOGUE_BIAS, BIAS_POINTER alignment " +
           std::to_string(pointer_alignment(reinterpret_cast<uintptr_t>(call.bias))) + "); " +
           layout("A", call.trans_a, call.m, call.k, call.lda) + "; " +
           layout("B", call.trans_b, call.k, call.n, call.ldb) + "; C=D layout(" + type_name(ab_type) +
           ", rows " + std::to_string(call.m) + ", cols " + std::to_string(call.n) + ", ld " +
           std::to_string(call.ldc) + "); preference(MAX_WORKSPACE_BYTES " + std::to_string(workspace_size) +
           ", REDUCTION_SCHEME_MASK " + (set_mask ? mask_name(mask) : "not set") +
           ", MIN_ALIGNMENT A/B/C/D " + std::to_string(align.a) + "/" + std::to_string(align.b) + "/" +
           std::to_string(align.c) + "/" + std::to_string(align.d) + " bytes)";
  };
  // One step: its status decides (gemm_route.h) whether to go on.
  auto step = [&](const char* name, cublasStatus_t status, bool heuristic = false, int found = 1) {
    result.status = static_cast<int>(status);
    result.verdict = lt_verdict(result.status, heuristic, found);
    if (result.verdict != LtVerdict::kContinue) {
      result.step = name;
      result.descriptors = describe();
      if (status == CUBLAS_STATUS_SUCCESS) result.status = static_cast<int>(CUBLAS_STATUS_NOT_SUPPORTED);
      return false;
    }
    return true;
  };
  cublasLtHandle_t handle = nullptr;
  if (!step("cublasLtCreate (the cuBLASLt handle)", cublas_lt_handle(device, &handle))) return result;

  LtPlanKey key;
  key.device = device;
  key.dtype = static_cast<int>(call.dtype);
  key.accumulate16 = compute == CUBLAS_COMPUTE_16F;
  key.reduction = reduction;
  key.trans_a = call.trans_a;
  key.trans_b = call.trans_b;
  key.m = call.m;
  key.n = call.n;
  key.k = call.k;
  key.lda = call.lda;
  key.ldb = call.ldb;
  key.ldc = call.ldc;
  key.align = align;
  key.workspace_size = workspace_size;
  LtPlanCache<LtPlan>& cache = plan_cache();
  LtPlan* plan = cache.find(key);
  if (plan == nullptr) {
    // Five descriptors and a heuristic query, once per key (then cached, a refusal too).
    LtPlan fresh;
    fresh.descriptors = std::make_unique<LtDescriptors>();
    LtDescriptors& d = *fresh.descriptors;
    const auto rows_a = static_cast<uint64_t>(call.trans_a ? call.k : call.m);
    const auto cols_a = static_cast<uint64_t>(call.trans_a ? call.m : call.k);
    const auto rows_b = static_cast<uint64_t>(call.trans_b ? call.n : call.k);
    const auto cols_b = static_cast<uint64_t>(call.trans_b ? call.k : call.n);
    if (!step("cublasLtMatmulDescCreate", cublasLtMatmulDescCreate(&d.matmul, compute, scale)) ||
        !step("cublasLtMatmulDescSetAttribute(TRANSA)",
              cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                             sizeof(trans_a))) ||
        !step("cublasLtMatmulDescSetAttribute(TRANSB)",
              cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                             sizeof(trans_b))) ||
        !step("cublasLtMatmulDescSetAttribute(EPILOGUE)",
              cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                             sizeof(epilogue))) ||
        !step("cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
              cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &call.bias,
                                             sizeof(call.bias))) ||
        !step("cublasLtMatrixLayoutCreate(A)",
              cublasLtMatrixLayoutCreate(&d.a, ab_type, rows_a, cols_a, call.lda)) ||
        !step("cublasLtMatrixLayoutCreate(B)",
              cublasLtMatrixLayoutCreate(&d.b, ab_type, rows_b, cols_b, call.ldb)) ||
        !step("cublasLtMatrixLayoutCreate(C)",
              cublasLtMatrixLayoutCreate(&d.c, ab_type, static_cast<uint64_t>(call.m),
                                         static_cast<uint64_t>(call.n), call.ldc)) ||
        !step("cublasLtMatmulPreferenceCreate", cublasLtMatmulPreferenceCreate(&d.preference))) {
      return result;
    }
    if (set_mask &&
        !step("cublasLtMatmulPreferenceSetAttribute(REDUCTION_SCHEME_MASK)",
              cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                   &mask, sizeof(mask)))) {
      return result;
    }
    const std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t> alignments[] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align.a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align.b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align.c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align.d}};
    if (!step("cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)",
              cublasLtMatmulPreferenceSetAttribute(d.preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &workspace_size, sizeof(workspace_size)))) {
      return result;
    }
    for (const auto& a : alignments) {
      if (!step("cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)",
                cublasLtMatmulPreferenceSetAttribute(d.preference, a.first, &a.second, sizeof(a.second)))) {
        return result;
      }
    }
    int found = 0;
    const cublasStatus_t query = cublasLtMatmulAlgoGetHeuristic(handle, d.matmul, d.a, d.b, d.c, d.c,
                                                                d.preference, 1, &fresh.heuristic, &found);
    if (!step("cublasLtMatmulAlgoGetHeuristic", query, /*heuristic=*/true, found)) {
      if (result.verdict != LtVerdict::kFallBack) return result;  // reported, not cached
      fresh.refused_status = result.status;
      fresh.refused_step = result.step;
      fresh.descriptors.reset();
      cache.insert(key, std::move(fresh));
      return result;
    }
    plan = &cache.insert(key, std::move(fresh));
  }
  if (plan->refused_status != 0) {  // refused before, for this very key
    result.status = plan->refused_status;
    result.verdict = LtVerdict::kFallBack;
    result.step = plan->refused_step;
    return result;
  }
  LtDescriptors& d = *plan->descriptors;
  if (!step("cublasLtMatmulDescSetAttribute(BIAS_POINTER)",
            cublasLtMatmulDescSetAttribute(d.matmul, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &call.bias,
                                           sizeof(call.bias)))) {
    return result;
  }
  step("cublasLtMatmul",
       injected != 0
           ? static_cast<cublasStatus_t>(injected)
           : cublasLtMatmul(handle, d.matmul, alpha_ptr, call.a, d.a, call.b, d.b, beta_ptr, call.c, d.c,
                            call.c, d.c, &plan->heuristic.algo, workspace, workspace_size, stream));
  return result;
}

}  // namespace cublas_guard
