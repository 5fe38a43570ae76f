// The deferred protocol's host side (watch_device.h says why): the slot map
// and the per-device tag arrays, the ring of call descriptors, and the op's
// hooks that turn one watched op into one scan launch per output with the
// inputs' slots as arguments. No host read of a tag on the hot path: the host
// never knows whether a value is finite, only where its tag lives. The
// reports are built from the record in watch_device_report.cpp.
#include "watch/watch_device.h"

#include <ATen/ops/zeros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>

namespace cublas_guard {
namespace watch {

namespace {

std::array<DeviceKernels, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)>&
kernel_table() {
  static std::array<DeviceKernels, static_cast<size_t>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)> t;
  return t;
}

std::atomic<bool> deferred_hook{false};

}  // namespace

void register_device_kernels(c10::DeviceType type, const DeviceKernels& kernels) {
  kernel_table()[static_cast<size_t>(type)] = kernels;
}

const DeviceKernels* device_kernels(c10::DeviceType type) {
  const DeviceKernels& k = kernel_table()[static_cast<size_t>(type)];
  return k.scan != nullptr ? &k : nullptr;
}

void set_deferred_protocol(bool on) { deferred_hook = on; }

bool deferred_protocol_wanted(bool on_gpu) {
  if (deferred_hook.load()) return true;
  const char* env = std::getenv("CUBLAS_GUARD_WATCH_DEFERRED");
  if (env != nullptr && (env[0] == '1' || env[0] == '0')) return env[0] == '1';
  return on_gpu;
}

void DescTensor::set(const at::Tensor& t) {
  dtype = static_cast<int8_t>(t.scalar_type());
  device = t.device();
  if (t.dim() > kDescDims) {
    ndim = -1;
    return;
  }
  ndim = static_cast<int8_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    sizes[d] = t.size(d);
    strides[d] = t.stride(d);
  }
}

// ---- the slot map ----------------------------------------------------------

int32_t SlotMap::find(const c10::StorageImpl* key) const {
  for (size_t i = home(key);; i = (i + 1) & mask()) {
    if (entries_[i].key == key) return entries_[i].storage.expired() ? -1 : entries_[i].slot;
    if (entries_[i].key == nullptr) return -1;
  }
}

void SlotMap::insert(const c10::StorageImpl* key, int32_t slot,
                     c10::weak_intrusive_ptr<c10::StorageImpl> weak) {
  if (2 * (size_ + 1) > entries_.size()) grow();
  size_t i = home(key);
  for (; entries_[i].key != nullptr && entries_[i].key != key; i = (i + 1) & mask()) {
  }
  if (entries_[i].key == nullptr) ++size_;
  entries_[i].key = key;
  entries_[i].storage = std::move(weak);
  entries_[i].slot = slot;
}

void SlotMap::grow() {
  std::vector<Entry> old(2 * entries_.size());
  old.swap(entries_);
  size_ = 0;
  for (Entry& e : old) {
    if (e.key != nullptr) insert(e.key, e.slot, std::move(e.storage));
  }
}

void SlotMap::drop_expired(std::vector<int32_t>& freed) {
  std::vector<Entry> old(entries_.size());
  old.swap(entries_);
  size_ = 0;
  for (Entry& e : old) {
    if (e.key == nullptr) continue;
    if (e.storage.expired()) {
      freed.push_back(e.slot);
    } else {
      insert(e.key, e.slot, std::move(e.storage));
    }
  }
}

void SlotMap::clear() {
  for (Entry& e : entries_) e = Entry();
  size_ = 0;
}

// ---- the thread's state ----------------------------------------------------

std::shared_ptr<DeviceWatch> deferred_begin(bool outermost) {
  static thread_local std::shared_ptr<DeviceWatch> w;
  if (!outermost && w != nullptr) return w;
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  if (w == nullptr || w.use_count() > 1) w = std::make_shared<DeviceWatch>();  // one still held: a new one
  DeviceWatch& d = *w;
  d.next_seq = 0;
  d.slots.clear();
  d.free_slots.clear();
  d.next_slot = 0;
  d.names.clear();
  d.sink_ids.clear();
  d.origin_of_seq.clear();
  d.lost = 0;
  for (CallDesc& c : d.ring) {
    c.seq = -1;
    c.node.reset();
  }
  for (DeviceTags& t : d.devices) {
    t.kernels->reset_record(t.device, t.record, t.counters.data_ptr<int32_t>());
    t.seq_tags.zero_();
    t.births_read = t.findings_read = 0;
  }
  return w;
}

namespace {

DeviceTags* tags_for(DeviceWatch& w, c10::Device device) {
  for (DeviceTags& t : w.devices) {
    if (t.device == device) return &t;
  }
  const DeviceKernels* k = device_kernels(device.type());
  if (k == nullptr) return nullptr;  // a device with no kernels: not watched by the deferred protocol
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  DeviceTags t;
  t.device = device;
  t.kernels = k;
  const auto options = at::TensorOptions().dtype(at::kInt).device(device);
  t.tags = at::zeros({w.capacity}, options);
  t.seq_tags = at::zeros({w.seq_capacity}, options);
  t.counters = at::zeros({kWatchCounters}, options);
  t.record = k->record(device);
  k->reset_record(device, t.record, t.counters.data_ptr<int32_t>());
  w.devices.push_back(std::move(t));
  return &w.devices.back();
}

// Grows every device's array to `capacity` (stream-ordered copies, no sync).
void grow(at::Tensor DeviceTags::* which, DeviceWatch& w, int64_t capacity) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  for (DeviceTags& t : w.devices) {
    at::Tensor& old = t.*which;
    at::Tensor bigger = at::zeros({capacity}, old.options());
    bigger.narrow(0, 0, old.numel()).copy_(old);
    old = bigger;
  }
}

bool covers_storage(const at::Tensor& t) {
  return t.storage_offset() == 0 && t.is_non_overlapping_and_dense() &&
         static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
}

// t's slot; a new one (*fresh) when its storage has none.
int32_t slot_of(DeviceWatch& w, const at::Tensor& t, bool* fresh) {
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  const int32_t found = w.slots.find(key);
  if (found >= 0) {
    *fresh = false;
    return found;
  }
  *fresh = true;
  if (w.free_slots.empty() && w.slots.size() >= w.prune_at) {
    w.slots.drop_expired(w.free_slots);
    w.prune_at = std::max<size_t>(8192, 2 * w.slots.size());
  }
  int32_t slot;
  if (!w.free_slots.empty()) {
    slot = w.free_slots.back();
    w.free_slots.pop_back();
  } else {
    if (w.next_slot >= w.capacity) {  // big chunks: the array doubles
      w.capacity *= 2;
      grow(&DeviceTags::tags, w, w.capacity);
    }
    slot = w.next_slot++;
  }
  w.slots.insert(key, slot, t.storage().getWeakStorageImpl());
  return slot;
}

void launch(DeviceTags& d, const at::Tensor& t, const TagArgs& a) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  d.kernels->scan(t, a, d.tags.data_ptr<int32_t>(), d.seq_tags.data_ptr<int32_t>(), d.record,
                  d.counters.data_ptr<int32_t>());
}

// A tensor no watched op wrote gets a slot and a first-sight scan (before the
// op: an in-place op would overwrite what it held).
void first_sight(DeviceWatch& w, const at::Tensor& t) {
  if (!readable(t)) return;
  DeviceTags* d = tags_for(w, t.device());
  if (d == nullptr) return;
  bool fresh = false;
  const int32_t slot = slot_of(w, t, &fresh);
  if (!fresh) return;
  TagArgs a;
  a.kind = kScanFirstSight;
  a.out_slot = slot;
  launch(*d, t, a);
}

// The module of the op running now (where_now() without the node's name).
int32_t module_now(const Session& s, const torch::autograd::Node* node) {
  if (!s.module_stack.empty()) return s.module_stack.back();
  if (node != nullptr && node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
    const uint64_t i = node->sequence_nr() - s.seq_base;
    if (i < s.seq_module.size()) return s.seq_module[i];
  }
  return -1;
}

void describe(CallDesc& c, const OpInfo& info, const std::vector<c10::IValue>& args) {
  c.n_items = 0;
  c.num_inputs = 0;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      ++c.num_inputs;
      if (c.n_items >= kDescItems) return;
      DescItem& item = c.items[c.n_items++];
      item.arg = static_cast<int16_t>(i);
      item.scalar = false;
      item.tensor.set(t);
    });
    if ((scalar_non_finite(args[i]) || args[i].isDouble()) && c.n_items < kDescItems) {
      DescItem& item = c.items[c.n_items++];
      item.arg = static_cast<int16_t>(i);
      item.scalar = true;
      item.value = args[i].isDouble() ? args[i].toDouble() : 0.0;
    }
  }
}

// The written-sink id of output t (written_sink() of watch_fallback.cpp), -1 if none.
int64_t written_sink_id(Session& s, DeviceWatch& w, const c10::OperatorHandle& op, const OpInfo& info,
                        const std::vector<c10::IValue>& args, const at::Tensor& t, bool in_node) {
  if (info.written_args.empty() || !t.has_storage()) return -1;
  if (!trusted() || (t.requires_grad() && !t.is_leaf())) return -1;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  bool written = false;
  for (int a : info.written_args) {
    for_each_tensor(args[a], [&](const at::Tensor& x) {
      written = written || (x.defined() && x.has_storage() && x.storage().unsafeGetStorageImpl() == key);
    });
  }
  if (!written) return -1;
  const auto state = s.state.find(key);
  const bool outside = state == s.state.end() && s.has_model && s.module_stack.empty() && !in_node;
  if (state == s.state.end() && !outside) return -1;
  const auto cache_key = std::make_pair(static_cast<const void*>(&op.schema()),
                                        outside ? nullptr : static_cast<const void*>(key));
  const auto it = w.sink_ids.find(cache_key);
  if (it != w.sink_ids.end()) return it->second;
  const std::string name = op_display_name(op.schema());
  w.names.push_back(outside ? "a tensor written by " + name +
                                  " outside the model's forward and backward (state such as an optimizer's)"
                            : "the model's parameter or buffer '" + state->second + "', written by " + name);
  const int64_t id = static_cast<int64_t>(w.names.size()) - 1;
  w.sink_ids.emplace(cache_key, id);
  return id;
}

}  // namespace

void deferred_before(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args) {
  DeviceWatch& w = *s.device;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t) { first_sight(w, t); });
  }
}

void deferred_after(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                    const std::vector<c10::IValue>& args, const torch::jit::Stack& stack, int64_t seq_index) {
  DeviceWatch& w = *s.device;
  const bool consequence = s.report == kReportConsequence;
  const c10::FunctionSchema& schema = op.schema();
  const auto node = torch::autograd::get_current_node();
  const int32_t module = module_now(s, node.get());
  TagArgs base;
  base.birth = consequence ? 0 : 1;
  base.backward = node != nullptr ? 1 : 0;
  bool allowed = op_allowed(s, schema);
  if (module >= 0 && static_cast<size_t>(module) < s.module_allowed.size() && s.module_allowed[module]) {
    allowed = true;
  }
  base.allowed = allowed ? 1 : 0;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    if (scalar_non_finite(args[i])) base.scalar_bad = 1;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!readable(t) || base.n_in >= kMaxTagInputs) return;
      const int32_t slot = w.slots.find(t.storage().unsafeGetStorageImpl());
      if (slot >= 0) base.in_slots[base.n_in++] = slot;
    });
  }
  if (consequence && node && node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
    const uint64_t i = node->sequence_nr() - s.seq_base;
    if (static_cast<int64_t>(i) < w.seq_capacity) base.seq_read = static_cast<int32_t>(i);
  }
  if (consequence && seq_index >= 0) {
    if (seq_index >= w.seq_capacity) {
      while (seq_index >= w.seq_capacity) w.seq_capacity *= 2;
      grow(&DeviceTags::seq_tags, w, w.seq_capacity);
    }
    base.seq_write = static_cast<int32_t>(seq_index);
  }
  bool first_output = true;
  auto scan_output = [&](const at::Tensor& t, int64_t index) {
    if (!readable(t)) return;
    DeviceTags* d = tags_for(w, t.device());
    if (d == nullptr) return;
    ++s.outputs_scanned;
    TagArgs a = base;
    bool fresh = false;
    a.out_slot = slot_of(w, t, &fresh);
    a.whole = covers_storage(t) ? 1 : 0;
    a.fresh = fresh || (!info.composite && a.whole) ? 1 : 0;
    a.output_index = index;
    a.seq_merge = first_output ? 0 : 1;
    first_output = false;
    a.sink = consequence ? written_sink_id(s, w, op, info, args, t, node != nullptr) : -1;
    const int64_t seq = w.next_seq++;
    a.seq = static_cast<int32_t>(seq);
    CallDesc& c = w.ring[seq & (DeviceWatch::kRing - 1)];
    c.seq = seq;
    c.entry = false;
    c.schema = &schema;
    c.module = module;
    c.backward = node != nullptr;
    c.node = node;
    c.output_index = index;
    c.out.set(t);
    describe(c, info, args);
    launch(*d, t, a);
  };
  if (info.scan_written_args) {
    for (int a : info.written_args) {
      for_each_tensor(args[a], [&](const at::Tensor& t) { scan_output(t, a); });
    }
  } else if (stack.size() >= info.scan_return.size()) {
    const size_t num_returns = info.scan_return.size();
    for (size_t r = 0; r < num_returns; ++r) {
      if (!info.scan_return[r]) continue;
      const c10::IValue& out = stack[stack.size() - num_returns + r];
      for_each_tensor(out, [&](const at::Tensor& t) { scan_output(t, static_cast<int64_t>(r)); });
    }
  }
  deferred_harvest(s, /*synchronize=*/false, /*as_pending=*/false);
}

void deferred_poll(Session& s) {
  SessionLock lock(s.mu);  // a device thread may be adding a device's arrays
  DeviceWatch& w = *s.device;
  bool flagged = false;
  for (const DeviceTags& d : w.devices) {
    flagged = flagged || reinterpret_cast<volatile const int64_t*>(&d.record->flag)[0] != 0;
  }
  if (flagged) deferred_harvest(s, /*synchronize=*/false, /*as_pending=*/true);
}

void deferred_reached(Session& s, const at::Tensor& t, const std::string& where) {
  DeviceWatch& w = *s.device;
  if (!readable(t)) return;
  const int32_t slot = w.slots.find(t.storage().unsafeGetStorageImpl());
  DeviceTags* d = tags_for(w, t.device());
  if (slot < 0 || d == nullptr) return;  // untagged: finite, or from nowhere the watch saw
  w.names.push_back(where);
  TagArgs a;
  a.kind = kScanSink;
  a.out_slot = slot;
  a.sink = static_cast<int64_t>(w.names.size()) - 1;
  launch(*d, t, a);
  deferred_harvest(s, /*synchronize=*/false, /*as_pending=*/false);
}

void deferred_entry(Session& s, const at::Tensor& t, const std::string& name, bool allowed) {
  DeviceWatch& w = *s.device;
  if (!readable(t)) return;
  DeviceTags* d = tags_for(w, t.device());
  if (d == nullptr) return;
  bool fresh = false;
  TagArgs a;
  a.kind = kScanEntry;
  a.out_slot = slot_of(w, t, &fresh);
  a.allowed = allowed ? 1 : 0;
  const int64_t seq = w.next_seq++;
  a.seq = static_cast<int32_t>(seq);
  CallDesc& c = w.ring[seq & (DeviceWatch::kRing - 1)];
  c.seq = seq;
  c.entry = true;
  c.schema = nullptr;
  c.node.reset();
  c.out.set(t);
  c.n_items = 0;
  w.names.push_back(name);
  c.entry_name = static_cast<int32_t>(w.names.size()) - 1;
  launch(*d, t, a);
  deferred_harvest(s, /*synchronize=*/false, /*as_pending=*/false);
}

uint32_t deferred_input_origin(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args) {
  deferred_harvest(s, /*synchronize=*/true, /*as_pending=*/true);
  DeviceWatch& w = *s.device;
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  uint32_t origin = kNoOrigin;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!readable(t)) return;
      const int32_t slot = w.slots.find(t.storage().unsafeGetStorageImpl());
      DeviceTags* d = tags_for(w, t.device());
      if (slot < 0 || d == nullptr) return;
      const int32_t tag = d->tags.narrow(0, slot, 1).item<int32_t>();  // the error path's read-back
      if (tag < kTagFirst) return;
      const auto it = w.origin_of_seq.find(tag - kTagFirst);
      if (it != w.origin_of_seq.end()) origin = better_origin(origin, it->second);
    });
  }
  return origin;
}

}  // namespace watch
}  // namespace cublas_guard
