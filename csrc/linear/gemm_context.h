// What a failed or refused GEMM's CublasError report carries beyond its
// GemmCall (gemm_plan.h), and the two raises (gemm_report.cpp): the backends
// fill a GemmContext, the plan raises.
#pragma once

#include "core/tensor_api.h"
#include "linear/gemm_plan.h"
#include "report/error_report.h"

#include <cstdint>
#include <string>

namespace cublas_guard {

// What a CublasError report says about a GEMM beyond its GemmCall
// (linear/gemm_plan.h): the layer, the device and its state, the operands.
struct GemmContext {
  std::string layer;
  std::string math_mode;     // e.g. "CUBLAS_DEFAULT_MATH", "CUBLAS_TF32_TENSOR_OP_MATH"
  std::string device;        // e.g. "cuda:0 (NVIDIA H200, sm_90)"
  std::string status_name;   // from cublasGetStatusName when available
  const Tensor* operand_a = nullptr;  // the torch tensors behind A, B, C
  const Tensor* operand_b = nullptr;
  const Tensor* operand_c = nullptr;
  const char* roles[3] = {"", "", ""};    // what A, B, C are to the user ("weight^T", ...)
  MemoryFacts memory;  // at the time of a failure (CUDA)
  // Set by a backend whose failing call was not call.routine (a cuBLASLt step):
  // the call that failed, and the descriptors it was given.
  std::string api;
  std::string descriptors;
  std::string gemm_path;  // CUBLAS_GUARD_GEMM_PATH's choice, when the backend has one
};
// Raises the CublasError report for a failed status (report/gemm_report.cpp).
[[noreturn]] void raise_gemm_failure(int status, const GemmCall& call, const GemmContext& ctx);
// Raises the CublasError report of a GEMM refused before it was sent: the
// status cuBLAS would have returned, the rule it breaks, the call's arguments.
[[noreturn]] void raise_gemm_precheck(const GemmCall& call, const std::string& layer, int64_t status,
                                      const char* status_name, const std::string& rule,
                                      const std::string& message);

}  // namespace cublas_guard
