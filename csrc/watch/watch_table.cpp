// The known-values table and the scans of watch: the thread's per-storage
// record of the last scan (range, version, finite or not), consulted where it
// can be trusted, and the scan itself (the project's fused CPU scan; ATen
// elsewhere). See watch.h for when the table is trusted and why.
#include "watch/watch.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/logical_not.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>

namespace cublas_guard {
namespace watch {

std::shared_ptr<ThreadTable> thread_table() {
  static thread_local std::shared_ptr<ThreadTable> table = std::make_shared<ThreadTable>();
  return table;
}

bool readable(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.layout() != at::kStrided || t.numel() == 0) {
    return false;
  }
  if (t.is_meta() || !t.has_storage()) return false;
  static const c10::DispatchKeySet wrappers = c10::DispatchKeySet({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::Fake,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::Batched,
  });
  return (t.key_set() & wrappers).empty();
}

// The element range a strided tensor touches in its storage (non-negative strides).
bool storage_range(const at::Tensor& t, int64_t& begin, int64_t& end) {
  int64_t span = 1;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.stride(d) < 0) return false;
    span += (t.size(d) - 1) * t.stride(d);
  }
  begin = t.storage_offset();
  end = begin + span;
  return true;
}

// A known result for t's current values, or nullptr. Consulted only from
// Python (depth 0), by a top-level op (depth 1) and by ops that only composite
// ops (CompositeImplicitAutograd: dispatcher calls, no writes of their own)
// call: there, every write that went through the dispatcher either bumped the
// version (ADInplaceOrView) or was seen by this fallback (forget). Inside a
// kernel, versions lag and a kernel may write its buffers directly, so ops
// nested in a kernel always scan.
bool trusted() { return tls_depth <= tls_kernel_depth; }

const Known* lookup(Session& s, const at::Tensor& t) {
  if (!trusted() || t.is_inference()) return nullptr;
  const Known* found = s.known.find(t.storage().unsafeGetStorageImpl());
  if (found == nullptr) return nullptr;
  const Known& k = *found;
  if (k.version != t._version() || !k.describes(t)) return nullptr;
  int64_t begin = 0, end = 0;
  if (!storage_range(t, begin, end)) return nullptr;
  if (k.finite ? (begin >= k.begin && end <= k.end) : (begin == k.begin && end == k.end)) return &k;
  return nullptr;
}

// An op wrote into t's storage: what was known about it is stale (writes
// inside kernels run below ADInplaceOrView and do not bump the version).
void forget(Session& s, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || s.known.size() == 0) return;
  s.known.erase(t.storage().unsafeGetStorageImpl());
}

// Entries also carry the origin tag of non-finite values (watch.h): a finite
// scan of part of a tagged storage (a slice that misses the bad elements)
// does not replace the tagged entry, and a non-finite scan keeps the tag the
// storage already had (a view of a tagged tensor found bad again).
void remember(Session& s, const at::Tensor& t, bool finite, const Range& range) {
  if (t.is_inference() || !t.has_storage()) return;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  int64_t begin = 0, end = 0;
  const bool ranged = t.is_non_overlapping_and_dense() && storage_range(t, begin, end);
  Known* old = s.known.find(key);
  const bool tagged = old != nullptr && !old->finite && old->origin != kNoOrigin && old->describes(t);
  if (!ranged) {
    if (!tagged) s.known.erase(key);
    else old->begin = old->end = 0;  // never matches a lookup; the tag stays
    return;
  }
  if (tagged && finite && (begin > old->begin || end < old->end)) return;
  const uint32_t origin = tagged && !finite ? old->origin : kNoOrigin;
  if (s.known.size() >= s.known.prune_at) {  // drop the entries of freed storages
    s.known.drop_expired();
    s.known.prune_at = std::max<size_t>(1024, 2 * s.known.size());
  }
  Known& k = s.known.insert(key);
  k.track(t);
  k.begin = begin;
  k.end = end;
  k.version = t._version();
  k.finite = finite;
  k.origin = origin;
  k.producer = finite ? tls_producer : nullptr;
  k.range = finite ? range : Range();
}

const char* entry_tracking(Session& s, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const Known* k = s.known.find(t.storage().unsafeGetStorageImpl());
  if (k == nullptr || !k->describes(t)) return nullptr;
  return k->stamp != 0 ? "stamp" : "weak";
}

uint32_t origin_of(Session& s, const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || s.known.size() == 0) return kNoOrigin;
  const Known* k = s.known.find(t.storage().unsafeGetStorageImpl());
  if (k == nullptr || k->finite || !k->describes(t)) return kNoOrigin;
  return k->origin;
}

void tag(Session& s, const at::Tensor& t, uint32_t origin) {
  if (origin == kNoOrigin || !t.defined() || !t.has_storage()) return;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  Known* k = s.known.find(key);
  if (k == nullptr || !k->describes(t)) {
    k = &s.known.insert(key);
    *k = Known();  // a freed storage's entry at this address: none of it holds
    k->track(t);
    k->begin = k->end = 0;  // a tag only: lookups scan again
    k->version = t.is_inference() ? 0 : t._version();
  }
  k->finite = false;
  k->origin = better_origin(k->origin, origin);
}

uint32_t better_origin(uint32_t a, uint32_t b) {
  if (a >= kFirstOrigin && b >= kFirstOrigin) return std::min(a, b);
  if (a >= kFirstOrigin) return a;
  if (b >= kFirstOrigin) return b;
  return std::max(a, b);
}

// One fused pass (the project's scan) for float32 on the CPU; other dtypes and
// devices go through ATen until the scan takes them (a host sync on CUDA).
Counts scan_values(Session& s, const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  Counts c;
  if (t.device().is_cpu() && is_guarded_dtype(t.scalar_type())) {
    // float32/bf16/fp16, contiguous: the range pass, which also tells finite
    // values' bounds; the counting scan only for what it finds non-finite.
    ValueRange bounds;
    if (scan_cpu_range(t, bounds) && bounds.finite) {
      c.range.lo = bounds.lo;
      c.range.hi = bounds.hi;
      return c;
    }
    if (!s.slot.defined()) s.slot = at::empty({kScanFields}, at::TensorOptions().dtype(at::kLong));
    scan_cpu_into(t, s.slot, nullptr, "watch");
    const int64_t* r = s.slot.data_ptr<int64_t>();
    c.nan = r[kNanCount];
    c.posinf = r[kPosInfCount];
    c.neginf = r[kNegInfCount];
    c.first = r[kFirstBadIndex];
    return c;
  }
  if (at::isfinite(t).all().item<bool>()) return c;
  const at::Tensor flat = t.reshape({-1});
  c.nan = at::isnan(flat).sum().item<int64_t>();
  c.posinf = at::isposinf(flat).sum().item<int64_t>();
  c.neginf = at::isneginf(flat).sum().item<int64_t>();
  c.first = at::logical_not(at::isfinite(flat)).nonzero().select(1, 0).min().item<int64_t>();
  return c;
}

Counts scan_fresh(Session& s, const at::Tensor& t) {
  ++s.outputs_scanned;
  Counts c = scan_values(s, t);
  remember(s, t, !c.bad(), c.range);
  return c;
}

Counts scan_known(Session& s, const at::Tensor& t) {
  if (const Known* k = lookup(s, t)) {
    ++s.scans_saved;
    Counts c;
    if (!k->finite) c.first = 0;  // known bad: the counts are not needed by callers
    if (k->finite) c.range = k->range;
    return c;
  }
  ++s.outputs_scanned;
  Counts c = scan_values(s, t);
  remember(s, t, !c.bad(), c.range);
  return c;
}

bool known_finite(Session& s, const at::Tensor& t) {
  const Known* k = lookup(s, t);
  return k != nullptr && k->finite;
}

Range known_range(Session& s, const at::Tensor& t) {
  const Known* k = lookup(s, t);
  return k != nullptr && k->finite ? k->range : Range();
}

}  // namespace watch
}  // namespace cublas_guard
