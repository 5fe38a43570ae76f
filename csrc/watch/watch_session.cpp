// The watch session: the per-thread registry that lets autograd's engine
// threads find the session of the thread whose forward built the node, module
// attribution (forward: the module stack; backward: the forward module kept
// under the node's sequence number), and the judgement of a non-finite output
// (producer or propagator) with the report it raises or keeps.
#include "watch/watch.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>

#include <frameobject.h>

namespace cublas_guard {
namespace watch {

thread_local Session* tls_session = nullptr;
thread_local SessionRef tls_session_ref;
thread_local Deferred tls_deferred;
thread_local const c10::FunctionSchema* tls_producer = nullptr;
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
std::unordered_map<uint64_t, SessionRef>& registry() {
  static std::unordered_map<uint64_t, SessionRef> r;
  return r;
}

// Refcounted: py_end drops the registry's and the owner's references; a device
// thread running a node of the block's backward keeps its own until its op is
// done, so the session is never freed under it.
Session* current_session(SessionRef& hold) {
  if (tls_session != nullptr) return tls_session;
  // A backward op on an engine thread: the session of the node's forward thread.
  const auto node = torch::autograd::get_current_node();
  if (!node) return nullptr;
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(node->thread_id());
  if (it == registry().end()) return nullptr;
  hold = it->second;
  return hold.get();
}

void run_deferred(Session& s) {
  if (tls_deferred.stack_for != kNoOrigin) {
    const uint32_t id = tls_deferred.stack_for;
    tls_deferred.stack_for = kNoOrigin;
    const std::string stack = python_stack();
    if (!stack.empty()) {
      SessionLock lock(s.mu);
      OriginStore& store = *s.origins;
      if (id - kFirstOrigin < store.origins.size())
        store.origins[id - kFirstOrigin].report.add("birth_stack", stack);
    }
  }
  if (!tls_deferred.raise.empty()) {
    std::string message = std::move(tls_deferred.raise);
    tls_deferred.raise.clear();
    raise_message(message);
  }
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

void describe_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const OpInfo& info) {
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

// Raised through cublas_guard_ext.watch._typed (the typed finding, with the
// arrival and the birth stack added to its message); python_errors.cpp's
// raise where that is not importable.
[[noreturn]] void raise_message(const std::string& message) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  if (Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    PyObject* module = PyImport_ImportModule("cublas_guard_ext.watch");
    PyObject* exc = module != nullptr ? PyObject_CallMethod(module, "_typed", "s", message.c_str()) : nullptr;
    Py_XDECREF(module);
    if (exc != nullptr && PyExceptionInstance_Check(exc)) {
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
      Py_DECREF(exc);
      python_error error;
      error.persist();
      throw error;
    }
    Py_XDECREF(exc);
    PyErr_Clear();
  }
  throw_python_error_if_possible(message);
  C10_THROW_ERROR(ValueError, message);
}

void raise_pending(Session& s) {
  std::string message;
  {
    SessionLock lock(s.mu);
    if (!s.pending) return;
    s.pending = false;
    message = std::move(s.pending_message);
    s.pending_message.clear();
  }
  raise_message(message);
}

namespace {

bool skipped_frame(const std::string& file) {
  return file.find("/torch/") != std::string::npos || file.find("/cublas_guard_ext/") != std::string::npos ||
         file.rfind("<frozen", 0) == 0;
}

}  // namespace

// A finding of a producer: once per op, module, phase and output index.
uint32_t record_origin(Session& s, ErrorReport& r, const std::string& key, const std::string& summary,
                       bool with_stack) {
  OriginStore& store = *s.origins;
  const auto it = store.by_key.find(key);
  if (it != store.by_key.end()) return it->second;
  if (store.origins.size() >= OriginStore::kMax) {
    return kFirstOrigin + static_cast<uint32_t>(store.origins.size() - 1);
  }
  store.origins.push_back(Origin{r, summary});
  const uint32_t id = kFirstOrigin + static_cast<uint32_t>(store.origins.size() - 1);
  // the stack of the thread that runs Python (none on a device thread), after the lock
  if (with_stack && tls_session == &s) tls_deferred.stack_for = id;
  store.by_key.emplace(key, id);
  return id;
}

std::string python_stack() {
  if (!Py_IsInitialized()) return "";
  pybind11::gil_scoped_acquire gil;
  std::string out;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  Py_XINCREF(frame);
  int kept = 0;
  for (int depth = 0; frame != nullptr && depth < 64 && kept < 6; ++depth) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    const char* file = PyUnicode_AsUTF8(code->co_filename);
    const char* func = PyUnicode_AsUTF8(code->co_name);
    const std::string f = file != nullptr ? file : "?";
    if (!skipped_frame(f)) {
      if (!out.empty()) out += "\n";
      out += f + ":" + std::to_string(PyFrame_GetLineNumber(frame)) + " in " + (func != nullptr ? func : "?");
      ++kept;
    }
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  Py_XDECREF(frame);
  PyErr_Clear();
  return out;
}

uint32_t judge(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
               const std::vector<c10::IValue>& args, bool inplace_bad_before, uint32_t inplace_origin,
               const at::Tensor& t, int64_t index, const Counts& c) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  const c10::FunctionSchema& schema = op.schema();
  const bool birth = s.report == kReportBirth;
  // The tags of the tensor inputs (table look-ups, no scan): what a propagator inherits.
  uint32_t inherited = inplace_origin;
  if (!birth) {
    for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
      if (info.is_out_arg[i] || is_inplace_arg(info, static_cast<int>(i))) continue;
      for_each_tensor(args[i],
                      [&](const at::Tensor& in) { inherited = better_origin(inherited, origin_of(s, in)); });
    }
  }
  // Propagator: a non-finite scalar argument or tensor input.
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    if (scalar_non_finite(args[i])) return better_origin(kQuietOrigin, inherited);
  }
  if (inplace_bad_before) return inherited;
  bool bad_input = false;
  for (size_t i = 0; i < args.size() && i < info.num_args && !bad_input; ++i) {
    if (info.is_out_arg[i]) continue;
    if (is_inplace_arg(info, static_cast<int>(i))) continue;  // judged by its scan before the op
    for_each_tensor(args[i], [&](const at::Tensor& in) {
      if (!bad_input && readable(in) && scan_known(s, in).bad()) bad_input = true;
    });
  }
  if (bad_input) return inherited;
  if (!birth) {
    const auto node = torch::autograd::get_current_node();
    if (node && node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
      const uint64_t i = node->sequence_nr() - s.seq_base;
      if (i < s.seq_origin.size() && s.seq_origin[i] != kNoOrigin) return s.seq_origin[i];
    }
  }
  if (op_allowed(s, schema)) return kQuietOrigin;
  const Where w = where_now(s);
  if (w.module >= 0 && static_cast<size_t>(w.module) < s.module_allowed.size() &&
      s.module_allowed[w.module]) {
    return kQuietOrigin;
  }
  if (birth && s.mode == kModeAsync && s.pending) return kNoOrigin;  // only the first finding is kept

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
  const std::string summary = "watch: " + name + " produced non-finite values from finite inputs";
  if (!birth) {
    const std::string key = name + "|" + std::to_string(w.module) + "|" + (w.backward ? "b" : "f") +
                            w.node_name + "|" + std::to_string(index);
    const uint32_t id = record_origin(s, r, key, summary, /*with_stack=*/true);
    // Born in backward from finite values: a gradient computed wrong is a
    // result that matters even where a later node masks it (sqrt's gradient
    // at 0 under a ReLU's); values born in forward are judged downstream.
    if (w.backward) reached(s, id, "a gradient: a backward formula produced it from finite values");
    return id;
  }
  const std::string message = r.message(summary);
  if (s.mode == kModeAsync) {
    s.pending = true;
    s.pending_message = message;
    return kNoOrigin;
  }
  if (tls_deferred.raise.empty()) tls_deferred.raise = message;  // raised by run_deferred
  return kNoOrigin;
}

void reached(Session& s, uint32_t origin, const std::string& where) {
  if (s.report == kReportBirth || origin < kFirstOrigin) return;
  const OriginStore& store = *s.origins;
  const size_t i = origin - kFirstOrigin;
  if (i >= store.origins.size()) return;
  if (s.mode == kModeAsync && s.pending) return;  // only the first finding is kept
  ErrorReport r = store.origins[i].report;
  r.add("reached", where);
  const std::string message = r.message(store.origins[i].summary);
  if (s.mode == kModeAsync) {
    s.pending = true;
    s.pending_message = message;
    return;
  }
  if (tls_deferred.raise.empty()) tls_deferred.raise = message;  // raised by run_deferred
}

uint32_t entry_origin(Session& s, const at::Tensor& t, const std::string& name, const Counts& c) {
  ErrorReport r("non_finite_entry");
  r.add("role", "argument").add("name", name);
  r.add("nan_count", c.nan).add("posinf_count", c.posinf).add("neginf_count", c.neginf);
  r.add("first_bad_index", c.first);
  r.add("shape", t.sizes()).add("dtype", std::string(c10::toString(t.scalar_type())));
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  const uint32_t id = record_origin(s, r, "entry|" + name,
                                    "watch: the model's argument '" + name + "' is non-finite on entry",
                                    /*with_stack=*/false);
  tag(s, t, id);
  return id;
}

}  // namespace watch
}  // namespace cublas_guard
