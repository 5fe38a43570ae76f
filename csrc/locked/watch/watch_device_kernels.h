// csrc/locked/watch/watch_device_kernels.h: the device-specific part of watch, as the
// host code sees it: a set of functions each device type registers at load
// time (watch_device_cpu.cpp for the CPU, locked/watch/watch_scan.cu for CUDA), so the
// host side never includes CUDA and the CUDA file never includes Python or the
// dispatcher (watch.h). Only ATen's Tensor class and the PODs of
// watch_device_logic.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "locked/watch/watch_device_logic.h"

namespace cublas_guard {
namespace watch {

// The device-specific part, registered per device type.
struct DeviceKernels {
  // Counts t's NaN, +Inf, -Inf (and on a birth its zeros, the first bad value,
  // the views' absolute maxima), applies apply_rule to tags[a.out_slot] and
  // seq_tags, and writes the record only when it finds something. CUDA: one
  // launch on the current stream, no sync; CPU: in the calling thread.
  void (*scan)(const at::Tensor& t, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* record,
               int32_t* counters) = nullptr;
  // A record with `capacity` entries per ring, zeroed; freed by free_record.
  WatchRecord* (*alloc_record)(c10::Device device, int64_t capacity) = nullptr;
  void (*free_record)(c10::Device device, WatchRecord* record) = nullptr;
  // Clears the record and the claim counters at block start (nothing in flight).
  void (*reset_record)(c10::Device device, WatchRecord* record, int32_t* counters) = nullptr;
  // The final check's wait for everything queued on the device.
  void (*synchronize)(c10::Device device) = nullptr;
  // One tag read on the host (a copy between devices, a refused input). CUDA:
  // waits for the current stream first.
  int32_t (*read_tag)(c10::Device device, const int32_t* tags, int32_t slot) = nullptr;
};
void register_device_kernels(c10::DeviceType type, const DeviceKernels& kernels);
const DeviceKernels* device_kernels(c10::DeviceType type);

// The host's side of the record's rings (both backends write them the same
// way): acquire loads, the entry's `ready` read before and after its fields.
inline int64_t load_acquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }

}  // namespace watch
}  // namespace cublas_guard
