// The test hooks the op's code consults: declared at the lowest layer that
// consults them, defined with the ops that arm them (testing.cpp,
// torch.ops.cublas_guard_testing), so that every layer above can take a fault.
#pragma once

#include <cstdint>
#include <string>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Test-only hooks: fault injection and the lowered size limit. Both refuse to
// act unless CUBLAS_GUARD_EXT_TESTING=1 is set in the environment, so they
// cannot be switched on by accident in production.
// ---------------------------------------------------------------------------
enum class FaultSite : int { kGemmStatus = 0, kLaunch = 1, kHandle = 2, kCount = 3 };
// Raises unless CUBLAS_GUARD_EXT_TESTING=1: every test hook calls it first (`what` names the hook).
void require_testing_env(const char* what);
// Returns the injected code for `site` and consumes one use, or 0 (no fault).
int take_injected_fault(FaultSite site);
void set_fault_for_testing(const std::string& site, int64_t code, int64_t times);
int64_t set_size_limit_for_testing(int64_t limit, bool allow_64bit);

}  // namespace cublas_guard
