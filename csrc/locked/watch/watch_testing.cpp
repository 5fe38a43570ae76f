// watch's test hooks (torch.ops.cublas_guard_testing, the namespace testing.cpp
// defines; refused unless CUBLAS_GUARD_EXT_TESTING=1): the version-locked
// library's, as watch is.
#include "linear/linear_op.h"  // require_testing_env
#include "locked/watch/watch_device.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>

namespace cublas_guard {
namespace watch {
// locked/watch/watch_slots.cpp: the CPU as two devices, a late harvest, a small tag array.
void set_test_seam_values(bool two_cpu_devices, bool late_harvest, int64_t tag_capacity);
}  // namespace watch

namespace {

// watch blocks that begin from now on run with this seam (watch_device.h, TestSeam): float64
// CPU tensors on a tag array of their own (two devices), the record read only at check(), the
// block's end or an error path (a GPU running behind the host), a small initial tag array.
void watch_test_seam_op(bool two_cpu_devices, bool late_harvest, int64_t tag_capacity) {
  require_testing_env("watch_test_seam");
  watch::set_test_seam_values(two_cpu_devices, late_harvest, tag_capacity);
}

// The watch key on (or off) in this thread with no session of its own, as
// autograd's device threads run (the key comes with the forward thread's
// state): its backward ops find the session of the node's thread. The previous value.
bool watch_set_key_included_op(bool on) {
  require_testing_env("watch_set_key_included");
  const bool previous = c10::impl::tls_is_dispatch_key_included(watch::kWatchKey);
  c10::impl::tls_set_dispatch_key_included(watch::kWatchKey, on);
  return previous;
}

// How many grown-out tag arrays this thread's watch keeps until its final check.
int64_t watch_retired_arrays_op() {
  require_testing_env("watch_retired_arrays");
  watch::Session* s = watch::tls_session;
  if (s == nullptr) return 0;
  watch::SessionLock lock(*s->mu);
  int64_t n = 0;
  for (const watch::DeviceTags& d : s->tags->devices) n += static_cast<int64_t>(d.retired.size());
  return n;
}

}  // namespace
}  // namespace cublas_guard

TORCH_LIBRARY_FRAGMENT(cublas_guard_testing, m) {
  using namespace cublas_guard;
  m.def("watch_test_seam(bool two_cpu_devices=False, bool late_harvest=False, int tag_capacity=0) -> ()",
        &watch_test_seam_op);
  m.def("watch_set_key_included(bool on) -> bool", &watch_set_key_included_op);
  m.def("watch_retired_arrays() -> int", &watch_retired_arrays_op);
}
