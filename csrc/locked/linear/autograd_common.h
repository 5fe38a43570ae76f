// What the C++ autograd Functions of the linear op (locked/linear/autograd.cpp) and the grouped
// op (locked/moe/grouped_autograd.cpp) share: one rule for when a node is recorded, one for what
// is saved. Version-locked library only (torch/csrc/autograd).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

#include <initializer_list>

namespace cublas_guard {

// `t` when a gradient will read it, else an undefined tensor (nothing saved).
inline at::Tensor saved_if(bool needed, const at::Tensor& t) { return needed ? t : at::Tensor(); }

// Whether an autograd node is needed: a gradient will be recorded (grad mode on
// and an input requires one) or an input carries a forward-mode tangent (the
// C++ Function then refuses it). Otherwise the call goes
// straight below autograd: no node, no saved state, no string copy: the
// per-call host cost of an inference call stays that of the op.
inline bool needs_node(std::initializer_list<const at::Tensor*> inputs) {
  const bool grad_mode = at::GradMode::is_enabled();
  for (const at::Tensor* t : inputs) {
    if (t == nullptr || !t->defined()) continue;
    if (grad_mode && t->requires_grad()) return true;
    if (t->_fw_grad(/*level=*/0).defined()) return true;
  }
  return false;
}

}  // namespace cublas_guard
