// The CUDA kernels of watch's deferred protocol (watch/watch_device.h): one
// launch per scanned output, on the current stream, with no host sync. The
// launch counts NaN/+Inf/-Inf and the first bad (logical, row-major, int64)
// index; its last block to finish applies the rule of
// watch/watch_device_logic.h (the CPU implementation runs the same function)
// to the inputs' tags, writes the output's tag slot, and writes the record
// (pinned host memory mapped into the device, async_record.h's pattern) only
// when it finds a birth or a finding. The claim counters and the per-launch
// scratch live in device memory; the scratch is left zeroed by the block that
// used it last, so no launch needs a memset before it.
//
// NEVER RUN ON A GPU: written and compile-checked (nvcc, sm_80 and sm_90) on a
// machine with no GPU; the CPU twin (watch_device_cpu.cpp) is what the tests run.
#include "watch/watch_device_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace cublas_guard {
namespace watch {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;
constexpr int kDims = 16;  // more dims: scanned from a contiguous copy

struct WatchGeometry {
  int ndim;
  bool contiguous;
  long long sizes[kDims];
  long long strides[kDims];
};

// Per stream, device memory: the launch's running totals and its ticket.
struct Scratch {
  unsigned long long nan, posinf, neginf;
  unsigned long long first;  // max of ~index over bad elements (the first index); 0 when none
  unsigned int ticket;
};

template <typename T>
__device__ __forceinline__ double as_double(T v) {
  return static_cast<double>(static_cast<float>(v));
}
template <>
__device__ __forceinline__ double as_double<double>(double v) {
  return v;
}

__device__ __forceinline__ long long offset_of(const WatchGeometry& g, long long i) {
  if (g.contiguous) return i;
  long long off = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const long long q = i / g.sizes[d];
    off += (i - q * g.sizes[d]) * g.strides[d];
    i = q;
  }
  return off;
}

__device__ void claim_birth(WatchRecord* rec, int32_t* counters, const TagArgs& a, long long nan,
                            long long pos, long long neg, long long first, double value) {
  const int i = atomicAdd(&counters[0], 1);
  if (i >= kMaxBirths) {
    *reinterpret_cast<volatile int64_t*>(&rec->lost_births) = 1;
  } else {
    BirthEntry* e = &rec->births[i];
    e->seq = a.seq;
    e->output_index = a.output_index;
    e->nan_count = nan;
    e->posinf_count = pos;
    e->neginf_count = neg;
    e->first_bad_index = first;
    e->first_bad_value = value;
    __threadfence_system();
    *reinterpret_cast<volatile int64_t*>(&e->ready) = static_cast<int64_t>(a.seq) + 1;
  }
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&rec->flag) = 1;
}

__device__ void claim_finding(WatchRecord* rec, int32_t* counters, int32_t tag, int64_t sink) {
  const int i = atomicAdd(&counters[1], 1);
  if (i >= kMaxFindings) {
    *reinterpret_cast<volatile int64_t*>(&rec->lost_findings) = 1;
  } else {
    FindingEntry* e = &rec->findings[i];
    e->origin_seq = tag - kTagFirst;
    e->sink = sink;
    __threadfence_system();
    *reinterpret_cast<volatile int64_t*>(&e->ready) = static_cast<int64_t>(tag - kTagFirst) + 1;
  }
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&rec->flag) = 1;
}

template <typename T>
__global__ void watch_scan_kernel(const T* __restrict__ data, long long n, WatchGeometry g, TagArgs a,
                                  int32_t* tags, int32_t* seq_tags, WatchRecord* rec, int32_t* counters,
                                  Scratch* scratch) {
  __shared__ unsigned long long s_nan, s_pos, s_neg, s_first;
  __shared__ bool s_last;
  if (threadIdx.x == 0) {
    s_nan = s_pos = s_neg = 0;
    s_first = 0;
  }
  __syncthreads();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = as_double(data[offset_of(g, i)]);
    if (!isfinite(v)) {  // the rare branch: classify
      if (isnan(v)) {
        atomicAdd(&s_nan, 1ull);
      } else if (v > 0) {
        atomicAdd(&s_pos, 1ull);
      } else {
        atomicAdd(&s_neg, 1ull);
      }
      atomicMax(&s_first, ~static_cast<unsigned long long>(i));
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_first != 0) {
      atomicAdd(&scratch->nan, s_nan);
      atomicAdd(&scratch->posinf, s_pos);
      atomicAdd(&scratch->neginf, s_neg);
      atomicMax(&scratch->first, s_first);
    }
    __threadfence();
    s_last = atomicAdd(&scratch->ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last || threadIdx.x != 0) return;
  // The last block: the totals of every block, then the rule.
  __threadfence();
  volatile Scratch* vs = scratch;
  const unsigned long long first_u = vs->first;
  const long long nan = static_cast<long long>(vs->nan);
  const long long pos = static_cast<long long>(vs->posinf);
  const long long neg = static_cast<long long>(vs->neginf);
  vs->nan = 0;  // left zeroed for the stream's next launch
  vs->posinf = 0;
  vs->neginf = 0;
  vs->first = 0;
  vs->ticket = 0;
  const bool bad = first_u != 0;
  const long long first = bad ? static_cast<long long>(~first_u) : -1;
  bool new_origin = false;
  const int32_t tag = decide_tag(a, tags, seq_tags, bad, &new_origin);
  if (a.kind != kScanSink && a.out_slot >= 0) tags[a.out_slot] = merged_tag(a, tags[a.out_slot], tag, bad);
  if (a.seq_write >= 0 && tag >= kTagQuiet) {
    seq_tags[a.seq_write] = a.seq_merge ? better_tag(seq_tags[a.seq_write], tag) : tag;
  }
  if (new_origin) {
    claim_birth(rec, counters, a, nan, pos, neg, first, as_double(data[offset_of(g, first)]));
  }
  int64_t sinks[2];
  const int k = findings_of(a, tag, bad, new_origin, sinks);
  for (int i = 0; i < k; ++i) claim_finding(rec, counters, tag, sinks[i]);
}

std::mutex& scratch_mutex() {
  static std::mutex m;
  return m;
}

// One zeroed Scratch per (device, stream), allocated at its first use (never
// during a capture: watch refuses capture), then reused: no allocation per op.
Scratch* scratch_for(c10::Device device, cudaStream_t stream) {
  static std::unordered_map<cudaStream_t, Scratch*> by_stream[64];
  std::lock_guard<std::mutex> lock(scratch_mutex());
  auto& map = by_stream[device.index()];
  const auto it = map.find(stream);
  if (it != map.end()) return it->second;
  void* p = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&p, sizeof(Scratch)));
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(Scratch), stream));  // all zero: no launch has run
  map.emplace(stream, static_cast<Scratch*>(p));
  return static_cast<Scratch*>(p);
}

template <typename T>
void launch_typed(const at::Tensor& t, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* rec,
                  int32_t* counters) {
  const long long n = t.numel();
  WatchGeometry g{};
  g.ndim = static_cast<int>(t.dim());
  g.contiguous = t.is_contiguous();
  for (int d = 0; d < g.ndim; ++d) {
    g.sizes[d] = t.size(d);
    g.strides[d] = t.stride(d);
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(t.device().index());
  Scratch* scratch = scratch_for(t.device(), stream);
  long long blocks = (n + kThreads * 4 - 1) / (kThreads * 4);
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  const T* data = static_cast<const T*>(t.const_data_ptr());
  watch_scan_kernel<T><<<static_cast<unsigned int>(blocks), kThreads, 0, stream>>>(
      data, n, g, a, tags, seq_tags, rec, counters, scratch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void scan_cuda(const at::Tensor& input, const TagArgs& a, int32_t* tags, int32_t* seq_tags, WatchRecord* rec,
               int32_t* counters) {
  const c10::cuda::CUDAGuard guard(input.device());
  const at::Tensor t = input.dim() > kDims ? input.contiguous() : input;
  switch (t.scalar_type()) {
    case at::kFloat: launch_typed<float>(t, a, tags, seq_tags, rec, counters); break;
    case at::kDouble: launch_typed<double>(t, a, tags, seq_tags, rec, counters); break;
    case at::kHalf: launch_typed<c10::Half>(t, a, tags, seq_tags, rec, counters); break;
    case at::kBFloat16: launch_typed<c10::BFloat16>(t, a, tags, seq_tags, rec, counters); break;
    default:
      // float8 and other formats: scanned as float32 (a converted copy: rare formats, not the
      // hot path), so the output's slot is written like any other's
      launch_typed<float>(t.to(at::kFloat), a, tags, seq_tags, rec, counters);
      break;
  }
}

WatchRecord* record_cuda(c10::Device device) {
  static std::array<WatchRecord*, 64> records{};
  static std::mutex m;
  TORCH_CHECK(device.index() >= 0 && device.index() < 64,
              "cublas_guard_ext.watch: unsupported CUDA device index ", static_cast<int>(device.index()));
  std::lock_guard<std::mutex> lock(m);
  WatchRecord*& r = records[device.index()];
  if (r == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    void* host = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(WatchRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(host, 0, sizeof(WatchRecord));
    void* device_view = nullptr;
    C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, host, 0));
    TORCH_CHECK(device_view == host,
                "cublas_guard_ext.watch: the device record needs unified virtual addressing");
    r = static_cast<WatchRecord*>(host);
  }
  return r;
}

// At block start: the previous block ended with its final check, so nothing writes the record now.
void reset_record_cuda(c10::Device device, WatchRecord* record, int32_t* counters) {
  const c10::cuda::CUDAGuard guard(device);
  std::memset(record, 0, sizeof(WatchRecord));
  C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, sizeof(int32_t) * kWatchCounters,
                                 at::cuda::getCurrentCUDAStream(device.index())));
}

void synchronize_cuda(c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaDeviceSynchronize());
}

const bool registered = [] {
  DeviceKernels k;
  k.scan = &scan_cuda;
  k.record = &record_cuda;
  k.reset_record = &reset_record_cuda;
  k.synchronize = &synchronize_cuda;
  register_device_kernels(c10::DeviceType::CUDA, k);
  return true;
}();

}  // namespace
}  // namespace watch
}  // namespace cublas_guard
