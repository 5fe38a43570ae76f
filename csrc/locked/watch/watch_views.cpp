// The inputs a birth reads (their absolute maxima, for the message's magnitudes): which tensor
// inputs of an op, and how each is read when the op's output turns out to be a birth (a dense
// tensor on the output's device by pointer; a Python number by its value, read here).
#include "locked/watch/watch_device.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace cublas_guard {
namespace watch {

namespace {

int32_t view_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kViewFloat;
    case at::kDouble: return kViewDouble;
    case at::kHalf: return kViewHalf;
    case at::kBFloat16: return kViewBFloat16;
    default: return kViewNone;
  }
}

// A wrapped number's value, read from its data (not item(): no op dispatched inside the watch).
double number_value(const at::Tensor& t) {
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble: return *static_cast<const double*>(p);
    case at::kFloat: return *static_cast<const float*>(p);
    case at::kLong: return static_cast<double>(*static_cast<const int64_t*>(p));
    case at::kInt: return static_cast<double>(*static_cast<const int32_t*>(p));
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}
}  // namespace

// An input a birth reads (its absolute maximum), as the input-th tensor input;
// unknown (kViewNone) when not dense, on another device, or written by the op.
void add_view(TagArgs& a, const OpInfo& info, size_t arg, const at::Tensor& t, int32_t input,
              bool same_home) {
  // A Python number (x * 10, scores * 0.125) wrapped as a 0-dim CPU tensor: its magnitude is
  // the number, read here on the host (no device read, also beside a CUDA op), whatever its dtype.
  const bool number = t.unsafeGetTensorImpl()->is_wrapped_number() && t.device().is_cpu() && t.numel() == 1 &&
                      (t.is_floating_point() || at::isIntegralType(t.scalar_type(), /*includeBool=*/false));
  if (a.n_views >= kMaxViews || !(t.is_floating_point() || number)) return;
  InputView& v = a.views[a.n_views++];
  v = InputView();
  v.input = input;
  if (number) {
    v.dtype = kViewValue;
    v.numel = 1;
    v.value = std::fabs(number_value(t));
    return;
  }
  const bool written = std::find(info.written_args.begin(), info.written_args.end(), static_cast<int>(arg)) !=
                       info.written_args.end();
  if (written || !same_home) return;
  const InputView dense = dense_view(t);
  v.data = dense.data;
  v.numel = dense.numel;
  v.dtype = dense.dtype;
}

InputView dense_view(const at::Tensor& t) {
  InputView v;
  const bool dense = t.layout() == at::kStrided && t.has_storage() && t.is_non_overlapping_and_dense();
  bool positive = true;
  for (int64_t d = 0; d < t.dim(); ++d) positive = positive && t.stride(d) >= 0;
  if (!dense || !positive || t.numel() == 0) return v;
  v.data = t.const_data_ptr();
  v.numel = t.numel();
  v.dtype = view_dtype(t.scalar_type());
  return v;
}

}  // namespace watch
}  // namespace cublas_guard
