// csrc/locked/watch/watch.h: what the watch's translation units share (the map).
//
// cublas_guard_ext.watch: the op that first produced NaN/Inf, and the module
// it ran in. One protocol on every device (docs/watch-design.md):
//
// How ops are observed. A boxed C++ fallback on a dispatch key no torch kernel
// uses, TESTING_ONLY_GenericMode, which a watch turns on in the thread-local
// include set of the watching thread only (autograd carries it to the threads
// that run backward). The key sits above Autograd, so every op call that goes
// through the dispatcher comes here first: the user's ops, the ops composite
// kernels decompose into, and the ops the backward formulas call. The
// fallback is a thin hook (watch_fallback.cpp): before the op, first-sight
// scans of inputs no watched op wrote; the op, with cuBLAS/CUDA failures
// re-raised typed (watch_reraise.cpp); after the op, one scan launch per
// output that may hold new values (views are skipped).
//
// The rule runs where the values are (watch_device_logic.h, the one
// decision): each storage has a tag slot in an int32 array on its device; a
// scan reads its inputs' tags, decides finite / new origin / inherited / quiet,
// writes the output's tag, and writes the thread's record only on a birth or a
// finding. The host keeps a ring of call descriptors and builds the typed
// errors from the record (watch_device_report.cpp) at the raise points: after
// each watched op and at the next one (acquire loads of the record's flag),
// at check() and at the end of the block (one synchronize).
//
// Attribution. Python's global module hooks push/pop module ids on the
// session's stack (forward). In forward each op stores the module under the
// autograd sequence number its node will take (at::sequence_number::peek());
// in backward the node being evaluated (torch::autograd::get_current_node())
// gives that number back, hence the forward module.
//
// The files: watch_ops.cpp (op traits), watch_session.cpp (sessions, module
// attribution, origins and findings), watch_fallback.cpp (the hook),
// watch_slots.cpp (tag slots, the launches), watch_device.cpp (the hooks, the ring),
// watch_device_report.cpp
// (the record read back into errors), watch_device_cpu.cpp and
// locked/watch/watch_scan.cu (the kernels), watch_verify.cpp (verify_inputs),
// watch_reraise.cpp, watch_python.cpp (the methods of cublas_guard_ext._C).
#pragma once

#include <Python.h>

#include "linear/linear_op.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/core/DispatchKey.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstdint>
#include <deque>
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
// value an op produces from finite inputs, at that op. kReportConsequence: a
// non-finite value is a finding when it reaches a sink: the model's outputs, a
// backward root (the loss), a parameter's or input's gradient, a parameter or
// buffer written in the block, state written outside the model's forward and
// backward (an optimizer's), a guarded layer that refuses its input.
constexpr int kReportConsequence = 0;
constexpr int kReportBirth = 1;

// Origin ids (OriginStore::origins[id - kFirstOrigin]); kQuietOrigin: intended
// non-finite values, never a finding.
constexpr uint32_t kNoOrigin = 0;
constexpr uint32_t kQuietOrigin = 1;
constexpr uint32_t kFirstOrigin = 2;

// What the fallback needs to know about an operator, computed once per operator.
struct OpInfo {
  bool skip = false;                 // outputs are uninitialised memory (empty, resize_, set_)
  std::vector<uint8_t> scan_return;  // per return: 1 = may hold new values (not a pure view)
  std::vector<uint8_t> is_out_arg;   // out= arguments and overwritten ones: outputs, not inputs
  std::vector<int> written_args;     // every argument the op writes (in place and out=)
  size_t num_args = 0;
  bool scan_written_args = false;  // returns nothing but writes arguments (_foreach_add_)
  bool composite = false;          // decomposes into dispatched ops, writes nothing itself
  bool product = false;            // a product or a square (the overflow note's is_product)
  // The project's own guarded ops (cublas_guard::linear, its gradients, the grouped
  // GEMMs): watched as one op each, with the watch key excluded while they run, so
  // their inner steps (the output's allocation, the bias copy, a nested call of the
  // same op from its autograd kernel) are neither hooked nor scanned: a birth in them
  // is the guarded op's, in the user's layer. torch's scaled GEMMs are sealed alike.
  bool sealed = false;
  // Where an Inf may vanish into the float8 range (float8_swallow): 1 a clamp or clip
  // (a saturated FP8 cast's first step), 2 _to_copy, 3 copy_.
  uint8_t float8_step = 0;
  // Finite inputs give finite outputs, whatever the values: copies (clone, _unsafe_view, a cast
  // or copy_ to the same or a wider float dtype), bounded maps (relu, gelu, softmax) and
  // bernoulli_. On the CPU, where the host reads the inputs' tags, such an output is tagged
  // finite without a scan when every input's tag is (watch_device.cpp: finite_by_rule).
  bool finite_from_finite = false;
  // embedding_dense_backward: each output value sums at most indices.numel() values of
  // grad_output, so a bound on grad_output's magnitude bounds the output's (watch_device.cpp:
  // bounded_by_rule). On the CPU its output, the word embedding's dense gradient (47 MB of
  // mostly zeros for MiniLM), is then tagged finite without a scan.
  bool bounded_sum = false;
  // cublas_guard_internal::optimizer_step_writes, an unhooked optimizer step's writes.
  bool step_writes = false;
  // A grouped GEMM (torch's _grouped_mm, the guarded grouped_linear): the arguments
  // holding its group ends and the weight's name (-1: none). A finding in its output
  // names the group of the first bad row (watch_device_report.cpp).
  int offs_arg = -1;
  int parameter_arg = -1;
};

// What watch(...) passes to begin (watch_python.cpp converts the Python
// arguments into it; nothing positional).
struct WatchConfig {
  int mode = kModeSync;
  int report = kReportBirth;
  bool has_model = false;
  bool verify_inputs = false;
  int64_t capacity = 4096;  // births and findings in the record, call descriptors in the ring
  std::vector<std::string> module_names;  // id -> qualified name
  std::vector<uint8_t> module_allowed;    // id -> non-finite results allowed there
  std::vector<std::string> allowed_ops;   // "aten::log" or "aten::log.default"
  std::vector<std::pair<at::Tensor, std::string>> state;  // parameters and buffers, by name
  std::vector<at::Tensor> finite_state;  // those the entry check just found finite
};

// A recorded birth: the finding's report, built when the host read the birth,
// raised when it reaches a sink. Births of the same op, module, phase and
// output share one record (T5 takes log(0) at every forward).
struct Origin {
  ErrorReport report{"non_finite_output"};
  std::string summary;
};
struct OriginStore {
  std::vector<Origin> origins;
  std::unordered_map<std::string, uint32_t> by_key;
};

struct TagState;     // the tags, the ring and the records (watch_device.h)
struct VerifyState;  // verify_inputs' storage -> version map (watch_verify.cpp)

struct Session {
  WatchConfig config;
  int mode = kModeSync;
  int report = kReportBirth;
  // Parameters and buffers of the watched model: storage -> name (sinks when written).
  std::unordered_map<const c10::StorageImpl*, std::string> state;
  // Shared with a nested watch: both read the thread's tags, whose origins index it.
  std::shared_ptr<OriginStore> origins = std::make_shared<OriginStore>();
  uint64_t thread_id = 0;
  bool key_was_included = false;
  std::shared_ptr<Session> outer;  // a watch nested in this thread's watch
  std::vector<int32_t> module_stack;
  // Inside optimizer.step() (torch's global step hooks, watching/optimizer_step.py): an op
  // outside every module and every autograd node is attributed to kModuleOptimizerStep.
  int32_t optimizer_depth = 0;
  // Steps of torch's own optimizers running unhooked now (py_optimizer_begin): the watch key
  // is off for the step, and what it wrote is judged at its end as one op's outputs.
  int32_t unhooked_steps = 0;
  bool key_off_for_step = false;  // the key was on when the outermost unhooked step began
  uint64_t seq_base = 0;
  std::vector<int32_t> seq_module;   // autograd sequence number - seq_base -> module id
  std::atomic<bool> pending{false};  // async: a finding waits to be raised
  std::string pending_message;
  std::atomic<int64_t> ops_seen{0}, outputs_scanned{0};
  // The thread's tag state (shared with nested watches and with the autograd
  // device threads that run this block's backward nodes); its mutex guards
  // every read or write of the session's state. Never held around an op's
  // kernel, never while waiting for the GIL (AfterUnlock).
  std::shared_ptr<TagState> tags;
  std::recursive_mutex* mu = nullptr;
  std::unique_ptr<VerifyState> verify;  // only while verify_inputs is on
  Session();  // both in watch_verify.cpp, where VerifyState is complete
  ~Session();
};
using SessionRef = std::shared_ptr<Session>;
using SessionLock = std::unique_lock<std::recursive_mutex>;

// What a locked section leaves to do once the lock is released: a finding to
// raise (sync) and a birth whose Python stack is still to be taken (with
// `stack_at_birth` false when the host read the birth after its op: the stack
// is then where it was detected, and the report says so).
struct AfterUnlock {
  std::string raise;
  uint32_t stack_for = kNoOrigin;
  bool stack_at_birth = true;
};
extern thread_local AfterUnlock tls_after_unlock;
// Runs this thread's AfterUnlock work; call with the session's lock released.
void run_after_unlock(Session& s);

extern thread_local Session* tls_session;  // this thread's innermost watch (owned by tls_session_ref)
extern thread_local SessionRef tls_session_ref;
extern thread_local int tls_depth;
// The depth of the outermost op running now that is not composite (its kernel
// may write buffers directly, below the dispatcher); INT_MAX when none. Writes
// into parameters and outside state are sinks only at or above it.
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
std::string op_display_name(const c10::FunctionSchema& schema);
bool op_allowed(const Session& s, const c10::FunctionSchema& schema);
// A step of a cast to float8 where +-Inf becomes a finite value (a clamp to a float8
// format's range, a cast to a float8 format without Inf): the tensor whose values it
// loses (set into *input) and the sink's words; "" when this call is not one.
std::string float8_swallow(const OpInfo& info, const std::vector<c10::IValue>& args,
                           const at::Tensor** input);
// Tensors whose values watch reads: floating, dense, with storage, not a wrapper.
bool readable(const at::Tensor& t);
// NaN, +Inf, -Inf and the first bad (flat, row-major) index of t, read on the
// host (a sync on CUDA): the project's fused scan for its dtypes, ATen for the
// rest. The entry check of arguments, verify_inputs.
struct HostCounts {
  int64_t nan = 0, posinf = 0, neginf = 0, first = -1;
  bool small = false;  // known: every value finite and below the dtype's small bound (scan_cpu_counts)
  bool bad() const { return first >= 0; }
  // From the fused scan's kScanFields counts.
  static HostCounts of_scan(const int64_t* r) {
    return HostCounts{r[kNanCount], r[kPosInfCount], r[kNegInfCount], r[kFirstBadIndex]};
  }
};
HostCounts host_counts(const at::Tensor& t);
// Whether every value of these tensors is finite: a fused scan each, one host
// read for the lot (the entry check of parameters and buffers).
bool all_finite(const std::vector<at::Tensor>& tensors);

// Calls fn(tensor) for every tensor in an argument (a tensor, a list of tensors
// or of optional tensors).
template <typename Fn>
void for_each_tensor(const c10::IValue& v, Fn&& fn) {
  if (v.isTensor()) {
    fn(v.toTensor());
  } else if (v.isList()) {  // tensor lists too: by reference (toTensorVector copies, refcounts and all)
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) fn(e.toTensor());
    }
  }
}

// watch_session.cpp: the session, attribution, origins and findings.
// This thread's session, else (an autograd device thread) the session of the
// node's forward thread, held by `hold` while the caller uses it.
Session* current_session(SessionRef& hold);
// The module id of an op run by optimizer.step() outside every module (no module's name).
constexpr int32_t kModuleOptimizerStep = -2;
struct Where {
  int32_t module = -1;
  bool backward = false;
  std::string node_name;
};
Where where_now(const Session& s);
// The op's inputs in the report (watch_device.cpp: the same fields as a birth's).
void describe_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const OpInfo& info);
void add_where(ErrorReport& r, const Session& s, const Where& w);
[[noreturn]] void raise_message(const std::string& message);
// The pending async finding, raised after the lock is released.
void raise_pending(Session& s);
// A finding's message: raised after the lock (sync), kept (async or `as_pending`).
void deliver(Session& s, const std::string& message, bool as_pending);
// A tagged value reached a sink (`where`, in words): the finding of its origin
// is delivered. Nothing for quiet values or in birth mode.
void reached(Session& s, uint32_t origin, const std::string& where, bool as_pending = false);
// Keeps a birth's report under `key` (once per op, module, phase and output); its origin id.
uint32_t record_origin(Session& s, ErrorReport& r, const std::string& key, const std::string& summary,
                       bool with_stack, bool stack_at_birth);
// The innermost Python frames outside torch and this package, one per line.
std::string python_stack();

// watch_verify.cpp: verify_inputs (a storage -> version map kept only while it is on).
void enable_verify(Session& s);
void verify_before(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                   const std::vector<c10::IValue>& args);
void verify_after(Session& s, const c10::OperatorHandle& op, const at::Tensor& out);
void verify_written(Session& s, const at::Tensor& t);

// watch_reraise.cpp: cuBLAS/CUDA errors of an op re-raised typed.
bool mentions_cuda_failure(const std::string& m);
[[noreturn]] void reraise_typed(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                                const std::vector<c10::IValue>& args, PyObject* original,
                                const std::string& original_message);
bool is_guard_error(PyObject* value);
std::string py_str(PyObject* value);

// watch_fallback.cpp: the boxed fallback on kWatchKey.
void install_fallback();

// watch_python.cpp: the methods cublas_guard_ext._C gets (python_module.cpp).
PyMethodDef* python_methods();

}  // namespace watch
}  // namespace cublas_guard
