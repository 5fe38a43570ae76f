// watch's raise side: reading the records (acquire loads of host memory; the
// final check synchronizes once first) and turning what the scans left there
// into errors. A birth entry and the call descriptor of its sequence number
// give every field of the report (op, module, phase, counts, inputs and their
// absolute maxima); findings go through reached(). Nothing is dropped: a birth
// the record lapped, a descriptor the ring overwrote, a finding whose origin
// is not known are counted and said in the finding that is raised.
#include "locked/watch/watch_device.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

namespace cublas_guard {
namespace watch {

namespace {

// A described tensor's shape (when not too many dims) and dtype.
void add_shape(ErrorReport& r, const DescTensor& t) {
  if (t.ndim >= 0) r.add("shape", c10::IntArrayRef(t.sizes, t.ndim));
}
std::string dtype_name(const DescTensor& t) { return c10::toString(static_cast<at::ScalarType>(t.dtype)); }

}  // namespace

void add_call_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const CallDesc& c) {
  int64_t n = 0;
  for (int i = 0; i < c.n_items; ++i) {
    const DescItem& item = c.items[i];
    const std::string& arg_name = schema.arguments()[item.arg].name();
    if (item.scalar) {
      r.add(("scalar_" + arg_name).c_str(), item.value);
      continue;
    }
    const int64_t input = n++;
    const std::string p = "input" + std::to_string(input) + "_";
    r.add((p + "name").c_str(), arg_name);
    if (item.tensor.ndim >= 0) {
      r.add((p + "shape").c_str(), c10::IntArrayRef(item.tensor.sizes, item.tensor.ndim));
      r.add((p + "strides").c_str(), c10::IntArrayRef(item.tensor.strides, item.tensor.ndim));
    }
    r.add((p + "dtype").c_str(), dtype_name(item.tensor));
    r.add((p + "device").c_str(), item.tensor.device.str());
  }
  r.add("num_inputs", c.num_inputs);
}

namespace {

// A grouped GEMM's output (rows sorted by group, CallDesc::offs their ends): the
// group of the first bad row (the expert, named as the guarded grouped linear's
// own reports name it), or that the row is past the last group end, where
// torch's grouped_mm leaves its output and its input gradient uninitialized.
// The ends are read back here, on the report's path only.
void add_group_of_first_bad_row(ErrorReport& r, const Session& s, const CallDesc& c, const BirthEntry& b) {
  if (!c.offs.defined() || c.out.ndim != 2 || b.first_bad_index < 0) return;
  const c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  const at::Tensor ends = c.offs.to(at::kCPU).to(at::kLong).contiguous();
  const int64_t* end = ends.const_data_ptr<int64_t>();
  const int64_t groups = ends.numel();
  const int64_t row = b.first_bad_index / std::max<int64_t>(1, c.out.sizes[1]);
  const int64_t routed = groups == 0 ? 0 : end[groups - 1];
  if (row >= routed) {
    r.add("past_groups", true).add("groups_end", routed);
    return;
  }
  const int64_t group = std::upper_bound(end, end + groups, row) - end;
  if (c.module >= 0 && static_cast<size_t>(c.module) < s.config.module_names.size()) {
    r.add("experts_module", s.config.module_names[c.module]);
  }
  if (!c.parameter.empty()) r.add("parameter", c.parameter);
  r.add("expert", group);
  r.add("expert_rows", c10::IntArrayRef({group == 0 ? 0 : end[group - 1], end[group]}));
}

// The report of a producer, from the descriptor and the birth entry.
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
  r.add("zero_count", b.zero_count);
  r.add("first_bad_index", b.first_bad_index);
  add_shape(r, c.out);
  if (c.out.ndim >= 0) r.add("strides", c10::IntArrayRef(c.out.strides, c.out.ndim));
  r.add("dtype", dtype_name(c.out));
  r.add("device", c.out.device.str());
  r.add("first_bad_value", b.first_bad_value);
  if (c.product) r.add("product", true);
  add_call_inputs(r, schema, c);
  add_group_of_first_bad_row(r, s, c, b);
  // The views' maxima (the scan recorded which input each view is), where known.
  for (int v = 0; v < kMaxViews; ++v) {
    if (std::isfinite(b.input_absmax[v])) {
      r.add(("input" + std::to_string(b.input_index[v]) + "_absmax").c_str(), b.input_absmax[v]);
    }
  }
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  if (s.mode == kModeAsync) r.add("deferred", true);
  summary = "watch: " + name + " produced non-finite values from finite inputs";
  key = name + "|" + std::to_string(w.module) + "|" + (w.backward ? "b" : "f") + w.node_name + "|" +
        std::to_string(b.output_index);
}

// The report of a non-finite argument (or buffer) of the model.
void entry_report(Session& s, const TagState& w, const CallDesc& c, const BirthEntry& b, ErrorReport& r,
                  std::string& summary, std::string& key) {
  const std::string& name = w.names[c.entry_name];
  const char* role = c.entry_buffer ? "buffer" : "argument";
  r.add("role", role).add("name", name);
  r.add("nan_count", b.nan_count).add("posinf_count", b.posinf_count).add("neginf_count", b.neginf_count);
  r.add("zero_count", b.zero_count);
  r.add("first_bad_index", b.first_bad_index);
  add_shape(r, c.out);
  r.add("dtype", dtype_name(c.out));
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  summary = std::string("watch: the model's ") + role + " '" + name + "' is non-finite on entry";
  key = "entry|" + name;
}

void take_birth(Session& s, TagState& w, const BirthEntry& b, bool as_pending, bool at_op) {
  const CallDesc& c = w.ring[b.seq & (w.capacity - 1)];
  if (c.seq != b.seq) {  // the ring moved on before the host read this birth
    ++w.lost_calls;
    return;
  }
  ErrorReport entry("non_finite_entry");
  ErrorReport output("non_finite_output");
  ErrorReport& r = c.entry ? entry : output;
  std::string summary, key;
  if (c.entry) {
    entry_report(s, w, c, b, r, summary, key);
  } else {
    birth_report(s, c, b, r, summary, key);
  }
  const bool birth_mode = s.report == kReportBirth;
  if (birth_mode && !c.entry) {  // the birth is the finding
    add_lost(r, w);
    deliver(s, r.message(summary), as_pending);
    return;
  }
  const bool stack_at_birth = at_op && b.seq >= w.op_first_seq;
  w.origin_of_seq[b.seq] = record_origin(s, r, key, summary, /*with_stack=*/!c.entry, stack_at_birth);
}

void take_finding(Session& s, TagState& w, const FindingEntry& f, bool as_pending) {
  std::string where;
  if (f.sink == kSinkBackwardBirth) {
    where = "a gradient: a backward formula produced it from finite values";
  } else if (f.sink >= 0 && static_cast<size_t>(f.sink) < w.names.size()) {
    where = w.names[f.sink];
  } else {
    where = "a result";
  }
  const auto it = w.origin_of_seq.find(f.origin_seq);
  if (it != w.origin_of_seq.end()) {
    reached(s, it->second, where, as_pending);
    return;
  }
  // The origin's birth was not read (lapped, or its descriptor overwritten):
  // the finding still stands, without the op that made the values.
  ErrorReport r("non_finite_output");
  r.add("reached", where);
  add_lost(r, w);
  r.add("mode", s.mode == kModeAsync ? "async" : "sync");
  deliver(s, r.message("watch: non-finite values reached " + where + "; the op that made them is not known"),
          as_pending);
}

// One ring entry, read as a seqlock: 1 taken, 0 not written yet, -1 lapped (lost).
template <class Entry>
int read_entry(const Entry* ring, int64_t capacity, int64_t index, Entry& out) {
  const Entry& e = ring[index % capacity];
  const int64_t r1 = load_acquire(&e.ready);
  if (r1 == 0 || r1 - 1 < index) return 0;
  if (r1 - 1 > index) return -1;
  std::memcpy(static_cast<void*>(&out), static_cast<const void*>(&e), sizeof(Entry));
  std::atomic_thread_fence(std::memory_order_acquire);
  return load_acquire(&e.ready) == r1 ? 1 : -1;
}

}  // namespace

void add_lost(ErrorReport& r, const TagState& w) {
  if (w.lost_births + w.lost_findings + w.lost_calls == 0) return;
  r.add("lost", "watch lost " + std::to_string(w.lost_births + w.lost_calls) + " birth(s) and " +
                    std::to_string(w.lost_findings) +
                    " finding(s) of this block before reading them (it keeps " + std::to_string(w.capacity) +
                    " of each: the device ran that far ahead of the host, or births "
                    "flooded the record); watch(..., capacity=" +
                    std::to_string(4 * w.capacity) + ") keeps more");
}

void harvest(Session& s, bool synchronize, bool as_pending, bool at_op) {
  TagState& w = *s.tags;
  if (synchronize) {
    for (DeviceTags& d : w.devices) d.kernels->synchronize(d.home.device);
    for (DeviceTags& d : w.devices) d.retired.clear();  // nothing in flight uses them now
  }
  const int64_t lost_before = w.lost_births + w.lost_calls;
  // Every device's births first: a finding on one device may carry an origin born on another.
  for (DeviceTags& d : w.devices) {
    const WatchRecord* rec = d.record;
    if (load_acquire(&rec->flag) == 0) continue;
    for (;;) {
      BirthEntry b;
      const int got = read_entry(rec->births, rec->capacity, d.births_read, b);
      if (got == 0) break;
      ++d.births_read;
      if (got < 0) {
        ++w.lost_births;
        continue;
      }
      take_birth(s, w, b, as_pending, at_op);
    }
  }
  for (DeviceTags& d : w.devices) {
    const WatchRecord* rec = d.record;
    if (load_acquire(&rec->flag) == 0) continue;
    for (;;) {
      FindingEntry f;
      const int got = read_entry(rec->findings, rec->capacity, d.findings_read, f);
      if (got == 0) break;
      ++d.findings_read;
      if (got < 0) {
        ++w.lost_findings;
        continue;
      }
      take_finding(s, w, f, as_pending);
    }
  }
  // Birth mode: a lost birth is a lost finding; say so rather than pass in silence.
  if (s.report == kReportBirth && w.lost_births + w.lost_calls > lost_before) {
    ErrorReport r("non_finite_output");
    add_lost(r, w);
    r.add("mode", s.mode == kModeAsync ? "async" : "sync");
    deliver(s,
            r.message("watch: non-finite values were born in this block, but the record lost their births"),
            as_pending);
  }
}

}  // namespace watch
}  // namespace cublas_guard
