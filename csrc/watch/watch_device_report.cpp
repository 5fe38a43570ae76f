// The deferred protocol's raise side: reading the records (plain loads of
// host memory; the final check synchronizes once first) and turning what the
// scans left there into the direct path's errors. A birth entry and the call
// descriptor of its sequence number give back every field judge() and
// entry_origin() put into a report, in the same order, so the error has the
// same class, fields and message; findings go through reached(), as on the
// direct path. Births are read as soon as the host sees them (after each
// watched op), while the descriptor ring still holds their call.
#include "watch/watch_device.h"

#include <torch/csrc/autograd/function.h>

namespace cublas_guard {
namespace watch {

namespace {

void add_tensor(ErrorReport& r, const std::string& p, const DescTensor& t, bool strides) {
  if (t.ndim >= 0) r.add((p + "shape").c_str(), c10::IntArrayRef(t.sizes, t.ndim));
  if (strides && t.ndim >= 0) r.add((p + "strides").c_str(), c10::IntArrayRef(t.strides, t.ndim));
  r.add((p + "dtype").c_str(), std::string(c10::toString(static_cast<at::ScalarType>(t.dtype))));
}

// judge()'s report of a producer, from the descriptor and the birth entry.
void birth_report(Session& s, const CallDesc& c, const BirthEntry& b, ErrorReport& r, std::string& summary,
                  std::string& key) {
  const c10::FunctionSchema& schema = *c.schema;
  const std::string name = op_display_name(schema);
  Where w;
  w.module = c.module;
  w.backward = c.backward;
  if (c.node) w.node_name = c.node->name();
  r.add("op", name);
  add_where(r, s, w);
  r.add("output_index", b.output_index);
  r.add("nan_count", b.nan_count).add("posinf_count", b.posinf_count).add("neginf_count", b.neginf_count);
  r.add("first_bad_index", b.first_bad_index);
  add_tensor(r, "", c.out, /*strides=*/true);
  r.add("device", c.out.device.str());
  r.add("first_bad_value", b.first_bad_value);
  int64_t n = 0;
  for (int i = 0; i < c.n_items; ++i) {
    const DescItem& item = c.items[i];
    const std::string& arg_name = schema.arguments()[item.arg].name();
    if (item.scalar) {
      r.add(("scalar_" + arg_name).c_str(), item.value);
      continue;
    }
    const std::string p = "input" + std::to_string(n++) + "_";
    r.add((p + "name").c_str(), arg_name);
    if (item.tensor.ndim >= 0) {
      r.add((p + "shape").c_str(), c10::IntArrayRef(item.tensor.sizes, item.tensor.ndim));
      r.add((p + "strides").c_str(), c10::IntArrayRef(item.tensor.strides, item.tensor.ndim));
    }
    r.add((p + "dtype").c_str(), std::string(c10::toString(static_cast<at::ScalarType>(item.tensor.dtype))));
    r.add((p + "device").c_str(), item.tensor.device.str());
  }
  r.add("num_inputs", c.num_inputs);
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  if (s.mode == kModeAsync) r.add("deferred", true);
  summary = "watch: " + name + " produced non-finite values from finite inputs";
  key = name + "|" + std::to_string(w.module) + "|" + (w.backward ? "b" : "f") + w.node_name + "|" +
        std::to_string(b.output_index);
}

// entry_origin()'s report of a non-finite argument.
void entry_report(Session& s, const DeviceWatch& dw, const CallDesc& c, const BirthEntry& b, ErrorReport& r,
                  std::string& summary, std::string& key) {
  const std::string& name = dw.names[c.entry_name];
  r.add("role", "argument").add("name", name);
  r.add("nan_count", b.nan_count).add("posinf_count", b.posinf_count).add("neginf_count", b.neginf_count);
  r.add("first_bad_index", b.first_bad_index);
  add_tensor(r, "", c.out, /*strides=*/false);
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  summary = "watch: the model's argument '" + name + "' is non-finite on entry";
  key = "entry|" + name;
}

// A finding's message: raised at the op (sync), kept (async, or a check that raises it itself).
void deliver(Session& s, const std::string& message, bool as_pending) {
  if (s.mode == kModeAsync || as_pending) {
    if (s.pending) return;  // only the first finding is kept
    s.pending_message = message;
    s.pending = true;
    return;
  }
  if (tls_deferred.raise.empty()) tls_deferred.raise = message;
}

void take_birth(Session& s, DeviceWatch& w, const BirthEntry& b, bool as_pending) {
  const CallDesc& c = w.ring[b.seq & (DeviceWatch::kRing - 1)];
  if (c.seq != b.seq) {  // the ring moved on before the host saw this birth
    ++w.lost;
    return;
  }
  const bool birth = s.report == kReportBirth;
  ErrorReport r(c.entry ? "non_finite_entry" : "non_finite_output");
  std::string summary, key;
  if (c.entry) {
    entry_report(s, w, c, b, r, summary, key);
  } else {
    birth_report(s, c, b, r, summary, key);
  }
  if (birth) {  // the birth is the finding
    if (!c.entry) deliver(s, r.message(summary), as_pending);
    return;
  }
  const uint32_t id = record_origin(s, r, key, summary, /*with_stack=*/!c.entry);
  w.origin_of_seq[b.seq] = id;
}

void take_finding(Session& s, DeviceWatch& w, const FindingEntry& f, bool as_pending) {
  const auto it = w.origin_of_seq.find(f.origin_seq);
  if (it == w.origin_of_seq.end()) {
    ++w.lost;
    return;
  }
  std::string where;
  if (f.sink == kSinkBackwardBirth) {
    where = "a gradient: a backward formula produced it from finite values";
  } else if (f.sink >= 0 && static_cast<size_t>(f.sink) < w.names.size()) {
    where = w.names[f.sink];
  } else {
    where = "a result";
  }
  if (!as_pending || s.mode == kModeAsync) {
    reached(s, it->second, where);
    return;
  }
  // A sync finding read at a check: kept pending, raised by the caller.
  const int saved = s.mode;
  s.mode = kModeAsync;
  reached(s, it->second, where);
  s.mode = saved;
}

}  // namespace

void deferred_harvest(Session& s, bool synchronize, bool as_pending) {
  DeviceWatch& w = *s.device;
  if (synchronize) {
    for (DeviceTags& d : w.devices) d.kernels->synchronize(d.device);
  }
  for (DeviceTags& d : w.devices) {
    volatile WatchRecord* rec = d.record;
    if (rec->flag == 0) continue;
    while (d.births_read < kMaxBirths && rec->births[d.births_read].ready != 0) {
      BirthEntry b;
      b.seq = rec->births[d.births_read].seq;
      b.output_index = rec->births[d.births_read].output_index;
      b.nan_count = rec->births[d.births_read].nan_count;
      b.posinf_count = rec->births[d.births_read].posinf_count;
      b.neginf_count = rec->births[d.births_read].neginf_count;
      b.first_bad_index = rec->births[d.births_read].first_bad_index;
      b.first_bad_value = rec->births[d.births_read].first_bad_value;
      ++d.births_read;
      take_birth(s, w, b, as_pending);
    }
    while (d.findings_read < kMaxFindings && rec->findings[d.findings_read].ready != 0) {
      FindingEntry f;
      f.origin_seq = rec->findings[d.findings_read].origin_seq;
      f.sink = rec->findings[d.findings_read].sink;
      ++d.findings_read;
      take_finding(s, w, f, as_pending);
    }
  }
}

}  // namespace watch
}  // namespace cublas_guard
