// The watch session: the per-thread registry that lets autograd's engine
// threads find the session of the thread whose forward built the node, module
// attribution (forward: the module stack; backward: the forward module kept
// under the node's sequence number), and the judgement of a non-finite output
// (producer or propagator) with the report it raises or keeps.
#include "watch/watch.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

namespace cublas_guard {
namespace watch {

thread_local Session* tls_session = nullptr;
thread_local int tls_depth = 0;
// The depth of the outermost op running now that is not composite (its kernel
// may write buffers directly, below the dispatcher); INT_MAX when none. The
// table of known values is trusted only by ops with no such op around them.
thread_local int tls_kernel_depth = std::numeric_limits<int>::max();
// Per nesting depth; a deque, so growing it keeps the outer frames' references valid.
thread_local std::deque<std::vector<c10::IValue>> tls_saved_args;


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


Session* current_session() {
  if (tls_session != nullptr) return tls_session;
  // A backward op on an engine thread: the session of the node's forward thread.
  const auto node = torch::autograd::get_current_node();
  if (!node) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(node->thread_id());
  return it == registry().end() ? nullptr : it->second;
}

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

}  // namespace watch
}  // namespace cublas_guard
