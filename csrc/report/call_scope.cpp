// The thread's guarded call (call_scope.h): a thread-local pointer and a
// process-wide relaxed counter, the whole cost on the clean path.
#include "report/call_scope.h"

#include <atomic>

namespace cublas_guard {

namespace {
thread_local const GuardedCall* tls_call = nullptr;
std::atomic<int64_t> call_counter{0};
}  // namespace

const GuardedCall* current_guarded_call() { return tls_call; }

GuardedCallScope::GuardedCallScope(const char* phase, const char* name0, const Tensor* t0, const char* name1,
                                   const Tensor* t1, const char* name2, const Tensor* t2) {
  call_.phase = phase;
  call_.number = call_counter.fetch_add(1, std::memory_order_relaxed) + 1;
  call_.names[0] = name0;
  call_.names[1] = name1;
  call_.names[2] = name2;
  call_.tensors[0] = t0;
  call_.tensors[1] = t1;
  call_.tensors[2] = t2;
  call_.outer = tls_call;
  tls_call = &call_;
}

GuardedCallScope::~GuardedCallScope() { tls_call = call_.outer; }

}  // namespace cublas_guard
