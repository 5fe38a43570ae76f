// The guarded call running on this thread, for the failure capsule.
//
// A cuBLAS-side failure (a GEMM status, an earlier kernel's CUDA error, a
// guard kernel's launch failure) is written to a capsule file by
// cublas_guard_ext.capsule, in Python, from the report and the tensors of the
// failing call. In backward those tensors exist only here, in C++ (the
// autograd engine calls linear_grad_input / linear_grad_weight with them), so
// every guarded call publishes its operands in a thread-local scope: three
// pointers and a number, no allocation, no lock. A report raised while the
// scope is alive hands them to the Python error constructor with the payload
// (locked/report/python_errors.cpp), while they are still alive; the capsule copies what it
// keeps before the exception leaves the call.
//
// The call number counts every guarded call of the process (forward and both
// gradient GEMMs together) with one relaxed atomic increment: "the capsule is
// call 1234" places a failure in a run without a lock or a per-layer map on
// the hot path.
#pragma once

#include "core/tensor_api.h"

#include <cstdint>

namespace cublas_guard {

struct GuardedCall {
  const char* phase = "";  // forward | grad_input | grad_weight
  int64_t number = 0;      // 1-based, process-wide
  const char* names[3] = {nullptr, nullptr, nullptr};
  const Tensor* tensors[3] = {nullptr, nullptr, nullptr};
  const GuardedCall* outer = nullptr;
};

// The innermost guarded call of this thread, or nullptr.
const GuardedCall* current_guarded_call();

class GuardedCallScope {
 public:
  // Up to three operands (name, tensor; a null tensor pointer or an undefined
  // tensor is left out). The tensors must outlive the scope.
  GuardedCallScope(const char* phase, const char* name0, const Tensor* t0, const char* name1,
                   const Tensor* t1, const char* name2 = nullptr, const Tensor* t2 = nullptr);
  ~GuardedCallScope();
  GuardedCallScope(const GuardedCallScope&) = delete;
  GuardedCallScope& operator=(const GuardedCallScope&) = delete;

 private:
  GuardedCall call_;
};

}  // namespace cublas_guard
