// The replay of one captured GEMM (replay/replay.h): the schema, the call and
// its checks (checked_replay_call: the device-independent part, here once for
// both kernels), and the CPU kernel, which runs torch's CPU addmm as the CPU
// backend does (linear/linear_cpu.cpp) and consults the same "gemm" fault
// site, so that a capsule from an injected failure replays as reproduced while
// the fault is armed (CUBLAS_GUARD_EXT_FAULT in the replay's environment) and
// as not reproduced without it. The CUDA kernel is replay/replay_cuda.cu.
#include "linear/linear_op.h"
#include "replay/replay.h"

#include "core/registration.h"

#include <algorithm>

namespace cublas_guard {

namespace {

void check_operand(const char* name, const Tensor& t, int64_t rows, int64_t cols, int64_t ld) {
  CG_CHECK_VALUE(ld >= std::max<int64_t>(1, rows), "cublas_guard_ext: replay: ld", name, " = ", ld,
                 " < max(1, ", rows, ")");
  CG_CHECK_VALUE(ld <= (int64_t{1} << 40) && rows <= (int64_t{1} << 40) && cols <= (int64_t{1} << 40),
                 "cublas_guard_ext: replay: operand ", name, " sizes out of range");
  const int64_t needed = operand_span(rows, cols, ld);
  CG_CHECK_VALUE(needed <= t.numel(), "cublas_guard_ext: replay: operand ", name, " spans ", needed,
                 " elements but its buffer holds ", t.numel());
}

Tensor column_major(const Tensor& buffer, int64_t rows, int64_t cols, int64_t ld) {
  return from_blob(buffer.data_ptr(), {rows, cols}, {1, ld}, buffer.scalar_type(), buffer.device());
}

int64_t replay_gemm_cpu(const Tensor& a, const Tensor& b, const Tensor& c, bool transa, bool transb,
                        int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, double alpha,
                        double beta, StringArg routine, StringArg /*math_mode*/, bool /*workspace*/) {
  (void)checked_replay_call(a, b, c, transa, transb, m, n, k, lda, ldb, ldc, alpha, beta);
  CG_CHECK_VALUE(routine == "torch CPU addmm",
                 "cublas_guard_ext: replay: the CPU runs only "
                 "'torch CPU addmm', not '",
                 std::string(routine), "'");
  if (const int injected = take_injected_fault(FaultSite::kGemmStatus)) return injected;
  if (m == 0 || n == 0) return 0;
  Tensor out = column_major(c, m, n, ldc);
  if (k == 0) {  // an empty sum: C = beta * C, as cuBLAS (beta = 0 ignores C)
    addmm_cpu(out, empty_cpu({m, 0}, c.scalar_type()), empty_cpu({0, n}, c.scalar_type()), beta, alpha);
    return 0;
  }
  const Tensor op_a = transa ? transposed_view(column_major(a, k, m, lda)) : column_major(a, m, k, lda);
  const Tensor op_b = transb ? transposed_view(column_major(b, n, k, ldb)) : column_major(b, k, n, ldb);
  addmm_cpu(out, op_a, op_b, beta, alpha);
  return 0;
}

}  // namespace

ReplayCall checked_replay_call(const Tensor& a, const Tensor& b, const Tensor& c, bool transa, bool transb,
                               int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                               double alpha, double beta) {
  ReplayCall call;
  call.trans_a = transa;
  call.trans_b = transb;
  call.m = m;
  call.n = n;
  call.k = k;
  call.lda = lda;
  call.ldb = ldb;
  call.ldc = ldc;
  call.alpha = alpha;
  call.beta = beta;
  for (const Tensor* t : {&a, &b, &c}) {
    CG_CHECK_VALUE(t->dim() == 1 && t->stride(0) == 1,
                   "cublas_guard_ext: replay: operands must be flat dense buffers");
    CG_CHECK_VALUE(t->scalar_type() == c.scalar_type() && same_device(*t, c),
                   "cublas_guard_ext: replay: operands must share one dtype and device");
  }
  CG_CHECK_VALUE(is_guarded_dtype(c.scalar_type()), "cublas_guard_ext: replay: dtype ", c.scalar_type(),
                 " is not one the guard runs");
  CG_CHECK_VALUE(call.m >= 0 && call.n >= 0 && call.k >= 0, "cublas_guard_ext: replay: m, n, k must be >= 0");
  if (call.trans_a) {
    check_operand("a", a, call.k, call.m, call.lda);
  } else {
    check_operand("a", a, call.m, call.k, call.lda);
  }
  if (call.trans_b) {
    check_operand("b", b, call.n, call.k, call.ldb);
  } else {
    check_operand("b", b, call.k, call.n, call.ldb);
  }
  check_operand("c", c, call.m, call.n, call.ldc);
  return call;
}

}  // namespace cublas_guard

CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  // The status the routine returned (0 = success); raises for bad arguments.
  m.def(
      "replay_gemm(Tensor a, Tensor b, Tensor(c!) c, bool transa, bool transb, int m, int n, "
      "int k, int lda, int ldb, int ldc, float alpha, float beta, str routine, str math_mode, "
      "bool workspace) -> int");
}

CG_LIBRARY_IMPL(cublas_guard_internal, CPU, m) { CG_IMPL(m, "replay_gemm", &cublas_guard::replay_gemm_cpu); }
