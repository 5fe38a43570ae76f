// Which GEMM a call takes, and the bias prefill, kept free of the CUDA headers
// so that the CPU build compiles them and their tests run on any machine
// without a GPU. cuda/linear.cu and cuda/lt_gemm.cu call these; the test hooks in
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

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <string>
#include <unordered_map>
#include <utility>

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
// case, CUBLAS_STATUS_NOT_SUPPORTED, or CUBLAS_STATUS_INVALID_VALUE from the
// heuristic query, which some cuBLASLt releases answer for a layout they do
// not handle), or report the status (any other failure: a broken handle, a
// bad argument to a descriptor, an execution failure).
enum class LtVerdict : int { kContinue = 0, kFallBack = 1, kReport = 2 };
LtVerdict lt_verdict(int status, bool heuristic_step, int algorithms_found);

// As torch's _getAlignment: the largest power of two up to 256 bytes dividing the address.
uint32_t pointer_alignment(uintptr_t address);

// The minimum alignments (bytes) a cuBLASLt call declares in its preference.
// D is the output, which is C: a piece of a split GEMM starts m0 + n0 * ldc
// elements into it, and the bias epilogue reads the bias from its m0-th
// element, so D declares the smaller of C's and the bias's alignment (a
// kernel chosen for a larger one would make misaligned vector stores: a
// sticky error).
struct LtAlignments {
  uint32_t a, b, c, d;
};
LtAlignments lt_alignments(uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t bias);

// Everything a cuBLASLt bias-epilogue call's descriptors and heuristic answer
// depend on: two calls with equal keys can share one plan (the bias pointer
// is set per call). torch's reduction option and fp16 accumulation are read
// per call, so changing them mid-run changes the key.
struct LtPlanKey {
  int device = -1;
  int dtype = 0;
  bool accumulate16 = false;  // CUBLAS_COMPUTE_16F with half alpha/beta
  int reduction = 0;          // at::CuBLASReductionOption's value
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0, lda = 0, ldb = 0, ldc = 0;
  LtAlignments align{0, 0, 0, 0};
  uint64_t workspace_size = 0;

  bool operator==(const LtPlanKey& o) const {
    return device == o.device && dtype == o.dtype && accumulate16 == o.accumulate16 &&
           reduction == o.reduction && trans_a == o.trans_a && trans_b == o.trans_b && m == o.m && n == o.n &&
           k == o.k && lda == o.lda && ldb == o.ldb && ldc == o.ldc && align.a == o.align.a &&
           align.b == o.align.b && align.c == o.align.c && align.d == o.align.d &&
           workspace_size == o.workspace_size;
  }
};

struct LtPlanKeyHash {
  size_t operator()(const LtPlanKey& key) const {
    uint64_t h = 1469598103934665603ull;  // FNV-1a over the fields
    const auto mix = [&h](uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<uint64_t>(key.device));
    mix(static_cast<uint64_t>(key.dtype) | (static_cast<uint64_t>(key.accumulate16) << 8) |
        (static_cast<uint64_t>(key.reduction) << 16) | (static_cast<uint64_t>(key.trans_a) << 24) |
        (static_cast<uint64_t>(key.trans_b) << 25));
    for (const int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc}) mix(static_cast<uint64_t>(v));
    mix(static_cast<uint64_t>(key.align.a) | (static_cast<uint64_t>(key.align.b) << 16) |
        (static_cast<uint64_t>(key.align.c) << 32) | (static_cast<uint64_t>(key.align.d) << 48));
    mix(key.workspace_size);
    return static_cast<size_t>(h);
  }
};

// The plans of recent cuBLASLt calls, least recently used evicted first. One
// per thread (torch's cuBLASLt handle is per thread too): no lock. `Plan` is
// movable; an evicted plan is destroyed (its descriptors with it).
template <typename Plan>
class LtPlanCache {
 public:
  explicit LtPlanCache(size_t capacity) : capacity_(capacity < 1 ? 1 : capacity) {}
  LtPlanCache(const LtPlanCache&) = delete;
  LtPlanCache& operator=(const LtPlanCache&) = delete;

  // The plan for `key`, now the most recently used; nullptr when there is none.
  Plan* find(const LtPlanKey& key) {
    const auto it = index_.find(key);
    if (it == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second);
    return &it->second->second;
  }
  // Stores the plan for `key` (replacing one there), evicting the least recently used beyond capacity.
  Plan& insert(const LtPlanKey& key, Plan plan) {
    const auto it = index_.find(key);
    if (it != index_.end()) {
      order_.erase(it->second);
      index_.erase(it);
    }
    order_.emplace_front(key, std::move(plan));
    index_.emplace(key, order_.begin());
    while (order_.size() > capacity_) {
      index_.erase(order_.back().first);
      order_.pop_back();
    }
    return order_.front().second;
  }
  size_t size() const { return order_.size(); }

 private:
  size_t capacity_;
  std::list<std::pair<LtPlanKey, Plan>> order_;  // most recently used first
  std::unordered_map<LtPlanKey, typename std::list<std::pair<LtPlanKey, Plan>>::iterator, LtPlanKeyHash>
      index_;
};

// Plans each thread keeps: a model's distinct (shape, layout) pairs, forward and backward.
constexpr size_t kLtPlanCacheCapacity = 64;

// cublasGemmEx cannot keep split-K off: torch refuses
// allow_{bf16,fp16}_reduced_precision_reduction(..., allow_splitk=False) for
// the GEMMs it runs through cuBLAS (only its cuBLASLt path honours it), and so
// does this one. `reduction` is at::CuBLASReductionOption's value. Returns
// the setting's name when cublasGemmEx must refuse, nullptr when it may run.
const char* gemm_ex_refused_reduction(int dtype, int reduction);
// torch's current reduction option (at::CuBLASReductionOption's value) for a
// half-precision dtype: allow_{bf16,fp16}_reduced_precision_reduction.
int torch_reduction_option(int dtype);
// The stable core cannot read torch's settings: the package passes them (a no-op in the locked library).
void set_reduction_options(int64_t fp16, int64_t bf16);
// at::CuBLASReductionOption's values (gemm_route.cpp asserts them in the locked library).
namespace reduction_option {
constexpr int kAllowReducedPrecisionWithSplitK = 0;
constexpr int kDisallowReducedPrecisionAllowSplitK = 1;
constexpr int kDisallowReducedPrecisionDisallowSplitK = 2;
}  // namespace reduction_option

// torch.backends.cuda.matmul.allow_fp16_accumulation (torch 2.7+; false
// before): float16 GEMMs then accumulate in float16 on sm_70+, as torch's own
// (CUBLAS_COMPUTE_16F). Handed to the stable core by the package, as the
// reduction options (set_fp16_accumulation: a no-op in the locked library).
bool torch_fp16_accumulation();
void set_fp16_accumulation(bool allow);

struct GemmCall;  // linear/gemm_plan.h
// Raises the CublasError (CUBLAS_STATUS_NOT_SUPPORTED, refused before the
// call) naming `setting`, for `call` (cublasGemmEx's arguments).
[[noreturn]] void raise_gemm_ex_reduction_refused(const GemmCall& call, const char* setting,
                                                  const std::string& layer);

// dtype codes (ScalarType's values, without its header).
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
