// The clean-parameter cache in the stable core: there is none. Telling an
// unchanged parameter from a changed one needs its version counter and its
// TensorImpl (linear/param_cache.cpp), which the stable ABI does not expose;
// so the stable core scans a layer's weight and bias on every guarded call
// (correct, and the cost docs/building.md states), and the same ops exist so
// the package calls them alike.
#ifdef CUBLAS_GUARD_STABLE
#include "core/registration.h"
#include "linear/param_cache.h"

namespace cublas_guard {

bool parameter_known_clean(const Tensor& /*t*/) { return false; }
void mark_parameter_clean(const Tensor& /*t*/) {}
void forget_clean_parameters() {}

namespace {
void parameters_changed_op() {}
// [entries, entries whose tensor is alive, generation]: always empty here.
std::vector<int64_t> clean_cache_stats_op() { return {0, 0, 0}; }
}  // namespace

}  // namespace cublas_guard

CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) { m.def("parameters_changed() -> ()"); }
CG_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "parameters_changed", &cublas_guard::parameters_changed_op);
}
CG_LIBRARY_FRAGMENT(cublas_guard_testing, m) { m.def("clean_cache_stats() -> int[]"); }
CG_LIBRARY_IMPL(cublas_guard_testing, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "clean_cache_stats", &cublas_guard::clean_cache_stats_op);
}
#endif  // CUBLAS_GUARD_STABLE
