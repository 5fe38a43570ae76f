// The async records of every device and the layer names their reports carry.
// A scan in async mode leaves a finding in its device's record
// (report/async_record.h) instead of raising; every guarded call reads the
// records first without waiting, and the explicit check reads them after
// waiting for the devices, so a finding is raised at the next opportunity,
// naming the layer and its call number.
#include "report/async_registry.h"

#include "report/error_report.h"

#include "core/registration.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace cublas_guard {

namespace {

// ---------------------------------------------------------------------------
// Layer names <-> ids, and per-layer call counters, for async reports.
// ---------------------------------------------------------------------------
class LayerRegistry {
 public:
  // Returns (layer id, this call's number for the layer, counting from 1).
  // Forward and backward calls are counted apart.
  std::pair<int64_t, int64_t> next_call(const std::string& layer, bool backward) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ids_.find(layer);
    if (it == ids_.end()) {
      it = ids_.emplace(layer, static_cast<int64_t>(names_.size())).first;
      names_.push_back(layer);
      calls_.push_back({0, 0});
    }
    return {it->second, ++calls_[it->second][backward ? 1 : 0]};
  }
  // A new layer took this name: its calls count from 1 again.
  void reset(const std::string& layer) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ids_.find(layer);
    if (it != ids_.end()) calls_[it->second] = {0, 0};
  }
  std::string name(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    return id >= 0 && id < static_cast<int64_t>(names_.size()) ? names_[id] : "<unknown layer>";
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::string, int64_t> ids_;
  std::vector<std::string> names_;
  std::vector<std::array<int64_t, 2>> calls_;
};

LayerRegistry& layers() {
  static LayerRegistry registry;
  return registry;
}

struct RegisteredRecord {
  Device device;
  AsyncRecord* record;
  int* claim;
  RecordHooks hooks;
};

std::mutex& records_mutex() {
  static std::mutex m;
  return m;
}
// What runs when a finding is taken from a record (on_async_finding_taken).
std::atomic<void (*)()>& finding_taken_hook() {
  static std::atomic<void (*)()> hook{nullptr};
  return hook;
}
std::vector<RegisteredRecord>& records() {
  static std::vector<RegisteredRecord> all;
  return all;
}

// The records again, for the check every guarded call makes first: read without
// the lock and without copying the list: a per-call cost. Registration publishes a
// record's address, then the count; past kMaxFastRecords every check takes the
// locked path.
constexpr size_t kMaxFastRecords = 64;
std::array<std::atomic<AsyncRecord*>, kMaxFastRecords> fast_records{};
std::atomic<size_t> fast_record_count{0};
std::atomic<bool> fast_records_overflow{false};

// Whether some record may hold a finding (a flag set): false means nothing to raise.
bool any_record_flagged() {
  if (fast_records_overflow.load(std::memory_order_acquire)) return true;
  const size_t n = fast_record_count.load(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    const AsyncRecord* record = fast_records[i].load(std::memory_order_relaxed);
    if (__atomic_load_n(&record->flag, __ATOMIC_ACQUIRE) != 0) return true;
  }
  return false;
}

[[noreturn]] void raise_recorded(const AsyncRecord& rec, const Device& device) {
  const std::string layer = layers().name(rec.layer_id);
  ErrorReport report("non_finite");
  report.add("layer", layer).add("role", tensor_role_name(rec.role));
  report.add("nan_count", rec.nan_count).add("posinf_count", rec.posinf_count);
  report.add("neginf_count", rec.neginf_count).add("first_bad_index", rec.first_bad_index);
  const int64_t ndim = std::min<int64_t>(rec.ndim, kRecordMaxDims);
  std::vector<int64_t> shape(rec.shape, rec.shape + ndim);
  if (rec.ndim <= kRecordMaxDims) {
    std::vector<int64_t> coords(ndim, 0);
    int64_t rest = rec.first_bad_index;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      const int64_t size = std::max<int64_t>(shape[d], 1);
      coords[d] = rest % size;
      rest /= size;
    }
    report.add("first_bad_coords", coords);
    report.add("shape", shape);
  }
  report.add("ndim", rec.ndim).add("numel", rec.numel);
  report.add("deferred", true).add("call", rec.call_id).add("device", device_name(device));
  report.add("pass", rec.role == kRoleGradOutput ? "backward" : "forward");
  if (rec.replay != 0) report.add("replay", rec.replay);  // a CUDA graph replay of that call
  const std::string replay =
      rec.replay > 0 ? ", replay " + std::to_string(rec.replay) : (rec.replay < 0 ? ", a replay" : "");
  report.raise_value_error("layer '" + layer + "' (call " + std::to_string(rec.call_id) + replay + "): " +
                           tensor_role_name(rec.role) + " had " + std::to_string(rec.nan_count) + " NaN, " +
                           std::to_string(rec.posinf_count) + " +Inf, " + std::to_string(rec.neginf_count) +
                           " -Inf (recorded asynchronously, reported now)");
}

}  // namespace

const char* tensor_role_name(int64_t role) {
  switch (role) {
    case kRoleInput: return "input";
    case kRoleWeight: return "weight";
    case kRoleBias: return "bias";
    case kRoleGradOutput: return "grad_output";
    default: return "tensor";
  }
}

std::pair<int64_t, int64_t> next_layer_call(const std::string& layer, bool backward) {
  return layers().next_call(layer, backward);
}

void register_async_record(Device device, AsyncRecord* record, int* claim, RecordHooks hooks) {
  std::lock_guard<std::mutex> lock(records_mutex());
  records().push_back(RegisteredRecord{device, record, claim, hooks});
  const size_t n = fast_record_count.load(std::memory_order_relaxed);
  if (n < kMaxFastRecords) {
    fast_records[n].store(record, std::memory_order_relaxed);
    fast_record_count.store(n + 1, std::memory_order_release);
  } else {
    fast_records_overflow.store(true, std::memory_order_release);
  }
}

void on_async_finding_taken(void (*hook)()) { finding_taken_hook().store(hook, std::memory_order_release); }

void raise_if_async_recorded(bool synchronize) {
  // Without a synchronization to run, a record whose flag is clear has nothing to report.
  if (!synchronize && !any_record_flagged()) return;
  std::vector<RegisteredRecord> snapshot;
  {
    std::lock_guard<std::mutex> lock(records_mutex());
    snapshot = records();
  }
  for (const auto& reg : snapshot) {
    if (synchronize && reg.hooks.synchronize != nullptr) reg.hooks.synchronize(reg.device);
    // The writer stores the fields, fences, then the flag: seeing the flag
    // means the fields are complete. Taking the flag atomically makes one
    // reader (thread) the owner of the report; the claim stays set, so no new
    // writer touches the fields until they are copied.
    if (__atomic_exchange_n(&reg.record->flag, int64_t{0}, __ATOMIC_ACQ_REL) == 0) continue;
    const AsyncRecord copy = *reg.record;
    // Free the claim for the next finding (async_record.h): a host store, after
    // the copy, that no CUDA call can fail or misorder, so the report taken
    // here is always raised and the claim never stays taken.
    __atomic_store_n(&reg.record->epoch, copy.epoch + 1, __ATOMIC_RELEASE);
    // A recorded parameter must be scanned again (linear/param_cache.cpp).
    if (const auto hook = finding_taken_hook().load(std::memory_order_acquire)) hook();
    raise_recorded(copy, reg.device);
  }
}

namespace {
void reset_layer_calls_op(StringArg layer) { layers().reset(std::string(layer)); }
}  // namespace

}  // namespace cublas_guard

// The package's private entry points (cublas_guard_ext.nn): the per-name call
// counters (the optimizer-step hook is linear/param_cache.cpp's).
CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  // SafeLinear calls it when an instance takes a name (async reports count calls per name).
  m.def("reset_layer_calls(str layer) -> ()");
}
CG_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "reset_layer_calls", &cublas_guard::reset_layer_calls_op);
}
