// watch's tags, host side, part one (watch_device.h says why): the kernels each
// device type registers, the test seam, a thread's tag state and its reset at a
// block's start, the per-device tag arrays and the storage -> slot maps, and one
// launch (a scan, a first sight). The op's hooks that use them are in
// watch_device.cpp.
#include "locked/watch/watch_device.h"

#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <mutex>
#include <optional>

namespace cublas_guard {
namespace watch {

namespace {

std::array<DeviceKernels, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
kernels_by_device_type() {
  static std::array<DeviceKernels, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)> t;
  return t;
}

std::mutex seam_mutex;
TestSeam current_seam;

}  // namespace

void register_device_kernels(c10::DeviceType type, const DeviceKernels& kernels) {
  kernels_by_device_type()[static_cast<size_t>(type)] = kernels;
}

const DeviceKernels* device_kernels(c10::DeviceType type) {
  const DeviceKernels& k = kernels_by_device_type()[static_cast<size_t>(type)];
  return k.scan != nullptr ? &k : nullptr;
}

void set_test_seam_values(bool two_cpu_devices, bool late_harvest, int64_t tag_capacity) {
  std::lock_guard<std::mutex> lock(seam_mutex);
  current_seam = TestSeam{two_cpu_devices, late_harvest, tag_capacity};
}

TestSeam test_seam() {
  std::lock_guard<std::mutex> lock(seam_mutex);
  return current_seam;
}

void DescTensor::set(const at::Tensor& t) {
  dtype = static_cast<int8_t>(t.scalar_type());
  device = t.device();
  if (t.dim() > kDescDims) {
    ndim = -1;
    return;
  }
  ndim = static_cast<int8_t>(t.dim());
  const c10::IntArrayRef sz = t.sizes(), st = t.strides();  // once, not a checked call per dim
  for (size_t d = 0; d < sz.size(); ++d) {
    sizes[d] = sz[d];
    strides[d] = st[d];
  }
}

// ---- the thread's state ----------------------------------------------------

TagState::~TagState() {
  for (DeviceTags& d : devices) {
    if (d.record != nullptr) d.kernels->free_record(d.home.device, d.record);
  }
}

std::shared_ptr<TagState> tags_begin(bool outermost, int64_t capacity) {
  static thread_local std::shared_ptr<TagState> w;
  if (!outermost && w != nullptr) return w;
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  int64_t rounded = 64;
  while (rounded < capacity) rounded *= 2;
  const TestSeam seam = test_seam();
  // A state still held (a device thread finishing a node), records of another size, another
  // test seam: a new one.
  if (w == nullptr || w.use_count() > 1 || w->capacity != rounded ||
      w->seam.tag_capacity != seam.tag_capacity || w->seam.two_cpu_devices != seam.two_cpu_devices) {
    w = std::make_shared<TagState>();
    w->capacity = rounded;
    w->ring.resize(static_cast<size_t>(rounded));
  }
  TagState& d = *w;
  // Only what the last block used is reset (issue 50: a block over a short step, an optimizer
  // step, paid ~0.5 ms for clearing the whole ring and both 256 KB arrays): ring entries below
  // its last sequence number, tag slots below its high-water mark, node tags below its last node.
  const int64_t used_ring = std::min<int64_t>(d.next_seq, static_cast<int64_t>(d.ring.size()));
  const int64_t used_nodes = static_cast<int64_t>(d.seq_home.size());
  d.seam = seam;
  d.next_seq = 0;
  d.op_first_seq = 0;
  d.names.clear();
  d.sink_ids.clear();
  d.origin_of_seq.clear();
  d.seq_home.clear();
  d.lost_births = d.lost_findings = d.lost_calls = 0;
  for (int64_t i = 0; i < used_ring; ++i) {
    d.ring[i].seq = -1;
    d.ring[i].node.reset();
  }
  for (DeviceTags& t : d.devices) {
    // A new block: no storage has a slot yet, and no tag of the last block is read again.
    const int64_t used_slots = std::min<int64_t>(t.next_slot, t.tags.numel());
    t.slots.clear();
    t.free_slots.clear();
    t.next_slot = 0;
    t.retired.clear();
    t.kernels->reset_record(t.home.device, t.record, t.counters.data_ptr<int32_t>());
    if (used_slots > 0) t.tags.narrow(0, 0, used_slots).zero_();
    const int64_t nodes = std::min<int64_t>(used_nodes, t.seq_tags.numel());
    if (nodes > 0) t.seq_tags.narrow(0, 0, nodes).zero_();
    t.births_read = t.findings_read = 0;
  }
  return w;
}

TagHome home_of(const TagState& w, const at::Tensor& t) {
  TagHome h;
  h.device = t.device();
  if (w.seam.two_cpu_devices && t.is_cpu() && t.scalar_type() == at::kDouble) h.lane = 1;
  return h;
}

DeviceTags* tags_for(TagState& w, const at::Tensor& t) {
  const TagHome h = home_of(w, t);
  for (DeviceTags& d : w.devices) {
    if (d.home == h) return &d;
  }
  const DeviceKernels* k = device_kernels(h.device.type());
  if (k == nullptr) return nullptr;  // a device with no kernels: not watched
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  DeviceTags& d = w.devices.emplace_back();
  d.home = h;
  d.kernels = k;
  if (w.seam.tag_capacity > 0) d.capacity = w.seam.tag_capacity;
  const auto options = at::TensorOptions().dtype(at::kInt).device(h.device);
  d.tags = at::zeros({d.capacity}, options);
  d.seq_tags = at::zeros({d.seq_capacity}, options);
  d.counters = at::zeros({kWatchCounters}, options);
  d.record = k->alloc_record(h.device, w.capacity);
  k->reset_record(h.device, d.record, d.counters.data_ptr<int32_t>());
  return &d;
}

// Grows one array to `capacity` (a stream-ordered copy, no sync); the old one
// is retired, not freed, until the final check.
void grow(DeviceTags& d, at::Tensor DeviceTags::* which, int64_t capacity) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  at::Tensor& old = d.*which;
  at::Tensor bigger = at::zeros({capacity}, old.options());
  bigger.narrow(0, 0, old.numel()).copy_(old);
  d.retired.push_back(old);
  old = bigger;
}

bool covers_storage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_non_overlapping_and_dense() &&
         static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
}

// t's slot in d; a new one (*fresh) when its storage has none.
int32_t slot_of(DeviceTags& d, const at::Tensor& t, bool* fresh) {
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  const int32_t found = d.slots.find(key);
  if (found >= 0) {
    *fresh = false;
    return found;
  }
  *fresh = true;
  if (d.free_slots.empty() && d.slots.size() >= d.prune_at) {
    d.slots.drop_expired(d.free_slots);
    d.prune_at = std::max<size_t>(8192, 2 * d.slots.size());
  }
  int32_t slot;
  if (!d.free_slots.empty()) {
    slot = d.free_slots.back();
    d.free_slots.pop_back();
    // A recycled slot holds its last storage's tag: every fresh slot starts finite, as one from
    // the never-used end of the array does (a fresh slot's old tag is otherwise never read, but
    // tags_known_finite relies on it). Rare: only after 8,192 slots, for storages that died.
    if (d.home.device.is_cpu()) {
      raw(d.tags)[slot] = kTagFinite;
    } else {
      c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
      d.tags.narrow(0, slot, 1).zero_();
    }
  } else {
    if (d.next_slot >= d.capacity) {  // big chunks: the array doubles
      d.capacity *= 2;
      grow(d, &DeviceTags::tags, d.capacity);
    }
    slot = d.next_slot++;
  }
  d.slots.insert(key, slot, t.storage().getWeakStorageImpl());
  if (d.slot_seq.size() <= static_cast<size_t>(slot)) {
    d.slot_seq.resize(static_cast<size_t>(slot) + 1, -1);
    d.bounds.resize(static_cast<size_t>(slot) + 1);
  }
  d.slot_seq[slot] = -1;
  d.bounds[slot].seq = DeviceTags::kNoBound;
  return slot;
}

void note_bound(DeviceTags& d, int32_t slot, int32_t exp) {
  DeviceTags::Bound& b = d.bounds[slot];
  b.seq = exp >= 0 ? d.slot_seq[slot] : DeviceTags::kNoBound;
  b.exp = exp;
}

int32_t bound_of(const DeviceTags& d, int32_t slot) {
  if (slot < 0 || static_cast<size_t>(slot) >= d.bounds.size()) return std::numeric_limits<int32_t>::max();
  const DeviceTags::Bound& b = d.bounds[slot];
  return b.seq != DeviceTags::kNoBound && b.seq == d.slot_seq[slot] ? b.exp
                                                                    : std::numeric_limits<int32_t>::max();
}

int32_t tag_finite_unscanned(DeviceTags& d, const at::Tensor& t, int64_t seq, int32_t exp) {
  bool fresh = false;
  const int32_t slot = slot_of(d, t, &fresh);
  raw(d.tags)[slot] = kTagFinite;  // (a slot it already had may hold a non-finite tag)
  d.slot_seq[slot] = seq;
  note_bound(d, slot, exp);
  return slot;
}

// Watch's own int32 arrays (dense, offset 0, never copy-on-write), without data_ptr's checks.
int32_t* raw(const at::Tensor& a) {
  return static_cast<int32_t*>(
      a.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()->mutable_data());
}

void launch(DeviceTags& d, const at::Tensor& t, const TagArgs& a) {
  // The CPU kernel turns the watch's key off itself, only where it calls ATen (not on a small scan).
  std::optional<c10::impl::ExcludeDispatchKeyGuard> no_watch;
  if (!t.is_cpu()) no_watch.emplace(kWatchKey);
  d.kernels->scan(t, a, raw(d.tags), raw(d.seq_tags), d.record, raw(d.counters));
  // What the CPU scan found about the values' size (a whole storage only: a part says nothing of
  // the rest). tags_after set slot_seq to this scan's number (and a.whole); a first sight's fresh
  // slot has -1.
  if (a.out_slot >= 0 && (a.kind == kScanOutput || a.kind == kScanFirstSight) && t.is_cpu()) {
    const bool whole = a.kind == kScanOutput ? a.whole != 0 : covers_storage(t);
    note_bound(d, a.out_slot, whole && last_cpu_scan_small() ? small_bound_exp(t.scalar_type()) : -1);
  }
}

// A tensor no watched op wrote gets a slot and a first-sight scan (before the
// op: an in-place op would overwrite what it held).
void first_sight(TagState& w, const at::Tensor& t) {
  if (!readable(t)) return;
  DeviceTags* d = tags_for(w, t);
  if (d == nullptr) return;
  bool fresh = false;
  const int32_t slot = slot_of(*d, t, &fresh);
  if (!fresh) return;
  TagArgs a;
  a.kind = kScanFirstSight;
  a.out_slot = slot;
  launch(*d, t, a);
}

}  // namespace watch
}  // namespace cublas_guard
