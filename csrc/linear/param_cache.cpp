// The clean-parameter cache of linear_common.cpp (param_cache.h), with the
// package's optimizer-step hook and the tests' view of it.
#ifndef CUBLAS_GUARD_STABLE
#include "linear/param_cache.h"
#include "report/async_registry.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace cublas_guard {

namespace {

// ---------------------------------------------------------------------------
// Parameters are scanned when they change, not on every call. A parameter is
// "known clean" while it is the same tensor, with the same version counter
// value, data pointer, dtype, sizes and strides as when it was last scanned
// clean, and no optimizer step ran since (the generation below).
//
// Identity without a weak reference (torch.utils.swap_tensors refuses tensors
// with weak references): an entry, keyed by the TensorImpl's address, holds a
// strong reference to the tensor's *version counter*, a small object of its
// own. While the entry holds it, no other tensor can get a counter at that
// address, so a freed TensorImpl whose address is reused by a new tensor is
// told apart by its counter. The entry does not keep the tensor or its memory
// alive. An entry is dead when the counter has no other holder; every
// insertion checks two entries, round robin, and drops dead ones, so the cost
// per call is O(1) whatever the number of live parameters.
//
// Change detectors: the version counter (optimizer steps of the plain and
// foreach kinds, load_state_dict, in-place edits under no_grad), the data
// pointer (`.data = ...`, set_()), and the generation, bumped after every
// torch.optim optimizer step (fused optimizers write without bumping the
// version counter) through cublas_guard::_parameters_changed. Not seen: writes
// through `.data` or a DLPack/NumPy alias, and kernels that write a parameter
// in place without declaring it (a custom op, a fused update outside
// torch.optim); those parameters are scanned again at their next tracked change.
// ---------------------------------------------------------------------------
class CleanParameterCache {
 public:
  bool known_clean(const at::Tensor& t) {
    if (!cacheable(t)) return false;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = index_.find(t.unsafeGetTensorImpl());
    if (it == index_.end()) return false;
    const Entry& e = slots_[it->second];
    return e.generation == generation_ && counter_identity(e.counter) == counter_of(t) &&
           e.version == t._version() && e.data == t.data_ptr() && e.dtype == t.scalar_type() &&
           t.sizes().equals(e.sizes) && t.strides().equals(e.strides);
  }

  void mark_clean(const at::Tensor& t) {
    if (!cacheable(t)) return;
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    Entry entry{impl,
                impl->version_counter(),
                t._version(),
                t.data_ptr(),
                t.scalar_type(),
                t.sizes().vec(),
                t.strides().vec(),
                0};
    std::lock_guard<std::mutex> lock(mutex_);
    entry.generation = generation_;
    sweep(2);
    auto it = index_.find(impl);
    if (it != index_.end()) {
      slots_[it->second] = std::move(entry);
    } else {
      index_.emplace(impl, slots_.size());
      slots_.push_back(std::move(entry));
    }
  }

  // Forget everything (after an async report: the reported tensor must be scanned again).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    index_.clear();
    slots_.clear();
    cursor_ = 0;
  }

  // Some parameters may have been written without a version bump: none is known clean.
  void invalidate() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++generation_;
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t live = 0;
    for (const auto& e : slots_) live += e.counter.unique() ? 0 : 1;
    return {static_cast<int64_t>(slots_.size()), live, static_cast<int64_t>(generation_)};
  }

 private:
  struct Entry {
    const c10::TensorImpl* impl;
    c10::VariableVersion counter;  // a strong reference to the counter, never to the tensor
    int64_t version;
    const void* data;
    at::ScalarType dtype;
    std::vector<int64_t> sizes, strides;
    uint64_t generation;
  };

  // Inference tensors have no version counter; a view shares its base's
  // counter (an entry per short-lived view would keep it shared forever).
  static bool cacheable(const at::Tensor& t) {
    return !t.is_inference() && !t.is_view() && t.unsafeGetTensorImpl()->version_counter().enabled();
  }

  // The address of the counter object: VariableVersion's only member is its
  // intrusive_ptr, and it offers no accessor.
  static const void* counter_identity(const c10::VariableVersion& v) {
    static_assert(sizeof(c10::VariableVersion) == sizeof(void*),
                  "c10::VariableVersion is expected to hold exactly one pointer");
    const void* p = nullptr;
    std::memcpy(&p, static_cast<const void*>(&v), sizeof(p));
    return p;
  }
  static const void* counter_of(const at::Tensor& t) {
    return counter_identity(t.unsafeGetTensorImpl()->version_counter());
  }

  // Looks at up to `n` entries from the cursor; drops those whose tensor is gone.
  void sweep(int n) {
    for (int i = 0; i < n && !slots_.empty(); ++i) {
      if (cursor_ >= slots_.size()) cursor_ = 0;
      if (slots_[cursor_].counter.unique()) {
        index_.erase(slots_[cursor_].impl);
        if (cursor_ + 1 != slots_.size()) {
          slots_[cursor_] = std::move(slots_.back());
          index_[slots_[cursor_].impl] = cursor_;
        }
        slots_.pop_back();
      } else {
        ++cursor_;
      }
    }
  }

  std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, size_t> index_;
  std::vector<Entry> slots_;
  size_t cursor_ = 0;
  uint64_t generation_ = 0;
};

CleanParameterCache& clean_parameters() {
  static CleanParameterCache cache;
  return cache;
}

}  // namespace

bool parameter_known_clean(const at::Tensor& t) { return clean_parameters().known_clean(t); }
void mark_parameter_clean(const at::Tensor& t) { clean_parameters().mark_clean(t); }
void forget_clean_parameters() { clean_parameters().clear(); }

namespace {
// A parameter an async report names must be scanned again: the registry below
// (report/async_registry.h) calls this whenever it takes a finding.
const bool forget_on_async_findings = (on_async_finding_taken(&forget_clean_parameters), true);
}  // namespace

}  // namespace cublas_guard

// The package's optimizer-step hook (cublas_guard_ext.nn): some parameters may have been written
// without a version bump (fused optimizers), so none is known clean.
TORCH_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("parameters_changed() -> ()", [] { cublas_guard::clean_parameters().invalidate(); });
}

// The tests' view of the parameter cache (the other hooks are in testing.cpp):
// [entries, entries whose tensor is alive, generation].
TORCH_LIBRARY_FRAGMENT(cublas_guard_testing, m) {
  m.def("clean_cache_stats() -> int[]", [] { return cublas_guard::clean_parameters().stats(); });
}
#endif  // !CUBLAS_GUARD_STABLE
