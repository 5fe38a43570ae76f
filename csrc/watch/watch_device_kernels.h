// csrc/watch/watch_device_kernels.h: the device-specific part of watch's
// deferred protocol, as the host code sees it: a table of functions each
// device type registers at load time (watch_device_cpu.cpp for the CPU,
// cuda/watch_scan.cu for CUDA), so the host side never includes CUDA and the
// CUDA file never includes Python or the dispatcher (watch.h). Only ATen's
// Tensor class and the PODs of watch_device_logic.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "watch/watch_device_logic.h"

namespace cublas_guard {
namespace watch {

// The device-specific part, registered per device type.
struct DeviceKernels {
  // Scans t (counts, first bad index and value), applies decide_tag and
  // merged_tag to tags[a.out_slot] (and seq_tags), and writes the record only
  // when it finds something. CUDA: one launch on the current stream, no sync.
  void (*scan)(const at::Tensor& t, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* record,
               int32_t* counters) = nullptr;
  // The device's record (allocated once, never freed; zeroed by reset_record).
  WatchRecord* (*record)(c10::Device device) = nullptr;
  // Clears the record and the claim counters at block start (nothing in flight).
  void (*reset_record)(c10::Device device, WatchRecord* record, int32_t* counters) = nullptr;
  // The final check's wait for everything queued on the device.
  void (*synchronize)(c10::Device device) = nullptr;
};
void register_device_kernels(c10::DeviceType type, const DeviceKernels& kernels);
const DeviceKernels* device_kernels(c10::DeviceType type);

}  // namespace watch
}  // namespace cublas_guard
