// The guard modes as the op schemas pass them: an int keeps a schema simple for
// torch.compile. Python's cublas_guard_ext._native.loading.codes owns the names and
// tests/package/test_codes.py checks that the values here agree with it.
#pragma once

#include "core/tensor_api.h"

#include <cstdint>

namespace cublas_guard {

enum class GuardMode : int64_t { kOff = 0, kSync = 1, kAsync = 2 };

// The mode an op was given, or a ValueError naming the accepted values.
inline GuardMode parse_mode(int64_t mode) {
  constexpr auto off = static_cast<int64_t>(GuardMode::kOff);
  constexpr auto sync = static_cast<int64_t>(GuardMode::kSync);
  constexpr auto async = static_cast<int64_t>(GuardMode::kAsync);
  CG_CHECK_VALUE(mode == off || mode == sync || mode == async, "cublas_guard_ext: mode must be ", off,
                 " (off), ", sync, " (sync) or ", async, " (async), got ", mode);
  return static_cast<GuardMode>(mode);
}

}  // namespace cublas_guard
