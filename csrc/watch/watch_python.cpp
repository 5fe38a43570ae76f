// watch's methods of the native module cublas_guard_ext._C (python_module.cpp
// adds them to its method list): begin/end a session from a config, the module stack
// pushes and pops of the Python hooks, the pending async finding, sinks and
// entries, and the probes the Python side and the tests use. Hand-written
// (not pybind11) to keep the per-module hook calls cheap.
#include "watch/watch.h"
#include "watch/watch_device.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdlib>
#include <mutex>

namespace cublas_guard {
namespace watch {

namespace {

// A config item of `d`, or nullptr (a borrowed reference).
PyObject* item(PyObject* d, const char* key) { return PyDict_GetItemString(d, key); }

bool read_strings(PyObject* list, std::vector<std::string>& out, const char* key) {
  if (list == nullptr) return true;
  PyObject* seq = PySequence_Fast(list, key);
  if (seq == nullptr) return false;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
    const char* s = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
    if (s == nullptr) {
      Py_DECREF(seq);
      return false;
    }
    out.emplace_back(s);
  }
  Py_DECREF(seq);
  return true;
}

// watch.py's config dict -> WatchConfig (names, kinds and ranges checked here,
// so nothing positional or stringly-typed crosses the boundary).
bool parse_config(PyObject* d, WatchConfig& c) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "cublas_guard_ext._C._watch_begin takes a config dict");
    return false;
  }
  static const char* const known[] = {"mode",     "report",       "has_model",      "verify_inputs",
                                      "capacity", "module_names", "module_allowed", "allowed_ops",
                                      "state",    "finite_state"};
  PyObject *key = nullptr, *value = nullptr;
  for (Py_ssize_t pos = 0; PyDict_Next(d, &pos, &key, &value);) {
    const char* k = PyUnicode_AsUTF8(key);
    bool ok = false;
    for (const char* n : known) ok = ok || (k != nullptr && std::string(k) == n);
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "cublas_guard_ext.watch: unknown config key %R", key);
      return false;
    }
  }
  if (PyObject* v = item(d, "mode")) {  // a code of cublas_guard_ext._native.codes
    const long m = PyLong_AsLong(v);
    if (PyErr_Occurred() || (m != kModeSync && m != kModeAsync)) {
      PyErr_Clear();
      PyErr_Format(PyExc_ValueError,
                   "cublas_guard_ext.watch: mode must be the code of 'sync' or 'async', got %R", v);
      return false;
    }
    c.mode = static_cast<int>(m);
  }
  if (PyObject* v = item(d, "report")) {
    const char* r = PyUnicode_AsUTF8(v);
    if (r == nullptr || (std::string(r) != "birth" && std::string(r) != "consequence")) {
      PyErr_Format(PyExc_ValueError,
                   "cublas_guard_ext.watch: report must be 'birth' or 'consequence', got %R", v);
      return false;
    }
    c.report = std::string(r) == "birth" ? kReportBirth : kReportConsequence;
  }
  if (PyObject* v = item(d, "has_model")) c.has_model = PyObject_IsTrue(v) == 1;
  if (PyObject* v = item(d, "verify_inputs")) c.verify_inputs = PyObject_IsTrue(v) == 1;
  if (PyObject* v = item(d, "capacity")) {
    c.capacity = PyLong_AsLongLong(v);
    if (PyErr_Occurred()) return false;
    if (c.capacity < 64 || c.capacity > (int64_t{1} << 24)) {
      PyErr_Format(PyExc_ValueError, "cublas_guard_ext.watch: capacity must be in [64, 16777216], got %R", v);
      return false;
    }
  }
  if (!read_strings(item(d, "module_names"), c.module_names, "module_names")) return false;
  if (!read_strings(item(d, "allowed_ops"), c.allowed_ops, "allowed_ops")) return false;
  if (PyObject* v = item(d, "module_allowed")) {
    PyObject* seq = PySequence_Fast(v, "module_allowed");
    if (seq == nullptr) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      c.module_allowed.push_back(PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, i)) == 1 ? 1 : 0);
    }
    Py_DECREF(seq);
  }
  if (PyObject* v = item(d, "state")) {  // [(name, tensor), ...]
    PyObject* seq = PySequence_Fast(v, "state");
    if (seq == nullptr) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* pair = PySequence_Fast_GET_ITEM(seq, i);
      PyObject* name =
          PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 ? PyTuple_GET_ITEM(pair, 0) : nullptr;
      PyObject* tensor = name != nullptr ? PyTuple_GET_ITEM(pair, 1) : nullptr;
      const char* n = name != nullptr ? PyUnicode_AsUTF8(name) : nullptr;
      if (n == nullptr || !THPVariable_Check(tensor)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "cublas_guard_ext.watch: state must be (name, tensor) pairs");
        return false;
      }
      c.state.emplace_back(THPVariable_Unpack(tensor), n);
    }
    Py_DECREF(seq);
  }
  if (PyObject* v = item(d, "finite_state")) {
    PyObject* seq = PySequence_Fast(v, "finite_state");
    if (seq == nullptr) return false;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i) {
      PyObject* t = PySequence_Fast_GET_ITEM(seq, i);
      if (THPVariable_Check(t)) c.finite_state.push_back(THPVariable_Unpack(t));
    }
    Py_DECREF(seq);
  }
  return true;
}

PyObject* py_begin(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  WatchConfig config;
  if (!parse_config(arg, config)) return nullptr;
  install_fallback();
  SessionRef ref = std::make_shared<Session>();
  Session* s = ref.get();
  s->mode = config.mode;
  s->report = config.report;
  for (const auto& [t, name] : config.state) {
    if (t.has_storage()) s->state.emplace(t.storage().unsafeGetStorageImpl(), name);
  }
  config.state.clear();  // the names are kept by storage; no reference to the tensors
  s->config = std::move(config);
  s->thread_id = at::RecordFunction::currentThreadId();
  s->seq_base = at::sequence_number::peek();
  s->seq_module.reserve(4096);
  s->outer = tls_session_ref;
  if (s->outer != nullptr) s->origins = s->outer->origins;  // the thread's tags index it
  s->key_was_included = c10::impl::tls_is_dispatch_key_included(kWatchKey);
  s->tags = tags_begin(/*outermost=*/s->outer == nullptr, s->config.capacity);
  s->mu = &s->tags->mu;
  // Found finite by the entry check just now: a finite tag, no first-sight scan (the
  // arrays of a block's outermost start are all zero, that is finite).
  if (s->outer == nullptr) {
    for (const at::Tensor& t : s->config.finite_state) tags_known_finite(*s, t);
  }
  s->config.finite_state.clear();
  if (s->config.verify_inputs) enable_verify(*s);
  tls_session_ref = ref;
  tls_session = s;
  {
    std::lock_guard<std::mutex> registry_lock(registry_mutex());
    registry()[s->thread_id] = ref;
  }
  c10::impl::tls_set_dispatch_key_included(kWatchKey, true);
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Ends this thread's innermost watch; returns the pending finding's message or None.
PyObject* py_end(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  SessionRef ref = tls_session_ref;  // the owner's reference, dropped below
  Session* s = ref.get();
  if (s == nullptr) Py_RETURN_NONE;
  c10::impl::tls_set_dispatch_key_included(kWatchKey, s->key_was_included);
  tls_session_ref = s->outer;
  tls_session = s->outer.get();
  {
    std::lock_guard<std::mutex> registry_lock(registry_mutex());
    if (s->outer != nullptr) {
      registry()[s->thread_id] = s->outer;
    } else {
      registry().erase(s->thread_id);
    }
  }
  // A device thread still running a node of this block holds its own reference:
  // the session lives until that op is done (it finds no session after it).
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    harvest(*s, /*synchronize=*/true, /*as_pending=*/true);  // the final check: one synchronize
    tls_after_unlock.stack_for = kNoOrigin;  // no stack to take at the block's end for an origin never raised
  }
  PyObject* result = s->pending ? PyUnicode_FromString(s->pending_message.c_str()) : Py_None;
  if (result == Py_None) Py_INCREF(Py_None);
  s->pending = false;
  return result;
  END_HANDLE_TH_ERRORS
}

// check(): the final check of what is queued so far, then the pending finding's message.
PyObject* py_take_pending(PyObject*, PyObject*) {
  HANDLE_TH_ERRORS
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    harvest(*s, /*synchronize=*/true, /*as_pending=*/true);
  }
  run_after_unlock(*s);
  SessionLock lock(*s->mu);
  if (!s->pending) Py_RETURN_NONE;
  s->pending = false;
  PyObject* result = PyUnicode_FromString(s->pending_message.c_str());
  s->pending_message.clear();
  return result;
  END_HANDLE_TH_ERRORS
}

PyObject* py_push(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(*s->mu);
    s->module_stack.push_back(static_cast<int32_t>(PyLong_AsLong(arg)));
  }
  Py_RETURN_NONE;
}

PyObject* py_pop(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(*s->mu);
    if (!s->module_stack.empty()) s->module_stack.pop_back();
  }
  Py_RETURN_NONE;
}

PyObject* py_active(PyObject*, PyObject*) { return PyBool_FromLong(tls_session != nullptr); }

// (nan, +inf, -inf, first_bad_index) of any floating tensor; None if not readable
// (the entry check of parameters and buffers: a host read, outside the block's ops).
PyObject* py_scan(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  if (!THPVariable_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "expected a tensor");
    return nullptr;
  }
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (!readable(t)) Py_RETURN_NONE;
  HostCounts c;
  {
    pybind11::gil_scoped_release nogil;
    c = host_counts(t);
  }
  return Py_BuildValue("(LLLL)", static_cast<long long>(c.nan), static_cast<long long>(c.posinf),
                       static_cast<long long>(c.neginf), static_cast<long long>(c.first));
  END_HANDLE_TH_ERRORS
}

PyObject* py_all_finite(PyObject*, PyObject* arg) {
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> tensors;
  for (Py_ssize_t i = 0; i < PySequence_Size(arg); ++i) {
    PyObject* obj = PySequence_GetItem(arg, i);
    const bool ok = obj != nullptr && THPVariable_Check(obj);
    if (ok) tensors.push_back(THPVariable_Unpack(obj));
    Py_XDECREF(obj);
    if (!ok) {
      PyErr_SetString(PyExc_TypeError, "expected a sequence of tensors");
      return nullptr;
    }
  }
  bool finite = false;
  {
    pybind11::gil_scoped_release nogil;
    finite = all_finite(tensors);
  }
  return PyBool_FromLong(finite ? 1 : 0);
  END_HANDLE_TH_ERRORS
}

PyObject* py_stats(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  return Py_BuildValue("(LL)", static_cast<long long>(s->ops_seen.load()),
                       static_cast<long long>(s->outputs_scanned.load()));
}

// Sinks the Python side sees: reached(tensors, wheres). A tagged tensor's
// finding is raised (sync) or kept (async); finite and untagged ones pass.
PyObject* py_reached(PyObject*, PyObject* args) {
  PyObject *tensors = nullptr, *wheres = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &tensors, &wheres)) return nullptr;
  SessionRef hold;  // a post-accumulate-grad hook may run on a device thread
  Session* s = current_session(hold);
  if (s == nullptr || s->report != kReportConsequence) Py_RETURN_NONE;
  std::vector<std::string> where;
  if (!read_strings(wheres, where, "wheres")) return nullptr;
  try {
    for (Py_ssize_t i = 0; i < PySequence_Size(tensors); ++i) {
      PyObject* obj = PySequence_GetItem(tensors, i);
      if (obj == nullptr || !THPVariable_Check(obj)) {
        Py_XDECREF(obj);
        continue;
      }
      const at::Tensor t = THPVariable_Unpack(obj);
      Py_DECREF(obj);
      if (!readable(t)) continue;
      pybind11::gil_scoped_release nogil;
      {
        SessionLock lock(*s->mu);
        tags_reached(*s, t, static_cast<size_t>(i) < where.size() ? where[i] : "a result");
      }
      run_after_unlock(*s);
    }
  } catch (python_error& e) {
    e.restore();
    return nullptr;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  PyErr_Clear();
  Py_RETURN_NONE;
}

// A non-finite argument of the watched model: an origin (an entry scan).
PyObject* py_entry(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* tensor = nullptr;
  const char* name = nullptr;
  int allowed = 0;
  if (!PyArg_ParseTuple(args, "Osp", &tensor, &name, &allowed)) return nullptr;
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(tensor)) Py_RETURN_NONE;
  const at::Tensor t = THPVariable_Unpack(tensor);
  if (!readable(t)) Py_RETURN_NONE;
  const std::string arg_name = name;
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    tags_entry(*s, t, arg_name, allowed != 0);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Test seam: the watch key on (or off) in this thread with no session of its
// own, as autograd's device threads run (the key comes with the forward
// thread's state): its backward ops find the session of the node's thread.
PyObject* py_set_key_included(PyObject*, PyObject* arg) {
  const char* flag = std::getenv("CUBLAS_GUARD_EXT_TESTING");
  if (flag == nullptr || std::string(flag) != "1") {
    PyErr_SetString(
        PyExc_RuntimeError,
        "cublas_guard_ext: _watch_set_key_included is a test hook; set CUBLAS_GUARD_EXT_TESTING=1 to use it");
    return nullptr;
  }
  const bool previous = c10::impl::tls_is_dispatch_key_included(kWatchKey);
  c10::impl::tls_set_dispatch_key_included(kWatchKey, PyObject_IsTrue(arg) == 1);
  return PyBool_FromLong(previous);
}

PyObject* py_key_included(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::impl::tls_is_dispatch_key_included(kWatchKey));
}

// How many grown-out tag arrays this thread's watch keeps until its final check (tests).
PyObject* py_retired_arrays(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s == nullptr) return PyLong_FromLong(0);
  SessionLock lock(*s->mu);
  int64_t n = 0;
  for (const DeviceTags& d : s->tags->devices) n += static_cast<int64_t>(d.retired.size());
  return PyLong_FromLongLong(n);
}

PyMethodDef methods[] = {
    {"_watch_begin", py_begin, METH_O, "_watch_begin(config: dict): begin this thread's watch"},
    {"_watch_end", py_end, METH_NOARGS, "_watch_end() -> the pending finding's message or None"},
    {"_watch_take_pending", py_take_pending, METH_NOARGS,
     "the final check so far: the pending message, or None"},
    {"_watch_reached", py_reached, METH_VARARGS, "_watch_reached(tensors, wheres): sinks (consequence mode)"},
    {"_watch_entry", py_entry, METH_VARARGS,
     "_watch_entry(tensor, name, allowed): a model argument's entry scan"},
    {"_watch_push", py_push, METH_O, "push a module id"},
    {"_watch_pop", py_pop, METH_NOARGS, "pop a module id"},
    {"_watch_active", py_active, METH_NOARGS, "whether this thread is watching"},
    {"_watch_scan", py_scan, METH_O, "(nan, posinf, neginf, first_bad_index) or None"},
    {"_watch_all_finite", py_all_finite, METH_O, "whether every value of these tensors is finite"},
    {"_watch_stats", py_stats, METH_NOARGS, "(ops seen, outputs scanned) of this thread's watch"},
    {"_watch_key_included", py_key_included, METH_NOARGS, "whether the watch key is on in this thread"},
    {"_watch_set_key_included", py_set_key_included, METH_O,
     "test seam: the watch key on/off in this thread (a device thread's state); the previous value"},
    {"_watch_retired_arrays", py_retired_arrays, METH_NOARGS,
     "grown-out tag arrays kept until the final check"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_methods() { return methods; }

}  // namespace watch
}  // namespace cublas_guard
