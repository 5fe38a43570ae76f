// Autograd for the three GEMM ops, in C++. A Python-registered autograd
// formula (torch.library.register_autograd) costs a Python autograd.Function
// round trip on every forward, tens of microseconds, which a drop-in
// nn.Linear cannot afford; this costs what torch's own C++ autograd nodes cost.
//
// The ops are closed under differentiation, so double backward works:
//   y  = x W^T + b     dy -> dx = dy W            (linear_grad_input)
//                            dW = dy^T x          (linear_grad_weight)
//                            db = sum(dy)
//   gi = g W           dgi -> dg = dgi W^T = linear(dgi, W^T) via grad_weight's dual
//   gw = g^T x         dgw -> dg = x dgw^T,  dx = g dgw
#include "linear/linear_op.h"
#include "locked/linear/autograd_common.h"
#include "locked/op_handles.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace cublas_guard {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       c10::string_view layer, int64_t mode, bool scan_grad) {
  return linear_handle().call(x, weight, bias, layer, mode, scan_grad);
}

void call_guard_values(const at::Tensor& t, c10::string_view layer, int64_t role, int64_t mode) {
  guard_values_handle().call(t, layer, role, mode);
}

at::Tensor call_grad_input(const at::Tensor& grad_output, const at::Tensor& weight, c10::string_view layer) {
  return grad_input_handle().call(grad_output, weight, layer);
}

at::Tensor call_grad_weight(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view layer) {
  return grad_weight_handle().call(grad_output, x, layer);
}

// Whether some dim of more than one element repeats its elements (stride 0).
bool broadcast_in_memory(const at::Tensor& t) {
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) == 0 && t.size(d) > 1) return true;
  }
  return false;
}

// grad_output summed over every dim but the last: the bias gradient.
at::Tensor bias_grad(const at::Tensor& grad_output) {
  std::vector<int64_t> batch_dims(grad_output.dim() - 1);
  for (int64_t d = 0; d + 1 < grad_output.dim(); ++d) batch_dims[d] = d;
  return batch_dims.empty() ? grad_output.clone() : grad_output.sum(batch_dims);
}

class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const c10::optional<at::Tensor>& bias, const std::string& layer, int64_t mode,
                            bool scan_grad) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // Like nn.Linear, only what the needed gradients read: dW = g^T x needs x,
    // dx = g W needs W. A frozen layer then keeps no activation alive, an
    // in-place edit of its input is allowed, and inference-mode weights can be
    // used with an input that needs no gradient.
    ctx->save_for_backward({saved_if(weight.requires_grad(), x), saved_if(x.requires_grad(), weight)});
    ctx->saved_data["layer"] = layer;
    // needs_input_grad counts tensor arguments only: an absent bias has no index.
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["grad_mode"] = scan_grad ? mode : static_cast<int64_t>(GuardMode::kOff);
    return call_linear(x, weight, bias, layer, mode, scan_grad);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    // A gradient broadcast from a reduction (loss = out.sum() or .mean()) arrives
    // expanded, with zero strides: each GEMM would copy it into a layout cuBLAS
    // takes (as_column_major); copy it once for both.
    const at::Tensor grad =
        broadcast_in_memory(grads[0]) && ctx->needs_input_grad(0) && ctx->needs_input_grad(1)
            ? grads[0].contiguous()
            : grads[0];
    // The gradient arriving at this layer, scanned under the layer's mode when asked.
    const int64_t grad_mode = ctx->saved_data["grad_mode"].toInt();
    if (grad_mode != static_cast<int64_t>(GuardMode::kOff)) {
      call_guard_values(grad, layer, kRoleGradOutput, grad_mode);
    }
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(0)) grad_x = call_grad_input(grad, weight, layer);
    if (ctx->needs_input_grad(1)) grad_w = call_grad_weight(grad, x, layer);
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) grad_b = bias_grad(grad);
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

class GradInputFunction : public torch::autograd::Function<GradInputFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_output, const at::Tensor& weight,
                            const std::string& layer) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // dg needs W, dW needs g (see backward).
    ctx->save_for_backward(
        {saved_if(weight.requires_grad(), grad_output), saved_if(grad_output.requires_grad(), weight)});
    ctx->saved_data["layer"] = layer;
    return call_grad_input(grad_output, weight, layer);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // gi = g W:  d g = dgi W^T = linear(dgi, W) ;  d W = g^T dgi = grad_weight(g, dgi)
    const auto saved = ctx->get_saved_variables();
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    const at::Tensor& dgi = grads[0];
    at::Tensor grad_g, grad_w;
    if (ctx->needs_input_grad(0)) {
      grad_g = call_linear(dgi, saved[1], c10::nullopt, layer, static_cast<int64_t>(GuardMode::kOff), false);
    }
    if (ctx->needs_input_grad(1)) grad_w = call_grad_weight(saved[0], dgi, layer);
    return {grad_g, grad_w, at::Tensor()};
  }
};

class GradWeightFunction : public torch::autograd::Function<GradWeightFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad_output, const at::Tensor& x,
                            const std::string& layer) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // dg needs x, dx needs g (see backward).
    ctx->save_for_backward(
        {saved_if(x.requires_grad(), grad_output), saved_if(grad_output.requires_grad(), x)});
    ctx->saved_data["layer"] = layer;
    return call_grad_weight(grad_output, x, layer);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // gw = g^T x:  d g = x dgw^T = linear(x, dgw) ;  d x = g dgw = grad_input(g, dgw)
    const auto saved = ctx->get_saved_variables();
    const std::string layer = ctx->saved_data["layer"].toStringRef();
    const at::Tensor& dgw = grads[0];
    at::Tensor grad_g, grad_x;
    if (ctx->needs_input_grad(0)) {
      grad_g = call_linear(saved[1], dgw, c10::nullopt, layer, static_cast<int64_t>(GuardMode::kOff), false);
    }
    if (ctx->needs_input_grad(1)) grad_x = call_grad_input(saved[0], dgw, layer);
    return {grad_g, grad_x, at::Tensor()};
  }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const c10::optional<at::Tensor>& bias, c10::string_view layer, int64_t mode,
                           bool scan_grad) {
  if (!needs_node({&x, &weight, bias.has_value() ? &*bias : nullptr})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_linear(x, weight, bias, layer, mode, scan_grad);
  }
  // nn.Linear reads the weight through `weight.t()`: outside inference mode, a
  // view of an inference tensor is not tracked, so an inference-mode weight gets
  // no gradient there (its bias does). The same here: such a weight counts as
  // one that needs no gradient (and, as in nn.Linear, cannot be saved for an
  // input that needs one).
  if (C10_UNLIKELY(weight.is_inference() && weight.requires_grad() && !c10::InferenceMode::is_enabled())) {
    return LinearFunction::apply(x, weight.detach(), bias, std::string(layer), mode, scan_grad);
  }
  return LinearFunction::apply(x, weight, bias, std::string(layer), mode, scan_grad);
}

at::Tensor grad_input_autograd(const at::Tensor& grad_output, const at::Tensor& weight,
                               c10::string_view layer) {
  if (!needs_node({&grad_output, &weight})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grad_input(grad_output, weight, layer);
  }
  return GradInputFunction::apply(grad_output, weight, std::string(layer));
}

at::Tensor grad_weight_autograd(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view layer) {
  if (!needs_node({&grad_output, &x})) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return call_grad_weight(grad_output, x, layer);
  }
  return GradWeightFunction::apply(grad_output, x, std::string(layer));
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_IMPL(cublas_guard, Autograd, m) {
  using namespace cublas_guard;
  m.impl("linear", &linear_autograd);
  m.impl("linear_grad_input", &grad_input_autograd);
  m.impl("linear_grad_weight", &grad_weight_autograd);
}
