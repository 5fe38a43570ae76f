// Whether a kernel launch fits the device's limits, decided before the
// launch, free of the CUDA headers: cuda_backend.h's check_launch_fits runs
// it before every kernel of ours, and the CPU tests run the same decision and
// the same error (torch.ops.cublas_guard_testing.launch_limits_check).
//
// A launch beyond a limit fails with cudaErrorInvalidConfiguration, which the
// launch check would catch too, but only after the fact and without saying
// which size broke which limit; asked first, the report names the kernel, its
// grid, block and shared memory and the limit.
#pragma once

#include <cstdint>
#include <string>

namespace cublas_guard {

struct LaunchShape {
  int64_t grid[3] = {1, 1, 1};
  int64_t block[3] = {1, 1, 1};
  int64_t shared_bytes = 0;  // dynamic shared memory per block
};

// cudaDeviceProp's maxGridSize, maxThreadsDim, maxThreadsPerBlock and
// sharedMemPerBlockOptin (the most a kernel may ask for); the defaults are
// every GPU's since compute capability 3.0 with 48 KiB of shared memory.
struct LaunchLimits {
  int64_t max_grid[3] = {2147483647, 65535, 65535};
  int64_t max_block[3] = {1024, 1024, 64};
  int64_t max_threads_per_block = 1024;
  int64_t max_shared_bytes = 48 * 1024;
};

// nullptr when the launch fits; else the rule it breaks, e.g. "grid.y <= 65535".
// The text is written into `rule`.
inline const char* launch_limit_broken(const LaunchShape& shape, const LaunchLimits& limits,
                                       std::string& rule) {
  static const char* const axes[3] = {"x", "y", "z"};
  for (int i = 0; i < 3; ++i) {
    if (shape.grid[i] < 1 || shape.grid[i] > limits.max_grid[i]) {
      rule = std::string("1 <= grid.") + axes[i] + " <= " + std::to_string(limits.max_grid[i]);
      return rule.c_str();
    }
  }
  for (int i = 0; i < 3; ++i) {
    if (shape.block[i] < 1 || shape.block[i] > limits.max_block[i]) {
      rule = std::string("1 <= block.") + axes[i] + " <= " + std::to_string(limits.max_block[i]);
      return rule.c_str();
    }
  }
  if (shape.block[0] * shape.block[1] * shape.block[2] > limits.max_threads_per_block) {
    rule = "block.x * block.y * block.z <= " + std::to_string(limits.max_threads_per_block) + " threads";
    return rule.c_str();
  }
  if (shape.shared_bytes < 0 || shape.shared_bytes > limits.max_shared_bytes) {
    rule = "dynamic shared memory <= " + std::to_string(limits.max_shared_bytes) + " bytes per block";
    return rule.c_str();
  }
  return nullptr;
}

// Tests may lower the limits (the size-limit seam of launches), so that a
// real launch of ours crosses one on any GPU; each 0 keeps the device's.
// Defined in linear/gemm_route.cpp.
LaunchLimits launch_limits_for_testing(const LaunchLimits& device_limits);

// Raises the CudaLaunchError (cudaErrorInvalidConfiguration, before the
// launch) naming the kernel, its sizes and the broken rule.
[[noreturn]] void raise_launch_limit(const char* kernel, const LaunchShape& shape, const std::string& rule,
                                     const std::string& layer);

}  // namespace cublas_guard
