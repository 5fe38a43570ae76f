// The linear op's shared declarations: what its CPU (.cpp) and CUDA (.cu)
// implementations, the Meta kernels and the test hooks all need. The scan
// result layout, the error report that carries structured fields to Python,
// the argument checks (the single source of truth for every rule), the
// backend interface and the entry points of the orchestration. The GEMM plan
// is in linear/gemm_plan.h, the guard modes in linear/guard_mode.h, the async
// records' registry in report/async_registry.h; this header includes them.
//
// Only ATen's Tensor class is included: not <ATen/ATen.h> (all of
// ATen/Functions.h, the biggest part of a compile) and never
// <torch/extension.h>: every translation unit and nvcc compile it. A file that
// calls an at:: function includes its per-op header (<ATen/ops/empty.h>).
#pragma once

#include "core/tensor_api.h"

#include "linear/gemm_plan.h"
#include "linear/guard_mode.h"
#include "report/async_record.h"
#include "report/async_registry.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Scan result: a small int64 tensor on the scanned tensor's device.
// ---------------------------------------------------------------------------
enum ScanField : int64_t {
  kNanCount = 0,
  kPosInfCount = 1,
  kNegInfCount = 2,
  kFirstBadIndex = 3,  // flat (row-major, logical) index; -1 when all finite
  kScanFields = 4,
};

// ---------------------------------------------------------------------------
// Error reports. A report is a kind plus key/value fields; it is thrown as the
// c10 error type Python users expect (ValueError, TypeError, RuntimeError,
// OutOfMemoryError) with a one-line summary followed by a JSON payload line.
// cublas_guard_ext.errors parses the payload into a typed exception and is the
// one place where the full, user-facing message is written.
// ---------------------------------------------------------------------------
constexpr const char* kPayloadMarker = "[cublas_guard_ext payload] ";

class ErrorReport {
 public:
  explicit ErrorReport(std::string kind);

  ErrorReport& add(const char* key, int64_t value);
  ErrorReport& add(const char* key, int value) { return add(key, static_cast<int64_t>(value)); }
  ErrorReport& add(const char* key, double value);
  ErrorReport& add(const char* key, bool value);
  ErrorReport& add(const char* key, const std::string& value);
  ErrorReport& add(const char* key, const char* value) { return add(key, std::string(value)); }
  ErrorReport& add(const char* key, const std::vector<int64_t>& values);
#ifndef CUBLAS_GUARD_STABLE
  ErrorReport& add(const char* key, c10::IntArrayRef values) { return add(key, values.vec()); }
  // Sizes of a tensor being traced with symbolic shapes (torch.compile, torch.export)
  // are SymInts; a report states their concrete value (guarding on it: it raises anyway).
  ErrorReport& add(const char* key, const c10::SymInt& value);
  ErrorReport& add(const char* key, c10::SymIntArrayRef values);
#endif
  // A tensor handed to the Python error constructor with the payload, never
  // serialized into it (the failure capsule's GEMM buffers: report/call_scope.h).
  ErrorReport& attach(const char* name, const Tensor& tensor);
  const std::vector<std::pair<std::string, Tensor>>& attached() const { return attached_; }

  std::string json() const;
  std::string message(const std::string& summary) const;

  [[noreturn]] void raise_value_error(const std::string& summary) const;
  [[noreturn]] void raise_type_error(const std::string& summary) const;
  [[noreturn]] void raise_runtime_error(const std::string& summary) const;
  [[noreturn]] void raise_out_of_memory(const std::string& summary) const;

 private:
  std::string kind_;
  std::vector<std::pair<std::string, std::string>> fields_;  // value already JSON-encoded
  std::vector<std::pair<std::string, Tensor>> attached_;
};

// When Python is running: throws the typed Python exception for `message`
// (locked/report/python_errors.cpp), handing it the report's attached tensors and the
// operands of this thread's guarded call (report/call_scope.h); otherwise
// returns and the caller throws the c10 error.
void throw_python_error_if_possible(const std::string& message, const ErrorReport* report = nullptr);

// Device memory at some moment (-1 = unknown), and the fields it adds to a report.
struct MemoryFacts {
  int64_t free_bytes = -1, total_bytes = -1;
  int64_t torch_allocated = -1, torch_reserved = -1;  // torch's caching allocator
  int64_t workspace_bytes = -1;                       // cuBLAS workspace torch attaches
};
void add_memory_fields(ErrorReport& report, const MemoryFacts& memory);

// Fields every report about a tensor carries: its shape, strides, dtype, device.
void describe_tensor(ErrorReport& report, const char* prefix, const Tensor& t);

// ---------------------------------------------------------------------------
// Argument checks: the one place each rule lives. Python never re-checks.
// ---------------------------------------------------------------------------
// The floating dtypes nn.Linear takes, and so the guard: float32, bfloat16,
// float16, float64.
bool is_guarded_dtype(ScalarType dtype);

// The public scan's rule: a tensor of a guarded dtype (TypeError otherwise).
void check_scannable(const Tensor& t);

// TypeError report: `t` (playing `role`) is not of a guarded dtype.
[[noreturn]] void raise_dtype_error(const Tensor& t, const char* role, const std::string& layer);
// TypeError report: `t` (playing `role`) and `anchor` (playing `anchor_role`)
// are of different floating dtypes (nn.Linear refuses them too).
[[noreturn]] void raise_dtype_mismatch(const Tensor& t, const char* role, const Tensor& anchor,
                                       const char* anchor_role, const std::string& layer);

// ValueError report: `t` (playing `role`) has a shape other than `expected` (a
// parameter's or a gradient's, not the input's last dim: check_input).
[[noreturn]] void raise_shape(const Tensor& t, const char* role, const std::string& expected,
                              const std::string& layer);
// RuntimeError report: `t` (playing `role`) is not on the device of `anchor`
// (the layer's `anchor_name`).
[[noreturn]] void raise_device_mismatch(const Tensor& t, const char* role, const Tensor& anchor,
                                        const char* anchor_name, const std::string& layer);

// The input alone (what check_features needs): a guarded dtype, at least 1-D, last dim
// == in_features, sizes within the GEMM limits.
// Sizes are compared as SymInts, so a traced batch dim stays symbolic.
void check_input(const Tensor& x, const SymSize& in_features, const std::string& layer);
// The whole linear call: the input checks plus weight/bias dtype, shape and
// device agreement.
void check_linear_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                       const std::string& layer);
// Backward operands (grad_output against weight or input).
void check_grad_args(const Tensor& grad_output, const Tensor& other, const SymSize& expected_last,
                     const char* other_name, const std::string& layer);

// Raises NonFiniteInputError's report when `counts` (host int64[4]) is not clean.
void raise_if_non_finite(const Tensor& scanned, const int64_t* counts, const char* tensor_role,
                         const std::string& layer);

// What a CublasError report says about a GEMM beyond its GemmCall
// (linear/gemm_plan.h): the layer, the device and its state, the operands.
struct GemmContext {
  std::string layer;
  std::string math_mode;     // e.g. "CUBLAS_DEFAULT_MATH", "CUBLAS_TF32_TENSOR_OP_MATH"
  std::string device;        // e.g. "cuda:0 (NVIDIA H200, sm_90)"
  std::string status_name;   // from cublasGetStatusName when available
  const Tensor* operand_a = nullptr;  // the torch tensors behind A, B, C
  const Tensor* operand_b = nullptr;
  const Tensor* operand_c = nullptr;
  const char* roles[3] = {"", "", ""};    // what A, B, C are to the user ("weight^T", ...)
  MemoryFacts memory;  // at the time of a failure (CUDA)
  // Set by a backend whose failing call was not call.routine (a cuBLASLt step):
  // the call that failed, and the descriptors it was given.
  std::string api;
  std::string descriptors;
  std::string gemm_path;  // CUBLAS_GUARD_GEMM_PATH's choice, when the backend has one
};
// Raises the CublasError report for a failed status (report/gemm_report.cpp).
[[noreturn]] void raise_gemm_failure(int status, const GemmCall& call, const GemmContext& ctx);
// Raises the CublasError report of a GEMM refused before it was sent: the
// status cuBLAS would have returned, the rule it breaks, the call's arguments.
[[noreturn]] void raise_gemm_precheck(const GemmCall& call, const std::string& layer, int64_t status,
                                      const char* status_name, const std::string& rule,
                                      const std::string& message);

// ---------------------------------------------------------------------------
// Test-only hooks: fault injection and the lowered size limit. Both refuse to
// act unless CUBLAS_GUARD_EXT_TESTING=1 is set in the environment, so they
// cannot be switched on by accident in production.
// ---------------------------------------------------------------------------
enum class FaultSite : int { kGemmStatus = 0, kLaunch = 1, kHandle = 2, kCount = 3 };
// Raises unless CUBLAS_GUARD_EXT_TESTING=1: every test hook calls it first (`what` names the hook).
void require_testing_env(const char* what);
// Returns the injected code for `site` and consumes one use, or 0 (no fault).
int take_injected_fault(FaultSite site);
void set_fault_for_testing(const std::string& site, int64_t code, int64_t times);
int64_t set_size_limit_for_testing(int64_t limit, bool allow_64bit);

// ---------------------------------------------------------------------------
// The parts of the linear op that differ between devices. The orchestration
// (checks, scans, bias, GEMM, error reports) is shared in linear_common.cpp.
// ---------------------------------------------------------------------------
// kBiasByCopy: the output is prefilled with a broadcast copy, then beta = 1
// (torch's addmm fallback); kBiasInGemm: the GEMM adds GemmCall::bias (a
// cuBLASLt epilogue); kBiasByBackend: the backend's prefill kernel, fused into
// the input's scan when there is one, then beta = 1.
enum class BiasHandling : int { kBiasByCopy = 0, kBiasInGemm = 1, kBiasByBackend = 2 };

struct LinearBackend {
  // Enqueue a scan of `t` writing kScanFields int64 into out_slot (on t's
  // device; may be undefined when only the record matters). With a target, a
  // scan that finds non-finite values also fills the async record. Never
  // synchronizes.
  void (*scan_into)(const Tensor& t, Tensor out_slot, const AsyncTarget* target, const std::string& layer);
  // Copy scan results to the host (a stream synchronization on CUDA); an error
  // surfacing here comes from an earlier kernel and is reported as such.
  Tensor (*fetch)(const Tensor& device_results, const std::string& layer);
  // Run one GEMM; returns the cublasStatus_t as int (0 = success). Fills ctx
  // (math mode, device) first, then consults the kGemmStatus fault hook.
  int (*gemm)(const GemmCall& call, GemmContext& ctx);
  // Sync mode, before any launch: report an error an earlier kernel left behind.
  void (*check_pending_error)(const std::string& layer);
  // The async record and claim word for `device` (allocated once, then reused).
  void (*async_slot)(Device device, AsyncRecord** record, int** claim);
  // Adds free/total device memory and torch's allocated/reserved bytes to a report.
  void (*memory_info)(ErrorReport& report, Device device);
  // Whether gemm() can take calls beyond the 32-bit limit (use_64bit).
  bool has_64bit_api;
  // What gemm() runs for a dtype (names for reports; never nullptr).
  GemmNames (*gemm_names)(ScalarType dtype);
  // Async mode: whether the current stream of `device` is being captured into a
  // CUDA graph; if so, *counter is a fresh device counter for this call's
  // replays (nullptr when none is left). Null on devices without graphs.
  bool (*capture_replay_counter)(Device device, int64_t** counter) = nullptr;
  // How the forward's bias reaches the output for `dtype` (nullptr: kBiasByCopy).
  BiasHandling (*bias_handling)(ScalarType dtype) = nullptr;
  // kBiasByBackend: write `bias` into every row of `out` (one launch of ours),
  // or, with a scan to run, in the same launch as the scan of `t`.
  void (*prefill_bias)(Tensor& out, const Tensor& bias, const std::string& layer) = nullptr;
  void (*scan_into_prefilling)(const Tensor& t, Tensor out_slot, const AsyncTarget* target,
                               const std::string& layer, Tensor& out, const Tensor& bias) = nullptr;
};

// Build facts of this library, as JSON (the doctor's source). The CUDA
// translation unit adds its part through set_cuda_build_info.
std::string build_info_json();
void set_cuda_build_info(std::string (*provider)());

Tensor linear_forward(const LinearBackend& backend, const Tensor& x, const Tensor& weight,
                      const std::optional<Tensor>& bias, const std::string& layer, int64_t mode);
// The value scan of any tensor of a guarded dtype under a mode (sync raises now, async
// records, off does nothing); `role` is a TensorRole for the report.
void guard_tensor(const LinearBackend& backend, const Tensor& t, const std::string& layer, int64_t role,
                  int64_t mode);
Tensor linear_grad_input(const LinearBackend& backend, const Tensor& grad_output, const Tensor& weight,
                         const std::string& layer);
Tensor linear_grad_weight(const LinearBackend& backend, const Tensor& grad_output, const Tensor& x,
                          const std::string& layer);
void check_features(const LinearBackend& backend, const Tensor& x, int64_t in_features,
                    const std::string& layer);
Tensor scan(const LinearBackend& backend, const Tensor& x);

// The CPU backend (linear/linear_cpu.cpp): torch's CPU BLAS behind the same plan.
const LinearBackend& cpu_backend();

// The CPU scan (also the reference the CUDA scan is tested against).
void scan_cpu_into(const Tensor& t, Tensor out_slot, const AsyncTarget* target, const std::string& layer);

// Strided iteration support shared by the CPU and CUDA scans: dims merged where
// their strides allow, so that most views become one or two dims.
constexpr int kMaxScanDims = 16;
struct ScanGeometry {
  int ndim = 0;
  int64_t sizes[kMaxScanDims];    // innermost last
  int64_t strides[kMaxScanDims];  // in elements
  bool contiguous = true;          // one dim of stride 1 (or empty/scalar)
};
// Returns false when the tensor needs more than kMaxScanDims dims even after merging.
bool scan_geometry(const Tensor& t, ScanGeometry& geometry);

}  // namespace cublas_guard
