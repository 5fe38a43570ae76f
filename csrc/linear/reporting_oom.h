// The out-of-memory report of a guarded call: an allocation inside one that
// runs out of memory is reported with the device's numbers and the request
// (torch raises its own OutOfMemoryError otherwise). Shared by the linear op
// (linear_common.cpp) and the grouped linear (moe/grouped_common.cpp).
#pragma once

#include "linear/linear_op.h"

#include <exception>
#include <string>

namespace cublas_guard {

template <typename Fn>
auto reporting_oom(const LinearBackend& be, Device device, const std::string& layer, const char* stage,
                   int64_t bytes, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::exception& e) {
    // torch's allocator ran out (c10::OutOfMemoryError in the locked build; in
    // the stable core only the message says so): anything else goes on as it was.
    std::string detail;
    if (!out_of_memory_detail(e, detail)) throw;
    ErrorReport report("out_of_memory");
    report.add("layer", layer).add("stage", stage).add("bytes_requested", bytes);
    report.add("detail", detail);
    if (be.memory_info != nullptr) be.memory_info(report, device);
    report.raise_out_of_memory("layer '" + layer + "': out of memory during " + stage);
  }
}

}  // namespace cublas_guard
