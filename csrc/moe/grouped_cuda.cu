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

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <string>

namespace cublas_guard {
namespace {

GroupedNames names_of(c10::string_view layer, c10::string_view parameter) {
  return {std::string(layer), std::string(parameter)};
}

// The weight's device when it is a CUDA device; else the other operand's (the checks then
// report the mismatch).
c10::Device guard_device(const at::Tensor& preferred, const at::Tensor& other) {
  return preferred.is_cuda() ? preferred.device() : other.device();
}

template <typename Fn>
at::Tensor attributing(const std::string& layer, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    raise_if_earlier_cuda_error(e, layer);
    throw;
  }
}

at::Tensor grouped_linear_op(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                             c10::string_view layer, c10::string_view parameter, int64_t mode,
                             bool transposed) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, x));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_forward(cuda_backend(), x, weight, bias, offs, names, mode, transposed);
  });
}

at::Tensor grouped_grad_input_op(const at::Tensor& grad_output, const at::Tensor& weight,
                                 const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                                 bool transposed) {
  const c10::cuda::CUDAGuard guard(guard_device(weight, grad_output));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_grad_input(cuda_backend(), grad_output, weight, offs, names, transposed);
  });
}

at::Tensor grouped_grad_weight_op(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& offs,
                                  c10::string_view layer, c10::string_view parameter, bool transposed) {
  const c10::cuda::CUDAGuard guard(guard_device(x, grad_output));
  const GroupedNames names = names_of(layer, parameter);
  return attributing(names.label(), [&] {
    return grouped_linear_grad_weight(cuda_backend(), grad_output, x, offs, names, transposed);
  });
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, CUDA, m) {
  using namespace cublas_guard;
  m.impl("grouped_linear", &grouped_linear_op);
  m.impl("grouped_linear_grad_input", &grouped_grad_input_op);
  m.impl("grouped_linear_grad_weight", &grouped_grad_weight_op);
}
