// csrc/watch/watch_device.h: the deferred protocol of watch (issue 20), host side.
//
// Why: the direct path (watch_fallback.cpp) decides on the host after every
// scan, which on CUDA means a host sync per op. The deferred protocol keeps
// the decision on the device: per-storage tag slots (an int32 array on each
// device; the host's slot map keeps only the slot index of a storage, never
// its finiteness), one scan launch per output that reads its inputs' tags and
// writes its own (watch_device_logic.h: the rule), and a record that a scan
// writes only when it finds something (a birth, a finding). The host keeps a
// fixed ring of call descriptors by sequence number (op, module, phase,
// shapes, dtypes: what the message needs) and builds the same errors as the
// direct path from the record and the ring, at the raise points: after each
// watched op and at the next one (a plain load of the record's flag), at
// check() and at the end of the block (one synchronize: the final check).
//
// One protocol, two devices: the CPU runs it through watch_device_cpu.cpp
// (selected by cublas_guard_testing.watch_deferred_protocol or
// CUBLAS_GUARD_WATCH_DEFERRED=1 at block start), CUDA through
// cuda/watch_scan.cu. The kernels register themselves (DeviceKernels), so the
// host code never includes CUDA. See docs/watch-design.md.
#pragma once

#include "watch/watch.h"
#include "watch/watch_device_kernels.h"

#include <torch/csrc/autograd/function.h>

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cublas_guard {
namespace watch {

// Whether a block runs the deferred protocol, read at block start: the test
// hook (cublas_guard_testing.watch_deferred_protocol), else
// CUBLAS_GUARD_WATCH_DEFERRED=1/0, else `on_gpu` (the watched model has CUDA
// state and the CUDA kernels are built): the CPU default stays the direct path.
void set_deferred_protocol(bool on);
bool deferred_protocol_wanted(bool on_gpu);

// One call descriptor: enough for today's message (describe_inputs, judge).
constexpr int kDescItems = 10;  // inputs and scalar arguments described (in argument order)
constexpr int kDescDims = 8;    // dims of a described shape (more: the shape is left out)
struct DescTensor {
  int8_t ndim = -1;  // -1: too many dims to describe
  int8_t dtype = 0;
  c10::Device device{c10::kCPU};
  int64_t sizes[kDescDims];
  int64_t strides[kDescDims];
  void set(const at::Tensor& t);
};
struct DescItem {
  int16_t arg = 0;      // the schema argument
  bool scalar = false;  // a Scalar argument (value) rather than a tensor
  double value = 0.0;
  DescTensor tensor;
};
// What torch::autograd::get_current_node() returns: std::shared_ptr<Node> up to torch
// 2.11, c10::intrusive_ptr<Node> from 2.13 (CI builds both).
using NodeRef = decltype(torch::autograd::get_current_node());
struct CallDesc {
  int64_t seq = -1;  // which call this slot of the ring holds now
  bool entry = false;
  const c10::FunctionSchema* schema = nullptr;
  int32_t module = -1;
  bool backward = false;
  NodeRef node;  // its name, at report time
  int64_t output_index = 0;
  DescTensor out;
  int n_items = 0;
  DescItem items[kDescItems];
  int64_t num_inputs = 0;  // tensors, also those beyond kDescItems
  int32_t entry_name = -1;  // entry: index into DeviceWatch::names
};

// Storage -> slot (open addressing, like KnownTable; weak references so a freed
// storage's slot goes back to the free list and never matches a new storage).
class SlotMap {
 public:
  struct Entry {
    const c10::StorageImpl* key = nullptr;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{
        c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())};
    int32_t slot = -1;
  };
  SlotMap() : entries_(4096) {}
  int32_t find(const c10::StorageImpl* key) const;
  // Inserts a storage that find() does not hold.
  void insert(const c10::StorageImpl* key, int32_t slot, c10::weak_intrusive_ptr<c10::StorageImpl> weak);
  // Removes the entries of freed storages, appending their slots to `freed`.
  void drop_expired(std::vector<int32_t>& freed);
  void clear();
  size_t size() const { return size_; }

 private:
  size_t mask() const { return entries_.size() - 1; }
  size_t home(const c10::StorageImpl* key) const {
    const uint64_t h = reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 20) & mask();
  }
  void grow();
  std::vector<Entry> entries_;
  size_t size_ = 0;
};

// The per-device arrays of one watch.
struct DeviceTags {
  c10::Device device{c10::kCPU};
  const DeviceKernels* kernels = nullptr;
  at::Tensor tags, seq_tags, counters;  // int32 on the device (grown: stream-ordered copies)
  WatchRecord* record = nullptr;
  int64_t births_read = 0, findings_read = 0;
};

// A thread's deferred state: reset when the thread's outermost deferred block begins.
struct DeviceWatch {
  static constexpr int64_t kRing = 4096;  // call descriptors kept (a power of two)
  std::vector<CallDesc> ring = std::vector<CallDesc>(kRing);
  int64_t next_seq = 0;
  SlotMap slots;
  std::vector<int32_t> free_slots;
  int32_t next_slot = 0;
  int64_t capacity = 1 << 16;      // tag slots per device array
  int64_t seq_capacity = 1 << 16;  // autograd nodes per block (seq_tags)
  size_t prune_at = 8192;
  std::vector<DeviceTags> devices;
  std::vector<std::string> names;  // sink descriptions and entry argument names
  std::map<std::pair<const void*, const void*>, int64_t> sink_ids;  // (op, storage) -> written-sink id
  std::unordered_map<int64_t, uint32_t> origin_of_seq;  // harvested births -> OriginStore id
  int64_t lost = 0;  // births or findings the record had no room for
};

// Begin (outermost: reset the thread's state) and the raise-point checks.
std::shared_ptr<DeviceWatch> deferred_begin(bool outermost);
// The op's hooks (watch_fallback.cpp calls them with the session locked).
void deferred_before(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args);
void deferred_after(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                    const std::vector<c10::IValue>& args, const torch::jit::Stack& stack, int64_t seq_index);
// A guarded layer refused its input: the earliest origin (an OriginStore id)
// its inputs carry, else kNoOrigin (an error path: synchronizes and reads tags back).
uint32_t deferred_input_origin(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args);
// Reads the records (plain loads) and turns births into origins and findings
// into errors; with `synchronize`, waits for the devices first (the final
// check); with `as_pending`, a sync finding is kept pending (raised by the caller).
void deferred_harvest(Session& s, bool synchronize, bool as_pending);
// The next op's check: harvests when a record's flag is up (a plain load).
void deferred_poll(Session& s);
// Python-side sinks and entries (watch_python.cpp).
void deferred_reached(Session& s, const at::Tensor& t, const std::string& where);
void deferred_entry(Session& s, const at::Tensor& t, const std::string& name, bool allowed);

}  // namespace watch
}  // namespace cublas_guard
