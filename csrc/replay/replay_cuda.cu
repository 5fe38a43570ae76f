// The CUDA kernel of the GEMM replay (replay/replay.h; the schema, the call's
// checks and the CPU kernel are in replay_cpu.cpp): one captured cuBLAS call,
// run with the routine, math mode and workspace the replay's variant asks for:
//   routine    cublasSgemm, cublasGemmEx, cublasSgemmEx, cublasDgemm, their
//              _64 forms (cuBLAS 12+), or cublasLtMatmul
//   math_mode  a cublasMath_t by name ("CUBLAS_TF32_TENSOR_OP_MATH", ...,
//              "| CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION"), set on
//              the handle for the call and restored after it
//   workspace  true: torch's handle with torch's workspace (what the guard
//              uses); false: a private handle with no workspace at all
// It returns the cublasStatus_t; a CUDA error the call leaves (it is run with
// CUDA_LAUNCH_BLOCKING=1 by the replay) is raised with its name, so the
// replay can tell a broken context from a status. The "gemm" fault site is
// consulted first, as the guard's own GEMM does.
#include "core/cuda_api.h"
#include "core/registration.h"
#include "linear/linear_op.h"
#include "replay/replay.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

namespace cublas_guard {

namespace {

cublasMath_t parse_math_mode(const std::string& name) {
  int mode = CUBLAS_DEFAULT_MATH;
  if (name.find("CUBLAS_TF32_TENSOR_OP_MATH") != std::string::npos) {
    mode = CUBLAS_TF32_TENSOR_OP_MATH;
  } else if (name.find("CUBLAS_PEDANTIC_MATH") != std::string::npos) {
    mode = CUBLAS_PEDANTIC_MATH;
  }
  if (name.find("CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION") != std::string::npos) {
    mode |= CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION;
  }
  return static_cast<cublasMath_t>(mode);
}

cudaDataType_t data_type(ScalarType dtype) {
  switch (dtype) {
    case kDouble: return CUDA_R_64F;
    case kHalf: return CUDA_R_16F;
    case kBFloat16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

// A handle for the call: torch's (with its workspace) or a private one without any.
struct ReplayHandle {
  cublasHandle_t handle = nullptr;
  bool owned = false;
  cublasMath_t saved_math = CUBLAS_DEFAULT_MATH;
  ~ReplayHandle() {
    if (handle == nullptr) return;
    if (owned) {
      cublasDestroy(handle);
    } else {
      cublasSetMathMode(handle, saved_math);  // give torch's handle back as it was
    }
  }
};

cublasStatus_t run_lt(const ReplayCall& call, const Tensor& a, const Tensor& b, const Tensor& c, bool tf32,
                      bool workspace) {
  const cudaDataType_t type = data_type(c.scalar_type());
  const bool dbl = c.scalar_type() == kDouble;
  const cublasComputeType_t compute =
      dbl ? CUBLAS_COMPUTE_64F
          : (tf32 && type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F);
  const cudaDataType_t scale = dbl ? CUDA_R_64F : CUDA_R_32F;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasStatus_t status = cublasLtCreate(&lt);
  if (status == CUBLAS_STATUS_SUCCESS) status = cublasLtMatmulDescCreate(&desc, compute, scale);
  const cublasOperation_t op_a = call.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = call.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a));
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b));
  }
  // Layouts of the stored matrices (column-major): A is [m x k] or, transposed, [k x m].
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&la, type, call.trans_a ? call.k : call.m,
                                        call.trans_a ? call.m : call.k, call.lda);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&lb, type, call.trans_b ? call.n : call.k,
                                        call.trans_b ? call.k : call.n, call.ldb);
  }
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatrixLayoutCreate(&lc, type, call.m, call.n, call.ldc);
  }
  Tensor space;
  constexpr size_t kLtWorkspace = size_t{32} << 20;  // what torch gives cuBLASLt by default
  if (workspace) space = empty({static_cast<int64_t>(kLtWorkspace)}, kByte, c);
  if (status == CUBLAS_STATUS_SUCCESS) {
    const float alpha_f = static_cast<float>(call.alpha), beta_f = static_cast<float>(call.beta);
    const double alpha_d = call.alpha, beta_d = call.beta;
    const void* alpha = dbl ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
    const void* beta = dbl ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
    // algo = nullptr: cuBLASLt runs its own heuristic query, as a plain call would.
    status = cublasLtMatmul(lt, desc, alpha, a.data_ptr(), la, b.data_ptr(), lb, beta, c.data_ptr(), lc,
                            c.data_ptr(), lc, nullptr, workspace ? space.data_ptr() : nullptr,
                            workspace ? kLtWorkspace : 0, current_cuda_stream());
  }
  if (lc != nullptr) cublasLtMatrixLayoutDestroy(lc);
  if (lb != nullptr) cublasLtMatrixLayoutDestroy(lb);
  if (la != nullptr) cublasLtMatrixLayoutDestroy(la);
  if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  if (lt != nullptr) cublasLtDestroy(lt);
  return status;
}

cublasStatus_t run_routine(cublasHandle_t h, const std::string& routine, const ReplayCall& call,
                           const Tensor& a, const Tensor& b, const Tensor& c) {
  const cublasOperation_t op_a = call.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = call.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const ScalarType dtype = c.scalar_type();
  const cudaDataType_t type = data_type(dtype);
  const bool wide = routine.size() > 3 && routine.compare(routine.size() - 3, 3, "_64") == 0;
  const std::string base = wide ? routine.substr(0, routine.size() - 3) : routine;
  const int64_t limit = 2147483647;
  CG_CHECK_VALUE(wide || (call.m <= limit && call.n <= limit && call.k <= limit && call.lda <= limit &&
                          call.ldb <= limit && call.ldc <= limit),
                 "cublas_guard_ext: replay: ", routine,
                 " takes 32-bit arguments; this call needs the _64 API");
#if CUBLAS_VER_MAJOR < 12
  CG_CHECK_VALUE(!wide, "cublas_guard_ext: replay: this cuBLAS has no _64 API");
#endif
  const int m = static_cast<int>(call.m), n = static_cast<int>(call.n), k = static_cast<int>(call.k);
  const int lda = static_cast<int>(call.lda), ldb = static_cast<int>(call.ldb);
  const int ldc = static_cast<int>(call.ldc);
  const float alpha_f = static_cast<float>(call.alpha), beta_f = static_cast<float>(call.beta);
  const double alpha_d = call.alpha, beta_d = call.beta;
  if (base == "cublasSgemm") {
    CG_CHECK_VALUE(dtype == kFloat, "cublas_guard_ext: replay: cublasSgemm is float32 only");
    const auto* pa = static_cast<const float*>(a.data_ptr());
    const auto* pb = static_cast<const float*>(b.data_ptr());
    auto* pc = static_cast<float*>(c.data_ptr());
#if CUBLAS_VER_MAJOR >= 12
    if (wide) {
      return cublasSgemm_64(h, op_a, op_b, call.m, call.n, call.k, &alpha_f, pa, call.lda, pb, call.ldb,
                            &beta_f, pc, call.ldc);
    }
#endif
    return cublasSgemm(h, op_a, op_b, m, n, k, &alpha_f, pa, lda, pb, ldb, &beta_f, pc, ldc);
  }
  if (base == "cublasDgemm") {
    CG_CHECK_VALUE(dtype == kDouble, "cublas_guard_ext: replay: cublasDgemm is float64 only");
    const auto* pa = static_cast<const double*>(a.data_ptr());
    const auto* pb = static_cast<const double*>(b.data_ptr());
    auto* pc = static_cast<double*>(c.data_ptr());
#if CUBLAS_VER_MAJOR >= 12
    if (wide) {
      return cublasDgemm_64(h, op_a, op_b, call.m, call.n, call.k, &alpha_d, pa, call.lda, pb, call.ldb,
                            &beta_d, pc, call.ldc);
    }
#endif
    return cublasDgemm(h, op_a, op_b, m, n, k, &alpha_d, pa, lda, pb, ldb, &beta_d, pc, ldc);
  }
  if (base == "cublasSgemmEx") {
    CG_CHECK_VALUE(dtype != kDouble, "cublas_guard_ext: replay: cublasSgemmEx has no float64");
#if CUBLAS_VER_MAJOR >= 12
    if (wide) {
      return cublasSgemmEx_64(h, op_a, op_b, call.m, call.n, call.k, &alpha_f, a.data_ptr(), type, call.lda,
                              b.data_ptr(), type, call.ldb, &beta_f, c.data_ptr(), type, call.ldc);
    }
#endif
    return cublasSgemmEx(h, op_a, op_b, m, n, k, &alpha_f, a.data_ptr(), type, lda, b.data_ptr(), type, ldb,
                         &beta_f, c.data_ptr(), type, ldc);
  }
  CG_CHECK_VALUE(base == "cublasGemmEx", "cublas_guard_ext: replay: unknown routine '", routine, "'");
  const bool dbl = dtype == kDouble;
  const cublasComputeType_t compute = dbl ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F;
  const void* alpha = dbl ? static_cast<const void*>(&alpha_d) : static_cast<const void*>(&alpha_f);
  const void* beta = dbl ? static_cast<const void*>(&beta_d) : static_cast<const void*>(&beta_f);
#if CUBLAS_VER_MAJOR >= 12
  if (wide) {
    return cublasGemmEx_64(h, op_a, op_b, call.m, call.n, call.k, alpha, a.data_ptr(), type, call.lda,
                           b.data_ptr(), type, call.ldb, beta, c.data_ptr(), type, call.ldc, compute,
                           CUBLAS_GEMM_DEFAULT_TENSOR_OP);
  }
#endif
  return cublasGemmEx(h, op_a, op_b, m, n, k, alpha, a.data_ptr(), type, lda, b.data_ptr(), type, ldb, beta,
                      c.data_ptr(), type, ldc, compute, CUBLAS_GEMM_DEFAULT_TENSOR_OP);
}

int64_t replay_gemm_cuda(const Tensor& a, const Tensor& b, const Tensor& c, bool transa, bool transb,
                         int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, double alpha,
                         double beta, StringArg routine_view, StringArg math_view, bool workspace) {
  const ReplayCall call = checked_replay_call(a, b, c, transa, transb, m, n, k, lda, ldb, ldc, alpha, beta);
  const CudaDeviceGuard guard(device_index(c));
  const std::string routine(routine_view), math(math_view);
  if (const int injected = take_injected_fault(FaultSite::kGemmStatus)) return injected;
  const cublasMath_t math_mode = parse_math_mode(math);
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  if (routine == "cublasLtMatmul") {
    status = run_lt(call, a, b, c, (math_mode & CUBLAS_TF32_TENSOR_OP_MATH) != 0, workspace);
  } else {
    ReplayHandle handle;
    if (workspace) {
      handle.handle = torch_cublas_handle();  // bound to the current stream
      status = cublasGetMathMode(handle.handle, &handle.saved_math);
    } else {
      status = cublasCreate(&handle.handle);
      handle.owned = status == CUBLAS_STATUS_SUCCESS;
      if (status == CUBLAS_STATUS_SUCCESS) {
        status = cublasSetStream(handle.handle, current_cuda_stream());
      }
      if (status == CUBLAS_STATUS_SUCCESS) status = cublasSetWorkspace(handle.handle, nullptr, 0);
    }
    if (status == CUBLAS_STATUS_SUCCESS && !math.empty()) {
      status = cublasSetMathMode(handle.handle, math_mode);
    }
    if (status == CUBLAS_STATUS_SUCCESS) status = run_routine(handle.handle, routine, call, a, b, c);
  }
  // The replay runs with CUDA_LAUNCH_BLOCKING=1: a kernel fault is here now.
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    CG_CHECK(false, "cublas_guard_ext: replay: CUDA error after the call: ", cudaGetErrorName(err), " (",
             static_cast<int>(err), "): ", cudaGetErrorString(err));
  }
  return static_cast<int64_t>(status);
}

}  // namespace
}  // namespace cublas_guard

CG_LIBRARY_IMPL(cublas_guard_internal, CUDA, m) {
  CG_IMPL(m, "replay_gemm", &cublas_guard::replay_gemm_cuda);
}
