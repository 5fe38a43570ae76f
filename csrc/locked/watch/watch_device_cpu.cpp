// The CPU kernels of watch: what locked/watch/watch_scan.cu does in one launch, done
// here in the calling thread, on the same structs and with the same rule
// (watch_device_logic.h). Counting: a contiguous output of at most
// kInlineScanMax elements of float32, float64, float16 or bfloat16 is counted
// by an inline loop here (a small op's output: the fused scan's setup cost
// more than its loop); larger ones by the project's fused scan, other dtypes
// by ATen. Everything a birth adds (zeros, the first bad value, the inputs'
// absolute maxima) is computed only on a birth.
#include "locked/watch/watch_device.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/eq.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

namespace cublas_guard {
namespace watch {
namespace {

template <typename T>
double absmax_typed(const void* data, int64_t n) {
  const T* p = static_cast<const T*>(data);
  double m = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = std::fabs(static_cast<double>(p[i]));
    if (std::isfinite(v) && v > m) m = v;
  }
  return m;
}

}  // namespace

double absmax_host(const InputView& v) {
  switch (v.dtype) {
    case kViewFloat: return absmax_typed<float>(v.data, v.numel);
    case kViewDouble: return absmax_typed<double>(v.data, v.numel);
    case kViewHalf: return absmax_typed<c10::Half>(v.data, v.numel);
    case kViewBFloat16: return absmax_typed<c10::BFloat16>(v.data, v.numel);
    case kViewValue: return std::isfinite(v.value) ? v.value : 0.0;  // finite values only, as above
    default: return std::numeric_limits<double>::quiet_NaN();
  }
}

namespace {

// Small contiguous outputs: counted inline (issue 50: the fused scan's entry
// builds a string, a slot tensor, the geometry and a ParallelGuard per call,
// ~1,100 instructions, against ~200 for 16 elements here).
constexpr int64_t kInlineScanMax = 1024;

template <typename T>
HostCounts count_inline(const void* data, int64_t n) {
  // float16/bfloat16 widen exactly to float; float64 is not narrowed (1e300 is finite there).
  using Wide = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const T* p = static_cast<const T*>(data);
  // scan_cpu_counts' small bound (float16: none); the largest magnitude is compared once, after.
  constexpr int exp = small_bound_exp(c10::CppTypeToScalarType<T>::value);
  const Wide bound = std::ldexp(Wide{1}, exp);
  HostCounts c;
  Wide largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const Wide v = static_cast<Wide>(p[i]);
    if (std::isfinite(v)) {
      largest = std::max(largest, std::fabs(v));
      continue;
    }
    if (c.first < 0) c.first = i;
    if (std::isnan(v)) {
      ++c.nan;
    } else if (v > 0) {
      ++c.posinf;
    } else {
      ++c.neginf;
    }
  }
  c.small = exp >= 0 && c.first < 0 && largest < bound;
  return c;
}

// Whether t is counted inline; its counts in *c.
bool count_small(const at::Tensor& t, HostCounts* c) {
  const int64_t n = t.numel();
  if (n > kInlineScanMax || !t.is_contiguous()) return false;
  const void* data = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kFloat: *c = count_inline<float>(data, n); return true;
    case at::kDouble: *c = count_inline<double>(data, n); return true;
    case at::kHalf: *c = count_inline<c10::Half>(data, n); return true;
    case at::kBFloat16: *c = count_inline<c10::BFloat16>(data, n); return true;
    default: return false;
  }
}

// The rest: the fused scan, or ATen for the dtypes it does not read.
HostCounts count_cpu(const at::Tensor& t) {
  if (!is_guarded_dtype(t.scalar_type())) return host_counts(t);
  int64_t counts[kScanFields];
  const bool small = scan_cpu_counts(t, counts);
  HostCounts c = HostCounts::of_scan(counts);
  c.small = small;
  return c;
}

// Whether the last scan_cpu of this thread found its tensor small (launch reads it right after).
thread_local bool last_scan_small = false;

}  // namespace

bool last_cpu_scan_small() { return last_scan_small; }

bool host_finite_cpu(const at::Tensor& t, bool* small) {
  HostCounts c;
  if (!count_small(t, &c)) {
    c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
    c = count_cpu(t);
  }
  if (small != nullptr) *small = c.small;
  return c.first < 0;
}

namespace {

void write_birth(WatchRecord* record, int32_t* counters, const TagArgs& a, const at::Tensor& t,
                 const HostCounts& c) {
  const int64_t i = counters[0]++;
  BirthEntry& e = record->births[i % record->capacity];
  __atomic_store_n(&e.ready, int64_t{0}, __ATOMIC_RELEASE);
  e.seq = a.seq;
  e.output_index = a.output_index;
  e.nan_count = c.nan;
  e.posinf_count = c.posinf;
  e.neginf_count = c.neginf;
  e.zero_count = at::eq(t, 0).sum().item<int64_t>();
  e.first_bad_index = c.first;
  e.first_bad_value = t.reshape({-1})[c.first].item<double>();
  for (int v = 0; v < kMaxViews; ++v) {
    e.input_absmax[v] = v < a.n_views ? absmax_host(a.views[v]) : std::numeric_limits<double>::quiet_NaN();
    e.input_index[v] = v < a.n_views ? a.views[v].input : -1;
  }
  __atomic_store_n(&e.ready, i + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&record->flag, int64_t{1}, __ATOMIC_RELEASE);
}

void write_finding(WatchRecord* record, int32_t* counters, int32_t tag, int64_t sink) {
  const int64_t i = counters[1]++;
  FindingEntry& e = record->findings[i % record->capacity];
  __atomic_store_n(&e.ready, int64_t{0}, __ATOMIC_RELEASE);
  e.origin_seq = tag - kTagFirst;
  e.sink = sink;
  __atomic_store_n(&e.ready, i + 1, __ATOMIC_RELEASE);
  __atomic_store_n(&record->flag, int64_t{1}, __ATOMIC_RELEASE);
}

void scan_cpu(const at::Tensor& t, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* record,
              int32_t* counters) {
  HostCounts c;
  if (!count_small(t, &c)) {  // the fused scan or ATen: with the watch's key off
    c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
    c = count_cpu(t);
  }
  last_scan_small = c.small;
  bool birth = false;
  int64_t sinks[2];
  int n = 0;
  const int32_t tag = apply_rule(a, tags, seq_tags, c.first >= 0, c.nan > 0, &birth, sinks, &n);
  if (birth) {
    c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);  // its zeros and first value: ATen
    write_birth(record, counters, a, t, c);
  }
  for (int i = 0; i < n; ++i) write_finding(record, counters, tag, sinks[i]);
}

WatchRecord* alloc_record_cpu(c10::Device, int64_t capacity) {
  const size_t bytes = sizeof(WatchRecord) + capacity * (sizeof(BirthEntry) + sizeof(FindingEntry));
  auto* r = static_cast<WatchRecord*>(std::calloc(1, bytes));
  TORCH_CHECK(r != nullptr, "cublas_guard_ext.watch: could not allocate its record (", bytes, " bytes)");
  r->capacity = capacity;
  r->births = reinterpret_cast<BirthEntry*>(r + 1);
  r->findings = reinterpret_cast<FindingEntry*>(r->births + capacity);
  return r;
}

void free_record_cpu(c10::Device, WatchRecord* record) { std::free(record); }

void reset_record_cpu(c10::Device, WatchRecord* record, int32_t* counters) {
  // Only the entries claimed since the last reset hold anything (the record starts zeroed).
  const int64_t capacity = record->capacity;
  const int64_t births = std::min<int64_t>(std::max(counters[0], 0), capacity);
  const int64_t findings = std::min<int64_t>(std::max(counters[1], 0), capacity);
  std::memset(record->births, 0, births * sizeof(BirthEntry));
  std::memset(record->findings, 0, findings * sizeof(FindingEntry));
  record->flag = 0;
  counters[0] = counters[1] = 0;
}

void synchronize_cpu(c10::Device) {}

int32_t read_tag_cpu(c10::Device, const int32_t* tags, int32_t slot) { return tags[slot]; }

const bool registered = [] {
  DeviceKernels k;
  k.scan = &scan_cpu;
  k.alloc_record = &alloc_record_cpu;
  k.free_record = &free_record_cpu;
  k.reset_record = &reset_record_cpu;
  k.synchronize = &synchronize_cpu;
  k.read_tag = &read_tag_cpu;
  register_device_kernels(c10::DeviceType::CPU, k);
  return true;
}();

}  // namespace
}  // namespace watch
}  // namespace cublas_guard
