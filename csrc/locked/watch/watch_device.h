// csrc/locked/watch/watch_device.h: watch's tags, host side.
//
// Per-storage tag slots (an int32 array per device; the host's slot map keeps
// only a storage's slot index, never whether its values are finite), one scan
// launch per output that reads its inputs' tags and writes its own
// (watch_device_logic.h: the rule), and a record per device that a scan
// writes only when it finds something (a birth, a finding). The host keeps a
// ring of call descriptors by sequence number (op, module, phase, shapes,
// dtypes: what the message needs) and builds the errors from the record and
// the ring at the raise points (watch_device_report.cpp). The kernels register
// themselves (DeviceKernels), so this code never includes CUDA.
//
// A thread's TagState is its own (its records included: two threads watching
// on one device never share a record); nested blocks of the thread and the
// autograd device threads running its backward nodes share it, under its mutex.
#pragma once

#include "locked/watch/watch.h"
#include "locked/watch/watch_device_kernels.h"

#include <torch/csrc/autograd/function.h>

#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cublas_guard {
namespace watch {

// One call descriptor: enough for the message (describe_inputs' fields).
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
  bool product = false;
  int32_t module = -1;
  bool backward = false;
  NodeRef node;  // its name, at report time
  int64_t output_index = 0;
  DescTensor out;
  int n_items = 0;
  DescItem items[kDescItems];
  int64_t num_inputs = 0;   // tensors, also those beyond kDescItems
  int32_t entry_name = -1;  // entry: index into TagState::names
  bool entry_buffer = false;  // entry: a buffer of the model (else an argument)
  // A grouped GEMM's group ends (OpInfo::offs_arg; a reference to the small int tensor,
  // read only when a finding is reported) and its weight's name.
  at::Tensor offs;
  std::string parameter;
};

// Storage -> slot. Weak references, so a freed storage's slot goes back to
// the free list and never matches a new storage at the same address.
class SlotMap {
 public:
  int32_t find(const c10::StorageImpl* key) const {
    const auto it = map_.find(key);
    return it == map_.end() || it->second.storage.expired() ? -1 : it->second.slot;
  }
  void insert(const c10::StorageImpl* key, int32_t slot, c10::weak_intrusive_ptr<c10::StorageImpl> weak) {
    map_.insert_or_assign(key, Entry{std::move(weak), slot});
  }
  // Removes the entries of freed storages, appending their slots to `freed`.
  void drop_expired(std::vector<int32_t>& freed) {
    for (auto it = map_.begin(); it != map_.end();) {
      if (!it->second.storage.expired()) {
        ++it;
        continue;
      }
      freed.push_back(it->second.slot);
      it = map_.erase(it);
    }
  }
  void clear() { map_.clear(); }
  size_t size() const { return map_.size(); }

 private:
  struct Entry {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int32_t slot;
  };
  std::unordered_map<const c10::StorageImpl*, Entry> map_;
};

// Which tag array a tensor's storage belongs to: its device, and on the CPU
// under the test seam a lane (float64 tensors on lane 1, the rest on lane 0:
// the CPU then behaves as two devices, and a cast between them as a copy).
struct TagHome {
  c10::Device device{c10::kCPU};
  int lane = 0;
  bool operator==(const TagHome& o) const { return device == o.device && lane == o.lane; }
};

// The arrays of one device (one lane).
struct DeviceTags {
  TagHome home;
  const DeviceKernels* kernels = nullptr;
  SlotMap slots;
  // Per slot, the sequence number of the last op output scanned into it (-1: none since the
  // slot was assigned): a composite op's output that an op inside it already scanned is not
  // read again (tags_after).
  std::vector<int64_t> slot_seq;
  // Per slot (CPU only: the host reads what a CPU scan found), a magnitude bound its values are
  // known to keep (every one finite, |x| < 2^exp) since the scan or proof numbered `seq`: valid
  // while slot_seq still holds that number (a fresh slot, any later scan or tag set by a rule moves
  // or resets it: note_bound). What watch's proof of an optimizer's second moment reads.
  static constexpr int64_t kNoBound = -2;  // below slot_seq's -1 (a fresh slot's)
  struct Bound {
    int64_t seq = kNoBound;
    int32_t exp = 0;
  };
  std::vector<Bound> bounds;
  std::vector<int32_t> free_slots;
  int32_t next_slot = 0;
  int64_t capacity = 1 << 16;      // tag slots
  int64_t seq_capacity = 1 << 16;  // autograd nodes per block (seq_tags)
  size_t prune_at = 8192;
  at::Tensor tags, seq_tags, counters;  // int32 on the device (grown: stream-ordered copies)
  // Arrays replaced by a bigger one, kept until the block's final check has
  // waited for the device (kernels on other streams may still use them).
  std::vector<at::Tensor> retired;
  WatchRecord* record = nullptr;  // owned (kernels->free_record)
  int64_t births_read = 0, findings_read = 0;
};

// Test seam (cublas_guard_testing.watch_test_seam): read at a block's start.
struct TestSeam {
  bool two_cpu_devices = false;  // float64 CPU tensors on a tag array of their own
  bool late_harvest = false;     // polls see nothing: the record is read at check(), the block's end
                              // or an error path, as on a GPU running behind the host
  int64_t tag_capacity = 0;  // > 0: the initial tag slots per device (growth tests)
};
void set_test_seam_values(bool two_cpu_devices, bool late_harvest, int64_t tag_capacity);
TestSeam test_seam();

// A thread's tag state: reset when the thread's outermost block begins.
struct TagState {
  std::recursive_mutex mu;
  TestSeam seam;
  int64_t capacity = 4096;  // ring entries and record entries (a power of two)
  std::vector<CallDesc> ring;
  int64_t next_seq = 0;
  int64_t op_first_seq = 0;  // the first sequence number of the op being finished
  std::deque<DeviceTags> devices;
  std::vector<std::string> names;  // sink descriptions and entry argument names
  std::map<std::pair<const void*, const void*>, int64_t> sink_ids;  // (op, storage) -> written-sink id
  std::unordered_map<int64_t, uint32_t> origin_of_seq;  // births read -> origin id
  std::vector<DeviceTags*> seq_home;  // autograd node index -> the device its forward tag is on
  int64_t lost_births = 0;  // births the record lapped before the host read them
  int64_t lost_findings = 0;  // findings the same way
  int64_t lost_calls = 0;  // births whose call descriptor the ring had overwritten
  ~TagState();
};

// Shared by watch_slots.cpp (which defines them) and watch_device.cpp.
// The tag array a tensor's storage belongs to: its device (and lane).
TagHome home_of(const TagState& w, const at::Tensor& t);
// That array's state, made when the block first touches the device; nullptr: a device with no
// kernels (not watched).
DeviceTags* tags_for(TagState& w, const at::Tensor& t);
// Grows one array (a stream-ordered copy, no sync); the old one is retired until the final check.
void grow(DeviceTags& d, at::Tensor DeviceTags::* which, int64_t capacity);
// Whether t is all of its storage (dense, offset 0): a finite scan of it makes the slot finite.
bool covers_storage(const at::Tensor& t);
// t's slot in d; a new one (*fresh) when its storage has none.
int32_t slot_of(DeviceTags& d, const at::Tensor& t, bool* fresh);
// Watch's own int32 arrays' data (dense, offset 0, never copy-on-write), without data_ptr's checks.
int32_t* raw(const at::Tensor& a);
// One scan of t with arguments a on d's device (on the CPU, an output's or first sight's scan
// also notes the bound it found: note_bound).
void launch(DeviceTags& d, const at::Tensor& t, const TagArgs& a);
// Slot `slot` was judged now (slot_seq[slot] set by the caller): its bound is 2^exp, or unknown
// for exp < 0. Every write of slot_seq outside slot_of goes with one.
void note_bound(DeviceTags& d, int32_t slot, int32_t exp);
// The slot's bound's exponent while valid, else INT32_MAX.
int32_t bound_of(const DeviceTags& d, int32_t slot);
// Tags a whole storage's slot finite without a scan (a rule proved it: finite_by_rule,
// bounded_by_rule, an unhooked step's end), judged by sequence number `seq`, with bound 2^exp
// (exp < 0: none known). Returns the slot.
int32_t tag_finite_unscanned(DeviceTags& d, const at::Tensor& t, int64_t seq, int32_t exp);
// A tensor no watched op wrote gets a slot and a first-sight scan.
void first_sight(TagState& w, const at::Tensor& t);

// The thread's tag state for a block beginning now (outermost: reset it).
std::shared_ptr<TagState> tags_begin(bool outermost, int64_t capacity);
// The op's hooks (watch_fallback.cpp calls them with the session locked).
void tags_before(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args);
// The arg-th argument `t` (the op's input-th tensor input) as a view a birth reads (watch_views.cpp).
void add_view(TagArgs& a, const OpInfo& info, size_t arg, const at::Tensor& t, int32_t input, bool same_home);
// A dense CPU or device tensor as a view read by pointer (kViewNone when not dense, not of a
// float dtype, or with a negative stride); absmax_host reads a CPU one (watch_device_cpu.cpp).
InputView dense_view(const at::Tensor& t);
double absmax_host(const InputView& v);
// Whether a readable CPU tensor holds no NaN/Inf: an inline count when small, else the fused scan.
// `small`: set to whether every value is also below the dtype's small bound (small_bound_exp).
bool host_finite_cpu(const at::Tensor& t, bool* small = nullptr);
// Whether the calling thread's last CPU scan (DeviceKernels::scan) found its tensor small.
bool last_cpu_scan_small();
// `first_seq`: the ring's next sequence number when the op began (the scans of the ops a
// composite op ran inside have numbers from there on).
void tags_after(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                const std::vector<c10::IValue>& args, const torch::jit::Stack& stack, int64_t seq_index,
                int64_t first_seq);
// A guarded layer refused its input: the earliest origin its inputs carry,
// else kNoOrigin (an error path: synchronizes and reads tags back).
uint32_t input_origin(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args);
// Reads the records and turns births into origins and findings into errors;
// with `synchronize`, waits for the devices first (the final check); with
// `as_pending`, a sync finding is kept pending (raised by the caller).
// `at_op`: called right after the op's launches (a birth of that op read
// there has its Python stack taken at the op).
void harvest(Session& s, bool synchronize, bool as_pending, bool at_op = false);
// The report's input<n>_* fields and scalar_<name> fields from a descriptor.
void add_call_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const CallDesc& c);
// The "lost" field of a finding when the block lost births or findings.
void add_lost(ErrorReport& r, const TagState& w);
// The next op's check: harvests when a record's flag is up (an acquire load).
void poll(Session& s);
void poll_locked(Session& s);  // the same, with the session's lock held
// A tensor known finite (the entry check at a block's outermost start, an unhooked step's
// earlier judgement): a fresh slot, whose tag starts finite (slot_of), so no first-sight scan
// reads it again; a slot it already has keeps its tag.
void tags_known_finite(Session& s, const at::Tensor& t);
// An optimizer step run unhooked (watching/optimizer_step.py): before it, first-sight scans of
// what it reads and may write (a value non-finite before the step is not its birth); after it,
// per parameter, each tensor it wrote (`written`: its states, then the parameter) scanned as an
// output of one op, cublas_guard_internal::optimizer_step_writes, whose inputs are `read` (the
// gradient, then the parameter's tensors as they were before the step; watch_python.cpp).
// `finite`: tensors judged finite at the end of this optimizer's last watched step and not
// written since (watching/optimizer_step.py keeps their versions): a finite tag, no scan.
// `bounded`: those of `finite` whose second-moment bound the same step proved (step_writes_finite),
// given that bound again on their fresh slots.
void tags_before_step(Session& s, const std::vector<at::Tensor>& tensors,
                      const std::vector<at::Tensor>& finite, const std::vector<at::Tensor>& bounded);
// Whether a CPU tensor's tag says finite (the host reads the CPU's tag array; false elsewhere).
bool tags_finite_on_host(Session& s, const at::Tensor& t);
// `implied`: the index in `written` of the Adam family's exp_avg, whose finiteness a finite
// parameter proves (watch_device.cpp: step_writes_finite); -1 for none. `second_moment`: the
// index of its exp_avg_sq where the optimizer and group qualify for its proof (a bounded
// gradient and a bounded exp_avg_sq before the step), else -1. Returns whether that second moment
// holds its bound now (carried to the next block's step by watching/optimizer_step.py).
bool tags_after_step(Session& s, const std::vector<at::Tensor>& read, const std::vector<at::Tensor>& written,
                     int64_t implied, int64_t second_moment);
// Python-side sinks and entries (watch_python.cpp).
void tags_reached(Session& s, const at::Tensor& t, const std::string& where);
// `buffer`: one of the model's buffers, judged like an argument by what it reaches (a cache's
// masked-out positions are named at the attention); else an argument of the model.
void tags_entry(Session& s, const at::Tensor& t, const std::string& name, bool allowed, bool buffer);

}  // namespace watch
}  // namespace cublas_guard
