// The async-mode record: where a scan that found non-finite values leaves its
// report for the host to read later without synchronizing.
//
// On CUDA the record is pinned, mapped host memory: the scan's last thread
// writes it directly over the bus, only when it found something, so a clean
// call costs no copy and no launch. The host reads it with plain loads. The
// first writer wins through a claim word in device memory (host-memory atomics
// over PCIe are not portable): a writer moves the claim from the record's
// epoch to epoch + 1, and the host, once it has copied the report, frees the
// claim by incrementing the epoch, a plain store to host memory. No CUDA call
// resets anything, so the reset is ordered with every stream, works inside a
// graph capture, and cannot fail.
#pragma once

#include <cstdint>

namespace cublas_guard {

constexpr int kRecordMaxDims = 16;  // a tensor with more dims is reported without its shape

enum TensorRole : int64_t { kRoleInput = 0, kRoleWeight = 1, kRoleBias = 2, kRoleGradOutput = 3 };

struct AsyncRecord {
  int64_t flag;  // 0 = clean; 1 = filled (written last, after a system fence)
  int64_t layer_id;
  int64_t call_id;
  int64_t role;
  int64_t nan_count;
  int64_t posinf_count;
  int64_t neginf_count;
  int64_t first_bad_index;
  int64_t numel;
  int64_t ndim;
  int64_t shape[kRecordMaxDims];
  // 0: an eager call; n > 0: the n-th replay of a call captured in a CUDA
  // graph (call_id is the capture's); -1: a replay whose count was not kept.
  int64_t replay;
  // Written by the host only: the claim is free while it equals (uint32) epoch.
  int64_t epoch;
};

// What one scan needs to know to fill the record if it finds something.
struct AsyncTarget {
  AsyncRecord* record = nullptr;  // host address (device-accessible on CUDA)
  int* claim = nullptr;           // device memory on CUDA, host memory on CPU
  int64_t layer_id = 0;
  int64_t call_id = 0;
  int64_t role = 0;
  int64_t numel = 0;
  int64_t ndim = 0;
  int64_t shape[kRecordMaxDims] = {0};
  // A call enqueued during a CUDA graph capture: its replays are counted in
  // `replays` (device memory, null when the counters ran out), incremented by
  // the call's first scan and read by its others.
  bool captured = false;
  bool counts_replay = false;
  int64_t* replays = nullptr;
};

}  // namespace cublas_guard
