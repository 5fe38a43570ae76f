// The linear op's argument rules (checks.cpp), each written once: the real
// kernels, the locked library's Meta kernels (locked/ops_meta.cpp) and the
// core's fake kernels (through ops.cpp's argument_rules) run these, so every
// path refuses the same inputs with the same errors.
#pragma once

#include "core/tensor_api.h"
#include "scan/scan_layout.h"

#include <cstdint>
#include <optional>
#include <string>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Argument checks: the one place each rule lives. Python never re-checks.
// ---------------------------------------------------------------------------

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

}  // namespace cublas_guard
