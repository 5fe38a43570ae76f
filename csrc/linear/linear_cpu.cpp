// The CPU backend: the same op behind the same checks, computing with torch's
// CPU BLAS. It executes the exact column-major call cuBLAS would receive, so
// the argument plan, the limits and every failure report are exercised on CPU.
#include "core/registration.h"
#include "linear/linear_op.h"

#include <cstdlib>
#include <mutex>
#include <string>

namespace cublas_guard {

namespace {

// A column-major [rows x cols] matrix with leading dimension ld, as a tensor view.
Tensor column_major(const void* data, int64_t rows, int64_t cols, int64_t ld, ScalarType dtype) {
  return from_blob(data, {rows, cols}, {1, ld}, dtype, cpu_device());
}

// What the CPU runs: torch's own CPU GEMM (addmm: MKL/OpenBLAS sgemm/dgemm for
// float32/float64, oneDNN or torch's cpublas for bfloat16/float16, which
// accumulate in float32). There is no 32-bit limit, so no second routine.
GemmNames gemm_names_cpu(ScalarType dtype) {
  switch (dtype) {
    case kBFloat16: return {"torch CPU addmm", "torch CPU addmm", "bfloat16", "float32"};
    case kHalf: return {"torch CPU addmm", "torch CPU addmm", "float16", "float32"};
    case kDouble: return {"torch CPU addmm", "torch CPU addmm", "float64", "float64"};
    default: return {"torch CPU addmm", "torch CPU addmm", "float32", "float32"};
  }
}

int gemm_cpu(const GemmCall& call, GemmContext& ctx) {
  if (const int injected = take_injected_fault(FaultSite::kGemmStatus)) {
    // Read only by a failure's report: built only then
    // (no string work on the clean path).
    ctx.math_mode = std::string("cpu (torch addmm, ") + call.data_type + ")";
    ctx.device = "cpu";
    return injected;
  }
  const ScalarType t = call.dtype;
  Tensor a = call.trans_a ? transposed_view(column_major(call.a, call.k, call.m, call.lda, t))
                          : column_major(call.a, call.m, call.k, call.lda, t);
  Tensor b = call.trans_b ? transposed_view(column_major(call.b, call.n, call.k, call.ldb, t))
                          : column_major(call.b, call.k, call.n, call.ldb, t);
  Tensor c = column_major(call.c, call.m, call.n, call.ldc, t);
  addmm_cpu(c, a, b, call.beta, call.alpha);
  return 0;
}

Tensor fetch_cpu(const Tensor& results, const std::string& /*layer*/) { return results; }

void no_pending_error(const std::string& /*layer*/) {}

void async_slot_cpu(Device /*device*/, AsyncRecord** record, int** claim) {
  static AsyncRecord cpu_record{};
  static int cpu_claim = 0;
  static std::once_flag registered;
  std::call_once(registered, [] {
    RecordHooks hooks;
    hooks.synchronize = nullptr;  // CPU scans finish before the op returns
    register_async_record(cpu_device(), &cpu_record, &cpu_claim, hooks);
  });
  *record = &cpu_record;
  *claim = &cpu_claim;
}

}  // namespace

const LinearBackend& cpu_backend() {
  // torch's CPU addmm has no 32-bit limit: the "64-bit API" is the same call.
  static const LinearBackend backend{scan_cpu_into,          fetch_cpu,      gemm_cpu,
                                     no_pending_error,       async_slot_cpu, /*memory_info=*/nullptr,
                                     /*has_64bit_api=*/true, gemm_names_cpu};
  return backend;
}

namespace {

Tensor scan_op(const Tensor& x) { return scan(cpu_backend(), x); }

Tensor linear_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, StringArg layer,
                 int64_t mode, bool /*scan_grad: autograd's business*/) {
  return linear_forward(cpu_backend(), x, weight, bias, std::string(layer), mode);
}

Tensor grad_input_op(const Tensor& grad_output, const Tensor& weight, StringArg layer) {
  return linear_grad_input(cpu_backend(), grad_output, weight, std::string(layer));
}

Tensor grad_weight_op(const Tensor& grad_output, const Tensor& x, StringArg layer) {
  return linear_grad_weight(cpu_backend(), grad_output, x, std::string(layer));
}

void check_features_op(const Tensor& x, int64_t in_features, StringArg layer) {
  check_features(cpu_backend(), x, in_features, std::string(layer));
}

void guard_values_op(const Tensor& t, StringArg layer, int64_t role, int64_t mode) {
  guard_tensor(cpu_backend(), t, std::string(layer), role, mode);
}

// The CPU backend as if its stream were being captured into a CUDA graph (the
// test hook linear_as_captured): the CPU has no graphs, but the decisions a
// capture changes (which parameters are scanned, what is marked clean) are
// linear_common.cpp's and run here as they would on CUDA.
bool always_captured(Device /*device*/, int64_t** counter) {
  *counter = nullptr;  // replays are reported as "a replay"
  return true;
}

const LinearBackend& cpu_backend_as_captured() {
  static const LinearBackend backend = [] {
    LinearBackend b = cpu_backend();
    b.capture_replay_counter = always_captured;
    return b;
  }();
  return backend;
}

Tensor linear_as_captured_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                             StringArg layer) {
  const char* flag = std::getenv("CUBLAS_GUARD_EXT_TESTING");
  CG_CHECK(flag != nullptr && std::string(flag) == "1",
           "cublas_guard_ext: linear_as_captured is a test hook; set CUBLAS_GUARD_EXT_TESTING=1 to use it");
  CG_CHECK_VALUE(x.is_cpu() && weight.is_cpu(),
                 "cublas_guard_ext: linear_as_captured runs the CPU backend only");
  return linear_forward(cpu_backend_as_captured(), x, weight, bias, std::string(layer),
                        static_cast<int64_t>(GuardMode::kAsync));
}

}  // namespace

const LinearKernels& cpu_linear_kernels() {
  static const LinearKernels kernels{linear_op, grad_input_op, grad_weight_op, guard_values_op};
  return kernels;
}

}  // namespace cublas_guard

// Test hook (the others are in testing.cpp): an async-mode forward on the CPU
// backend that takes its stream to be under CUDA graph capture.
CG_LIBRARY_FRAGMENT(cublas_guard_testing, m) {
  m.def("linear_as_captured(Tensor x, Tensor weight, Tensor? bias, str layer) -> Tensor");
}
CG_LIBRARY_IMPL(cublas_guard_testing, CPU, m) {
  CG_IMPL(m, "linear_as_captured", &cublas_guard::linear_as_captured_op);
}

CG_LIBRARY_IMPL(cublas_guard, CPU, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "scan", &scan_op);
  CG_IMPL(m, "linear", &linear_op);
  CG_IMPL(m, "linear_grad_input", &grad_input_op);
  CG_IMPL(m, "linear_grad_weight", &grad_weight_op);
  CG_IMPL(m, "check_features", &check_features_op);
  CG_IMPL(m, "guard_values", &guard_values_op);
}
