// The grouped linear's CUDA kernels: the device-independent body
// (grouped_common.cpp) on the linear op's CUDA backend (cuda/linear.cu): each
// non-empty expert one checked cuBLAS GEMM on torch's handle and current
// stream, the CUDA scans, the async record, earlier kernels' errors
// attributed. The group ends are copied to the host once per call (one
// stream synchronization): grouped_common.cpp says why.
//
// Compile-checked (.ci/nvcc_check.sh) but never run on a GPU yet.
#include "cuda/cuda_backend.h"
#include "moe/grouped_op.h"

#include "core/registration.h"

#include <string>

namespace cublas_guard {
namespace {

GroupedNames names_of(StringArg layer, StringArg parameter) {
  return {std::string(layer), std::string(parameter)};
}

// The weight's device when it is a CUDA device; else the other operand's (the checks then
// report the mismatch).
int grouped_guard_device(const Tensor& preferred, const Tensor& other) {
  return device_index(preferred.is_cuda() ? preferred : other);
}

template <typename Fn>
Tensor attributing(const std::string& layer, Fn&& fn) {
  try {
    return fn();
  } catch (const TorchError& e) {
    raise_if_earlier_cuda_error(e, layer);
    throw;
  }
}

Tensor grouped_linear_op(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                         const Tensor& offs, StringArg layer, StringArg parameter, int64_t mode,
                         bool transposed) {
  const CudaDeviceGuard guard(grouped_guard_device(weight, x));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_forward(cuda_backend(), x, weight, bias, offs, names, mode, transposed);
  });
}

Tensor grouped_grad_input_op(const Tensor& grad_output, const Tensor& weight, const Tensor& offs,
                             StringArg layer, StringArg parameter, bool transposed) {
  const CudaDeviceGuard guard(grouped_guard_device(weight, grad_output));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_grad_input(cuda_backend(), grad_output, weight, offs, names, transposed);
  });
}

Tensor grouped_grad_weight_op(const Tensor& grad_output, const Tensor& x, const Tensor& offs, StringArg layer,
                              StringArg parameter, bool transposed) {
  const CudaDeviceGuard guard(grouped_guard_device(x, grad_output));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_grad_weight(cuda_backend(), grad_output, x, offs, names, transposed);
  });
}

}  // namespace
}  // namespace cublas_guard

CG_LIBRARY_IMPL(cublas_guard, CUDA, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "grouped_linear", &grouped_linear_op);
  CG_IMPL(m, "grouped_linear_grad_input", &grouped_grad_input_op);
  CG_IMPL(m, "grouped_linear_grad_weight", &grouped_grad_weight_op);
}
