// The linear op's backend interface and entry points: what its CPU (.cpp) and
// CUDA (.cu) implementations and the ops that call them share. The rest of
// what they need has a header of its own, each included here: the scan layout
// (scan/scan_layout.h), the error report (report/error_report.h), the argument
// rules (linear/checks.h), the GEMM plan and its report's context
// (linear/gemm_plan.h, linear/gemm_context.h), the test hooks
// (linear/test_hooks.h), the guard modes (linear/guard_mode.h) and the async
// records' registry (report/async_registry.h). A lower layer includes the one
// it needs, never this header (tests/building/test_source_layout.py).
//
// Only ATen's Tensor class is included: not <ATen/ATen.h> (all of
// ATen/Functions.h, the biggest part of a compile) and never
// <torch/extension.h>: every translation unit and nvcc compile it. A file that
// calls an at:: function includes its per-op header (<ATen/ops/empty.h>).
#pragma once

#include "core/tensor_api.h"

#include "linear/checks.h"
#include "linear/gemm_context.h"
#include "linear/gemm_plan.h"
#include "linear/guard_mode.h"
#include "linear/test_hooks.h"
#include "report/async_record.h"
#include "report/async_registry.h"
#include "report/error_report.h"
#include "scan/scan_layout.h"

#include <cstdint>
#include <optional>
#include <string>

namespace cublas_guard {

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

// The linear ops' kernels as registered for one device key: what the stable core's C entry
// (python_entry_stable.cpp) calls when it may skip the dispatcher. The CPU's are
// linear/linear_cpu.cpp's; the CUDA's, cuda/linear.cu's, exist in CUDA builds only.
struct LinearKernels {
  Tensor (*linear)(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias, StringArg layer,
                   int64_t mode, bool scan_grad);
  Tensor (*grad_input)(const Tensor& grad_output, const Tensor& weight, StringArg layer);
  Tensor (*grad_weight)(const Tensor& grad_output, const Tensor& x, StringArg layer);
  void (*guard_values)(const Tensor& t, StringArg layer, int64_t role, int64_t mode);
};
const LinearKernels& cpu_linear_kernels();
const LinearKernels& cuda_linear_kernels();

}  // namespace cublas_guard
