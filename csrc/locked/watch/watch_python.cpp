// watch's methods of the native module cublas_guard_ext._C (python_module.cpp
// adds them to its method list): begin/end a session from a config, the module stack
// pushes and pops of the Python hooks, the pending async finding, sinks and
// entries, and the probes the Python side and the tests use. Hand-written
// (not pybind11) to keep the per-module hook calls cheap.
#include "locked/watch/watch.h"
#include "locked/watch/watch_device.h"

#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

namespace cublas_guard {
namespace watch {

namespace {

// Calls fn(item) for each item of the sequence `seq` (nullptr: none); false
// when fn or the sequence failed (a Python error is set).
template <typename Fn>
bool for_each_item(PyObject* seq, const char* what, Fn&& fn) {
  if (seq == nullptr) return true;
  PyObject* fast = PySequence_Fast(seq, what);
  if (fast == nullptr) return false;
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PySequence_Fast_GET_SIZE(fast); ++i)
    ok = fn(PySequence_Fast_GET_ITEM(fast, i));
  Py_DECREF(fast);
  return ok;
}

bool read_strings(PyObject* list, std::vector<std::string>& out, const char* what) {
  return for_each_item(list, what, [&](PyObject* o) {
    const char* s = PyUnicode_AsUTF8(o);
    if (s != nullptr) out.emplace_back(s);
    return s != nullptr;
  });
}

// watch.py's config dict -> WatchConfig. watch.py validated the user's
// arguments; this only converts (a wrong type is a TypeError naming the key).
bool parse_config(PyObject* d, WatchConfig& c) {
  auto item = [&](const char* key) { return PyDict_Check(d) ? PyDict_GetItemString(d, key) : nullptr; };
  PyObject* report = item("report");
  const char* r = report != nullptr ? PyUnicode_AsUTF8(report) : nullptr;
  PyObject* mode = item("mode");
  PyObject* capacity = item("capacity");
  if (r == nullptr || mode == nullptr || capacity == nullptr) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError,
                    "cublas_guard_ext._C._watch_begin: a config dict with mode, report, capacity");
    return false;
  }
  c.report = std::string(r) == "birth" ? kReportBirth : kReportConsequence;
  c.mode = static_cast<int>(PyLong_AsLong(mode));  // a code of cublas_guard_ext._native.loading.codes
  c.capacity = PyLong_AsLongLong(capacity);
  if (PyErr_Occurred()) return false;
  auto flag = [&](const char* key) { return item(key) != nullptr && PyObject_IsTrue(item(key)) == 1; };
  c.has_model = flag("has_model");
  c.verify_inputs = flag("verify_inputs");
  return read_strings(item("module_names"), c.module_names, "module_names") &&
         read_strings(item("allowed_ops"), c.allowed_ops, "allowed_ops") &&
         for_each_item(item("module_allowed"), "module_allowed",
                       [&](PyObject* o) {
                         c.module_allowed.push_back(PyObject_IsTrue(o) == 1 ? 1 : 0);
                         return true;
                       }) &&
         for_each_item(item("state"), "state",
                       [&](PyObject* pair) {  // (name, tensor)
                         const bool ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 &&
                                         PyUnicode_Check(PyTuple_GET_ITEM(pair, 0)) &&
                                         THPVariable_Check(PyTuple_GET_ITEM(pair, 1));
                         if (!ok)
                           PyErr_SetString(PyExc_TypeError,
                                           "_watch_begin: state must be (name, tensor) pairs");
                         if (ok) {
                           c.state.emplace_back(THPVariable_Unpack(PyTuple_GET_ITEM(pair, 1)),
                                                PyUnicode_AsUTF8(PyTuple_GET_ITEM(pair, 0)));
                         }
                         return ok;
                       }) &&
         for_each_item(item("finite_state"), "finite_state", [&](PyObject* t) {
           if (THPVariable_Check(t)) c.finite_state.push_back(THPVariable_Unpack(t));
           return true;
         });
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

bool read_tensors(PyObject* seq, std::vector<at::Tensor>& out) {
  return for_each_item(seq, "expected a sequence of tensors", [&](PyObject* obj) {
    const bool tensor = THPVariable_Check(obj);
    if (tensor) out.push_back(THPVariable_Unpack(obj));
    if (!tensor) PyErr_SetString(PyExc_TypeError, "expected a sequence of tensors");
    return tensor;
  });
}

// Turns the key back on after the outermost unhooked step (ended, or left by an exception:
// then at the next module's forward, py_push).
void end_unhooked_steps(Session& s, int32_t steps) {
  steps = std::min(steps, s.unhooked_steps);
  s.unhooked_steps -= steps;
  s.optimizer_depth = std::max(0, s.optimizer_depth - steps);
  if (s.unhooked_steps == 0 && s.key_off_for_step) {
    s.key_off_for_step = false;
    c10::impl::tls_set_dispatch_key_included(kWatchKey, true);
  }
}

PyObject* py_push(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(*s->mu);
    s->module_stack.push_back(static_cast<int32_t>(PyLong_AsLong(arg)));
    if (s->unhooked_steps > 0) end_unhooked_steps(*s, s->unhooked_steps);  // a step that raised
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

// optimizer.step() begins (True) or ends (False) in this thread.
PyObject* py_optimizer_step(PyObject*, PyObject* arg) {
  Session* s = tls_session;
  if (s != nullptr) {
    SessionLock lock(*s->mu);
    if (PyObject_IsTrue(arg)) {
      ++s->optimizer_depth;
    } else if (s->optimizer_depth > 0) {
      --s->optimizer_depth;
    }
  }
  Py_RETURN_NONE;
}

// A step of one of torch's optimizers begins in this thread, unhooked: `tensors` (what it reads
// and may write) get their first-sight scans, then the watch key goes off until
// py_optimizer_end. Its ops are torch's own, on the parameters, their gradients and states: the
// hook's per-op cost bought nothing there but which of the update's ops made a value (issue 50:
// AdamW's eight parameter-sized outputs per parameter, each scanned, were half of a watched
// MiniLM step's extra time).
PyObject* py_optimizer_begin(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *tensors_obj = nullptr, *finite_obj = nullptr, *bounded_obj = nullptr;
  if (!PyArg_ParseTuple(args, "OO|O", &tensors_obj, &finite_obj, &bounded_obj)) return nullptr;
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  std::vector<at::Tensor> tensors, finite, bounded;
  if (!read_tensors(tensors_obj, tensors) || !read_tensors(finite_obj, finite) ||
      (bounded_obj != nullptr && !read_tensors(bounded_obj, bounded))) {
    return nullptr;
  }
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    tags_before_step(*s, tensors, finite, bounded);
    ++s->optimizer_depth;
    if (s->unhooked_steps++ == 0) {
      s->key_off_for_step = c10::impl::tls_is_dispatch_key_included(kWatchKey);
      c10::impl::tls_set_dispatch_key_included(kWatchKey, false);
    }
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// The unhooked step ended: `groups`, one (read, written[, implied[, second_moment]]) tuple of
// tensor sequences per parameter (tags_after_step: `implied`, the index of a written state a
// finite parameter proves finite, `second_moment` that of an exp_avg_sq whose bound may be proven,
// -1 for none), scanned as one op's outputs each, in phase "optimizer step". Returns (whether
// every written tensor is on the CPU with a finite tag now (read on the host), the indices of the
// groups whose second moment holds its bound now).
PyObject* py_optimizer_end(PyObject*, PyObject* groups) {
  HANDLE_TH_ERRORS
  Session* s = tls_session;
  if (s == nullptr) Py_RETURN_NONE;
  struct StepWrites {
    std::vector<at::Tensor> read, written;
    int64_t implied = -1, second_moment = -1;
  };
  std::vector<StepWrites> steps;
  auto index_at = [](PyObject* item, Py_ssize_t i, int64_t* out) {
    return i >= PyTuple_GET_SIZE(item) || (*out = PyLong_AsLongLong(PyTuple_GET_ITEM(item, i))) != -1 ||
           !PyErr_Occurred();
  };
  const char* shape = "expected (read, written[, implied[, second_moment]]) tuples";
  const bool ok = for_each_item(groups, shape, [&](PyObject* item) {
    StepWrites& w = steps.emplace_back();
    const Py_ssize_t n = PyTuple_Check(item) ? PyTuple_GET_SIZE(item) : 0;
    if (n < 2 || n > 4 || !read_tensors(PyTuple_GET_ITEM(item, 0), w.read) ||
        !read_tensors(PyTuple_GET_ITEM(item, 1), w.written) || w.read.size() != w.written.size() + 1 ||
        !index_at(item, 2, &w.implied) || !index_at(item, 3, &w.second_moment)) {
      if (!PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError,
                        "_watch_optimizer_end: (read, written[, implied[, second_moment]]) tuples, read one "
                        "longer (the gradient first)");
      return false;
    }
    return true;
  });
  if (!ok) return nullptr;
  bool finite = true;
  std::vector<int64_t> bounded;
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
    // Attributed to the step (its depth is still counted) and only then ended.
    for (size_t i = 0; i < steps.size(); ++i) {
      const StepWrites& w = steps[i];
      if (tags_after_step(*s, w.read, w.written, w.implied, w.second_moment)) {
        bounded.push_back(static_cast<int64_t>(i));
      }
      for (const at::Tensor& t : w.written) finite = finite && tags_finite_on_host(*s, t);
    }
    end_unhooked_steps(*s, 1);
  }
  run_after_unlock(*s);  // a sync finding
  PyObject* indices = PyList_New(static_cast<Py_ssize_t>(bounded.size()));
  if (indices == nullptr) return nullptr;
  for (size_t i = 0; i < bounded.size(); ++i) {
    PyList_SET_ITEM(indices, static_cast<Py_ssize_t>(i), PyLong_FromLongLong(bounded[i]));
  }
  return Py_BuildValue("(NN)", PyBool_FromLong(finite ? 1 : 0), indices);
  END_HANDLE_TH_ERRORS
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
  if (!read_tensors(arg, tensors)) return nullptr;
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
  HANDLE_TH_ERRORS
  PyObject *tensors = nullptr, *wheres = nullptr;
  if (!PyArg_ParseTuple(args, "OO", &tensors, &wheres)) return nullptr;
  SessionRef hold;  // a post-accumulate-grad hook may run on a device thread
  Session* s = current_session(hold);
  if (s == nullptr || s->report != kReportConsequence) Py_RETURN_NONE;
  std::vector<std::string> where;
  if (!read_strings(wheres, where, "wheres")) return nullptr;
  size_t i = 0;
  const bool ok = for_each_item(tensors, "tensors", [&](PyObject* obj) {
    const size_t k = i++;
    if (!THPVariable_Check(obj) || !readable(THPVariable_Unpack(obj))) return true;
    const at::Tensor t = THPVariable_Unpack(obj);
    pybind11::gil_scoped_release nogil;
    {
      SessionLock lock(*s->mu);
      tags_reached(*s, t, k < where.size() ? where[k] : "a result");
    }
    run_after_unlock(*s);
    return true;
  });
  if (!ok) return nullptr;
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// A non-finite argument of the watched model: an origin (an entry scan).
PyObject* py_entry(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* tensor = nullptr;
  const char* name = nullptr;
  int allowed = 0;
  int buffer = 0;
  if (!PyArg_ParseTuple(args, "Osp|p", &tensor, &name, &allowed, &buffer)) return nullptr;
  Session* s = tls_session;
  if (s == nullptr || !THPVariable_Check(tensor)) Py_RETURN_NONE;
  const at::Tensor t = THPVariable_Unpack(tensor);
  if (!readable(t)) Py_RETURN_NONE;
  const std::string arg_name = name;
  {
    pybind11::gil_scoped_release nogil;
    SessionLock lock(*s->mu);
    tags_entry(*s, t, arg_name, allowed != 0, buffer != 0);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_key_included(PyObject*, PyObject*) {
  return PyBool_FromLong(c10::impl::tls_is_dispatch_key_included(kWatchKey));
}

PyMethodDef methods[] = {
    {"_watch_begin", py_begin, METH_O, "_watch_begin(config: dict): begin this thread's watch"},
    {"_watch_end", py_end, METH_NOARGS, "_watch_end() -> the pending finding's message or None"},
    {"_watch_take_pending", py_take_pending, METH_NOARGS,
     "the final check so far: the pending message, or None"},
    {"_watch_reached", py_reached, METH_VARARGS, "_watch_reached(tensors, wheres): sinks (consequence mode)"},
    {"_watch_entry", py_entry, METH_VARARGS,
     "_watch_entry(tensor, name, allowed, buffer=False): a model argument's (or buffer's) entry scan"},
    {"_watch_push", py_push, METH_O, "push a module id"},
    {"_watch_pop", py_pop, METH_NOARGS, "pop a module id"},
    {"_watch_optimizer_step", py_optimizer_step, METH_O, "optimizer.step() begins (True) or ends (False)"},
    {"_watch_optimizer_begin", py_optimizer_begin, METH_VARARGS,
     "_watch_optimizer_begin(tensors, finite[, bounded]): a torch optimizer's step begins, unhooked"},
    {"_watch_optimizer_end", py_optimizer_end, METH_O,
     "_watch_optimizer_end([(read, written[, implied[, second_moment]]), ...]): the unhooked step ended; "
     "what it wrote is judged. Returns (finite, indices of the groups whose second moment is bounded)"},
    {"_watch_active", py_active, METH_NOARGS, "whether this thread is watching"},
    {"_watch_scan", py_scan, METH_O, "(nan, posinf, neginf, first_bad_index) or None"},
    {"_watch_all_finite", py_all_finite, METH_O, "whether every value of these tensors is finite"},
    {"_watch_stats", py_stats, METH_NOARGS, "(ops seen, outputs scanned) of this thread's watch"},
    {"_watch_key_included", py_key_included, METH_NOARGS, "whether the watch key is on in this thread"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PyMethodDef* python_methods() { return methods; }

}  // namespace watch
}  // namespace cublas_guard

// Never called: its schema names what an unhooked optimizer step wrote (the state) and read (the
// gradient) in watch's findings, and tells the hooks which of the two it writes (watch_ops.cpp).
TORCH_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("optimizer_step_writes(Tensor[] read, Tensor(a!)[] state) -> ()");
}
TORCH_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  m.impl("optimizer_step_writes", [](at::TensorList, at::TensorList) {});
}
