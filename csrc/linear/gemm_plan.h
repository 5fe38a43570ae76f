// The GEMM plan: how a row-major product becomes the column-major cuBLAS call
// (or calls) that computes it, and the size rules every call is checked
// against before it is sent. Device-independent: the CPU backend runs the same
// plan through torch's BLAS, so every rule here is tested without a GPU.
//
#pragma once

#include "core/tensor_api.h"

#include <array>
#include <cstdint>
#include <string>

namespace cublas_guard {

struct LinearBackend;  // linear/linear_op.h

// Largest value cuBLAS's 32-bit int arguments (m, n, k, lda, ldb, ldc) may take.
// Lowered only by tests (set_size_limit_for_testing) so the limit logic runs on CPU.
int64_t gemm_size_limit();
// Whether a call beyond the limit may use the 64-bit API (tests can forbid it
// to exercise the SizeLimitError path a cuBLAS older than 12 would take).
bool gemm_64bit_allowed();
// Sets both; returns the previous limit. Only the test hook calls it
// (testing.cpp's set_size_limit_for_testing checks the environment first).
int64_t set_gemm_size_limit(int64_t limit, bool allow_64bit_api);

// ---------------------------------------------------------------------------
// Column-major GEMM, with exactly cuBLAS's arguments:
//   C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C
// A, B and C share one data type (`dtype`). alpha and beta are held as double
// and converted by the backend to what its routine's compute type takes
// (float for cublasSgemm and cublasGemmEx with CUBLAS_COMPUTE_32F, double for
// cublasDgemm).
// ---------------------------------------------------------------------------
struct GemmCall {
  ScalarType dtype = kFloat;
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 1, ldb = 1, ldc = 1;
  double alpha = 1.0, beta = 0.0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  const char* purpose = "forward";  // forward | grad_input | grad_weight
  // Set by plan_gemm_call: an argument exceeds the 32-bit limit, so the call
  // goes through cuBLAS's 64-bit API (cublasSgemm_64, cublasGemmEx_64, ...).
  bool use_64bit = false;
  // What runs it on this device: the routine (cublasSgemm, cublasGemmEx_64,
  // torch's CPU addmm, ...), the operands' data type and the compute type.
  // Set from the backend's gemm_names before planning.
  const char* routine = "";
  const char* data_type = "";
  const char* compute_type = "";
  std::string chunk;  // "n 0..2147483647 of 3000000000" when the GEMM was split
  // The forward's bias (m elements, contiguous) for a backend whose GEMM adds it
  // itself (LinearBackend::bias_handling == kBiasInGemm); beta is 0 then.
  const void* bias = nullptr;
};

// The names a backend gives the GEMM it runs for `dtype` (see GemmCall).
struct GemmNames {
  const char* routine;
  const char* routine_64;  // the 64-bit API's routine (the same name when there is no limit)
  const char* data_type;
  const char* compute_type;
};

// The elements a column-major operand of `inner` rows and `outer` columns with leading
// dimension `ld` spans in its buffer (0 when it is empty): what a GEMM reads or writes.
inline int64_t operand_span(int64_t inner, int64_t outer, int64_t ld) {
  return inner <= 0 || outer <= 0 ? 0 : (outer - 1) * ld + inner;
}

// Row-major matrices as cuBLAS sees them. A row-major [rows x cols] matrix whose
// columns are contiguous is a column-major [cols x rows] matrix with ld = row
// stride; one whose rows are contiguous is its transpose. Anything else is
// copied once (the caller says so in the docs).
struct ColumnMajorView {
  Tensor storage;  // keeps a copy alive when one was needed
  const void* data = nullptr;
  bool transposed = false;  // true: cuBLAS must use op T to read the row-major matrix
  int64_t ld = 1;
  bool copied = false;
};
// With `fit_limit` (no 64-bit API to fall back on), a layout whose leading
// dimension is beyond the 32-bit limit is copied into the other one if that fits.
ColumnMajorView as_column_major(const Tensor& matrix2d, bool fit_limit);

// Before a (sub-)GEMM is sent: checks cuBLAS's INVALID_VALUE rules (m/n/k >= 0,
// ld >= max(1, rows), raising a report that names the broken rule) and the
// 32-bit limit: beyond it the call is marked use_64bit when the backend has the
// 64-bit API, else SizeLimitError.
void plan_gemm_call(GemmCall& call, bool has_64bit_api, const std::string& layer);

// The piece sizes a GEMM beyond the 32-bit `limit` is split into (gemm_plan.cpp
// says why each operand's span must stay within it too).
struct GemmSteps {
  int64_t m, n, k;
};
GemmSteps gemm_steps(const GemmCall& whole, int64_t limit);

// out[P x Q] (contiguous, row-major) = beta * out + left[P x R] * right[R x Q],
// as the column-major product out^T = right^T * left^T that cuBLAS computes,
// split into pieces within the limit and each piece planned and run by the
// backend. `roles` names left, right and out for error reports; `bias`
// (BiasHandling::kBiasInGemm) is Q elements the GEMM adds to every output row.
void matmul_into(const LinearBackend& backend, Tensor& out, const Tensor& left, const Tensor& right,
                 double beta, const char* purpose, const std::array<const char*, 3>& roles,
                 const std::string& layer, const void* bias = nullptr);

}  // namespace cublas_guard
