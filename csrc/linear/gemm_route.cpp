// The CUDA backend's decisions that need no CUDA header, with their test
// hooks in torch.ops.cublas_guard_testing, so any build runs them: the GEMM
// route, cuBLASLt's verdicts, alignments and plan cache, cublasGemmEx's
// refusal of split-K off (gemm_route.h), the bias prefill's CPU twin, the
// strided scan's index walk (scan/strided_index.h), and the launch-limit
// check's error and lowered limits (linear/launch_limits.h).
#include "linear/gemm_route.h"

#include "linear/launch_limits.h"
#include "linear/linear_op.h"
#include "scan/strided_index.h"

#include "core/registration.h"

#ifndef CUBLAS_GUARD_STABLE
#include <ATen/Context.h>
#include <torch/version.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace cublas_guard {

#ifndef CUBLAS_GUARD_STABLE
static_assert(static_cast<int>(at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK) ==
                      reduction_option::kAllowReducedPrecisionWithSplitK &&
                  static_cast<int>(at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK) ==
                      reduction_option::kDisallowReducedPrecisionAllowSplitK &&
                  static_cast<int>(at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK) ==
                      reduction_option::kDisallowReducedPrecisionDisallowSplitK,
              "gemm_route.h's reduction_option values must be at::CuBLASReductionOption's");
#endif
static_assert(dtype_code::kHalf == static_cast<int>(kHalf) &&
                  dtype_code::kFloat == static_cast<int>(kFloat) &&
                  dtype_code::kDouble == static_cast<int>(kDouble) &&
                  dtype_code::kBFloat16 == static_cast<int>(kBFloat16),
              "gemm_route.h's dtype codes must be ScalarType's");

namespace {
constexpr int kStatusInvalidValue = 7;   // CUBLAS_STATUS_INVALID_VALUE (cuda/lt_gemm.cu asserts it)
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
    CG_CHECK_VALUE(parse_gemm_path(value, &parsed), "cublas_guard_ext: ", kPathVariable, "='", value,
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
  if (heuristic_step && status == kStatusInvalidValue) return LtVerdict::kFallBack;
  if (status != 0) return LtVerdict::kReport;
  if (heuristic_step && algorithms_found <= 0) return LtVerdict::kFallBack;
  return LtVerdict::kContinue;
}

uint32_t pointer_alignment(uintptr_t address) {
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

LtAlignments lt_alignments(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t bias) {
  const uint32_t align_c = pointer_alignment(c), align_bias = pointer_alignment(bias);
  return LtAlignments{pointer_alignment(a), pointer_alignment(b), align_c, std::min(align_c, align_bias)};
}

const char* gemm_ex_refused_reduction(int dtype, int reduction) {
  if (reduction != reduction_option::kDisallowReducedPrecisionDisallowSplitK) return nullptr;
  if (dtype == dtype_code::kBFloat16)
    return "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction";
  if (dtype == dtype_code::kHalf) return "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction";
  return nullptr;  // float32/float64 have no such setting
}

#ifdef CUBLAS_GUARD_STABLE
// The stable ABI cannot read torch's settings: Python hands them over
// (set_reduction_options, called by the package when they change).
namespace {
std::atomic<int> reduction_fp16{0}, reduction_bf16{0};  // torch's defaults: reduced precision, split-K
std::atomic<bool> fp16_accumulation{false};              // torch's default
}  // namespace
int torch_reduction_option(int dtype) {
  return (dtype == dtype_code::kBFloat16 ? reduction_bf16 : reduction_fp16).load(std::memory_order_relaxed);
}
void set_reduction_options(int64_t fp16, int64_t bf16) {
  reduction_fp16.store(static_cast<int>(fp16), std::memory_order_relaxed);
  reduction_bf16.store(static_cast<int>(bf16), std::memory_order_relaxed);
}
bool torch_fp16_accumulation() { return fp16_accumulation.load(std::memory_order_relaxed); }
void set_fp16_accumulation(bool allow) { fp16_accumulation.store(allow, std::memory_order_relaxed); }
#else
int torch_reduction_option(int dtype) {
  const at::CuBLASReductionOption option = dtype == dtype_code::kBFloat16
                                               ? at::globalContext().allowBF16ReductionCuBLAS()
                                               : at::globalContext().allowFP16ReductionCuBLAS();
  return static_cast<int>(option);
}
// The locked library reads torch's settings itself.
void set_reduction_options(int64_t /*fp16*/, int64_t /*bf16*/) {}
bool torch_fp16_accumulation() {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 7)
  return at::globalContext().allowFP16AccumulationCuBLAS();
#else
  return false;
#endif
}
void set_fp16_accumulation(bool /*allow*/) {}
#endif

void raise_gemm_ex_reduction_refused(const GemmCall& call, const char* setting, const std::string& layer) {
  const std::string rule = std::string(setting) +
                           " = (False, False) turns split-K off, which cublasGemmEx cannot do (torch's own "
                           "cuBLAS GEMMs refuse it too); allow split-K: " +
                           setting + " = (False, True)";
  raise_gemm_precheck(call, layer, kStatusNotSupported, "CUBLAS_STATUS_NOT_SUPPORTED", rule,
                      "layer '" + layer + "': " + call.routine + " refused: " + rule);
}

namespace {
// Lowered launch limits (tests only): 0 keeps the device's.
std::atomic<bool> launch_limits_lowered{false};
std::atomic<int64_t> lowered_grid_x{0}, lowered_grid_yz{0}, lowered_threads{0}, lowered_shared{0};
}  // namespace

LaunchLimits launch_limits_for_testing(const LaunchLimits& device_limits) {
  if (!launch_limits_lowered.load(std::memory_order_relaxed)) return device_limits;
  LaunchLimits limits = device_limits;
  const auto lower = [](int64_t& limit, const std::atomic<int64_t>& lowered) {
    const int64_t value = lowered.load(std::memory_order_relaxed);
    if (value > 0 && value < limit) limit = value;
  };
  lower(limits.max_grid[0], lowered_grid_x);
  lower(limits.max_grid[1], lowered_grid_yz);
  lower(limits.max_grid[2], lowered_grid_yz);
  lower(limits.max_block[0], lowered_threads);
  lower(limits.max_threads_per_block, lowered_threads);
  lower(limits.max_shared_bytes, lowered_shared);
  return limits;
}

void raise_launch_limit(const char* kernel, const LaunchShape& shape, const std::string& rule,
                        const std::string& layer) {
  constexpr int64_t kInvalidConfiguration = 9;  // cudaErrorInvalidConfiguration (cuda/linear.cu asserts it)
  ErrorReport report("cuda_launch");
  report.add("layer", layer).add("kernel", kernel);
  report.add("cuda_error", "cudaErrorInvalidConfiguration").add("cuda_error_code", kInvalidConfiguration);
  report.add("cuda_error_string", "invalid configuration argument");
  report.add("precheck", true).add("rule", rule);
  report.add("grid", std::vector<int64_t>(shape.grid, shape.grid + 3))
      .add("block", std::vector<int64_t>(shape.block, shape.block + 3));
  report.add("shared_memory_bytes", shape.shared_bytes);
  report.raise_runtime_error("layer '" + layer + "': " + kernel + " was not launched: grid (" +
                             std::to_string(shape.grid[0]) + ", " + std::to_string(shape.grid[1]) + ", " +
                             std::to_string(shape.grid[2]) + "), block (" + std::to_string(shape.block[0]) +
                             ", " + std::to_string(shape.block[1]) + ", " + std::to_string(shape.block[2]) +
                             ") breaks " + rule);
}

namespace {

int dtype_from_name(const std::string& name) {
  if (name == "float32") return dtype_code::kFloat;
  if (name == "float64") return dtype_code::kDouble;
  if (name == "float16") return dtype_code::kHalf;
  if (name == "bfloat16") return dtype_code::kBFloat16;
  throw_value_error("cublas_guard_ext: unknown dtype name '" + name + "'");
}

// [route name, then, for an Lt start, the verdict of each Lt step given as
// (status, heuristic step, algorithms found) triples: continue|fall_back|report].
std::vector<std::string> gemm_route_op(StringArg dtype, StringArg path, bool has_bias, bool use_64bit,
                                       bool lt_available, std::vector<int64_t> lt_steps) {
  require_testing_env("gemm_route");
  GemmPath parsed = GemmPath::kLegacy;
  const std::string path_text(path);
  CG_CHECK_VALUE(parse_gemm_path(path_text.c_str(), &parsed), "cublas_guard_ext: GEMM path '", path_text,
                 "' is neither 'legacy' nor 'lt'");
  std::vector<std::string> out{gemm_route_name(
      first_route(dtype_from_name(std::string(dtype)), parsed, has_bias, use_64bit, lt_available))};
  CG_CHECK_VALUE(lt_steps.size() % 3 == 0,
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
void prefill_bias_twin_op(Tensor c, const Tensor& bias, int64_t m, int64_t n, int64_t ldc, int64_t workers,
                          int64_t lanes) {
  require_testing_env("prefill_bias_twin");
  CG_CHECK_VALUE(c.is_cpu() && bias.is_cpu() && c.scalar_type() == kFloat && bias.scalar_type() == kFloat &&
                     c.is_contiguous() && bias.is_contiguous(),
                 "cublas_guard_ext: prefill_bias_twin takes contiguous float32 CPU tensors");
  CG_CHECK_VALUE(m >= 0 && n >= 0 && ldc >= std::max<int64_t>(1, m) && workers > 0 && lanes > 0 &&
                     bias.numel() >= m && (n == 0 || c.numel() >= (n - 1) * ldc + m),
                 "cublas_guard_ext: prefill_bias_twin: the block does not fit");
  float* data = data_as<float>(c);
  const float* b = data_as<float>(bias);
  for (int64_t w = 0; w < workers; ++w) {
    for (int64_t l = 0; l < lanes; ++l) prefill_columns(data, b, m, n, ldc, w, workers, l, lanes);
  }
}

std::vector<int64_t> lt_alignments_op(int64_t a, int64_t b, int64_t c, int64_t bias) {
  require_testing_env("lt_alignments");
  const LtAlignments al = lt_alignments(static_cast<uintptr_t>(a), static_cast<uintptr_t>(b),
                                        static_cast<uintptr_t>(c), static_cast<uintptr_t>(bias));
  return {al.a, al.b, al.c, al.d};
}

// The key's fields in the order lt_plan_cache_trace takes them.
const std::vector<std::string>& lt_plan_key_fields() {
  static const std::vector<std::string> fields{
      "device",  "dtype",   "accumulate16",  "reduction", "trans_a", "trans_b", "m",
      "n",       "k",       "lda",           "ldb",       "ldc",     "align_a", "align_b",
      "align_c", "align_d", "workspace_size"};
  return fields;
}

// Looks each key up in a cache of `capacity` plans (inserting it on a miss),
// as the cuBLASLt path does per call: "miss", or "hit i" where i is the
// lookup whose miss stored the plan found.
std::vector<std::string> lt_plan_cache_trace_op(int64_t capacity, std::vector<int64_t> keys) {
  require_testing_env("lt_plan_cache_trace");
  const size_t width = lt_plan_key_fields().size();
  CG_CHECK_VALUE(capacity > 0 && keys.size() % width == 0, "cublas_guard_ext: lt_plan_cache_trace takes ",
                 width, " ints per key and a capacity > 0");
  LtPlanCache<int64_t> cache(static_cast<size_t>(capacity));
  std::vector<std::string> out;
  for (size_t i = 0; i < keys.size(); i += width) {
    const int64_t* f = keys.data() + i;
    LtPlanKey key;
    key.device = static_cast<int>(f[0]);
    key.dtype = static_cast<int>(f[1]);
    key.accumulate16 = f[2] != 0;
    key.reduction = static_cast<int>(f[3]);
    key.trans_a = f[4] != 0;
    key.trans_b = f[5] != 0;
    key.m = f[6];
    key.n = f[7];
    key.k = f[8];
    key.lda = f[9];
    key.ldb = f[10];
    key.ldc = f[11];
    key.align = LtAlignments{static_cast<uint32_t>(f[12]), static_cast<uint32_t>(f[13]),
                             static_cast<uint32_t>(f[14]), static_cast<uint32_t>(f[15])};
    key.workspace_size = static_cast<uint64_t>(f[16]);
    if (const int64_t* plan = cache.find(key)) {
      out.push_back("hit " + std::to_string(*plan));  // the lookup that stored the plan
    } else {
      cache.insert(key, static_cast<int64_t>(i / width));
      out.emplace_back("miss");
    }
  }
  CG_CHECK(cache.size() <= static_cast<size_t>(capacity),
           "cublas_guard_ext: the plan cache outgrew its capacity");
  return out;
}

// What cublasGemmEx does for a half-precision GEMM under torch's reduction
// option (0, 1, 2: at::CuBLASReductionOption; -1: torch's current setting,
// as the CUDA path reads it): nothing, or the error the CUDA path raises.
void gemm_ex_reduction_check_op(StringArg dtype, int64_t reduction, StringArg layer) {
  require_testing_env("gemm_ex_reduction_check");
  const int code = dtype_from_name(std::string(dtype));
  const int option = reduction < 0 ? torch_reduction_option(code) : static_cast<int>(reduction);
  const char* setting = gemm_ex_refused_reduction(code, option);
  if (setting == nullptr) return;
  GemmCall call;
  call.dtype = static_cast<ScalarType>(code);
  call.m = 48;
  call.n = 16;
  call.k = 64;
  call.lda = 64;
  call.ldb = 64;
  call.ldc = 48;
  call.trans_a = true;
  call.routine = "cublasGemmEx";
  call.data_type = code == dtype_code::kBFloat16 ? "CUDA_R_16BF" : "CUDA_R_16F";
  call.compute_type = "CUBLAS_COMPUTE_32F";
  raise_gemm_ex_reduction_refused(call, setting, std::string(layer));
}

// plan_gemm_call's INVALID_VALUE rules on a float32 call with these
// arguments ([m, n, k, lda, ldb, ldc]): raises the precheck's CublasError.
void gemm_rules_check_op(IntList args, bool trans_a, bool trans_b, StringArg layer) {
  require_testing_env("gemm_rules_check");
  CG_CHECK(args.size() == 6, "gemm_rules_check: [m, n, k, lda, ldb, ldc]");
  GemmCall call;
  call.dtype = kFloat;
  call.m = args[0];
  call.n = args[1];
  call.k = args[2];
  call.lda = args[3];
  call.ldb = args[4];
  call.ldc = args[5];
  call.trans_a = trans_a;
  call.trans_b = trans_b;
  call.routine = "cublasSgemm";
  call.data_type = "CUDA_R_32F";
  call.compute_type = "CUBLAS_COMPUTE_32F";
  plan_gemm_call(call, /*has_64bit_api=*/true, std::string(layer));
}

// The strided scan kernel's index -> offset (scan/strided_index.h) on the
// CPU: merged dims (outermost first) of a tensor of `numel` elements (the
// product of the sizes when 0; a larger one forces the 64-bit walk), and the
// offset of each logical index.
std::vector<int64_t> strided_offsets_op(std::vector<int64_t> sizes, std::vector<int64_t> strides,
                                        int64_t numel, std::vector<int64_t> indices) {
  require_testing_env("strided_offsets");
  const auto ndim = static_cast<int>(sizes.size());
  int64_t product = 1;
  for (const int64_t s : sizes) product *= s;
  CG_CHECK_VALUE(ndim >= 1 && ndim <= kStridedIndexMaxDims && strides.size() == sizes.size() && product > 0 &&
                     (numel == 0 || numel >= product),
                 "cublas_guard_ext: strided_offsets takes 1 to ", kStridedIndexMaxDims,
                 " positive sizes, as many strides, and numel 0 or >= their product");
  StridedIndex g;
  make_strided_index(g, ndim, sizes.data(), strides.data(), numel == 0 ? product : numel);
  std::vector<int64_t> out;
  out.reserve(indices.size());
  for (const int64_t i : indices) {
    CG_CHECK_VALUE(i >= 0 && i < product, "cublas_guard_ext: strided_offsets: index ", i, " out of range");
    out.push_back(strided_offset(g, i));
  }
  return out;
}

// Lowers the launch limits every kernel of ours is checked against (0: the device's).
void set_launch_limits_op(int64_t max_grid_x, int64_t max_grid_yz, int64_t max_threads, int64_t max_shared) {
  require_testing_env("set_launch_limits");
  lowered_grid_x.store(max_grid_x);
  lowered_grid_yz.store(max_grid_yz);
  lowered_threads.store(max_threads);
  lowered_shared.store(max_shared);
  launch_limits_lowered.store(max_grid_x > 0 || max_grid_yz > 0 || max_threads > 0 || max_shared > 0);
}

// The check and the error of a launch (launch_limits.h) against the default
// limits, lowered as set_launch_limits says: what check_launch_fits does on a GPU.
void launch_limits_check_op(StringArg kernel, std::vector<int64_t> grid, std::vector<int64_t> block,
                            int64_t shared_bytes, StringArg layer) {
  require_testing_env("launch_limits_check");
  CG_CHECK_VALUE(grid.size() == 3 && block.size() == 3,
                 "cublas_guard_ext: launch_limits_check takes grid and block as 3 ints each");
  LaunchShape shape;
  for (int i = 0; i < 3; ++i) {
    shape.grid[i] = grid[i];
    shape.block[i] = block[i];
  }
  shape.shared_bytes = shared_bytes;
  std::string rule;
  if (launch_limit_broken(shape, launch_limits_for_testing(LaunchLimits{}), rule) != nullptr) {
    raise_launch_limit(std::string(kernel).c_str(), shape, rule, std::string(layer));
  }
}

std::string set_gemm_path_op(StringArg path) {
  require_testing_env("set_gemm_path");
  GemmPath parsed = GemmPath::kLegacy;
  const std::string text(path);
  CG_CHECK_VALUE(parse_gemm_path(text.c_str(), &parsed) && !text.empty(), "cublas_guard_ext: GEMM path '",
                 text, "' is neither 'legacy' nor 'lt'");
  const GemmPath previous = gemm_path();
  path_state().store(static_cast<int>(parsed));
  return gemm_path_name(previous);
}

std::vector<std::string> lt_plan_key_fields_op() { return lt_plan_key_fields(); }
std::string gemm_path_op() { return gemm_path_name(gemm_path()); }
void set_reduction_options_op(int64_t fp16, int64_t bf16) { set_reduction_options(fp16, bf16); }
void set_fp16_accumulation_op(bool allow) { set_fp16_accumulation(allow); }

}  // namespace
}  // namespace cublas_guard

CG_LIBRARY_FRAGMENT(cublas_guard_testing, m) {
  m.def(
      "gemm_route(str dtype, str path, bool has_bias, bool use_64bit, bool lt_available, "
      "int[] lt_steps) -> str[]");
  m.def("prefill_bias_twin(Tensor(a!) c, Tensor bias, int m, int n, int ldc, int workers, int lanes) -> ()");
  m.def("lt_alignments(int a, int b, int c, int bias) -> int[]");
  m.def("lt_plan_key_fields() -> str[]");
  m.def("lt_plan_cache_trace(int capacity, int[] keys) -> str[]");
  m.def("gemm_ex_reduction_check(str dtype, int reduction, str layer) -> ()");
  m.def("gemm_rules_check(int[] args, bool trans_a, bool trans_b, str layer) -> ()");
  m.def("strided_offsets(int[] sizes, int[] strides, int numel, int[] indices) -> int[]");
  m.def("set_launch_limits(int max_grid_x, int max_grid_yz, int max_threads, int max_shared) -> ()");
  m.def("launch_limits_check(str kernel, int[] grid, int[] block, int shared_bytes, str layer) -> ()");
  m.def("gemm_path() -> str");
  // Switches the process's path (CUBLAS_GUARD_GEMM_PATH's value) for a test; returns the previous one.
  m.def("set_gemm_path(str path) -> str");
}

CG_LIBRARY_IMPL(cublas_guard_testing, CompositeExplicitAutograd, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "gemm_route", &gemm_route_op);
  CG_IMPL(m, "prefill_bias_twin", &prefill_bias_twin_op);
  CG_IMPL(m, "lt_alignments", &lt_alignments_op);
  CG_IMPL(m, "lt_plan_key_fields", &lt_plan_key_fields_op);
  CG_IMPL(m, "lt_plan_cache_trace", &lt_plan_cache_trace_op);
  CG_IMPL(m, "gemm_ex_reduction_check", &gemm_ex_reduction_check_op);
  CG_IMPL(m, "gemm_rules_check", &gemm_rules_check_op);
  CG_IMPL(m, "strided_offsets", &strided_offsets_op);
  CG_IMPL(m, "set_launch_limits", &set_launch_limits_op);
  CG_IMPL(m, "launch_limits_check", &launch_limits_check_op);
  CG_IMPL(m, "gemm_path", &gemm_path_op);
  CG_IMPL(m, "set_gemm_path", &set_gemm_path_op);
}

// torch's cuBLAS settings, which the stable core cannot read: the package
// passes them (no-ops in the locked library). set_reduction_options takes
// torch.backends.cuda.matmul.allow_{fp16,bf16}_reduced_precision_reduction as
// at::CuBLASReductionOption values; set_fp16_accumulation takes
// torch.backends.cuda.matmul.allow_fp16_accumulation. (allow_tf32 needs no
// hand-over: torch sets its cuBLAS handle's math mode from it whenever the
// core asks for the handle.)
CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("set_reduction_options(int fp16, int bf16) -> ()");
  m.def("set_fp16_accumulation(bool allow) -> ()");
}
CG_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "set_reduction_options", &cublas_guard::set_reduction_options_op);
  CG_IMPL(m, "set_fp16_accumulation", &cublas_guard::set_fp16_accumulation_op);
}
