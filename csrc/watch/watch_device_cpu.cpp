// The CPU implementation of the deferred protocol's kernels: what
// cuda/watch_scan.cu does in one launch, done here in the calling thread, on
// the same structs and with the same rule (watch_device_logic.h), so that the
// deferred logic (tags, births, findings, the record) is tested on every run
// on a machine with no GPU. Counting is the direct path's (the project's fused
// scan for float32, ATen for the other dtypes: no sync on the CPU).
#include "watch/watch_device.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/logical_not.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <cstring>

namespace cublas_guard {
namespace watch {
namespace {

Counts count_cpu(const at::Tensor& t, double* first_value) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  Counts c;
  if (is_guarded_dtype(t.scalar_type())) {
    static thread_local at::Tensor slot = at::empty({kScanFields}, at::TensorOptions().dtype(at::kLong));
    scan_cpu_into(t, slot, nullptr, "watch");
    const int64_t* r = slot.data_ptr<int64_t>();
    c.nan = r[kNanCount];
    c.posinf = r[kPosInfCount];
    c.neginf = r[kNegInfCount];
    c.first = r[kFirstBadIndex];
  } else if (!at::isfinite(t).all().item<bool>()) {
    const at::Tensor flat = t.reshape({-1});
    c.nan = at::isnan(flat).sum().item<int64_t>();
    c.posinf = at::isposinf(flat).sum().item<int64_t>();
    c.neginf = at::isneginf(flat).sum().item<int64_t>();
    c.first = at::logical_not(at::isfinite(flat)).nonzero().select(1, 0).min().item<int64_t>();
  }
  if (c.bad()) *first_value = t.reshape({-1})[c.first].item<double>();
  return c;
}

void write_birth(WatchRecord* record, int32_t* counters, const TagArgs& a, const Counts& c, double value) {
  const int32_t i = counters[0]++;
  if (i >= kMaxBirths) {
    record->lost_births += 1;
    record->flag = 1;
    return;
  }
  BirthEntry& e = record->births[i];
  e.seq = a.seq;
  e.output_index = a.output_index;
  e.nan_count = c.nan;
  e.posinf_count = c.posinf;
  e.neginf_count = c.neginf;
  e.first_bad_index = c.first;
  e.first_bad_value = value;
  e.ready = static_cast<int64_t>(a.seq) + 1;
  record->flag = 1;
}

void write_finding(WatchRecord* record, int32_t* counters, int32_t tag, int64_t sink) {
  const int32_t i = counters[1]++;
  if (i >= kMaxFindings) {
    record->lost_findings += 1;
    record->flag = 1;
    return;
  }
  FindingEntry& e = record->findings[i];
  e.origin_seq = tag - kTagFirst;
  e.sink = sink;
  e.ready = e.origin_seq + 1;
  record->flag = 1;
}

void scan_cpu(const at::Tensor& t, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* record,
              int32_t* counters) {
  double value = 0.0;
  const Counts c = count_cpu(t, &value);
  const bool bad = c.bad();
  bool new_origin = false;
  const int32_t tag = decide_tag(a, tags, seq_tags, bad, &new_origin);
  if (a.kind != kScanSink && a.out_slot >= 0) tags[a.out_slot] = merged_tag(a, tags[a.out_slot], tag, bad);
  if (a.seq_write >= 0 && tag >= kTagQuiet) {
    seq_tags[a.seq_write] = a.seq_merge ? better_tag(seq_tags[a.seq_write], tag) : tag;
  }
  if (new_origin) write_birth(record, counters, a, c, value);
  int64_t sinks[2];
  const int n = findings_of(a, tag, bad, new_origin, sinks);
  for (int i = 0; i < n; ++i) write_finding(record, counters, tag, sinks[i]);
}

WatchRecord* record_cpu(c10::Device) {
  static thread_local WatchRecord* record = [] {
    auto* r = new WatchRecord;  // kept for the thread's life, like the CUDA one for the device's
    std::memset(r, 0, sizeof(WatchRecord));
    return r;
  }();
  return record;
}

void reset_record_cpu(c10::Device, WatchRecord* record, int32_t* counters) {
  std::memset(record, 0, sizeof(WatchRecord));
  counters[0] = counters[1] = 0;
}

void synchronize_cpu(c10::Device) {}

const bool registered = [] {
  DeviceKernels k;
  k.scan = &scan_cpu;
  k.record = &record_cpu;
  k.reset_record = &reset_record_cpu;
  k.synchronize = &synchronize_cpu;
  register_device_kernels(c10::DeviceType::CPU, k);
  return true;
}();

}  // namespace
}  // namespace watch
}  // namespace cublas_guard
