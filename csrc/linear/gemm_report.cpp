// The report of a failed GEMM (CublasError): the call exactly as cuBLAS got
// it, and the buffers it read, attached for the failure capsule.
//
// The buffers are what cuBLAS saw, not the user's tensors: each is a flat view
// starting at the (sub-)call's pointer and spanning the elements the call can
// touch, (outer - 1) * ld + inner for an operand stored column-major as
// [inner x outer]. So the capsule holds the piece of a split GEMM, a copy made
// for an unusable layout, and the alignment cuBLAS got, and a replay runs the
// same arguments on the same bytes (cublas_guard_ext.capsule_replay).
#include "linear/linear_op.h"

#include <string>

#include <cstdint>
#include <string>

namespace cublas_guard {

namespace {

Tensor buffer_view(const void* data, int64_t elements, const Tensor* like, ScalarType dtype) {
  return from_blob(data, {elements}, {1}, dtype, like != nullptr ? like->device() : cpu_device());
}

// The call's shape arguments, as cuBLAS got them.
void add_gemm_arguments(ErrorReport& report, const GemmCall& call) {
  report.add("purpose", call.purpose);
  report.add("transa", call.trans_a ? "T" : "N").add("transb", call.trans_b ? "T" : "N");
  report.add("m", call.m).add("n", call.n).add("k", call.k);
  report.add("lda", call.lda).add("ldb", call.ldb).add("ldc", call.ldc);
}

}  // namespace

[[noreturn]] void raise_gemm_precheck(const GemmCall& call, const std::string& layer, int64_t status,
                                      const char* status_name, const std::string& rule,
                                      const std::string& message) {
  ErrorReport report("cublas");
  report.add("layer", layer).add("status", status).add("status_name", status_name).add("rule", rule);
  report.add("precheck", true);
  add_gemm_arguments(report, call);
  report.add("api", call.routine).add("data_type", call.data_type).add("compute_type", call.compute_type);
  report.raise_runtime_error(message);
}

[[noreturn]] void raise_gemm_failure(int status, const GemmCall& call, const GemmContext& ctx) {
  ErrorReport report("cublas");
  report.add("layer", ctx.layer).add("status", static_cast<int64_t>(status));
  if (!ctx.status_name.empty()) report.add("status_name", ctx.status_name);
  add_gemm_arguments(report, call);
  report.add("alpha", call.alpha).add("beta", call.beta);
  // ctx.api names the cuBLASLt step that failed, when the Lt path ran (cuda/lt_gemm.cu).
  const std::string api = ctx.api.empty() ? std::string(call.routine) : ctx.api;
  report.add("api", api).add("data_type", call.data_type).add("compute_type", call.compute_type);
  if (!ctx.descriptors.empty()) report.add("descriptors", ctx.descriptors);
  if (!ctx.gemm_path.empty()) report.add("gemm_path", ctx.gemm_path);
  if (!call.chunk.empty()) report.add("chunk", call.chunk);
  add_memory_fields(report, ctx.memory);
  if (!ctx.math_mode.empty()) report.add("math_mode", ctx.math_mode);
  if (!ctx.device.empty()) report.add("device", ctx.device);
  const std::pair<const char*, const Tensor*> operands[] = {
      {"a", ctx.operand_a}, {"b", ctx.operand_b}, {"c", ctx.operand_c}};
  for (int i = 0; i < 3; ++i) {
    const auto& op = operands[i];
    if (op.second == nullptr) continue;
    describe_tensor(report, op.first, *op.second);
    report.add((std::string(op.first) + "_role").c_str(), ctx.roles[i]);
    report.add((std::string(op.first) + "_storage_offset").c_str(), op.second->storage_offset());
    // Alignment in bytes: the largest power of two (up to 256) dividing the address.
    const auto address = reinterpret_cast<uintptr_t>(op.second->data_ptr());
    int64_t alignment = 1;
    while (alignment < 256 && address % (alignment * 2) == 0) alignment *= 2;
    report.add((std::string(op.first) + "_alignment").c_str(), alignment);
  }
  // What cuBLAS read and wrote: op(A) is m x k, op(B) k x n, C m x n.
  const int64_t a_span =
      call.trans_a ? operand_span(call.k, call.m, call.lda) : operand_span(call.m, call.k, call.lda);
  const int64_t b_span =
      call.trans_b ? operand_span(call.n, call.k, call.ldb) : operand_span(call.k, call.n, call.ldb);
  const int64_t c_span = operand_span(call.m, call.n, call.ldc);
  report.attach("a", buffer_view(call.a, a_span, ctx.operand_a, call.dtype));
  report.attach("b", buffer_view(call.b, b_span, ctx.operand_b, call.dtype));
  report.attach("c", buffer_view(call.c, c_span, ctx.operand_c, call.dtype));
  report.raise_runtime_error("layer '" + ctx.layer + "': " + api + " (" + call.purpose +
                             ") failed with status " + std::to_string(status) +
                             (ctx.status_name.empty() ? "" : " " + ctx.status_name) +
                             " (m=" + std::to_string(call.m) + ", n=" + std::to_string(call.n) +
                             ", k=" + std::to_string(call.k) + ")");
}

}  // namespace cublas_guard
