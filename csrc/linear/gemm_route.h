// Which GEMM a call takes, and the bias prefill, kept free of the CUDA headers
// so that the CPU build compiles them and their tests run on any machine
// (issue 19). cuda/linear.cu and cuda/lt_gemm.cu call these; the test hooks in
// gemm_route.cpp run them on the CPU.
//
// Two paths, chosen once per process by CUBLAS_GUARD_GEMM_PATH:
//   legacy (the default until a GPU run shows the other correct and faster):
//     the bias is copied into the output (a broadcast copy), then every GEMM
//     runs with beta = 1: cublasSgemm / cublasDgemm / cublasGemmEx; a scan of
//     more than one block finishes in a second kernel;
//   lt: what torch's own addmm does for bfloat16/float16 with a bias,
//     cublasLtMatmul with the bias epilogue (no prefill at all), falling back
//     to the legacy cublasGemmEx when cuBLASLt refuses the case; float32 and
//     float64 keep cublasSgemm / cublasDgemm, with the bias written into the
//     output by the input's scan kernel (one launch, sync and async modes) or
//     by a prefill kernel (off mode); a scan is one launch whatever its size.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CUBLAS_GUARD_HOST_DEVICE __host__ __device__
#else
#define CUBLAS_GUARD_HOST_DEVICE
#endif

namespace cublas_guard {

enum class GemmPath : int { kLegacy = 0, kLt = 1 };

// Parses CUBLAS_GUARD_GEMM_PATH's value (nullptr or "" = unset = legacy).
// Returns false for anything but "legacy" / "lt".
bool parse_gemm_path(const char* value, GemmPath* path);
// The process's path: the variable read once, at the first GEMM; a value it
// cannot parse raises a ValueError naming the variable and the two choices.
GemmPath gemm_path();
const char* gemm_path_name(GemmPath path);

enum class GemmRoute : int { kSgemm = 0, kDgemm = 1, kGemmEx = 2, kLtBias = 3 };
const char* gemm_route_name(GemmRoute route);

// The routine a (sub-)GEMM starts with. `has_bias`: the call carries the
// bias for the epilogue (the forward's first k piece); `use_64bit`: an
// argument is beyond the 32-bit limit (cuBLASLt is not used then: the legacy
// _64 routines have the tested limit logic); `lt_available`: this build and
// torch have cuBLASLt's workspace.
GemmRoute first_route(int dtype_code, GemmPath path, bool has_bias, bool use_64bit, bool lt_available);

// After one cuBLASLt step (descriptor set-up, heuristic query, the matmul):
// done, fall back to cublasGemmEx (cuBLASLt refused: no algorithm for the
// case, or CUBLAS_STATUS_NOT_SUPPORTED), or report the status (any other
// failure: a broken handle, a bad argument, an execution failure).
enum class LtVerdict : int { kContinue = 0, kFallBack = 1, kReport = 2 };
LtVerdict lt_verdict(int status, bool heuristic_step, int algorithms_found);

// dtype codes (at::ScalarType's values, without its header).
namespace dtype_code {
constexpr int kHalf = 5;
constexpr int kFloat = 6;
constexpr int kDouble = 7;
constexpr int kBFloat16 = 15;
}  // namespace dtype_code

// ---------------------------------------------------------------------------
// The bias prefill: the column-major C[m x n] (leading dimension ldc) gets
// bias[r] in every column's row r. Worker `w` of `workers` takes columns w,
// w + workers, ...; lane `l` of `lanes` takes rows l, l + lanes, ... No
// division per element. The CUDA kernels run it with (block, grid, thread,
// block size); the CPU twin (prefill_bias_twin, a test hook) with loops.
// ---------------------------------------------------------------------------
template <typename T>
CUBLAS_GUARD_HOST_DEVICE inline void prefill_columns(T* c, const T* bias, int64_t m, int64_t n, int64_t ldc,
                                                     int64_t worker, int64_t workers, int64_t lane,
                                                     int64_t lanes) {
  for (int64_t col = worker; col < n; col += workers) {
    T* column = c + col * ldc;
    for (int64_t row = lane; row < m; row += lanes) column[row] = bias[row];
  }
}

}  // namespace cublas_guard
