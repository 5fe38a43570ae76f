// Autograd and autocast for the grouped linear, in C++ like the linear op's
// (locked/linear/autograd.cpp says why: a Python autograd.Function per call costs
// tens of microseconds). Per expert e, with rows r of e and W_e its weight as
// [out, in] (whatever the stored layout):
//   y_r  = x_r W_e^T + b_e   dy -> dx_r = dy_r W_e          (grouped_linear_grad_input)
//                                 dW_e = dy_e^T x_e         (grouped_linear_grad_weight, per expert,
//                                                            in the stored layout)
//                                 db_e = sum of dy over e's rows (zero for an empty expert)
// The three ops are closed under differentiation as the linear ones are, so
// double backward works:
//   gi = g W    dgi -> dg = grouped_linear(dgi, W),  dW = grouped_grad_weight(g, dgi)
//   gw = g^T x  dgw -> dg = grouped_linear(x, dgw),  dx = grouped_grad_input(g, dgw)
// Rows past the last group end get no gradient (zero), as they got no output.
//
// Autocast: like the linear op's kernel (locked/linear/autocast.cpp), the floating
// operands are cast to the autocast dtype in effect, through autocast's weight
// cache. torch's grouped_mm is not autocast-aware (transformers casts the
// input to the weight's dtype by hand); this op is, as nn.Linear is.
#include "locked/linear/autograd_common.h"
#include "locked/op_handles.h"
#include "moe/grouped_op.h"

#include <ATen/autocast_mode.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace cublas_guard {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr auto kModeOff = static_cast<int64_t>(GuardMode::kOff);

at::Tensor call_grouped(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                        int64_t mode, bool transposed) {
  return grouped_linear_handle().call(x, weight, bias, offs, layer, parameter, mode, transposed);
}

at::Tensor call_grad_input(const at::Tensor& grad_output, const at::Tensor& weight, const at::Tensor& offs,
                           c10::string_view layer, c10::string_view parameter, bool transposed) {
  return grouped_grad_input_handle().call(grad_output, weight, offs, layer, parameter, transposed);
}

at::Tensor call_grad_weight(const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& offs,
                            c10::string_view layer, c10::string_view parameter, bool transposed) {
  return grouped_grad_weight_handle().call(grad_output, x, offs, layer, parameter, transposed);
}

// Per expert, the sum of grad_output's rows of that expert: rows are matched to
// experts on the device (searchsorted on the ends; rows past the last end go
// to a dropped extra row), so no host synchronization. Half-precision sums
// accumulate in float32.
at::Tensor grouped_bias_grad(const at::Tensor& grad, const at::Tensor& offs) {
  const at::ScalarType dtype = grad.scalar_type();
  const at::ScalarType acc = (dtype == at::kHalf || dtype == at::kBFloat16) ? at::kFloat : dtype;
  const at::Tensor rows = at::arange(grad.sym_size(0), offs.options());
  const at::Tensor expert = at::searchsorted(offs, rows, /*out_int32=*/false, /*right=*/true);
  at::Tensor sums = at::zeros_symint({offs.sym_size(0) + 1, grad.sym_size(1)}, grad.options().dtype(acc));
  sums.index_put_({expert}, grad.to(acc), /*accumulate=*/true);
  return sums.narrow_symint(0, 0, offs.sym_size(0)).to(dtype);
}

void save_names(AutogradContext* ctx, c10::string_view layer, c10::string_view parameter, bool transposed) {
  ctx->saved_data["layer"] = std::string(layer);
  ctx->saved_data["parameter"] = std::string(parameter);
  ctx->saved_data["transposed"] = transposed;
}

class GroupedLinearFunction : public torch::autograd::Function<GroupedLinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                            c10::string_view layer, c10::string_view parameter, int64_t mode,
                            bool transposed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Only what the needed gradients read (as nn.Linear): dW needs x, dx needs W.
    ctx->save_for_backward({saved_if(weight.requires_grad(), x), saved_if(x.requires_grad(), weight), offs});
    save_names(ctx, layer, parameter, transposed);
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return call_grouped(x, weight, bias, offs, layer, parameter, mode, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    const std::string parameter = ctx->saved_data["parameter"].toStringRef();
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // A gradient broadcast from a reduction arrives with zero strides: one copy for every GEMM.
    const at::Tensor grad = grads[0].is_contiguous() ? grads[0] : grads[0].contiguous();
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0))
      grad_x = call_grad_input(grad, saved[1], saved[2], layer, parameter, transposed);
    if (ctx->needs_input_grad(1))
      grad_w = call_grad_weight(grad, saved[0], saved[2], layer, parameter, transposed);
    // needs_input_grad counts tensor arguments only: the bias is index 2 when present.
    if (has_bias && ctx->needs_input_grad(2)) grad_b = grouped_bias_grad(grad, saved[2]);
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class GroupedGradInputFunction : public torch::autograd::Function<GroupedGradInputFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_output, const at::Tensor& weight,
                            const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                            bool transposed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward(
        {saved_if(weight.requires_grad(), grad_output), saved_if(grad_output.requires_grad(), weight), offs});
    save_names(ctx, layer, parameter, transposed);
    return call_grad_input(grad_output, weight, offs, layer, parameter, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    const std::string parameter = ctx->saved_data["parameter"].toStringRef();
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const at::Tensor dgi = grads[0].contiguous();
    at::Tensor grad_g, grad_w;
    if (ctx->needs_input_grad(0)) {
      grad_g = call_grouped(dgi, saved[1], c10::nullopt, saved[2], layer, parameter, kModeOff, transposed);
    }
    if (ctx->needs_input_grad(1))
      grad_w = call_grad_weight(saved[0], dgi, saved[2], layer, parameter, transposed);
    return {grad_g, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class GroupedGradWeightFunction : public torch::autograd::Function<GroupedGradWeightFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_output, const at::Tensor& x,
                            const at::Tensor& offs, c10::string_view layer, c10::string_view parameter,
                            bool transposed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward(
        {saved_if(x.requires_grad(), grad_output), saved_if(grad_output.requires_grad(), x), offs});
    save_names(ctx, layer, parameter, transposed);
    return call_grad_weight(grad_output, x, offs, layer, parameter, transposed);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    const std::string parameter = ctx->saved_data["parameter"].toStringRef();
    const bool transposed = ctx->saved_data["transposed"].toBool();
    const at::Tensor dgw = grads[0].contiguous();
    at::Tensor grad_g, grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_g = call_grouped(saved[1], dgw, c10::nullopt, saved[2], layer, parameter, kModeOff, transposed);
    }
    if (ctx->needs_input_grad(1))
      grad_x = call_grad_input(saved[0], dgw, saved[2], layer, parameter, transposed);
    return {grad_g, grad_x, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor grouped_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                   const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                                   c10::string_view layer, c10::string_view parameter, int64_t mode,
                                   bool transposed) {
  if (!needs_node({&x, &weight, bias.has_value() ? &*bias : nullptr})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grouped(x, weight, bias, offs, layer, parameter, mode, transposed);
  }
  return GroupedLinearFunction::apply(x, weight, bias, offs, layer, parameter, mode, transposed);
}

at::Tensor grouped_grad_input_autograd(const at::Tensor& grad_output, const at::Tensor& weight,
                                       const at::Tensor& offs, c10::string_view layer,
                                       c10::string_view parameter, bool transposed) {
  if (!needs_node({&grad_output, &weight})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grad_input(grad_output, weight, offs, layer, parameter, transposed);
  }
  return GroupedGradInputFunction::apply(grad_output, weight, offs, layer, parameter, transposed);
}

at::Tensor grouped_grad_weight_autograd(const at::Tensor& grad_output, const at::Tensor& x,
                                        const at::Tensor& offs, c10::string_view layer,
                                        c10::string_view parameter, bool transposed) {
  if (!needs_node({&grad_output, &x})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grad_weight(grad_output, x, offs, layer, parameter, transposed);
  }
  return GroupedGradWeightFunction::apply(grad_output, x, offs, layer, parameter, transposed);
}

template <c10::DeviceType device_type>
at::Tensor grouped_linear_autocast(const at::Tensor& x, const at::Tensor& weight,
                                   const c10::optional<at::Tensor>& bias, const at::Tensor& offs,
                                   c10::string_view layer, c10::string_view parameter, int64_t mode,
                                   bool transposed) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device_type));
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device_type);
  return call_grouped(
      at::autocast::cached_cast(dtype, x, device_type), at::autocast::cached_cast(dtype, weight, device_type),
      at::autocast::cached_cast(dtype, bias, device_type), offs, layer, parameter, mode, transposed);
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, Autograd, m) {
  using namespace cublas_guard;
  m.impl("grouped_linear", &grouped_linear_autograd);
  m.impl("grouped_linear_grad_input", &grouped_grad_input_autograd);
  m.impl("grouped_linear_grad_weight", &grouped_grad_weight_autograd);
}

TORCH_LIBRARY_IMPL(cublas_guard, AutocastCPU, m) {
  m.impl("grouped_linear", &cublas_guard::grouped_linear_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(cublas_guard, AutocastCUDA, m) {
  m.impl("grouped_linear", &cublas_guard::grouped_linear_autocast<c10::DeviceType::CUDA>);
}
