// Autocast for the guarded linear. Without a kernel here, autocast's fallback
// passes the op through uncast (autocast_mode.cpp registers a fallthrough for
// every op it has no rule for), so a SafeLinear inside torch.autocast would
// see fp32 weights beside the lower-precision activations of the ops around it.
//
// linear is on autocast's lower-precision list for CPU and CUDA; this kernel
// does what torch's own lower_precision_fp wrapper (autocast_mode.h) does for
// it: exclude the autocast key, cast every eligible floating tensor argument
// to the autocast dtype *in effect at run time* (get_autocast_dtype, so
// torch.autocast("cpu", dtype=torch.float16) casts to float16, not to a dtype
// fixed at registration as torch.library.register_autocast would), through
// autocast's weight cache, and redispatch. float64 tensors are not eligible
// and stay float64, as for nn.Linear.
#include "linear/linear_op.h"
#include "locked/op_handles.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace cublas_guard {
namespace {

template <c10::DeviceType device_type>
at::Tensor linear_autocast(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias, c10::string_view layer, int64_t mode,
                           bool scan_grad) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return linear_handle().call(at::autocast::cached_cast(dtype, x, device_type),
                              at::autocast::cached_cast(dtype, weight, device_type),
                              at::autocast::cached_cast(dtype, bias, device_type), layer, mode, scan_grad);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, AutocastCPU, m) {
  m.impl("linear", &cublas_guard::linear_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(cublas_guard, AutocastCUDA, m) {
  m.impl("linear", &cublas_guard::linear_autocast<c10::DeviceType::CUDA>);
}
