// The CUDA kernel of watch (locked/watch/watch_device.h): one launch per scanned
// output, on the current stream, with no host sync. The launch counts
// NaN/+Inf/-Inf and the first bad (logical, row-major, int64) index; its last
// block to finish applies apply_rule of locked/watch/watch_device_logic.h (the CPU
// kernels run the same function) to the inputs' tags, writes the output's tag
// slot, and writes the record (pinned host memory mapped into the device,
// async_record.h's pattern) only when it finds a birth or a finding. On a
// birth the last block also counts the output's zeros and reads the inputs'
// absolute maxima (the inputs are alive: the caching allocator reuses their
// memory only for work queued after this launch on the stream). The claim
// counters and the per-launch scratch live in device memory; the scratch is
// left zeroed by the block that used it last, so no launch needs a memset.
//
// NEVER RUN ON A GPU: written and compile-checked (nvcc, sm_80 and sm_90) on a
// machine with no GPU; the CPU kernels (watch_device_cpu.cpp) are what the tests run.
#include "cuda/cuda_backend.h"
#include "locked/watch/watch_device_kernels.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

__device__ double view_value(const InputView& v, long long i) {
  switch (v.dtype) {
    case kViewFloat: return static_cast<const float*>(v.data)[i];
    case kViewDouble: return static_cast<const double*>(v.data)[i];
    case kViewHalf: return static_cast<float>(static_cast<const c10::Half*>(v.data)[i]);
    default: return static_cast<float>(static_cast<const c10::BFloat16*>(v.data)[i]);
  }
}

// The birth path, by the whole last block: zeros of the output and the views'
// absolute maxima (finite values), reduced in shared memory.
template <typename T>
__device__ void birth_extras(const T* data, long long n, const WatchGeometry& g, const TagArgs& a,
                             long long* zeros, double* absmax) {
  __shared__ unsigned long long s_zeros;
  __shared__ double s_max[kThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  if (tid == 0) s_zeros = 0;
  __syncthreads();
  unsigned long long z = 0;
  for (long long i = tid; i < n; i += threads) z += as_double(data[offset_of(g, i)]) == 0.0 ? 1 : 0;
  atomicAdd(&s_zeros, z);
  for (int v = 0; v < kMaxViews; ++v) {
    const bool known = v < a.n_views && a.views[v].dtype != kViewNone;
    double m = 0.0;
    if (known && a.views[v].dtype == kViewValue) {  // a Python number, read on the host
      m = tid == 0 && isfinite(a.views[v].value) ? a.views[v].value : 0.0;
    } else if (known) {
      for (long long i = tid; i < a.views[v].numel; i += threads) {
        const double x = fabs(view_value(a.views[v], i));
        if (isfinite(x) && x > m) m = x;
      }
    }
    s_max[tid] = m;
    __syncthreads();
    for (int half = threads / 2; half > 0; half >>= 1) {
      if (tid < half && s_max[tid + half] > s_max[tid]) s_max[tid] = s_max[tid + half];
      __syncthreads();
    }
    if (tid == 0) absmax[v] = known ? s_max[0] : nan("");
    __syncthreads();
  }
  if (tid == 0) *zeros = static_cast<long long>(s_zeros);
}

__device__ void write_birth(WatchRecord* rec, int32_t* counters, const TagArgs& a, long long nan_n,
                            long long pos, long long neg, long long zeros, long long first, double value,
                            const double* absmax) {
  const long long i = atomicAdd(&counters[0], 1);
  BirthEntry* e = &rec->births[i % rec->capacity];
  *reinterpret_cast<volatile int64_t*>(&e->ready) = 0;
  __threadfence_system();
  e->seq = a.seq;
  e->output_index = a.output_index;
  e->nan_count = nan_n;
  e->posinf_count = pos;
  e->neginf_count = neg;
  e->zero_count = zeros;
  e->first_bad_index = first;
  e->first_bad_value = value;
  for (int v = 0; v < kMaxViews; ++v) {
    e->input_absmax[v] = absmax[v];
    e->input_index[v] = v < a.n_views ? a.views[v].input : -1;
  }
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&e->ready) = static_cast<int64_t>(i) + 1;
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&rec->flag) = 1;
}

__device__ void write_finding(WatchRecord* rec, int32_t* counters, int32_t tag, int64_t sink) {
  const long long i = atomicAdd(&counters[1], 1);
  FindingEntry* e = &rec->findings[i % rec->capacity];
  *reinterpret_cast<volatile int64_t*>(&e->ready) = 0;
  __threadfence_system();
  e->origin_seq = tag - kTagFirst;
  e->sink = sink;
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&e->ready) = static_cast<int64_t>(i) + 1;
  __threadfence_system();
  *reinterpret_cast<volatile int64_t*>(&rec->flag) = 1;
}

template <typename T>
__global__ void watch_scan_kernel(const T* __restrict__ data, long long n, WatchGeometry g, TagArgs a,
                                  int32_t* tags, int32_t* seq_tags, WatchRecord* rec, int32_t* counters,
                                  Scratch* scratch) {
  __shared__ unsigned long long s_nan, s_pos, s_neg, s_first;
  __shared__ bool s_last;
  __shared__ bool s_birth;
  __shared__ long long s_zeros;
  __shared__ double s_absmax[kMaxViews];
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
  if (!s_last) return;
  // The last block: the totals of every block, then the rule (thread 0).
  __shared__ unsigned long long s_first_total;
  __shared__ long long s_counts[3];
  __shared__ int32_t s_tag;
  __shared__ int64_t s_sinks[2];
  __shared__ int s_n_sinks;
  if (threadIdx.x == 0) {
    __threadfence();
    volatile Scratch* vs = scratch;
    s_first_total = vs->first;
    s_counts[0] = static_cast<long long>(vs->nan);
    s_counts[1] = static_cast<long long>(vs->posinf);
    s_counts[2] = static_cast<long long>(vs->neginf);
    vs->nan = 0;  // left zeroed for the stream's next launch
    vs->posinf = 0;
    vs->neginf = 0;
    vs->first = 0;
    vs->ticket = 0;
    bool birth = false;
    int n_sinks = 0;
    int64_t sinks[2];
    s_tag = apply_rule(a, tags, seq_tags, s_first_total != 0, s_counts[0] != 0, &birth, sinks, &n_sinks);
    s_birth = birth;
    s_n_sinks = n_sinks;
    s_sinks[0] = sinks[0];
    s_sinks[1] = sinks[1];
  }
  __syncthreads();
  if (s_birth) birth_extras(data, n, g, a, &s_zeros, s_absmax);
  if (threadIdx.x != 0) return;
  if (s_birth) {
    const long long first = static_cast<long long>(~s_first_total);
    write_birth(rec, counters, a, s_counts[0], s_counts[1], s_counts[2], s_zeros, first,
                as_double(data[offset_of(g, first)]), s_absmax);
  }
  for (int i = 0; i < s_n_sinks; ++i) write_finding(rec, counters, s_tag, s_sinks[i]);
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
  long long n = t.numel();
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
  TagArgs args = a;
  void* params[] = {&data, &n, &g, &args, &tags, &seq_tags, &rec, &counters, &scratch};
  // The grid is capped at kMaxBlocks, so only a device with smaller limits (or a test's lowered
  // ones) can refuse it; the check is the same one every kernel of ours passes first.
  check_launch_fits("cublas_guard watch_scan_kernel", dim3(static_cast<unsigned>(blocks)), dim3(kThreads), 0,
                    "watch");
  // The launch's own status (cudaLaunchKernel returns it), not cudaGetLastError's:
  // an earlier, unrelated failure still pending in this thread is not this launch's.
  const cudaError_t status =
      cudaLaunchKernel(reinterpret_cast<const void*>(&watch_scan_kernel<T>),
                       dim3(static_cast<unsigned>(blocks)), dim3(kThreads), params, 0, stream);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // this launch's error, reported below: not left for the next check
    TORCH_CHECK(
        false, "cublas_guard_ext.watch: its scan kernel failed to launch on ", t.device().str(), ": ",
        cudaGetErrorString(status),
        " (the op before it ran; set CUBLAS_GUARD_MODE=off or leave the watch block to run without it)");
  }
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

// One record per (thread's watch, device): pinned, mapped, with its rings after the header.
WatchRecord* alloc_record_cuda(c10::Device device, int64_t capacity) {
  const c10::cuda::CUDAGuard guard(device);
  const size_t bytes = sizeof(WatchRecord) + capacity * (sizeof(BirthEntry) + sizeof(FindingEntry));
  void* host = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(host, 0, bytes);
  void* device_view = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, host, 0));
  TORCH_CHECK(device_view == host,
              "cublas_guard_ext.watch: the device record needs unified virtual addressing");
  auto* r = static_cast<WatchRecord*>(host);
  r->capacity = capacity;
  r->births = reinterpret_cast<BirthEntry*>(r + 1);
  r->findings = reinterpret_cast<FindingEntry*>(r->births + capacity);
  return r;
}

// Called when the thread's watch state goes (its last block ended with the final check),
// possibly at process exit after the CUDA runtime is gone: a failure is not raised from a
// destructor, only cleared.
void free_record_cuda(c10::Device, WatchRecord* record) {
  if (cudaFreeHost(record) != cudaSuccess) (void)cudaGetLastError();
}

// At block start: the previous block ended with its final check, so nothing writes the record now.
void reset_record_cuda(c10::Device device, WatchRecord* record, int32_t* counters) {
  const c10::cuda::CUDAGuard guard(device);
  std::memset(record->births, 0, record->capacity * sizeof(BirthEntry));
  std::memset(record->findings, 0, record->capacity * sizeof(FindingEntry));
  record->flag = 0;
  C10_CUDA_CHECK(cudaMemsetAsync(counters, 0, sizeof(int32_t) * kWatchCounters,
                                 at::cuda::getCurrentCUDAStream(device.index())));
}

void synchronize_cuda(c10::Device device) {
  const c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaDeviceSynchronize());
}

int32_t read_tag_cuda(c10::Device device, const int32_t* tags, int32_t slot) {
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  int32_t value = 0;
  C10_CUDA_CHECK(cudaMemcpyAsync(&value, tags + slot, sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream));
  return value;
}

const bool registered = [] {
  DeviceKernels k;
  k.scan = &scan_cuda;
  k.alloc_record = &alloc_record_cuda;
  k.free_record = &free_record_cuda;
  k.reset_record = &reset_record_cuda;
  k.synchronize = &synchronize_cuda;
  k.read_tag = &read_tag_cuda;
  register_device_kernels(c10::DeviceType::CUDA, k);
  return true;
}();

}  // namespace
}  // namespace watch
}  // namespace cublas_guard
