// The out-of-memory report of a guarded call: an allocation inside one that
// runs out of memory is reported with the device's numbers and the request
// (torch raises its own OutOfMemoryError otherwise). Shared by the linear op
// (linear_common.cpp) and the grouped linear (moe/grouped_common.cpp).
#pragma once

#include "linear/linear_op.h"

#include <c10/util/Exception.h>

#include <string>

namespace cublas_guard {

template <typename Fn>
auto reporting_oom(const LinearBackend& be, c10::Device device, const std::string& layer, const char* stage,
                   int64_t bytes, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError& e) {
    ErrorReport report("out_of_memory");
    report.add("layer", layer).add("stage", stage).add("bytes_requested", bytes);
    std::string detail = e.what_without_backtrace();
    detail = detail.substr(0, detail.find('\n'));
    report.add("detail", detail);
    if (be.memory_info != nullptr) be.memory_info(report, device);
    report.raise_out_of_memory("layer '" + layer + "': out of memory during " + stage);
  }
}

}  // namespace cublas_guard
