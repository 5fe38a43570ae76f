// The watch session: the per-thread registry that lets autograd's engine
// threads find the session of the thread whose forward built the node, module
// attribution (forward: the module stack; backward: the forward module kept
// under the node's sequence number), the origins the host read from the
// record, and the findings they make when they reach a sink.
#include "locked/watch/watch.h"
#include "locked/watch/watch_device.h"

#include <ATen/SequenceNumber.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>

#include <frameobject.h>

#include <limits>

namespace cublas_guard {
namespace watch {

thread_local Session* tls_session = nullptr;
thread_local SessionRef tls_session_ref;
thread_local AfterUnlock tls_after_unlock;
thread_local int tls_depth = 0;
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

void run_after_unlock(Session& s) {
  if (tls_after_unlock.stack_for != kNoOrigin) {
    const uint32_t id = tls_after_unlock.stack_for;
    tls_after_unlock.stack_for = kNoOrigin;
    const std::string stack = python_stack();
    if (!stack.empty()) {
      SessionLock lock(*s.mu);
      OriginStore& store = *s.origins;
      // At the op that made the values, the stack is the birth's; read later
      // (the device ran behind the host), it is only where watch detected it.
      if (id - kFirstOrigin < store.origins.size()) {
        ErrorReport& r = store.origins[id - kFirstOrigin].report;
        if (tls_after_unlock.stack_at_birth) {
          r.add("birth_stack", stack);
        } else {
          r.add("detected_stack", stack);
        }
      }
    }
  }
  if (!tls_after_unlock.raise.empty()) {
    std::string message = std::move(tls_after_unlock.raise);
    tls_after_unlock.raise.clear();
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
  } else if (s.optimizer_depth > 0) {
    w.module = kModuleOptimizerStep;
  }
  return w;
}

void add_where(ErrorReport& r, const Session& s, const Where& w) {
  if (w.module == kModuleOptimizerStep && !w.backward) {
    // The optimizer's update: a phase of its own (watching/optimizer_step.py names the
    // optimizer, the parameter and the state from Python when the finding is raised).
    r.add("phase", "optimizer step").add("outside", "in the optimizer step");
    return;
  }
  r.add("phase", w.backward ? "backward" : "forward");
  if (w.module >= 0 && static_cast<size_t>(w.module) < s.config.module_names.size()) {
    r.add("module", s.config.module_names[w.module]);
  } else if (s.config.has_model) {
    // Outside every module of the watched model: say which side of it.
    r.add("outside", w.backward
                         ? "the backward of an op outside the model (a loss computed after its forward)"
                         : "outside any module (the loss computed after the model's forward, or the "
                           "optimizer step)");
  }
  if (!w.node_name.empty()) r.add("backward_node", w.node_name);
}

// Raised through cublas_guard_ext._native_callbacks.watch_finding (the typed finding, with the
// arrival and the birth stack added to its message); python_errors.cpp's
// raise where that is not importable.
[[noreturn]] void raise_message(const std::string& message) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  if (Py_IsInitialized()) {
    pybind11::gil_scoped_acquire gil;
    PyObject* module = PyImport_ImportModule("cublas_guard_ext._native_callbacks");
    PyObject* exc =
        module != nullptr ? PyObject_CallMethod(module, "watch_finding", "s", message.c_str()) : nullptr;
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
    SessionLock lock(*s.mu);
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

// A birth's report: once per op, module, phase and output index.
uint32_t record_origin(Session& s, ErrorReport& r, const std::string& key, const std::string& summary,
                       bool with_stack, bool stack_at_birth) {
  OriginStore& store = *s.origins;
  const auto it = store.by_key.find(key);
  if (it != store.by_key.end()) return it->second;
  store.origins.push_back(Origin{r, summary});
  const uint32_t id = kFirstOrigin + static_cast<uint32_t>(store.origins.size() - 1);
  // the stack of the thread that runs Python (none on a device thread), after the lock
  if (with_stack && tls_session == &s) {
    tls_after_unlock.stack_for = id;
    tls_after_unlock.stack_at_birth = stack_at_birth;
  }
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

void deliver(Session& s, const std::string& message, bool as_pending) {
  if (s.mode == kModeAsync || as_pending) {
    if (s.pending) return;  // only the first finding is kept
    s.pending_message = message;
    s.pending = true;
    return;
  }
  if (tls_after_unlock.raise.empty()) tls_after_unlock.raise = message;  // raised by run_after_unlock
}

void reached(Session& s, uint32_t origin, const std::string& where, bool as_pending) {
  if (s.report == kReportBirth || origin < kFirstOrigin) return;
  const OriginStore& store = *s.origins;
  const size_t i = origin - kFirstOrigin;
  if (i >= store.origins.size()) return;
  if ((s.mode == kModeAsync || as_pending) && s.pending) return;  // only the first finding is kept
  ErrorReport r = store.origins[i].report;
  r.add("reached", where);
  if (s.tags) add_lost(r, *s.tags);
  deliver(s, r.message(store.origins[i].summary), as_pending);
}

}  // namespace watch
}  // namespace cublas_guard
