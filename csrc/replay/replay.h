// One GEMM replayed from a failure capsule (cublas_guard_ext.capsule_replay): the
// arguments cuBLAS got, on flat buffers, with a chosen routine, math mode and
// workspace. The capsule is a file someone sent: every argument is checked
// against the buffers before a pointer is formed.
#pragma once

#include "core/tensor_api.h"

#include <string>

namespace cublas_guard {

struct ReplayCall {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, lda = 1, ldb = 1, ldc = 1;
  double alpha = 1.0, beta = 0.0;
};

// The call the replay_gemm op's arguments describe, shared by both kernels
// (replay_cpu.cpp, replay_cuda.cu). TORCH_CHECKs that a, b, c are 1-D dense
// buffers of one guarded dtype on one device, that the sizes are valid and that
// every operand's span fits its buffer (the rules of plan_gemm_call, without the
// 32-bit limit), so no pointer is formed from a capsule's bad arguments.
ReplayCall checked_replay_call(const Tensor& a, const Tensor& b, const Tensor& c, bool transa, bool transb,
                               int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                               double alpha, double beta);

}  // namespace cublas_guard
