// The registry of async records (async_registry.cpp): each device's record,
// the layer ids and call numbers written into it, and the raise of a finding.
#pragma once

#include "report/async_record.h"

#include "core/tensor_api.h"

#include <cstdint>
#include <string>
#include <utility>

namespace cublas_guard {

// How the explicit check waits for a device before reading its record.
// The host frees the claim itself (async_record.h): no device hook resets it.
struct RecordHooks {
  void (*synchronize)(Device device);
};
void register_async_record(Device device, AsyncRecord* record, int* claim, RecordHooks hooks);
// Raises the first recorded finding of any device, if one is there; with
// `synchronize`, after waiting for each device (the explicit check), else
// without waiting (the check every guarded call makes first).
void raise_if_async_recorded(bool synchronize);
// `hook` runs whenever a finding is taken from a record, before it is raised:
// the clean-parameter cache (linear/param_cache.cpp, a layer above) forgets
// its parameters there, so a recorded one is scanned again.
void on_async_finding_taken(void (*hook)());

// (layer id, this call's number for the layer, counting from 1) for an async
// scan's record; forward and backward calls are counted apart.
std::pair<int64_t, int64_t> next_layer_call(const std::string& layer, bool backward);
// "input", "weight", "bias", "grad_output" for a TensorRole; "tensor" otherwise.
const char* tensor_role_name(int64_t role);

}  // namespace cublas_guard
