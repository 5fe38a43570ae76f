// The GEMM route decisions and the bias prefill's CPU twin (gemm_route.h),
// with their test hooks in torch.ops.cublas_guard_testing: any build runs them.
#include "linear/gemm_route.h"

#include "guard.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cublas_guard {

static_assert(dtype_code::kHalf == static_cast<int>(at::kHalf) &&
                  dtype_code::kFloat == static_cast<int>(at::kFloat) &&
                  dtype_code::kDouble == static_cast<int>(at::kDouble) &&
                  dtype_code::kBFloat16 == static_cast<int>(at::kBFloat16),
              "gemm_route.h's dtype codes must be at::ScalarType's");

namespace {
constexpr int kStatusNotSupported = 15;  // CUBLAS_STATUS_NOT_SUPPORTED (cuda/lt_gemm.cu asserts it)
constexpr const char* kPathVariable = "CUBLAS_GUARD_GEMM_PATH";
}  // namespace

bool parse_gemm_path(const char* value, GemmPath* path) {
  if (value == nullptr || value[0] == '\0' || std::strcmp(value, "legacy") == 0) {
    *path = GemmPath::kLegacy;
    return true;
  }
  if (std::strcmp(value, "lt") == 0) {
    *path = GemmPath::kLt;
    return true;
  }
  return false;
}

namespace {
// The variable's value, parsed at the first use; tests may switch it (set_gemm_path).
std::atomic<int>& path_state() {
  static std::atomic<int> state{[] {
    const char* value = std::getenv(kPathVariable);
    GemmPath parsed = GemmPath::kLegacy;
    TORCH_CHECK_VALUE(parse_gemm_path(value, &parsed), "cublas_guard_ext: ", kPathVariable, "='", value,
                      "' is not a GEMM path; use ", kPathVariable, "=legacy (the default) or ", kPathVariable,
                      "=lt");
    return static_cast<int>(parsed);
  }()};
  return state;
}
}  // namespace

GemmPath gemm_path() { return static_cast<GemmPath>(path_state().load(std::memory_order_relaxed)); }

const char* gemm_path_name(GemmPath path) { return path == GemmPath::kLt ? "lt" : "legacy"; }

const char* gemm_route_name(GemmRoute route) {
  switch (route) {
    case GemmRoute::kSgemm: return "cublasSgemm";
    case GemmRoute::kDgemm: return "cublasDgemm";
    case GemmRoute::kGemmEx: return "cublasGemmEx";
    case GemmRoute::kLtBias: return "cublasLtMatmul";
  }
  return "?";
}

GemmRoute first_route(int dtype, GemmPath path, bool has_bias, bool use_64bit, bool lt_available) {
  if (dtype == dtype_code::kDouble) return GemmRoute::kDgemm;
  if (dtype != dtype_code::kHalf && dtype != dtype_code::kBFloat16) return GemmRoute::kSgemm;
  if (path == GemmPath::kLt && has_bias && !use_64bit && lt_available) return GemmRoute::kLtBias;
  return GemmRoute::kGemmEx;
}

LtVerdict lt_verdict(int status, bool heuristic_step, int algorithms_found) {
  if (status == kStatusNotSupported) return LtVerdict::kFallBack;
  if (status != 0) return LtVerdict::kReport;
  if (heuristic_step && algorithms_found <= 0) return LtVerdict::kFallBack;
  return LtVerdict::kContinue;
}

namespace {

void require_testing_env(const char* what) {
  const char* flag = std::getenv("CUBLAS_GUARD_EXT_TESTING");
  TORCH_CHECK(flag != nullptr && std::string(flag) == "1", "cublas_guard_ext: ", what,
              " is a test hook; set CUBLAS_GUARD_EXT_TESTING=1 to use it");
}

int dtype_from_name(const std::string& name) {
  if (name == "float32") return dtype_code::kFloat;
  if (name == "float64") return dtype_code::kDouble;
  if (name == "float16") return dtype_code::kHalf;
  if (name == "bfloat16") return dtype_code::kBFloat16;
  TORCH_CHECK_VALUE(false, "cublas_guard_ext: unknown dtype name '", name, "'");
}

// [route name, then, for an Lt start, the verdict of each Lt step given as
// (status, heuristic step, algorithms found) triples: continue|fall_back|report].
std::vector<std::string> gemm_route_op(c10::string_view dtype, c10::string_view path, bool has_bias,
                                       bool use_64bit, bool lt_available, std::vector<int64_t> lt_steps) {
  require_testing_env("gemm_route");
  GemmPath parsed = GemmPath::kLegacy;
  const std::string path_text(path);
  TORCH_CHECK_VALUE(parse_gemm_path(path_text.c_str(), &parsed), "cublas_guard_ext: GEMM path '", path_text,
                    "' is neither 'legacy' nor 'lt'");
  std::vector<std::string> out{gemm_route_name(
      first_route(dtype_from_name(std::string(dtype)), parsed, has_bias, use_64bit, lt_available))};
  TORCH_CHECK_VALUE(lt_steps.size() % 3 == 0,
                    "cublas_guard_ext: lt_steps are (status, heuristic, found) triples");
  for (size_t i = 0; i < lt_steps.size(); i += 3) {
    const LtVerdict v =
        lt_verdict(static_cast<int>(lt_steps[i]), lt_steps[i + 1] != 0, static_cast<int>(lt_steps[i + 2]));
    out.push_back(v == LtVerdict::kContinue   ? "continue"
                  : v == LtVerdict::kFallBack ? "fall_back"
                                              : "report");
  }
  return out;
}

// The prefill kernels' loop (prefill_columns) on the CPU: c is a float tensor
// holding a column-major [m x n] matrix with leading dimension ldc (from its
// offset 0); every element outside the m x n block must stay as it was.
void prefill_bias_twin_op(at::Tensor c, const at::Tensor& bias, int64_t m, int64_t n, int64_t ldc,
                          int64_t workers, int64_t lanes) {
  require_testing_env("prefill_bias_twin");
  TORCH_CHECK_VALUE(c.is_cpu() && bias.is_cpu() && c.scalar_type() == at::kFloat &&
                        bias.scalar_type() == at::kFloat && c.is_contiguous() && bias.is_contiguous(),
                    "cublas_guard_ext: prefill_bias_twin takes contiguous float32 CPU tensors");
  TORCH_CHECK_VALUE(m >= 0 && n >= 0 && ldc >= std::max<int64_t>(1, m) && workers > 0 && lanes > 0 &&
                        bias.numel() >= m && (n == 0 || c.numel() >= (n - 1) * ldc + m),
                    "cublas_guard_ext: prefill_bias_twin: the block does not fit");
  float* data = c.data_ptr<float>();
  const float* b = bias.data_ptr<float>();
  for (int64_t w = 0; w < workers; ++w) {
    for (int64_t l = 0; l < lanes; ++l) prefill_columns(data, b, m, n, ldc, w, workers, l, lanes);
  }
}

std::string set_gemm_path_op(c10::string_view path) {
  require_testing_env("set_gemm_path");
  GemmPath parsed = GemmPath::kLegacy;
  const std::string text(path);
  TORCH_CHECK_VALUE(parse_gemm_path(text.c_str(), &parsed) && !text.empty(), "cublas_guard_ext: GEMM path '",
                    text, "' is neither 'legacy' nor 'lt'");
  const GemmPath previous = gemm_path();
  path_state().store(static_cast<int>(parsed));
  return gemm_path_name(previous);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_FRAGMENT(cublas_guard_testing, m) {
  m.def(
      "gemm_route(str dtype, str path, bool has_bias, bool use_64bit, bool lt_available, "
      "int[] lt_steps) -> str[]",
      &cublas_guard::gemm_route_op);
  m.def("prefill_bias_twin(Tensor(a!) c, Tensor bias, int m, int n, int ldc, int workers, int lanes) -> ()",
        &cublas_guard::prefill_bias_twin_op);
  m.def("gemm_path() -> str",
        [] { return std::string(cublas_guard::gemm_path_name(cublas_guard::gemm_path())); });
  // Switches the process's path (CUBLAS_GUARD_GEMM_PATH's value) for a test; returns the previous one.
  m.def("set_gemm_path(str path) -> str", &cublas_guard::set_gemm_path_op);
}
