// The guarded grouped linear: a mixture of experts' expert GEMMs, what its CPU
// (.cpp) and CUDA (.cu) kernels, the Meta kernels and autograd share.
//
// One call multiplies the rows of x, sorted by expert, with their expert's
// weight: rows [ends[e-1], ends[e]) of x with weight[e] (ends = offs, the
// cumulative group ends torch's grouped_mm takes). It is written against the
// same internal interfaces as the linear op (a LinearBackend, the value scans,
// the clean-parameter cache, matmul_into with its split, checks and CublasError
// report), so it runs on every backend the linear op has and ports with it;
// each non-empty expert is one checked GEMM (grouped_common.cpp says why).
//
// The weight is the experts module's 3-D Parameter as it is stored, so the
// clean-parameter cache knows it (a transposed view would be a new tensor at
// every call): [experts, out_features, in_features], or with `transposed`
// [experts, in_features, out_features] (gpt-oss's layout). Rows of the output
// and of the input gradient past the last group end are zero, never
// uninitialized memory; so are the weight gradients of experts no row went to.
#pragma once

#include "linear/linear_op.h"

#include <cstdint>
#include <string>
#include <vector>

namespace cublas_guard {

// What a grouped call's reports name: the experts module's qualified name
// ("model.layers.0.mlp.experts") and the weight's name in it ("gate_up_proj").
struct GroupedNames {
  std::string module;
  std::string parameter;
  // "model.layers.0.mlp.experts.gate_up_proj": the whole parameter.
  std::string label() const;
  // "model.layers.0.mlp.experts.gate_up_proj[3]": expert 3's slice of it.
  std::string expert_label(int64_t expert) const;
};

// ---------------------------------------------------------------------------
// Argument rules (grouped_checks.cpp), shared by the real and Meta kernels.
// ---------------------------------------------------------------------------
// x [tokens, in], weight 3-D (see above), bias [experts, out], offs 1-D int32/int64
// with one end per expert, all of one device, x/weight/bias of one guarded dtype.
void check_grouped_args(const Tensor& x, const Tensor& weight, const std::optional<Tensor>& bias,
                        const Tensor& offs, bool transposed, const GroupedNames& names);
// Backward: grad_output [tokens, width] against `other` (the weight, or the input
// [tokens, in]) and offs.
void check_grouped_grad_args(const Tensor& grad_output, const Tensor& other, const char* other_name,
                             const SymSize& expected_width, const Tensor& offs, const GroupedNames& names);
// The group ends on the host (a copy, so a synchronization, when offs is on a
// device), after the value rules: non-decreasing, >= 0, the last <= rows.
std::vector<int64_t> group_ends(const Tensor& offs, int64_t rows, const GroupedNames& names);

// The number of experts and the weight's [out_features, in_features] whatever its layout.
struct ExpertShape {
  int64_t experts, out_features, in_features;
};
ExpertShape expert_shape(const Tensor& weight, bool transposed);
// Expert e's weight as [out_features, in_features] (a view).
Tensor expert_weight(const Tensor& weight, int64_t expert, bool transposed);

// ---------------------------------------------------------------------------
// The entry points (grouped_common.cpp), device-independent.
// ---------------------------------------------------------------------------
Tensor grouped_linear_forward(const LinearBackend& backend, const Tensor& x, const Tensor& weight,
                              const std::optional<Tensor>& bias, const Tensor& offs,
                              const GroupedNames& names, int64_t mode, bool transposed);
// grad_x rows of expert e = grad_output rows of e times weight[e] ([out, in]).
Tensor grouped_linear_grad_input(const LinearBackend& backend, const Tensor& grad_output,
                                 const Tensor& weight, const Tensor& offs, const GroupedNames& names,
                                 bool transposed);
// grad_weight[e] = grad_output rows of e ^T times x rows of e, in the weight's layout.
Tensor grouped_linear_grad_weight(const LinearBackend& backend, const Tensor& grad_output, const Tensor& x,
                                  const Tensor& offs, const GroupedNames& names, bool transposed);

}  // namespace cublas_guard
