// The test hooks, in their own op namespace (torch.ops.cublas_guard_testing),
// so the product's namespace holds the product only. Each refuses to act
// unless CUBLAS_GUARD_EXT_TESTING=1 is set in the environment, so none can be
// switched on by accident in production:
//   set_fault             make the next GEMM / launch / handle lookup fail with a code
//                         (or, for a fresh process, CUBLAS_GUARD_EXT_FAULT=site:code:times
//                         in the environment, read when the library loads)
//   set_size_limit        lower the 32-bit size limit so the _64 paths run on small tensors
//   simulate_cuda_errors  run pending_errors.h's decisions against a model of the
//                         CUDA runtime's last-error rules (any build, no GPU needed)
//   clean_cache_stats     the parameter cache's counters (defined in linear/param_cache.cpp)
// The watch hooks (the version-locked library's) are in locked/watch/watch_testing.cpp.
#include "core/registration.h"
#include "linear/linear_op.h"
#include "report/pending_errors.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Fault injection: the state production code reads (a relaxed load per GEMM)
// and the setters only tests may call. The size limit's state is the GEMM
// plan's (linear/gemm_plan.cpp); only its test setter is here.
// ---------------------------------------------------------------------------
namespace {

struct InjectedFault {
  std::atomic<int> code{0};
  std::atomic<int64_t> remaining{0};
};

std::array<InjectedFault, static_cast<size_t>(FaultSite::kCount)>& faults() {
  static std::array<InjectedFault, static_cast<size_t>(FaultSite::kCount)> by_site;
  return by_site;
}

// Production code reads this on every GEMM; a relaxed atomic load is the whole cost.
std::atomic<bool>& any_fault_armed() {
  static std::atomic<bool> armed{false};
  return armed;
}

}  // namespace

void require_testing_env(const char* what) {
  const char* flag = std::getenv("CUBLAS_GUARD_EXT_TESTING");
  CG_CHECK(flag != nullptr && std::string(flag) == "1", "cublas_guard_ext: ", what,
           " is a test hook; set CUBLAS_GUARD_EXT_TESTING=1 to use it");
}

int take_injected_fault(FaultSite site) {
  if (!any_fault_armed().load(std::memory_order_relaxed)) return 0;
  auto& fault = faults()[static_cast<size_t>(site)];
  int64_t left = fault.remaining.load();
  while (left > 0) {
    if (fault.remaining.compare_exchange_weak(left, left - 1)) return fault.code.load();
  }
  return 0;
}

void set_fault_for_testing(const std::string& site, int64_t code, int64_t times) {
  require_testing_env("fault injection");
  FaultSite which;
  if (site == "gemm") {
    which = FaultSite::kGemmStatus;
  } else if (site == "launch") {
    which = FaultSite::kLaunch;
  } else if (site == "handle") {
    which = FaultSite::kHandle;
  } else {
    throw_value_error("cublas_guard_ext: unknown fault site '" + site +
                      "' (expected gemm, launch or handle)");
  }
  CG_CHECK_VALUE(times >= 0, "cublas_guard_ext: fault count must be >= 0");
  auto& fault = faults()[static_cast<size_t>(which)];
  fault.code.store(static_cast<int>(code));
  fault.remaining.store(times);
  bool armed = false;
  for (auto& f : faults()) armed = armed || f.remaining.load() > 0;
  any_fault_armed().store(armed);
}

namespace {

// CUBLAS_GUARD_EXT_FAULT=site:code:times[,site:code:times...]: the faults a
// fresh process starts with (a replay, a subprocess test), the same sites and
// codes as set_fault. Read once when the library loads, only with
// CUBLAS_GUARD_EXT_TESTING=1; an entry that does not parse is reported on
// stderr and ignored (a static initializer must not throw).
void arm_faults_from_environment() {
  const char* testing = std::getenv("CUBLAS_GUARD_EXT_TESTING");
  const char* spec = std::getenv("CUBLAS_GUARD_EXT_FAULT");
  if (spec == nullptr || *spec == '\0') return;
  if (testing == nullptr || std::string(testing) != "1") {
    std::fprintf(stderr,
                 "cublas_guard_ext: CUBLAS_GUARD_EXT_FAULT is ignored without "
                 "CUBLAS_GUARD_EXT_TESTING=1\n");
    return;
  }
  const std::string all(spec);
  size_t start = 0;
  while (start <= all.size()) {
    const size_t end = std::min(all.find(',', start), all.size());
    const std::string entry = all.substr(start, end - start);
    start = end + 1;
    if (entry.empty()) continue;
    const size_t c1 = entry.find(':');
    const size_t c2 = c1 == std::string::npos ? c1 : entry.find(':', c1 + 1);
    try {
      if (c2 == std::string::npos) throw std::invalid_argument("expected site:code:times");
      size_t used_code = 0, used_times = 0;
      const std::string code_text = entry.substr(c1 + 1, c2 - c1 - 1);
      const std::string times_text = entry.substr(c2 + 1);
      const long long code = std::stoll(code_text, &used_code);
      const long long times = std::stoll(times_text, &used_times);
      if (used_code != code_text.size() || used_times != times_text.size()) {
        throw std::invalid_argument("code and times must be integers");
      }
      set_fault_for_testing(entry.substr(0, c1), code, times);
    } catch (const std::exception& e) {
      std::string why = e.what();
      why = why.substr(0, why.find('\n'));
      std::fprintf(stderr, "cublas_guard_ext: ignoring CUBLAS_GUARD_EXT_FAULT entry '%s': %s\n",
                   entry.c_str(), why.c_str());
    }
  }
}

const bool faults_from_environment = (arm_faults_from_environment(), true);

}  // namespace

int64_t set_size_limit_for_testing(int64_t limit, bool allow_64bit_api) {
  require_testing_env("the size limit override");
  CG_CHECK_VALUE(limit >= 1 && limit <= 2147483647,
                 "cublas_guard_ext: size limit must be in [1, 2^31-1], got ", limit);
  return set_gemm_size_limit(limit, allow_64bit_api);
}

namespace {

// ---------------------------------------------------------------------------
// The CUDA runtime's last-error rules, modelled
// ---------------------------------------------------------------------------
// The runtime as pending_errors.h describes it, for one thread and one stream.
struct FakeCuda {
  int last = 0;          // the thread's last (non-sticky) error
  int context = 0;       // a sticky error: the context is broken
  bool busy = false;     // work still queued on the stream
  bool capturing = false;
  bool capture_invalidated = false;
  int queries = 0;
};
thread_local FakeCuda* fake = nullptr;

int fake_get_last_error() {
  const int err = fake->context != 0 ? fake->context : fake->last;
  fake->last = 0;
  return err;
}

int fake_stream_query() {
  ++fake->queries;
  int err = cuda_code::kSuccess;
  if (fake->context != 0) {
    err = fake->context;
  } else if (fake->capturing) {
    fake->capture_invalidated = true;
    err = cuda_code::kStreamCaptureUnsupported;
  } else if (fake->busy) {
    err = cuda_code::kNotReady;
  }
  if (err != cuda_code::kSuccess) fake->last = err;
  return err;
}

int fake_stream_is_capturing(bool* capturing) {
  if (fake->context != 0) return fake->context;
  *capturing = fake->capturing;
  return cuda_code::kSuccess;
}

// Runs one decision ("before": a sync-mode call's check; "failure": after torch
// raised inside a call) on the modelled state, then the next sync-mode call's
// check on what it left. Returns {reported, last error left (peeked), stream
// queries made, capture invalidated, what the next call's check reports}.
std::vector<int64_t> simulate_cuda_errors(StringArg stage, int64_t last_error, int64_t context_error,
                                          bool stream_busy, bool capturing) {
  FakeCuda state;
  state.last = static_cast<int>(last_error);
  state.context = static_cast<int>(context_error);
  state.busy = stream_busy;
  state.capturing = capturing;
  fake = &state;
  const CudaErrorProbe probe{fake_get_last_error, fake_stream_query, fake_stream_is_capturing};
  int reported = 0;
  const std::string which(stage);
  if (which == "before") {
    reported = take_pending_error(probe);
  } else if (which == "failure") {
    reported = sticky_error_behind_failure(probe);
  } else {
    fake = nullptr;
    throw_value_error("cublas_guard_ext: stage must be 'before' or 'failure', got '" + which + "'");
  }
  const int left = state.context != 0 ? state.context : state.last;
  const int next = take_pending_error(probe);
  fake = nullptr;
  return {reported, left, state.queries, state.capture_invalidated ? 1 : 0, next};
}

void set_fault_op(StringArg site, int64_t code, int64_t times) {
  set_fault_for_testing(std::string(site), code, times);
}

int64_t set_size_limit_op(int64_t limit, bool allow_64bit) {
  return set_size_limit_for_testing(limit, allow_64bit);
}

}  // namespace
}  // namespace cublas_guard

CG_LIBRARY(cublas_guard_testing, m) {
  m.def("set_fault(str site, int code, int times) -> ()");
  m.def("set_size_limit(int limit, bool allow_64bit=True) -> int");
  m.def(
      "simulate_cuda_errors(str stage, int last_error, int context_error, bool stream_busy, "
      "bool capturing) -> int[]");
}

CG_LIBRARY_IMPL(cublas_guard_testing, CompositeExplicitAutograd, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "set_fault", &set_fault_op);
  CG_IMPL(m, "set_size_limit", &set_size_limit_op);
  CG_IMPL(m, "simulate_cuda_errors", &simulate_cuda_errors);
}
