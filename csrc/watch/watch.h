// csrc/watch/watch.h: what the watch's translation units share.
//
// cublas_guard_ext.watch: the op that first produced NaN/Inf, and the module it ran in.
//
// How ops are observed. A RecordFunction callback (what the profiler uses) sees
// every op's inputs and outputs, but torch swallows any exception a callback
// throws, so it could never raise "at the op". Instead this file installs a
// boxed C++ fallback on a dispatch key that no torch kernel uses,
// TESTING_ONLY_GenericMode, and a watch turns that key on in the thread-local
// include set of the watching thread only (autograd carries it to the
// threads that run backward, with the rest of the thread-local state). The key
// sits above Autograd, so every op call that goes through the dispatcher comes
// here first: the user's ops, the ops composite kernels decompose into, and
// the ops the backward formulas call. The fallback keeps the arguments (a
// reused per-depth buffer: reference counts only), runs the op, and scans each
// floating output that may hold new values (views are skipped: they show
// values some earlier op produced) with the project's scan, into a reused
// 4-element slot.
//
// Producer or propagator. Only on the rare bad path (a non-finite output) are
// the inputs looked at: a non-finite scalar argument or tensor input makes the
// op a propagator (an -inf mask, a masked_fill with -inf, the softmax after
// them). Arguments an op writes in place are scanned before it runs, unless
// their values are known: a per-storage table of the last scan (range,
// version, finite or not) answers for a top-level op and for ops that only
// composite ops call, where every write that went through the dispatcher
// either bumped the version or was seen here (an optimizer's chain of in-place
// ops on one tensor then scans each result once). The table is the thread's
// and keeps what was found finite from one block to the next (version
// checked). A composite op (CompositeImplicitAutograd) reuses its inner ops'
// scans for its outputs; any other op's outputs are scanned, since its kernel
// may have written them directly, except where they are finite by
// construction (Values: ops that only move values or write 0/1 or a finite
// scalar, and x * s, x / s, x + s with a scalar that cannot overflow a known
// finite x; narrowing casts are always scanned). Ops that return nothing (the
// _foreach_*_ family, fused optimizers) are judged on the tensors they wrote.
// Values written behind torch's back (numpy views, raw pointers, .data writes
// outside the block) are not seen (the entry check has the same limit).
//
// Attribution. Python's global module hooks push/pop module ids on the
// session's stack (forward). In forward each op stores the module under the
// autograd sequence number its node will take (at::sequence_number::peek());
// in backward the node being evaluated (torch::autograd::get_current_node())
// gives that number back, hence the forward module.
//
// Modes. sync: the op raises the typed error (built by cublas_guard_ext.errors)
// before its output is returned. async: the first finding is kept and raised
// by the next watched op, at cublas_guard_ext.check() or at the end of the
// block. CPU-verified; on CUDA the deferred protocol (watch_device.h) runs instead.
//
// The files (by concern): watch_ops.cpp (op traits: what an op writes, which
// outputs are finite by construction), watch_bounds.cpp (outputs finite by
// their inputs' value bounds), watch_table.cpp (the known-values
// table and the scans), watch_session.cpp (the session registry, module
// attribution, judging a bad output), watch_fallback.cpp (the hot path),
// watch_reraise.cpp (cuBLAS/CUDA errors re-raised typed), watch_python.cpp
// (the hand-written CPython module cublas_guard_ext._watch_native), and the
// deferred protocol, the same rule decided on the device with no host sync
// (watch_device.h; Session::device set: the fallback hands each op to it).
#pragma once

#include <Python.h>

#include "guard.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace cublas_guard {
namespace watch {

constexpr c10::DispatchKey kWatchKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr int kModeSync = 1;
constexpr int kModeAsync = 2;

// What makes a finding (watch(..., report=)). kReportBirth: every non-finite
// value an op produces from finite inputs, at that op (the original rule).
// kReportConsequence: a non-finite value is judged by what it reaches. Both
// run one protocol, the one a device kernel can run without a host sync
// (docs/watch-design.md): record on bad (a non-finite output gets an origin
// tag: a new origin when its inputs are finite, else the earliest reportable
// origin of its inputs), decide from the bits (a sink reads the tag of what
// reaches it). Birth mode decides at the record; consequence mode at a sink:
// the model's outputs, a backward root (the loss), a parameter's or input's
// gradient, a parameter or buffer written in the block, state written outside
// the model's forward and backward (an optimizer's), a guarded layer that
// refuses its input.
constexpr int kReportConsequence = 0;
constexpr int kReportBirth = 1;

// Origin tags (Known::origin). kNoOrigin: finite, or non-finite from no op
// this watch saw; kQuietOrigin: intended (a non-finite Scalar argument such as
// masked_fill(..., -inf), an op or module in allow=, an allowed argument):
// never a finding; >= kFirstOrigin: OriginStore::origins[tag - kFirstOrigin].
constexpr uint32_t kNoOrigin = 0;
constexpr uint32_t kQuietOrigin = 1;
constexpr uint32_t kFirstOrigin = 2;

// Ops whose outputs are finite by construction when their inputs are (see
// finite_by_construction): their outputs are not scanned.
enum class Values : uint8_t {
  kComputed,   // anything: scanned
  kMoves,      // every output value is an input value, a Scalar argument or 0 (clone, cat, where...)
  kZeroOne,    // every output value is 0 or 1 (bernoulli)
  kScaleDown,  // x * s with |s| <= 1, x / s with |s| >= 1 (s a Scalar or a wrapped number)
  kAddSmall,   // x + alpha * s, x - alpha * s with |alpha * s| <= add_bound(dtype)
};

// The ops whose output bounds follow from their inputs' (watch_bounds.cpp).
enum class Rule : uint8_t { kNone, kScale, kDivide, kAdd, kSubtract, kLerp, kAddcmul, kAddcdiv, kSqrt };

// What the fallback needs to know about an operator, computed once per operator.
struct OpInfo {
  bool skip = false;                 // outputs are uninitialised memory (empty, resize_, set_)
  std::vector<uint8_t> scan_return;  // per return: 1 = may hold new values (not a pure view)
  std::vector<int> inplace_args;     // arguments the op writes in place (not out=)
  std::vector<uint8_t> is_out_arg;   // out= arguments: outputs, not inputs
  std::vector<int> written_args;     // every argument the op writes (in place and out=)
  size_t num_args = 0;
  bool scan_written_args = false;    // returns nothing but writes arguments (_foreach_add_)
  bool composite = false;            // decomposes into dispatched ops, writes nothing itself
  Values values = Values::kComputed;
  bool divides = false;              // kScaleDown: div (the scalar is the divisor)
  std::vector<int> scalar_args;      // arguments of schema type Scalar or Scalar?
  Rule rule = Rule::kNone;           // watch_bounds.cpp's rule for this op's output
};

// Bounds on a finite tensor's values (lo <= v <= hi for every value v), from
// the CPU scan's range pass or from an op's inputs' bounds (watch_bounds.cpp);
// unbounded (infinite) when not known.
struct Range {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool bounded() const {
    return lo > -std::numeric_limits<double>::infinity() && hi < std::numeric_limits<double>::infinity();
  }
};

struct Counts {
  int64_t nan = 0, posinf = 0, neginf = 0, first = -1;
  Range range;  // finite results: the values' bounds where the scan (or the table) had them
  bool bad() const { return first >= 0; }
};

// What is known about a storage's values: a range scanned at a version.
struct Known {
  // Which storage (watch_lifetime.cpp): the data pointer and its stamp, or
  // where the storage's deleter cannot be wrapped, a weak reference.
  const void* data = nullptr;
  uint64_t stamp = 0;
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{
      c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())};
  void track(const at::Tensor& t);              // made for t's storage
  bool alive() const;                           // that storage's data is not freed
  bool describes(const at::Tensor& t) const;    // t's storage is the one it was made for
  int64_t begin = 0, end = 0;
  uint32_t version = 0;
  bool finite = false;
  uint32_t origin = kNoOrigin;  // non-finite values: where they were born (kFirstOrigin...)
  const c10::FunctionSchema* producer = nullptr;  // finite values: the op whose output was scanned
  Range range;  // finite values: their bounds, where known (Range::bounded)
};

// Address -> V, open addressing with linear probing in one array: no
// allocation per entry (a node-based map allocated one per scanned output,
// thousands per training step, long-lived and scattered over the heap; with
// them the step took ~15,000 more page faults than without, see
// benchmarks/NOTES.md section 7). Erase shifts the following entries back
// (no tombstones). Allocates only when it grows. The known-values table and
// the stamp registry (watch_lifetime.cpp) are both one.
template <class K, class V>
class AddressTable {
 public:
  AddressTable() : slots_(kInitial) {}

  V* find(K key) {
    for (size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == nullptr) return nullptr;
    }
  }

  // The entry of `key`, a default V when it had none.
  V& insert(K key) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t i = home(key);
    for (; slots_[i].key != nullptr; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return slots_[i].value;
    }
    slots_[i].key = key;
    ++size_;
    return slots_[i].value;
  }

  void erase(K key) {
    if (size_ == 0) return;
    size_t i = home(key);
    for (; slots_[i].key != key; i = (i + 1) & mask()) {
      if (slots_[i].key == nullptr) return;
    }
    // Backward shift: move each following entry whose probe passes over i.
    for (size_t j = (i + 1) & mask(); slots_[j].key != nullptr; j = (j + 1) & mask()) {
      const size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (stays) continue;
      slots_[i] = std::move(slots_[j]);
      i = j;
    }
    slots_[i] = Slot();
    --size_;
  }

  size_t size() const { return size_; }

 protected:
  static constexpr size_t kInitial = 4096;  // a power of two
  struct Slot {
    K key = nullptr;
    V value;
  };
  size_t mask() const { return slots_.size() - 1; }
  size_t home(K key) const {
    // Fibonacci hashing of the address (its low bits are alignment zeros)
    const uint64_t h = reinterpret_cast<uintptr_t>(key) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 20) & mask();
  }
  void grow() {
    std::vector<Slot> old(2 * slots_.size());
    old.swap(slots_);
    size_ = 0;
    for (Slot& e : old) {
      if (e.key != nullptr) insert(e.key) = std::move(e.value);
    }
  }
  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// Storage -> Known. Allocates when it grows, and when the session begins.
class KnownTable : public AddressTable<const c10::StorageImpl*, Known> {
 public:
  // Drops the entries of freed storages, and with `finite_only` those of
  // non-finite values (rehashing into the same capacity, a reused buffer).
  void drop_expired(bool finite_only = false) {
    spare_.resize(slots_.size());
    spare_.swap(slots_);
    size_ = 0;
    for (Slot& e : spare_) {
      if (e.key != nullptr && e.value.alive() && (e.value.finite || !finite_only)) {
        insert(e.key) = std::move(e.value);
      }
      e = Slot();
    }
  }

  size_t prune_at = 1024;  // remember() drops freed storages' entries when the size reaches it

 private:
  std::vector<Slot> spare_;
};

// One table per thread, kept from one watch block to the next: what the last
// block's scans found finite stays known while the storage lives and its
// version does not move (an optimizer's state, written at every step by the
// last block, needs no scan before the next block's first in-place op on it).
// Writes outside a block through the dispatcher bump the version; writes
// behind torch's back (numpy, raw pointers, .data) are not seen, the limit the
// entry check already has. Values found non-finite are dropped at the end of
// a block. Sessions of backward ops on an engine thread use the table of the
// forward thread (through its session), as they always did.
// The table and the lock of one thread's watch state, shared (refcounted)
// by that thread's sessions and by the autograd device threads that run their
// backward nodes: every read or write of a session's state holds `mu`.
// Never taken around an op's kernel, never held while waiting for the GIL
// (findings and stacks are raised and taken after it is released: Deferred).
struct ThreadTable {
  std::recursive_mutex mu;
  KnownTable table;
};
std::shared_ptr<ThreadTable> thread_table();

// A recorded birth: the finding's report, built when the value was born (op,
// module, phase, counts, inputs, the Python stack), raised when it reaches a
// sink. Births of the same op, module, phase and output share one record (T5
// takes log(0) at every forward).
struct Origin {
  ErrorReport report{"non_finite_output"};
  std::string summary;
};
struct OriginStore {
  static constexpr size_t kMax = 4096;  // distinct births kept per block; later ones reuse the last
  std::vector<Origin> origins;
  std::unordered_map<std::string, uint32_t> by_key;
};

struct DeviceWatch;  // the deferred protocol's state (watch_device.h)

struct Session {
  int mode = kModeSync;
  int report = kReportBirth;
  bool has_model = false;
  // verify_inputs=True: inputs known finite are scanned again before each op;
  // non-finite ones were written by no op (NonFiniteFromNowhereError).
  bool verify = false;
  // Parameters and buffers of the watched model: storage -> name (sinks when written).
  std::unordered_map<const c10::StorageImpl*, std::string> state;
  // Shared with a nested watch: both read the thread's table, whose tags index it.
  std::shared_ptr<OriginStore> origins = std::make_shared<OriginStore>();
  uint64_t thread_id = 0;
  bool key_was_included = false;
  std::shared_ptr<Session> outer;  // a watch nested in this thread's watch
  std::vector<int32_t> module_stack;
  std::vector<std::string> module_names;  // id -> qualified name
  std::vector<uint8_t> module_allowed;    // id -> non-finite results allowed there
  std::vector<std::string> allowed_ops;   // "aten::log" or "aten::log.default"
  uint64_t seq_base = 0;
  std::vector<int32_t> seq_module;  // autograd sequence number - seq_base -> module id
  // Same index -> the origin tag of the forward op's output (consequence mode):
  // a non-finite gradient of a node whose forward produced a tagged value is a
  // consequence of that value (log's gradient at the 0 that gave -inf), not a birth.
  std::vector<uint32_t> seq_origin;
  std::atomic<bool> pending{false};  // async: a finding waits to be raised
  std::string pending_message;
  std::atomic<int64_t> ops_seen{0}, outputs_scanned{0}, scans_saved{0};
  at::Tensor slot;  // int64[4]: the scan's result, reused
  // Storage -> its last scan (the thread's table). Weak references: a freed
  // storage's entry can never match a new one (the StorageImpl stays
  // allocated while referenced).
  std::shared_ptr<ThreadTable> shared = thread_table();
  KnownTable& known = shared->table;
  std::recursive_mutex& mu = shared->mu;
  // Set: this block runs the deferred protocol (watch_device.h); null: the direct path.
  std::shared_ptr<DeviceWatch> device;
};
using SessionRef = std::shared_ptr<Session>;
using SessionLock = std::unique_lock<std::recursive_mutex>;

// What a locked section leaves to do once the lock is released: a finding to
// raise (sync) and a birth whose Python stack is still to be taken.
struct Deferred {
  std::string raise;
  uint32_t stack_for = kNoOrigin;
};
extern thread_local Deferred tls_deferred;
// Runs the deferred work of this thread; call with the session's lock released.
void run_deferred(Session& s);

extern thread_local Session* tls_session;  // this thread's innermost watch (owned by tls_session_ref)
extern thread_local SessionRef tls_session_ref;
// The op whose outputs are being scanned (remember() keeps it as the producer).
extern thread_local const c10::FunctionSchema* tls_producer;
extern thread_local int tls_depth;
// The depth of the outermost op running now that is not composite (its kernel
// may write buffers directly, below the dispatcher); INT_MAX when none. The
// table of known values is trusted only by ops with no such op around them.
extern thread_local int tls_kernel_depth;
// Per nesting depth; a deque, so growing it keeps the outer frames' references valid.
extern thread_local std::deque<std::vector<c10::IValue>> tls_saved_args;

// Sessions by the id of their thread (watch_session.cpp).
std::mutex& registry_mutex();
std::unordered_map<uint64_t, SessionRef>& registry();

// watch_ops.cpp: op traits.
bool starts_with(const std::string& s, const char* prefix);
const OpInfo& op_info(const c10::OperatorHandle& op);
bool scalar_non_finite(const c10::IValue& v);
// A finite real number from a Scalar argument or a wrapped number (x * 0.5).
bool real_value(const c10::IValue& v, double& out);
bool is_inplace_arg(const OpInfo& info, int a);
bool finite_by_construction(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                            bool inplace_bad_before, const at::Tensor& out, bool& known);
std::string op_display_name(const c10::FunctionSchema& schema);

// watch_bounds.cpp: outputs finite by their inputs' bounds (lerp_, addcmul_,
// sqrt, addcdiv_, x * s, x / s, x + s with bounded inputs); `range` receives
// the output's bounds. `inplace_before`: the written argument's bounds before the op.
bool bounded_by_construction(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                             const Range& inplace_before, const at::Tensor& out, Range& range);
bool op_allowed(const Session& s, const c10::FunctionSchema& schema);

// Calls fn(tensor) for every tensor in an argument (a tensor, a list of tensors
// or of optional tensors).
template <typename Fn>
void for_each_tensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) fn(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) fn(e.toTensor());
    }
  }
}

// watch_table.cpp: the known-values table and the scans.
bool readable(const at::Tensor& t);
bool storage_range(const at::Tensor& t, int64_t& begin, int64_t& end);
bool trusted();
const Known* lookup(Session& s, const at::Tensor& t);
void forget(Session& s, const at::Tensor& t);
void remember(Session& s, const at::Tensor& t, bool finite, const Range& range = Range());
// The origin tag of t's storage when its last scan found it non-finite, else kNoOrigin.
uint32_t origin_of(Session& s, const at::Tensor& t);
// Tags t's storage, known non-finite, with `origin`.
void tag(Session& s, const at::Tensor& t, uint32_t origin);
// The tag to keep of two: the earlier reportable origin, else the quieter one.
uint32_t better_origin(uint32_t a, uint32_t b);
bool known_finite(Session& s, const at::Tensor& t);
// The bounds of t's values when the table knows them finite and bounded, else unbounded.
Range known_range(Session& s, const at::Tensor& t);
// How t's entry tells its storage from a later one at the same address
// ("stamp" or "weak", watch_lifetime.cpp), or nullptr without an entry; and
// how many storages carry a stamp now (test hooks).
const char* entry_tracking(Session& s, const at::Tensor& t);
size_t stamped_storages();
void hold_stamp_lock(double seconds);  // test seam: the registry's lock held that long
Counts scan_values(Session& s, const at::Tensor& t);
Counts scan_fresh(Session& s, const at::Tensor& t);
Counts scan_known(Session& s, const at::Tensor& t);

// watch_session.cpp: the session, attribution and the judgement of a bad output.
// This thread's session, else (an autograd device thread) the session of the
// node's forward thread, held by `hold` while the caller uses it.
Session* current_session(SessionRef& hold);
struct Where {
  int32_t module = -1;
  bool backward = false;
  std::string node_name;
};
Where where_now(const Session& s);
void describe_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const OpInfo& info);
void add_where(ErrorReport& r, const Session& s, const Where& w);
[[noreturn]] void raise_message(const std::string& message);
// The pending async finding, raised after the lock is released.
void raise_pending(Session& s);
// The bad path: output t of op is not all finite. Returns its origin tag;
// in birth mode raises (sync) or keeps (async) the finding of a producer.
uint32_t judge(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
               const std::vector<c10::IValue>& args, bool inplace_bad_before, uint32_t inplace_origin,
               const at::Tensor& t, int64_t index, const Counts& c);
// A tagged value reached a sink (`where`, in words): the finding of its origin
// is raised (sync) or kept (async). Nothing for untagged and quiet values, or
// in birth mode.
void reached(Session& s, uint32_t origin, const std::string& where);
// Keeps a birth's report under `key` (once per op, module, phase and output); its OriginStore id.
uint32_t record_origin(Session& s, ErrorReport& r, const std::string& key, const std::string& summary,
                       bool with_stack);
// Records a non-finite argument of the watched model as an origin (entry finding).
uint32_t entry_origin(Session& s, const at::Tensor& t, const std::string& name, const Counts& c);
// The innermost Python frames outside torch and this package, one per line.
std::string python_stack();

// watch_reraise.cpp: cuBLAS/CUDA errors of an op re-raised typed.
bool mentions_cuda_failure(const std::string& m);
[[noreturn]] void reraise_typed(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                                const std::vector<c10::IValue>& args, PyObject* original,
                                const std::string& original_message);
bool is_guard_error(PyObject* value);
std::string py_str(PyObject* value);

// watch_fallback.cpp: the boxed fallback on kWatchKey.
void install_fallback();

}  // namespace watch
}  // namespace cublas_guard
