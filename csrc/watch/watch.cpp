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
// block. CPU-verified; CUDA tensors are scanned through ATen with a host sync
// (see the README's watch section).
#include <Python.h>

#include "guard.h"

#include <ATen/SequenceNumber.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/logical_not.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace cublas_guard {
namespace watch {
namespace {

constexpr c10::DispatchKey kWatchKey = c10::DispatchKey::TESTING_ONLY_GenericMode;
constexpr int kModeSync = 1;
constexpr int kModeAsync = 2;

// Ops whose outputs are finite by construction when their inputs are (see
// finite_by_construction): their outputs are not scanned.
enum class Values : uint8_t {
  kComputed,   // anything: scanned
  kMoves,      // every output value is an input value, a Scalar argument or 0 (clone, cat, where...)
  kZeroOne,    // every output value is 0 or 1 (bernoulli)
  kScaleDown,  // x * s with |s| <= 1, x / s with |s| >= 1 (s a Scalar or a wrapped number)
  kAddSmall,   // x + alpha * s, x - alpha * s with |alpha * s| <= add_bound(dtype)
};

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
};

struct Counts {
  int64_t nan = 0, posinf = 0, neginf = 0, first = -1;
  bool bad() const { return first >= 0; }
};

// What is known about a storage's values: a range scanned at a version.
struct Known {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::weak_intrusive_ptr<c10::StorageImpl>(
      c10::intrusive_ptr<c10::StorageImpl>())};
  int64_t begin = 0, end = 0;
  uint32_t version = 0;
  bool finite = false;
};

// Storage -> Known, open addressing with linear probing in one array: no
// allocation per entry (a node-based map allocated one per scanned output,
// thousands per training step, long-lived and scattered over the heap; with
// them the step took ~15,000 more page faults than without, see
// benchmarks/NOTES.md section 7). Erase shifts the following entries back
// (no tombstones). Allocates only when it grows, and when the session begins.
class KnownTable {
 public:
  KnownTable() : slots_(kInitial) {}

  Known* find(const c10::StorageImpl* key) {
    for (size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == nullptr) return nullptr;
    }
  }

  Known& insert(const c10::StorageImpl* key) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    size_t i = home(key);
    for (; slots_[i].key != nullptr; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return slots_[i].value;
    }
    slots_[i].key = key;
    ++size_;
    return slots_[i].value;
  }

  void erase(const c10::StorageImpl* key) {
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

  // Drops the entries of freed storages, and with `finite_only` those of
  // non-finite values (rehashing into the same capacity, a reused buffer).
  void drop_expired(bool finite_only = false) {
    spare_.resize(slots_.size());
    spare_.swap(slots_);
    size_ = 0;
    for (Slot& e : spare_) {
      if (e.key != nullptr && !e.value.storage.expired() && (e.value.finite || !finite_only)) {
        insert(e.key) = std::move(e.value);
      }
      e = Slot();
    }
  }

  size_t prune_at = 1024;  // remember() drops freed storages' entries when the size reaches it

  size_t size() const { return size_; }

 private:
  static constexpr size_t kInitial = 4096;  // a power of two
  struct Slot {
    const c10::StorageImpl* key = nullptr;
    Known value;
  };
  size_t mask() const { return slots_.size() - 1; }
  size_t home(const c10::StorageImpl* key) const {
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
  std::vector<Slot> spare_;
  size_t size_ = 0;
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
KnownTable& thread_known() {
  static thread_local KnownTable table;
  return table;
}

struct Session {
  int mode = kModeSync;
  uint64_t thread_id = 0;
  bool key_was_included = false;
  Session* outer = nullptr;  // a watch nested in this thread's watch
  std::vector<int32_t> module_stack;
  std::vector<std::string> module_names;  // id -> qualified name
  std::vector<uint8_t> module_allowed;    // id -> non-finite results allowed there
  std::vector<std::string> allowed_ops;   // "aten::log" or "aten::log.default"
  uint64_t seq_base = 0;
  std::vector<int32_t> seq_module;  // autograd sequence number - seq_base -> module id
  bool pending = false;             // async: a finding waits to be raised
  std::string pending_message;
  int64_t ops_seen = 0, outputs_scanned = 0, scans_saved = 0;
  at::Tensor slot;  // int64[4]: the scan's result, reused
  // Storage -> its last scan (the thread's table). Weak references: a freed
  // storage's entry can never match a new one (the StorageImpl stays
  // allocated while referenced).
  KnownTable& known = thread_known();
};

thread_local Session* tls_session = nullptr;
thread_local int tls_depth = 0;
// The depth of the outermost op running now that is not composite (its kernel
// may write buffers directly, below the dispatcher); INT_MAX when none. The
// table of known values is trusted only by ops with no such op around them.
thread_local int tls_kernel_depth = std::numeric_limits<int>::max();
// Per nesting depth; a deque, so growing it keeps the outer frames' references valid.
thread_local std::deque<std::vector<c10::IValue>> tls_saved_args;
thread_local std::unordered_map<const void*, OpInfo> tls_op_info;

// Sessions by the id of their thread: backward ops running on another thread
// (a device thread of the autograd engine) find the session of the thread
// whose forward created the node.
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_map<uint64_t, Session*>& registry() {
  static std::unordered_map<uint64_t, Session*> r;
  return r;
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// The explicit lists behind Values (aten ops only; tests/test_watch.py plants
// a non-finite input through each kMoves/kZeroOne op and overflows through
// the arithmetic ones). Whole names cover every overload; an op whose
// overloads differ (scatter's reduce=, index_put's accumulate=) is not listed.
Values value_class(const std::string& base, const std::string& overload) {
  static const std::unordered_map<std::string, Values> by_name = [] {
    std::unordered_map<std::string, Values> m;
    for (const char* n : {
             // copies and layout changes
             "clone", "copy_", "_to_copy", "_unsafe_view",
             "lift_fresh_copy", "contiguous", "expand_copy", "permute_copy", "transpose_copy",
             "t_copy", "squeeze_copy", "unsqueeze_copy", "slice_copy", "select_copy",
             "diagonal_copy", "as_strided_copy", "alias_copy", "detach_copy", "view_copy",
             "_reshape_copy", "narrow_copy", "unfold_copy", "repeat", "roll", "flip",
             // gathering and joining
             "cat", "stack", "index_select", "gather", "take", "embedding",
             "masked_select", "masked_scatter", "masked_scatter_",
             // scattering into zeros, zeroing parts
             "slice_backward", "select_backward", "diagonal_backward", "tril", "triu", "tril_",
             "triu_", "constant_pad_nd",
             // choosing between inputs and scalars
             "where", "masked_fill", "masked_fill_", "relu", "relu_", "clamp", "clamp_",
             "clamp_min", "clamp_min_", "clamp_max", "clamp_max_",
             // sign changes
             "neg", "neg_", "abs", "abs_",
             // filling with a scalar
             "fill_", "zero_", "zeros", "zeros_like", "ones", "ones_like", "full", "full_like",
             "new_zeros", "new_ones", "new_full", "scalar_tensor",
         }) {
      m.emplace(n, Values::kMoves);
    }
    m.emplace("bernoulli", Values::kZeroOne);
    m.emplace("bernoulli_", Values::kZeroOne);
    for (const char* n : {"mul", "mul_", "div", "div_"}) m.emplace(n, Values::kScaleDown);
    for (const char* n : {"add", "add_", "sub", "sub_"}) m.emplace(n, Values::kAddSmall);
    return m;
  }();
  if (base == "index") return overload == "Tensor" ? Values::kMoves : Values::kComputed;  // a gather
  const auto it = by_name.find(base);
  if (it == by_name.end()) return Values::kComputed;
  if (it->second == Values::kScaleDown || it->second == Values::kAddSmall) {
    // Tensor/Scalar overloads only (not div's rounding modes, not out=)
    if (overload != "Tensor" && overload != "Scalar") return Values::kComputed;
  }
  return it->second;
}

const OpInfo& op_info(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  auto it = tls_op_info.find(key);
  if (it != tls_op_info.end()) return it->second;
  const c10::FunctionSchema& schema = op.schema();
  OpInfo info;
  const std::string& name = schema.name();
  const auto sep = name.find("::");
  const std::string base = sep == std::string::npos ? name : name.substr(sep + 2);
  info.skip = starts_with(base, "empty") || starts_with(base, "new_empty") ||
              starts_with(base, "_empty") || starts_with(base, "resize") ||
              starts_with(base, "_resize") || base == "set_" || base == "_local_scalar_dense";
  info.num_args = schema.arguments().size();
  info.is_out_arg.resize(info.num_args, 0);
  // In-place ops whose result does not depend on the old values: the written
  // argument is an output only (like out=), never pre-scanned.
  const bool overwrites = base == "fill_" || base == "zero_" || base == "copy_" ||
                          base == "normal_" || base == "uniform_" || base == "random_" ||
                          base == "bernoulli_" || base == "exponential_";
  for (size_t i = 0; i < info.num_args; ++i) {
    const auto& arg = schema.arguments()[i];
    const c10::AliasInfo* alias = arg.alias_info();
    if (alias != nullptr && alias->isWrite()) info.written_args.push_back(static_cast<int>(i));
    if (arg.is_out() || (overwrites && alias != nullptr && alias->isWrite())) {
      info.is_out_arg[i] = 1;
    } else if (alias != nullptr && alias->isWrite()) {
      info.inplace_args.push_back(static_cast<int>(i));
    }
  }
  for (const auto& ret : schema.returns()) {
    const c10::AliasInfo* alias = ret.alias_info();
    info.scan_return.push_back(alias == nullptr || alias->isWrite() ? 1 : 0);
  }
  info.scan_written_args = schema.returns().empty() && !info.written_args.empty();
  for (size_t i = 0; i < info.num_args; ++i) {
    c10::TypePtr type = schema.arguments()[i].type();
    if (const auto opt = type->castRaw<c10::OptionalType>()) type = opt->getElementType();
    if (type->kind() == c10::TypeKind::NumberType) info.scalar_args.push_back(static_cast<int>(i));
  }
  // CompositeImplicitAutograd kernels are made of dispatcher calls only (they
  // must be, to be differentiable): their outputs are what inner ops returned.
  // An op with its own backend kernel uses that one instead. aten's Autograd
  // kernels of such ops (linear, matmul: VariableType) only redispatch to the
  // composite kernel; another namespace's Autograd kernel may compute.
  using K = c10::DispatchKey;
  const bool aten = starts_with(name, "aten::");
  info.composite = op.hasKernelForDispatchKey(K::CompositeImplicitAutograd) &&
                   !op.hasKernelForDispatchKey(K::CPU) && !op.hasKernelForDispatchKey(K::CUDA) &&
                   (aten || (!op.hasKernelForDispatchKey(K::Autograd) &&
                             !op.hasKernelForDispatchKey(K::AutogradCPU) &&
                             !op.hasKernelForDispatchKey(K::AutogradCUDA))) &&
                   !op.hasKernelForDispatchKey(K::CompositeExplicitAutograd) &&
                   !op.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
  if (aten) info.values = value_class(base, schema.overload_name());
  info.divides = starts_with(base, "div");
  return tls_op_info.emplace(key, std::move(info)).first->second;
}

// Tensors whose values this file can read: dense, with storage, not a wrapper
// (fake, functional, batched) whose data is elsewhere.
bool readable(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.layout() != at::kStrided || t.numel() == 0) {
    return false;
  }
  if (t.is_meta() || !t.has_storage()) return false;
  static const c10::DispatchKeySet wrappers = c10::DispatchKeySet({
      c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot, c10::DispatchKey::Fake,
      c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::BatchedNestedTensor,
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
  if (k.version != t._version() || k.storage.expired()) return nullptr;
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

void remember(Session& s, const at::Tensor& t, bool finite) {
  if (t.is_inference() || !t.has_storage()) return;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  int64_t begin = 0, end = 0;
  if (!t.is_non_overlapping_and_dense() || !storage_range(t, begin, end)) {
    s.known.erase(key);
    return;
  }
  if (s.known.size() >= s.known.prune_at) {  // drop the entries of freed storages
    s.known.drop_expired();
    s.known.prune_at = std::max<size_t>(1024, 2 * s.known.size());
  }
  Known& k = s.known.insert(key);
  k.storage = t.storage().getWeakStorageImpl();
  k.begin = begin;
  k.end = end;
  k.version = t._version();
  k.finite = finite;
}

// One fused pass (the project's scan) for float32 on the CPU; other dtypes and
// devices go through ATen until the scan takes them (a host sync on CUDA).
Counts scan_values(Session& s, const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  Counts c;
  if (t.device().is_cpu() && is_guarded_dtype(t.scalar_type())) {
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
  remember(s, t, !c.bad());
  return c;
}

Counts scan_known(Session& s, const at::Tensor& t) {
  if (const Known* k = lookup(s, t)) {
    ++s.scans_saved;
    Counts c;
    if (!k->finite) c.first = 0;  // known bad: the counts are not needed by callers
    return c;
  }
  ++s.outputs_scanned;
  Counts c = scan_values(s, t);
  remember(s, t, !c.bad());
  return c;
}

bool scalar_non_finite(const c10::IValue& v) {
  if (v.isDouble()) return !std::isfinite(v.toDouble());
  if (v.isComplexDouble()) {
    const auto z = v.toComplexDouble();
    return !std::isfinite(z.real()) || !std::isfinite(z.imag());
  }
  return false;
}

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


// ---------------------------------------------------------------------------
// Outputs that are finite by construction (Values). Skipping their scan never
// hides a finding: a kMoves/kZeroOne output can only be non-finite where an
// input is (or never), which makes the op a propagator that is never blamed;
// the arithmetic classes are skipped only when the input is known finite and
// the scalar cannot take a finite value out of range (IEEE rounding is
// monotonic: |round(x * s)| <= |x| for |s| <= 1). What is skipped with finite
// inputs is remembered finite, as a scan would have.
// ---------------------------------------------------------------------------

// The largest finite value of a floating dtype (0: not one this file handles).
double max_finite(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return std::numeric_limits<float>::max();
    case at::kDouble: return std::numeric_limits<double>::max();
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return 3.3895313892515355e38;
    default: return 0.0;
  }
}

// |c| up to which x + c cannot round past the dtype's largest finite value:
// at most a quarter of the gap between it and the next power of two (half
// that gap is where round-to-nearest overflows; fp16/bf16 arithmetic runs in
// float32 and rounds once more, hence the margin).
double add_bound(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return std::ldexp(1.0, 102);
    case at::kDouble: return std::ldexp(1.0, 968);
    case at::kHalf: return 4.0;
    case at::kBFloat16: return std::ldexp(1.0, 118);
    default: return 0.0;
  }
}

// Every value of dtype `from` is a finite value of dtype `to` (no overflow).
bool widens(at::ScalarType from, at::ScalarType to) {
  using S = at::ScalarType;
  if (max_finite(to) == 0.0) return false;
  switch (from) {
    case S::Bool:
    case S::Byte:
    case S::Char:
    case S::Short: return true;  // |v| <= 32767 < 65504
    case S::Int:
    case S::Long: return to != S::Half;
    case S::Half: return true;  // fp16's max is finite in bf16, fp32, fp64
    case S::BFloat16: return to != S::Half;
    case S::Float: return to == S::Float || to == S::Double;
    case S::Double: return to == S::Double;
    default: return false;
  }
}

// A real number from a Scalar argument or a wrapped number (a Python scalar
// passed where a tensor goes: x * 0.5 calls mul.Tensor).
bool real_value(const c10::IValue& v, double& out) {
  if (v.isDouble()) {
    out = v.toDouble();
  } else if (v.isInt()) {
    out = static_cast<double>(v.toInt());
  } else if (v.isBool()) {
    out = v.toBool() ? 1.0 : 0.0;
  } else if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number() || !t.device().is_cpu()) {
      return false;
    }
    switch (t.scalar_type()) {
      case at::kDouble: out = *static_cast<const double*>(t.const_data_ptr()); break;
      case at::kLong: out = static_cast<double>(*static_cast<const int64_t*>(t.const_data_ptr())); break;
      case at::kBool: out = *static_cast<const bool*>(t.const_data_ptr()) ? 1.0 : 0.0; break;
      default: return false;
    }
  } else {
    return false;
  }
  return std::isfinite(out);
}

// The value of a one-element CPU tensor (the wrapped numbers that kernels cast
// to the op's dtype: x * 0.5 on float32 copies a float64 0.5 to float32).
bool single_value(const at::Tensor& t, double& out) {
  if (t.numel() != 1 || !t.device().is_cpu() || !t.has_storage() || t.layout() != at::kStrided) {
    return false;
  }
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble: out = *static_cast<const double*>(p); return true;
    case at::kFloat: out = *static_cast<const float*>(p); return true;
    case at::kHalf: out = static_cast<float>(*static_cast<const at::Half*>(p)); return true;
    case at::kBFloat16: out = static_cast<float>(*static_cast<const at::BFloat16*>(p)); return true;
    case at::kLong: out = static_cast<double>(*static_cast<const int64_t*>(p)); return true;
    case at::kInt: out = static_cast<double>(*static_cast<const int32_t*>(p)); return true;
    default: return false;
  }
}

bool known_finite(Session& s, const at::Tensor& t) {
  const Known* k = lookup(s, t);
  return k != nullptr && k->finite;
}

bool is_inplace_arg(const OpInfo& info, int a) {
  for (int i : info.inplace_args) {
    if (i == a) return true;
  }
  return false;
}

// Whether `out` (an output of the op) is finite by construction: its scan
// can be skipped. `known`: whether it may be remembered as finite.
bool finite_by_construction(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                            bool inplace_bad_before, const at::Tensor& out, bool& known) {
  known = false;
  const at::ScalarType dtype = out.scalar_type();
  const double limit = max_finite(dtype);
  if (info.values == Values::kComputed || limit == 0.0 || args.size() < info.num_args) return false;
  if (info.values == Values::kZeroOne) {
    known = true;
    return true;
  }
  if (info.values == Values::kMoves) {
    for (int a : info.scalar_args) {
      double v = 0.0;
      if (args[a].isNone()) continue;
      if (!real_value(args[a], v) || std::fabs(v) > limit) return false;
    }
    bool ok = true;
    bool all_known = true;
    for (size_t i = 0; i < info.num_args && ok; ++i) {
      if (info.is_out_arg[i]) continue;
      const bool inplace = is_inplace_arg(info, static_cast<int>(i));
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        if (!ok || !t.defined()) return;
        double v = 0.0;
        if (!widens(t.scalar_type(), dtype) &&
            !(single_value(t, v) && std::isfinite(v) && std::fabs(v) <= limit)) {
          ok = false;  // a narrowing cast: scanned (fp32 -> fp16 overflows)
          return;
        }
        if (!t.is_floating_point()) return;  // integers and bools are finite
        if (inplace) {
          all_known = all_known && !inplace_bad_before;
        } else if (single_value(t, v)) {
          all_known = all_known && std::isfinite(v);
        } else {
          all_known = all_known && readable(t) && known_finite(s, t);
        }
      });
    }
    known = ok && all_known;
    return ok;
  }
  // kScaleDown, kAddSmall: self (or mul's other) is the tensor, the other a real scalar.
  if (args.size() < 2) return false;
  int x = 0;
  double v = 0.0;
  if (!real_value(args[1], v)) {
    if (info.values != Values::kScaleDown || info.divides || !info.inplace_args.empty() ||
        !real_value(args[0], v) || !args[1].isTensor()) {
      return false;
    }
    // 0.5 * x, on mul only (div's scalar must be the divisor)
    x = 1;
  }
  if (!args[x].isTensor()) return false;
  const at::Tensor& t = args[x].toTensor();
  if (!readable(t) || t.unsafeGetTensorImpl()->is_wrapped_number() || t.scalar_type() != dtype) {
    return false;
  }
  const bool x_finite = is_inplace_arg(info, x) ? !inplace_bad_before : known_finite(s, t);
  if (!x_finite) return false;
  bool safe = false;
  if (info.values == Values::kScaleDown) {
    // mul: |v| <= 1; div (the divisor is args[1]): |v| >= 1
    safe = info.divides ? (x == 0 && std::fabs(v) >= 1.0) : std::fabs(v) <= 1.0;
  } else {
    double alpha = 1.0;
    if (args.size() > 2 && !args[2].isNone() && !real_value(args[2], alpha)) return false;
    // each factor in range too: the kernel casts both to the op's math type first
    const double bound = add_bound(dtype);
    safe = std::fabs(alpha) <= limit && std::fabs(v) <= limit && std::fabs(alpha * v) <= bound;
  }
  known = safe;
  return safe;
}

Session* current_session() {
  if (tls_session != nullptr) return tls_session;
  // A backward op on an engine thread: the session of the node's forward thread.
  const auto node = torch::autograd::get_current_node();
  if (!node) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(node->thread_id());
  return it == registry().end() ? nullptr : it->second;
}

std::string op_display_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  const auto sep = name.find("::");
  if (sep != std::string::npos) name.replace(sep, 2, ".");
  return name + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
}

bool op_allowed(const Session& s, const c10::FunctionSchema& schema) {
  if (s.allowed_ops.empty()) return false;
  const std::string packet = schema.name();
  const std::string full =
      packet + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
  for (const auto& a : s.allowed_ops) {
    if (a == packet || a == full) return true;
  }
  return false;
}

struct Where {
  int32_t module = -1;
  bool backward = false;
  std::string node_name;
};

Where where_now(const Session& s) {
  Where w;
  const auto node = torch::autograd::get_current_node();
  if (node) {
    w.backward = true;
    w.node_name = node->name();
    if (!s.module_stack.empty()) {
      w.module = s.module_stack.back();  // a forward recomputed in backward (checkpointing)
    } else if (node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
      const uint64_t i = node->sequence_nr() - s.seq_base;
      if (i < s.seq_module.size()) w.module = s.seq_module[i];
    }
  } else if (!s.module_stack.empty()) {
    w.module = s.module_stack.back();
  }
  return w;
}

void describe_inputs(ErrorReport& r, const c10::FunctionSchema& schema,
                     const std::vector<c10::IValue>& args, const OpInfo& info) {
  int64_t n = 0;
  for (size_t i = 0; i < args.size() && i < schema.arguments().size(); ++i) {
    if (info.is_out_arg[i]) continue;
    const std::string& arg_name = schema.arguments()[i].name();
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      const std::string p = "input" + std::to_string(n++);
      r.add((p + "_name").c_str(), arg_name);
      r.add((p + "_shape").c_str(), t.sizes());
      r.add((p + "_strides").c_str(), t.strides());
      r.add((p + "_dtype").c_str(), std::string(c10::toString(t.scalar_type())));
      r.add((p + "_device").c_str(), t.device().str());
    });
    if (scalar_non_finite(args[i]) || args[i].isDouble()) {
      const std::string p = "scalar_" + arg_name;
      r.add(p.c_str(), args[i].isDouble() ? args[i].toDouble() : 0.0);
    }
  }
  r.add("num_inputs", n);
}

void add_where(ErrorReport& r, const Session& s, const Where& w) {
  r.add("phase", w.backward ? "backward" : "forward");
  if (w.module >= 0 && static_cast<size_t>(w.module) < s.module_names.size()) {
    r.add("module", s.module_names[w.module]);
  }
  if (!w.node_name.empty()) r.add("backward_node", w.node_name);
}

[[noreturn]] void raise_message(const std::string& message) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  throw_python_error_if_possible(message);
  C10_THROW_ERROR(ValueError, message);
}

void raise_pending(Session& s) {
  if (!s.pending) return;
  s.pending = false;
  std::string message = std::move(s.pending_message);
  s.pending_message.clear();
  raise_message(message);
}

// The bad path: output `t` (return `index`) of `op` is not all finite.
void judge(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
           const std::vector<c10::IValue>& args, bool inplace_bad_before,
           const at::Tensor& t, int64_t index, const Counts& c) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  const c10::FunctionSchema& schema = op.schema();
  // Propagator: a non-finite scalar argument or tensor input.
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    if (scalar_non_finite(args[i])) return;
  }
  if (inplace_bad_before) return;
  bool bad_input = false;
  for (size_t i = 0; i < args.size() && i < info.num_args && !bad_input; ++i) {
    if (info.is_out_arg[i]) continue;
    bool inplace = false;
    for (int a : info.inplace_args) inplace = inplace || a == static_cast<int>(i);
    if (inplace) continue;  // judged by its scan before the op
    for_each_tensor(args[i], [&](const at::Tensor& in) {
      if (!bad_input && readable(in) && scan_known(s, in).bad()) bad_input = true;
    });
  }
  if (bad_input) return;
  if (op_allowed(s, schema)) return;
  const Where w = where_now(s);
  if (w.module >= 0 && static_cast<size_t>(w.module) < s.module_allowed.size() &&
      s.module_allowed[w.module]) {
    return;
  }
  if (s.mode == kModeAsync && s.pending) return;  // only the first finding is kept

  ErrorReport r("non_finite_output");
  const std::string name = op_display_name(schema);
  r.add("op", name);
  add_where(r, s, w);
  r.add("output_index", index);
  r.add("nan_count", c.nan).add("posinf_count", c.posinf).add("neginf_count", c.neginf);
  r.add("first_bad_index", c.first);
  r.add("shape", t.sizes()).add("strides", t.strides());
  r.add("dtype", std::string(c10::toString(t.scalar_type())));
  r.add("device", t.device().str());
  try {
    r.add("first_bad_value", t.reshape({-1})[c.first].item<double>());
  } catch (const std::exception&) {
  }
  describe_inputs(r, schema, args, info);
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  if (s.mode == kModeAsync) r.add("deferred", true);
  const std::string message = r.message("watch: " + name + " produced non-finite values from finite inputs");
  if (s.mode == kModeAsync) {
    s.pending = true;
    s.pending_message = message;
    return;
  }
  raise_message(message);
}

bool mentions_cuda_failure(const std::string& m) {
  return m.find("CUBLAS_STATUS_") != std::string::npos ||
         m.find("CUDA error") != std::string::npos ||
         m.find("cudaError") != std::string::npos;
}

// An op failed with a cuBLAS/CUDA error: re-raise it typed, naming the module
// and op, the original as __cause__ (cublas_guard_ext.watch._op_failure builds it).
[[noreturn]] void reraise_typed(Session& s, const c10::OperatorHandle& op,
                                const OpInfo& info, const std::vector<c10::IValue>& args,
                                PyObject* original, const std::string& original_message) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  ErrorReport r("watch_op_failure");
  r.add("op", op_display_name(op.schema()));
  add_where(r, s, where_now(s));
  describe_inputs(r, op.schema(), args, info);
  const std::string payload = r.json();
  PyObject* module = PyImport_ImportModule("cublas_guard_ext.watch");
  PyObject* exc = nullptr;
  if (module != nullptr) {
    exc = PyObject_CallMethod(module, "_op_failure", "sOs", payload.c_str(),
                              original != nullptr ? original : Py_None, original_message.c_str());
  }
  Py_XDECREF(module);
  if (exc == nullptr || !PyExceptionInstance_Check(exc)) {
    Py_XDECREF(exc);
    PyErr_Clear();
    throw;  // NOLINT: rethrows the exception being handled by the caller
  }
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
  Py_DECREF(exc);
  python_error error;
  error.persist();
  throw error;
}

bool is_guard_error(PyObject* value) {
  PyObject* errors = PyImport_ImportModule("cublas_guard_ext.errors");
  if (errors == nullptr) {
    PyErr_Clear();
    return false;
  }
  PyObject* base = PyObject_GetAttrString(errors, "GuardError");
  Py_DECREF(errors);
  if (base == nullptr) {
    PyErr_Clear();
    return false;
  }
  const int r = PyObject_IsInstance(value, base);
  Py_DECREF(base);
  if (r < 0) PyErr_Clear();
  return r == 1;
}

std::string py_str(PyObject* value) {
  std::string out;
  PyObject* str = value != nullptr ? PyObject_Str(value) : nullptr;
  const char* utf8 = str != nullptr ? PyUnicode_AsUTF8(str) : nullptr;
  if (utf8 != nullptr) out = utf8;
  Py_XDECREF(str);
  PyErr_Clear();
  return out;
}

// Around an op's kernel: ops it calls are nested in a kernel unless it is composite.
struct KernelDepthGuard {
  int saved = tls_kernel_depth;
  explicit KernelDepthGuard(bool kernel) {
    if (kernel) tls_kernel_depth = std::min(tls_kernel_depth, tls_depth);
  }
  ~KernelDepthGuard() { tls_kernel_depth = saved; }
};

struct DepthGuard {
  std::vector<c10::IValue>& saved;
  explicit DepthGuard(std::vector<c10::IValue>& s) : saved(s) { ++tls_depth; }
  ~DepthGuard() {
    saved.clear();
    --tls_depth;
  }
};

void watch_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                    torch::jit::Stack* stack) {
  const c10::DispatchKeySet after =
      ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kWatchKey);
  Session* sp = current_session();
  if (sp == nullptr) {
    op.redispatchBoxed(after, stack);
    return;
  }
  Session& s = *sp;
  ++s.ops_seen;
  if (s.pending) raise_pending(s);  // async: the next watched op reports the first finding
  const OpInfo& info = op_info(op);
  if (info.skip) {
    KernelDepthGuard kernel(true);
    op.redispatchBoxed(after, stack);
    return;
  }
  // Forward: the module this op's autograd node (if any) will belong to.
  if (tls_session == sp && c10::GradMode::is_enabled()) {
    const uint64_t seq = at::sequence_number::peek();
    if (seq >= s.seq_base) {
      const uint64_t i = seq - s.seq_base;
      if (i >= s.seq_module.size()) s.seq_module.resize(i + 1, -1);
      s.seq_module[i] = s.module_stack.empty() ? -1 : s.module_stack.back();
    }
  }
  if (tls_saved_args.size() <= static_cast<size_t>(tls_depth)) tls_saved_args.resize(tls_depth + 1);
  std::vector<c10::IValue>& saved = tls_saved_args[tls_depth];
  DepthGuard depth(saved);
  const size_t n = std::min(info.num_args, stack->size());
  saved.assign(stack->end() - static_cast<std::ptrdiff_t>(n), stack->end());

  // In-place arguments (tensors or lists): were their values finite before
  // the op? Known (the last scan of the same storage and version) or scanned.
  bool inplace_bad_before = false;
  for (int a : info.inplace_args) {
    for_each_tensor(saved[a], [&](const at::Tensor& t) {
      if (!inplace_bad_before && readable(t) && scan_known(s, t).bad()) inplace_bad_before = true;
    });
  }

  try {
    KernelDepthGuard kernel(!info.composite);
    op.redispatchBoxed(after, stack);
  } catch (python_error& e) {
    pybind11::gil_scoped_acquire gil;
    if (e.value == nullptr || is_guard_error(e.value)) throw;
    const std::string message = py_str(e.value);
    if (!mentions_cuda_failure(message)) throw;
    reraise_typed(s, op, info, saved, e.value, message);
  } catch (pybind11::error_already_set& e) {
    pybind11::gil_scoped_acquire gil;
    if (is_guard_error(e.value().ptr())) throw;
    const std::string message = py_str(e.value().ptr());
    if (!mentions_cuda_failure(message)) throw;
    reraise_typed(s, op, info, saved, e.value().ptr(), message);
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    if (message.find(kPayloadMarker) != std::string::npos || !mentions_cuda_failure(message)) throw;
    pybind11::gil_scoped_acquire gil;
    reraise_typed(s, op, info, saved, nullptr, message);
  }

  for (int a : info.written_args) {
    for_each_tensor(saved[a], [&](const at::Tensor& t) { forget(s, t); });
  }
  // An output produced by the op's own kernel is always scanned (a kernel may
  // have written a buffer an inner op scanned); a composite op's output was
  // produced by the inner ops the fallback saw, so their scan is reused.
  auto check_output = [&](const at::Tensor& t, int64_t index) {
    if (!readable(t)) return;
    bool known = false;
    if (finite_by_construction(s, info, saved, inplace_bad_before, t, known)) {
      ++s.scans_saved;
      if (known) remember(s, t, true);
      return;
    }
    const Counts c = info.composite ? scan_known(s, t) : scan_fresh(s, t);
    if (c.bad()) {
      // a known-bad result's counts were not kept: count them for the report
      const Counts full = c.nan + c.posinf + c.neginf > 0 ? c : scan_values(s, t);
      judge(s, op, info, saved, inplace_bad_before, t, index, full);
    }
  };
  if (info.scan_written_args) {
    // Ops that return nothing (the _foreach_*_ family): the arguments they
    // wrote are their outputs.
    for (int a : info.written_args) {
      for_each_tensor(saved[a], [&](const at::Tensor& t) { check_output(t, a); });
    }
    return;
  }
  const size_t num_returns = info.scan_return.size();
  if (stack->size() < num_returns) return;
  for (size_t r = 0; r < num_returns; ++r) {
    if (!info.scan_return[r]) continue;
    const c10::IValue& out = (*stack)[stack->size() - num_returns + r];
    for_each_tensor(out, [&](const at::Tensor& t) { check_output(t, static_cast<int64_t>(r)); });
  }
}

// ---------------------------------------------------------------------------
// Python entry points (module cublas_guard_ext._watch_native).
// ---------------------------------------------------------------------------
std::once_flag fallback_once;
torch::Library* fallback_library = nullptr;

void install_fallback() {
  std::call_once(fallback_once, [] {
    // Registered once and kept: it does nothing unless a watching thread has
    // the key in its thread-local include set.
    fallback_library = new torch::Library(torch::Library::IMPL, "_", kWatchKey, __FILE__, __LINE__);
    fallback_library->fallback(torch::CppFunction::makeFromBoxedFunction<&watch_fallback>());
  });
}

std::vector<std::string> string_list(PyObject* list) {
  std::vector<std::string> out;
  const Py_ssize_t n = PySequence_Size(list);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(list, i);
    const char* s = item != nullptr ? PyUnicode_AsUTF8(item) : nullptr;
    out.emplace_back(s != nullptr ? s : "");
    Py_XDECREF(item);
  }
  PyErr_Clear();
  return out;
}

PyObject* py_begin(PyObject*, PyObject* args) {
  int mode = kModeSync;
  PyObject *names = nullptr, *allowed = nullptr, *ops = nullptr, *clean = nullptr;
  if (!PyArg_ParseTuple(args, "iOOOO", &mode, &names, &allowed, &ops, &clean)) return nullptr;
  install_fallback();
  auto* s = new Session();
  s->mode = mode;
  s->thread_id = at::RecordFunction::currentThreadId();
  s->module_names = string_list(names);
  for (const auto& a : string_list(allowed)) s->module_allowed.push_back(a == "1" ? 1 : 0);
  s->allowed_ops = string_list(ops);
  s->seq_base = at::sequence_number::peek();
  s->seq_module.reserve(4096);
  s->outer = tls_session;
  if (s->outer == nullptr) s->known.drop_expired(/*finite_only=*/true);  // freed since the last block
  s->key_was_included = c10::impl::tls_is_dispatch_key_included(kWatchKey);
  // Tensors the entry check found finite (parameters, buffers): known.
  const Py_ssize_t n_clean = PySequence_Size(clean);
  for (Py_ssize_t i = 0; i < n_clean; ++i) {
    PyObject* item = PySequence_GetItem(clean, i);
    if (item != nullptr && THPVariable_Check(item)) {
      const at::Tensor& t = THPVariable_Unpack(item);
      if (readable(t)) remember(*s, t, true);
    }
    Py_XDECREF(item);
  }
  PyErr_Clear();
  tls_session = s;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry()[s->thread_id] = s;
  }
  c10::impl::tls_set_dispatch_key_included(kWatchKey, true);
  Py_RETURN_NONE;
}

// Ends this thread's innermost watch; returns the pending finding's message or None.
PyObject* py_end(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  c10::impl::tls_set_dispatch_key_included(kWatchKey, s->key_was_included);
  tls_session = s->outer;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (s->outer != nullptr) {
      registry()[s->thread_id] = s->outer;
    } else {
      registry().erase(s->thread_id);
    }
  }
  if (s->outer == nullptr) s->known.drop_expired(/*finite_only=*/true);
  PyObject* result = s->pending ? PyUnicode_FromString(s->pending_message.c_str()) : Py_None;
  if (result == Py_None) Py_INCREF(Py_None);
  delete s;
  return result;
}

PyObject* py_take_pending(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s == nullptr || !s->pending) Py_RETURN_NONE;
  s->pending = false;
  PyObject* result = PyUnicode_FromString(s->pending_message.c_str());
  s->pending_message.clear();
  return result;
}

PyObject* py_push(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) s->module_stack.push_back(static_cast<int32_t>(PyLong_AsLong(arg)));
  Py_RETURN_NONE;
}

PyObject* py_pop(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s != nullptr && !s->module_stack.empty()) s->module_stack.pop_back();
  Py_RETURN_NONE;
}

PyObject* py_active(PyObject*, PyObject*) {
  return PyBool_FromLong(tls_session != nullptr);
}

// (nan, +inf, -inf, first_bad_index) of any floating tensor; None if not readable.
PyObject* py_scan(PyObject*, PyObject* arg) {
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "expected a tensor");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (!readable(t)) Py_RETURN_NONE;
  Counts c;
  try {
    Session tmp;
    c = scan_values(tmp, t);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  return Py_BuildValue("(LLLL)", static_cast<long long>(c.nan), static_cast<long long>(c.posinf),
                       static_cast<long long>(c.neginf), static_cast<long long>(c.first));
}

PyObject* py_stats(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  return Py_BuildValue("(LLL)", static_cast<long long>(s->ops_seen),
                       static_cast<long long>(s->outputs_scanned),
                       static_cast<long long>(s->scans_saved));
}

// Whether this thread's watch knows t's current values to be finite.
PyObject* py_known_finite(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(arg)) Py_RETURN_FALSE;
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (!readable(t)) Py_RETURN_FALSE;
  const Known* k = lookup(*s, t);
  return PyBool_FromLong(k != nullptr && k->finite);
}

PyObject* py_key_included(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::impl::tls_is_dispatch_key_included(kWatchKey));
}

PyMethodDef methods[] = {
    {"begin", py_begin, METH_VARARGS,
     "begin(mode, module_names, module_allowed, allowed_ops, clean_tensors)"},
    {"end", py_end, METH_NOARGS, "end() -> pending message or None"},
    {"take_pending", py_take_pending, METH_NOARGS, "the pending finding's message, or None"},
    {"push", py_push, METH_O, "push a module id"},
    {"pop", py_pop, METH_NOARGS, "pop a module id"},
    {"active", py_active, METH_NOARGS, "whether this thread is watching"},
    {"scan", py_scan, METH_O, "(nan, posinf, neginf, first_bad_index) or None"},
    {"stats", py_stats, METH_NOARGS, "(ops seen, outputs scanned, scans saved) of this thread's watch"},
    {"known_finite", py_known_finite, METH_O, "whether this thread's watch knows the tensor finite"},
    {"key_included", py_key_included, METH_NOARGS, "whether the watch key is on in this thread"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cublas_guard_ext._watch_native", nullptr, -1,
                          methods};

// Puts the module above into sys.modules (works for the prebuilt and the JIT
// library alike: the JIT one is not a Python module).
void install_python_module() {
  if (!Py_IsInitialized()) return;
  const PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* modules = PyImport_GetModuleDict();
  if (PyDict_GetItemString(modules, "cublas_guard_ext._watch_native") == nullptr) {
    PyObject* m = PyModule_Create(&module_def);
    if (m != nullptr) {
      PyDict_SetItemString(modules, "cublas_guard_ext._watch_native", m);
      Py_DECREF(m);
    }
  }
  PyErr_Clear();
  PyGILState_Release(gil);
}

}  // namespace
}  // namespace watch
}  // namespace cublas_guard

TORCH_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("watch_install() -> ()", &cublas_guard::watch::install_python_module);
}
