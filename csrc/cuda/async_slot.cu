// The async record of each CUDA device (pinned host memory mapped into the
// device's address space, and a device-memory claim word) and the replay
// counters of calls captured into CUDA graphs, allocated once per device.
// (async_record.h says how the record is written and taken.)
#include "cuda/cuda_backend.h"

#include <array>
#include <cstring>
#include <mutex>

namespace cublas_guard {
namespace {

// Replay counters of captured calls, per device: one each, never reused (a
// graph may be replayed at any time), allocated with the claim word.
constexpr int64_t kReplayCounters = 16384;

struct DeviceRecord {
  AsyncRecord* record = nullptr;
  int* claim = nullptr;
  int64_t* replay_counters = nullptr;  // kReplayCounters, zeroed
  int64_t replay_counters_used = 0;
};

std::mutex& slots_mutex() {
  static std::mutex mutex;
  return mutex;
}
std::array<DeviceRecord, 64>& device_slots() {
  static std::array<DeviceRecord, 64> slots;
  return slots;
}

// Zeroes `bytes` at `device_memory` on a stream of its own, created
// non-blocking (it never waits for, nor holds up, any other stream), and
// waits for it.
void zero_on_private_stream(void* device_memory, size_t bytes) {
  cudaStream_t stream = nullptr;
  CG_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaError_t err = cudaMemsetAsync(device_memory, 0, bytes, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  const cudaError_t destroyed = cudaStreamDestroy(stream);
  CG_CUDA_CHECK(err);
  CG_CUDA_CHECK(destroyed);
}

}  // namespace

void async_slot_cuda(Device device, AsyncRecord** record, int** claim) {
  const int index = device.index();
  CG_CHECK(index >= 0 && index < 64, "cublas_guard_ext: unsupported CUDA device index ", index);
  std::lock_guard<std::mutex> lock(slots_mutex());
  DeviceRecord& slot = device_slots()[index];
  if (slot.record == nullptr) {
    const CudaDeviceGuard guard(index);
    // One-time allocations, allowed even if the first async call is being captured.
    const RelaxedCaptureModeGuard relaxed;
    void* host = nullptr;
    CG_CUDA_CHECK(cudaHostAlloc(&host, sizeof(AsyncRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, sizeof(AsyncRecord));
    void* device_view = nullptr;
    CG_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, host, 0));
    // With unified addressing (every 64-bit platform CUDA supports) both are one address.
    CG_CHECK(device_view == host, "cublas_guard_ext: async mode needs unified virtual addressing");
    // The claim word, then the replay counters (8-byte aligned), all zero. The
    // zeroing runs on a private non-blocking stream and is waited for there:
    // no later stream is ordered after it. Not cudaMemset and the legacy
    // stream: the legacy stream synchronizes with every blocking stream, and a
    // capture running on one (this very call may be the first of a capture)
    // would be invalidated.
    const size_t bytes = sizeof(int64_t) * (1 + kReplayCounters);
    void* device_memory = nullptr;
    CG_CUDA_CHECK(cudaMalloc(&device_memory, bytes));
    zero_on_private_stream(device_memory, bytes);
    slot.record = static_cast<AsyncRecord*>(host);
    slot.claim = static_cast<int*>(device_memory);
    slot.replay_counters = static_cast<int64_t*>(device_memory) + 1;
    RecordHooks hooks;
    hooks.synchronize = [](Device d) {
      const CudaDeviceGuard g(d.index());
      CG_CUDA_CHECK(cudaDeviceSynchronize());
    };
    register_async_record(device, slot.record, slot.claim, hooks);
  }
  *record = slot.record;
  *claim = slot.claim;
}

// Async mode: a captured call gets its own replay counter. Asked before the
// call's scans are chosen (a captured call scans its parameters every replay),
// so it makes sure the device's slot, which holds the counters, exists.
bool capture_replay_counter_cuda(Device device, int64_t** counter) {
  *counter = nullptr;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(current_cuda_stream(device.index()), &status) != cudaSuccess) {
    (void)cudaGetLastError();  // not known to be capturing: count nothing, leave no error behind
    return false;
  }
  if (status == cudaStreamCaptureStatusNone) return false;
  AsyncRecord* record = nullptr;
  int* claim = nullptr;
  async_slot_cuda(device, &record, &claim);  // once per device; a lookup after that
  std::lock_guard<std::mutex> lock(slots_mutex());
  DeviceRecord& slot = device_slots()[device.index()];
  if (slot.replay_counters != nullptr && slot.replay_counters_used < kReplayCounters) {
    *counter = slot.replay_counters + slot.replay_counters_used++;
  }
  return true;  // a replay all the same; its number is reported as unknown without a counter
}

}  // namespace cublas_guard
