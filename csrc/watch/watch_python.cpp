// The hand-written CPython module cublas_guard_ext._watch_native: begin/end a
// session, the module stack pushes and pops of the Python hooks, the pending
// async finding, and the scan/stats/known-values probes the Python side and
// the tests use. Hand-written (not pybind11) to keep the per-module hook
// calls cheap; put into sys.modules by cublas_guard_internal::watch_install.
#include "watch/watch.h"
#include "watch/watch_device.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <mutex>

namespace cublas_guard {
namespace watch {

namespace {

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
  int mode = kModeSync, report = kReportBirth, has_model = 0;
  PyObject *names = nullptr, *allowed = nullptr, *ops = nullptr, *clean = nullptr;
  PyObject *state = nullptr, *state_names = nullptr;
  if (!PyArg_ParseTuple(args, "iOOOOiiOO", &mode, &names, &allowed, &ops, &clean, &report, &has_model, &state,
                        &state_names)) {
    return nullptr;
  }
  install_fallback();
  SessionRef ref = std::make_shared<Session>();
  Session* s = ref.get();
  SessionLock lock(s->mu);
  s->mode = mode;
  s->report = report;
  s->has_model = has_model != 0;
  const std::vector<std::string> state_list = string_list(state_names);
  bool cuda_state = false;  // a parameter or buffer on a CUDA device: the deferred protocol by default
  for (Py_ssize_t i = 0; i < PySequence_Size(state); ++i) {
    PyObject* item = PySequence_GetItem(state, i);
    if (item != nullptr && THPVariable_Check(item) && static_cast<size_t>(i) < state_list.size()) {
      const at::Tensor& t = THPVariable_Unpack(item);
      cuda_state = cuda_state || t.is_cuda();
      if (t.has_storage()) s->state.emplace(t.storage().unsafeGetStorageImpl(), state_list[i]);
    }
    Py_XDECREF(item);
  }
  PyErr_Clear();
  s->thread_id = at::RecordFunction::currentThreadId();
  s->module_names = string_list(names);
  for (const auto& a : string_list(allowed)) s->module_allowed.push_back(a == "1" ? 1 : 0);
  s->allowed_ops = string_list(ops);
  s->seq_base = at::sequence_number::peek();
  s->seq_module.reserve(4096);
  s->outer = tls_session_ref;
  if (s->outer != nullptr) s->origins = s->outer->origins;  // tags in the thread's table index it
  if (s->outer == nullptr) s->known.drop_expired(/*finite_only=*/true);  // freed since the last block
  s->key_was_included = c10::impl::tls_is_dispatch_key_included(kWatchKey);
  // The deferred protocol (test hook or CUBLAS_GUARD_WATCH_DEFERRED=1); a nested watch follows its outer one.
  const bool on_gpu = device_kernels(c10::DeviceType::CUDA) != nullptr && cuda_state;
  if (s->outer != nullptr ? s->outer->device != nullptr : deferred_protocol_wanted(on_gpu)) {
    try {
      s->device = deferred_begin(/*outermost=*/s->outer == nullptr);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  // Tensors the entry check found finite (parameters, buffers): known.
  const Py_ssize_t n_clean = PySequence_Size(clean);
  for (Py_ssize_t i = 0; i < n_clean; ++i) {
    PyObject* item = PySequence_GetItem(clean, i);
    if (item != nullptr && THPVariable_Check(item)) {
      const at::Tensor& t = THPVariable_Unpack(item);
      if (readable(t) && !known_finite(*s, t)) remember(*s, t, true);  // kept: its scan's bounds
    }
    Py_XDECREF(item);
  }
  PyErr_Clear();
  tls_session_ref = ref;
  tls_session = s;
  {
    std::lock_guard<std::mutex> registry_lock(registry_mutex());
    registry()[s->thread_id] = ref;
  }
  c10::impl::tls_set_dispatch_key_included(kWatchKey, true);
  Py_RETURN_NONE;
}

// Ends this thread's innermost watch; returns the pending finding's message or None.
PyObject* py_end(PyObject*, PyObject*) {
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
  SessionLock lock(s->mu);
  if (s->device) {  // the final check: one synchronize, then the records
    try {
      deferred_harvest(*s, /*synchronize=*/true, /*as_pending=*/true);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  if (s->outer == nullptr) s->known.drop_expired(/*finite_only=*/true);
  PyObject* result = s->pending ? PyUnicode_FromString(s->pending_message.c_str()) : Py_None;
  if (result == Py_None) Py_INCREF(Py_None);
  s->pending = false;
  return result;
}

PyObject* py_take_pending(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s != nullptr && s->device) {  // check(): the final check of what is queued so far
    SessionLock lock(s->mu);
    try {
      deferred_harvest(*s, /*synchronize=*/true, /*as_pending=*/true);
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
  }
  if (s == nullptr || !s->pending) Py_RETURN_NONE;
  SessionLock lock(s->mu);
  if (!s->pending) Py_RETURN_NONE;
  s->pending = false;
  PyObject* result = PyUnicode_FromString(s->pending_message.c_str());
  s->pending_message.clear();
  return result;
}

PyObject* py_push(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(s->mu);
    s->module_stack.push_back(static_cast<int32_t>(PyLong_AsLong(arg)));
  }
  Py_RETURN_NONE;
}

PyObject* py_pop(PyObject*, PyObject*) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(s->mu);
    if (!s->module_stack.empty()) s->module_stack.pop_back();
  }
  Py_RETURN_NONE;
}

PyObject* py_active(PyObject*, PyObject*) { return PyBool_FromLong(tls_session != nullptr); }

// "deferred" or "direct": the protocol this thread's innermost watch runs; None outside a watch.
PyObject* py_protocol(PyObject*, PyObject*) {
  if (tls_session == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(tls_session->device ? "deferred" : "direct");
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
    Session tmp;  // a session of its own: its slot; the thread's table
    c = scan_values(tmp, t);
    // Finite: known, with the bounds watch_bounds.cpp needs (the entry check's scans).
    if (!c.bad() && c.range.bounded()) {
      SessionLock lock(tmp.mu);
      remember(tmp, t, true, c.range);
    }
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
  return Py_BuildValue("(LLL)", static_cast<long long>(s->ops_seen.load()),
                       static_cast<long long>(s->outputs_scanned.load()),
                       static_cast<long long>(s->scans_saved.load()));
}

// Whether this thread's watch knows t's current values to be finite.
PyObject* py_known_finite(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(arg)) Py_RETURN_FALSE;
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (!readable(t) || s->device) Py_RETURN_FALSE;  // deferred: the host never knows
  SessionLock lock(s->mu);
  const Known* k = lookup(*s, t);
  return PyBool_FromLong(k != nullptr && k->finite);
}

// The bounds this thread's watch knows for t's current values: (lo, hi), or
// None when it does not know them finite and bounded (tests of watch_bounds.cpp).
PyObject* py_known_range(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(arg)) Py_RETURN_NONE;
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (!readable(t) || s->device) Py_RETURN_NONE;
  SessionLock lock(s->mu);
  const Range r = known_range(*s, t);
  if (!r.bounded()) Py_RETURN_NONE;
  return Py_BuildValue("(dd)", r.lo, r.hi);
}

// How this thread's watch tells t's storage from a later one at its address:
// "stamp" (its deleter wrapped), "weak" (a weak reference), None (no entry).
PyObject* py_entry_tracking(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(arg)) Py_RETURN_NONE;
  const at::Tensor& t = THPVariable_Unpack(arg);
  SessionLock lock(s->mu);
  const char* how = entry_tracking(*s, t);
  if (how == nullptr) Py_RETURN_NONE;
  return PyUnicode_FromString(how);
}

PyObject* py_stamped_storages(PyObject*, PyObject*) { return PyLong_FromSize_t(stamped_storages()); }

// Test seam: holds the stamp registry's lock for `seconds`, the GIL released
// (a fork while another thread is inside the registry).
PyObject* py_hold_stamp_lock(PyObject*, PyObject* arg) {
  const double seconds = PyFloat_AsDouble(arg);
  if (PyErr_Occurred()) return nullptr;
  Py_BEGIN_ALLOW_THREADS hold_stamp_lock(seconds);
  Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

// Sinks the Python side sees: reached(tensors, wheres). A tagged tensor's
// finding is raised (sync) or kept (async); finite and untagged ones pass.
PyObject* py_reached(PyObject*, PyObject* args) {
  PyObject *tensors = nullptr, *wheres = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &tensors, &wheres)) return nullptr;
  SessionRef hold;  // a post-accumulate-grad hook may run on a device thread
  Session* s = current_session(hold);
  if (s == nullptr || s->report != kReportConsequence) Py_RETURN_NONE;
  const std::vector<std::string> where = string_list(wheres);
  try {
    for (Py_ssize_t i = 0; i < PySequence_Size(tensors); ++i) {
      PyObject* item = PySequence_GetItem(tensors, i);
      if (item == nullptr || !THPVariable_Check(item)) {
        Py_XDECREF(item);
        continue;
      }
      const at::Tensor t = THPVariable_Unpack(item);
      Py_DECREF(item);
      if (!readable(t)) continue;
      pybind11::gil_scoped_release nogil;
      if (s->device) {  // a sink launch: the device reads the tag
        {
          SessionLock lock(s->mu);
          deferred_reached(*s, t, static_cast<size_t>(i) < where.size() ? where[i] : "a result");
        }
        run_deferred(*s);
        continue;
      }
      {
        SessionLock lock(s->mu);
        const uint32_t origin = origin_of(*s, t);
        if (origin == kNoOrigin) continue;  // finite, or non-finite from nowhere watch saw
        if (const Known* k = lookup(*s, t)) {
          if (k->finite) continue;
        } else if (!scan_values(*s, t).bad()) {
          continue;  // a finite part of a tagged storage
        }
        reached(*s, origin, static_cast<size_t>(i) < where.size() ? where[i] : "a result");
      }
      run_deferred(*s);
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

// A non-finite argument of the watched model: its origin (entry_origin).
PyObject* py_entry(PyObject*, PyObject* args) {
  PyObject* tensor = nullptr;
  const char* name = nullptr;
  int allowed = 0;
  if (!PyArg_ParseTuple(args, "Osi", &tensor, &name, &allowed)) return nullptr;
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(tensor)) Py_RETURN_NONE;
  const at::Tensor& t = THPVariable_Unpack(tensor);
  if (!readable(t)) Py_RETURN_NONE;
  try {
    SessionLock lock(s->mu);
    if (s->device) {  // an entry launch: the device tags it
      deferred_entry(*s, t, name, allowed != 0);
      Py_RETURN_NONE;
    }
    const Counts c = scan_values(*s, t);
    if (!c.bad()) Py_RETURN_NONE;
    remember(*s, t, false);
    if (allowed) {
      tag(*s, t, kQuietOrigin);
    } else {
      entry_origin(*s, t, name, c);
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// verify_inputs=True for this thread's innermost watch.
PyObject* py_set_verify(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(s->mu);
    s->verify = PyObject_IsTrue(arg) == 1;
    // verify_inputs needs the host to know what is finite: the direct path runs the block.
    if (s->verify && s->outer == nullptr) s->device.reset();
  }
  Py_RETURN_NONE;
}

// Test seam: the watch key on (or off) in this thread with no session of its
// own, as autograd's device threads run (the key comes with the forward
// thread's state): its backward ops find the session of the node's thread.
PyObject* py_set_key_included(PyObject*, PyObject* arg) {
  const bool previous = c10::impl::tls_is_dispatch_key_included(kWatchKey);
  c10::impl::tls_set_dispatch_key_included(kWatchKey, PyObject_IsTrue(arg) == 1);
  return PyBool_FromLong(previous);
}

PyObject* py_key_included(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::impl::tls_is_dispatch_key_included(kWatchKey));
}

PyMethodDef methods[] = {
    {"begin", py_begin, METH_VARARGS,
     "begin(mode, module_names, module_allowed, allowed_ops, clean_tensors, report, has_model, "
     "state_tensors, state_names)"},
    {"reached", py_reached, METH_VARARGS, "reached(tensors, wheres): sinks (consequence mode)"},
    {"entry", py_entry, METH_VARARGS, "entry(tensor, name, allowed): a non-finite argument's origin"},
    {"end", py_end, METH_NOARGS, "end() -> pending message or None"},
    {"take_pending", py_take_pending, METH_NOARGS, "the pending finding's message, or None"},
    {"push", py_push, METH_O, "push a module id"},
    {"pop", py_pop, METH_NOARGS, "pop a module id"},
    {"active", py_active, METH_NOARGS, "whether this thread is watching"},
    {"protocol", py_protocol, METH_NOARGS, "'deferred' or 'direct' for this thread's watch, or None"},
    {"scan", py_scan, METH_O, "(nan, posinf, neginf, first_bad_index) or None"},
    {"stats", py_stats, METH_NOARGS, "(ops seen, outputs scanned, scans saved) of this thread's watch"},
    {"known_finite", py_known_finite, METH_O, "whether this thread's watch knows the tensor finite"},
    {"known_range", py_known_range, METH_O, "(lo, hi): the bounds the watch knows for the tensor, or None"},
    {"entry_tracking", py_entry_tracking, METH_O, "'stamp', 'weak' or None: how the table knows t's storage"},
    {"hold_stamp_lock", py_hold_stamp_lock, METH_O, "test seam: hold the stamp registry's lock (seconds)"},
    {"stamped_storages", py_stamped_storages, METH_NOARGS, "how many storages carry a watch stamp now"},
    {"key_included", py_key_included, METH_NOARGS, "whether the watch key is on in this thread"},
    {"set_verify", py_set_verify, METH_O, "verify_inputs for this thread's innermost watch"},
    {"set_key_included", py_set_key_included, METH_O,
     "test seam: the watch key on/off in this thread (a device thread's state); the previous value"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cublas_guard_ext._watch_native", nullptr, -1, methods};

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
