// Op registration in both builds of the core (core/tensor_api.h says why there
// are two): TORCH_LIBRARY and unboxed kernels in the locked library,
// STABLE_TORCH_LIBRARY and boxed ones (TORCH_BOX) in the stable core.
// A kernel is a plain function whose argument types are tensor_api.h's names.
#pragma once

#include "core/tensor_api.h"

#ifdef CUBLAS_GUARD_STABLE
#include <torch/csrc/stable/library.h>
#define CG_LIBRARY(ns, m) STABLE_TORCH_LIBRARY(ns, m)
#define CG_LIBRARY_FRAGMENT(ns, m) STABLE_TORCH_LIBRARY_FRAGMENT(ns, m)
#define CG_LIBRARY_IMPL(ns, key, m) STABLE_TORCH_LIBRARY_IMPL(ns, key, m)
#define CG_IMPL(m, name, fn) m.impl(name, TORCH_BOX(fn))
#else
#include <torch/library.h>
#define CG_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define CG_LIBRARY_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define CG_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define CG_IMPL(m, name, fn) m.impl(name, fn)
#endif
