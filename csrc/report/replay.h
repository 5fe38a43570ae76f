// One GEMM replayed from a failure capsule (cublas_guard_ext.capsule_replay): the
// arguments cuBLAS got, on flat buffers, with a chosen routine, math mode and
// workspace. The capsule is a file someone sent: every argument is checked
// against the buffers before a pointer is formed.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace cublas_guard {

struct ReplayCall {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, lda = 1, ldb = 1, ldc = 1;
  double alpha = 1.0, beta = 0.0;
};

// TORCH_CHECKs that a, b, c are 1-D dense buffers of one guarded dtype on one
// device, that the call's sizes are valid and that every operand's span fits
// its buffer (the rules of plan_gemm_call, without the 32-bit limit).
void check_replay_call(const ReplayCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c);

}  // namespace cublas_guard
