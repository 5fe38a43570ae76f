// The clean-parameter cache: which weights and biases need no scan in this
// call (param_cache.cpp says when a parameter counts as unchanged).
#pragma once

#include "core/tensor_api.h"

namespace cublas_guard {

// The same tensor, unchanged since it was last scanned clean.
bool parameter_known_clean(const Tensor& t);
// Scanned clean now (or enqueued for an async scan that reports a finding).
void mark_parameter_clean(const Tensor& t);
// Forget everything (after an async report: the reported tensor must be scanned again).
void forget_clean_parameters();

}  // namespace cublas_guard
