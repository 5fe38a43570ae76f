// The fused validation kernel: one pass that counts NaN, +Inf and -Inf and
// finds the first bad element (logical row-major index), int64 throughout.
//
// Instantiated per format (float32, bfloat16, float16, float64): the tests
// use only integer ops on each format's own bits.
//
// Layout of the work:
//  * contiguous input: 16-byte vector loads (4 float32, 8 bfloat16/float16 or
//    2 float64 per load; a scalar head up to the first 16-byte boundary and a
//    scalar tail), a grid-stride loop with kUnroll
//    independent loads in flight per thread;
//  * strided input (views, slices, expand): dims merged on the host, then one
//    index -> offset conversion per element (scan/strided_index.h: below 2^31
//    elements a multiply-high per dim with divisors precomputed on the host,
//    no 64-bit division); no copy;
//  * the hot path tests only "is any exponent all ones"; classification runs
//    in the rare branch;
//  * each block reduces (warp shuffles, then shared memory) and writes one
//    partial; no atomics and no zero-init launch. A grid of one block writes
//    the result directly; a larger grid is finished by a one-block kernel.
//    Both leave the result deterministic.
//  * async mode: the finishing thread fills the host-mapped record, only if it
//    found something;
//  * the forward's bias prefill (CUBLAS_GUARD_GEMM_PATH=lt, float32/float64):
//    the input's scan kernel also writes the bias into every row of the output
//    (gemm_route.h's prefill_columns: block b takes columns b, b + grid, ...),
//    so the GEMM (beta = 1) is preceded by one launch of ours, not a scan and
//    a copy; off mode launches the prefill alone;
//  * partials of a multi-block scan come from a buffer kept per device and
//    stream (no allocation per call); inside a CUDA graph capture they come
//    from the graph's own pool instead (a replay on another stream must not
//    share them with eager scans). With CUBLAS_GUARD_GEMM_PATH=lt the last
//    block to finish reduces them (a ticket in that buffer): one launch.
#include "cuda/cuda_backend.h"
#include "linear/gemm_route.h"
#include "scan/strided_index.h"

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace cublas_guard {
namespace {

constexpr int kThreads = 256;          // threads per block of the multi-block scan
constexpr int kSmallThreads = 1024;    // threads of the single-block scan
constexpr int kUnroll = 4;             // 16-byte loads in flight per thread
constexpr int kMaxWarps = 32;
constexpr int64_t kSingleBlockMax = 32768;  // elements the single-block path takes
constexpr long long kNone = 0x7fffffffffffffffLL;

struct Partial {
  long long nan;
  long long posinf;
  long long neginf;
  long long first;
};

static_assert(kStridedIndexMaxDims == kMaxScanDims, "strided_index.h holds ScanGeometry's dims");

// The bias prefill a scan kernel does besides its scan (out == nullptr: none).
template <typename Bits>
struct Prefill {
  Bits* out;
  const Bits* bias;
  long long m, n, ldc;  // column-major C[m x n]: the row-major output [n x m]
};

template <typename Bits>
__device__ __forceinline__ void run_prefill(const Prefill<Bits>& pf) {
  if (pf.out != nullptr) {
    prefill_columns(pf.out, pf.bias, pf.m, pf.n, pf.ldc, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
  }
}

__device__ __forceinline__ Partial empty_partial() { return Partial{0, 0, 0, kNone}; }

// Each format's bit layout (the same as scan_cpu.cpp's). The Bits types are
// the ones __ldg has overloads for.
struct Float32Bits {
  using Bits = unsigned int;
  static constexpr Bits kExponent = 0x7f800000u, kMantissa = 0x007fffffu;
  static constexpr Bits kSign = 0x80000000u, kStep = 0x00800000u;
};
struct BFloat16Bits {
  using Bits = unsigned short;
  static constexpr Bits kExponent = 0x7f80u, kMantissa = 0x007fu;
  static constexpr Bits kSign = 0x8000u, kStep = 0x0080u;
};
struct Float16Bits {
  using Bits = unsigned short;
  static constexpr Bits kExponent = 0x7c00u, kMantissa = 0x03ffu;
  static constexpr Bits kSign = 0x8000u, kStep = 0x0400u;
};
struct Float64Bits {
  using Bits = unsigned long long;
  static constexpr Bits kExponent = 0x7ff0000000000000ull, kMantissa = 0x000fffffffffffffull;
  static constexpr Bits kSign = 0x8000000000000000ull, kStep = 0x0010000000000000ull;
};

template <typename F>
__device__ __forceinline__ void classify(typename F::Bits bits, long long index, Partial& p) {
  if ((bits & F::kExponent) != F::kExponent) return;
  if (bits & F::kMantissa) {
    ++p.nan;
  } else if (bits & F::kSign) {
    ++p.neginf;
  } else {
    ++p.posinf;
  }
  p.first = index < p.first ? index : p.first;
}

// One 16-byte vector: kPerVector elements starting at logical `index`.
template <typename F>
__device__ __forceinline__ void classify_vector(const uint4& v, long long index, Partial& p) {
  using Bits = typename F::Bits;
  constexpr int kPerVector = 16 / sizeof(Bits);
  Bits b[kPerVector];
  memcpy(b, &v, sizeof(v));
  // The sign bit survives iff one of the exponents is all ones: the masked
  // exponent plus one exponent step carries into it only then.
  Bits any = 0;
#pragma unroll
  for (int i = 0; i < kPerVector; ++i) any |= static_cast<Bits>((b[i] & F::kExponent) + F::kStep);
  if (!(any & F::kSign)) return;
#pragma unroll
  for (int i = 0; i < kPerVector; ++i) classify<F>(b[i], index + i, p);
}

__device__ __forceinline__ Partial combine(const Partial& a, const Partial& b) {
  return Partial{a.nan + b.nan, a.posinf + b.posinf, a.neginf + b.neginf,
                 a.first < b.first ? a.first : b.first};
}

__device__ __forceinline__ Partial warp_reduce(Partial p) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Partial o;
    o.nan = __shfl_down_sync(0xffffffffu, p.nan, offset);
    o.posinf = __shfl_down_sync(0xffffffffu, p.posinf, offset);
    o.neginf = __shfl_down_sync(0xffffffffu, p.neginf, offset);
    o.first = __shfl_down_sync(0xffffffffu, p.first, offset);
    p = combine(p, o);
  }
  return p;
}

// Valid in thread 0 only. blockDim.x must be a multiple of 32.
__device__ Partial block_reduce(Partial p) {
  __shared__ Partial warp_results[kMaxWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  p = warp_reduce(p);
  if (lane == 0) warp_results[warp] = p;
  __syncthreads();
  if (warp == 0) {
    const int warps = blockDim.x / 32;
    p = lane < warps ? warp_results[lane] : empty_partial();
    p = warp_reduce(p);
  }
  return p;
}

__device__ void write_result(const Partial& p, long long* out, const AsyncTarget& target) {
  if (out != nullptr) {  // async scans have no result tensor, only the record
    out[kNanCount] = p.nan;
    out[kPosInfCount] = p.posinf;
    out[kNegInfCount] = p.neginf;
    out[kFirstBadIndex] = p.first == kNone ? -1 : p.first;
  }
  if (target.record == nullptr) return;
  long long replay = 0;  // which replay of a captured call this is (async_record.h)
  if (target.captured) {
    auto* counter = reinterpret_cast<unsigned long long*>(target.replays);
    if (counter == nullptr) {
      replay = -1;
    } else if (target.counts_replay) {
      replay = static_cast<long long>(atomicAdd(counter, 1ULL) + 1ULL);  // clean replays count too
    } else {
      replay = static_cast<long long>(*static_cast<volatile unsigned long long*>(counter));
    }
  }
  if (p.first == kNone) return;
  volatile AsyncRecord* r = target.record;
  // First writer wins; later bad calls before the host has taken the report are
  // dropped. The claim is free while it equals the epoch the host last set.
  const unsigned epoch = static_cast<unsigned>(r->epoch);
  if (atomicCAS(reinterpret_cast<unsigned*>(target.claim), epoch, epoch + 1u) != epoch) return;
  r->layer_id = target.layer_id;
  r->call_id = target.call_id;
  r->role = target.role;
  r->nan_count = p.nan;
  r->posinf_count = p.posinf;
  r->neginf_count = p.neginf;
  r->first_bad_index = p.first;
  r->numel = target.numel;
  r->ndim = target.ndim;
#pragma unroll
  for (int d = 0; d < kRecordMaxDims; ++d) r->shape[d] = target.shape[d];
  r->replay = replay;
  __threadfence_system();  // the fields reach the host before the flag does
  r->flag = 1;
}

// Block-level epilogue shared by both scan kernels. A grid of one block
// writes the result. A larger grid writes one partial per block; then either
// scan_finish_kernel reduces them (ticket == nullptr), or the last block to
// finish does, in the same launch: each block publishes its partial, fences,
// and takes a ticket; the block that draws the last one reads every partial
// and resets the ticket to 0 for the stream's next scan.
__device__ __forceinline__ void finish_block(Partial p, Partial* partials, unsigned* ticket, long long* out,
                                             const AsyncTarget& target) {
  p = block_reduce(p);
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) write_result(p, out, target);
    return;
  }
  __shared__ bool last_block;
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = p;
    if (ticket != nullptr) {
      __threadfence();  // the partial is visible device-wide before the ticket is taken
      last_block = atomicAdd(ticket, 1u) == gridDim.x - 1;
    }
  }
  if (ticket == nullptr) return;
  __syncthreads();  // (also: warp 0 is done with block_reduce's shared memory)
  if (!last_block) return;
  __threadfence();
  const volatile Partial* all = partials;
  Partial q = empty_partial();
  for (unsigned i = threadIdx.x; i < gridDim.x; i += blockDim.x) {
    q = combine(q, Partial{all[i].nan, all[i].posinf, all[i].neginf, all[i].first});
  }
  q = block_reduce(q);
  if (threadIdx.x == 0) {
    write_result(q, out, target);
    *ticket = 0u;
  }
}

// Every scan kernel is launched with kThreads or kSmallThreads threads.
template <typename F>
__global__ void __launch_bounds__(kSmallThreads)
    scan_contiguous_kernel(const typename F::Bits* __restrict__ data, long long n, long long head,
                           Partial* partials, unsigned* ticket, long long* out, AsyncTarget target,
                           Prefill<typename F::Bits> prefill) {
  constexpr int kPerVector = 16 / sizeof(typename F::Bits);
  run_prefill(prefill);
  Partial p = empty_partial();
  const long long tid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Scalar head (up to the 16-byte boundary) and tail: a few threads of block 0.
  const long long body = (n - head) / kPerVector;
  const long long tail_start = head + body * kPerVector;
  if (tid < head) classify<F>(__ldg(data + tid), tid, p);
  if (tid < n - tail_start) classify<F>(__ldg(data + tail_start + tid), tail_start + tid, p);
  const uint4* vec = reinterpret_cast<const uint4*>(data + head);
  // Each iteration a thread has kUnroll loads in flight, blockDim apart so a
  // warp's loads stay coalesced.
  const long long block_span = static_cast<long long>(blockDim.x) * kUnroll;
  for (long long base = static_cast<long long>(blockIdx.x) * block_span + threadIdx.x; base < body;
       base += static_cast<long long>(gridDim.x) * block_span) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + static_cast<long long>(u) * blockDim.x;
      if (i < body) v[u] = __ldg(vec + i);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + static_cast<long long>(u) * blockDim.x;
      if (i < body) classify_vector<F>(v[u], head + kPerVector * i, p);
    }
  }
  finish_block(p, partials, ticket, out, target);
}

template <typename F>
__global__ void __launch_bounds__(kSmallThreads)
    scan_strided_kernel(const typename F::Bits* __restrict__ data, long long n, StridedIndex g,
                        Partial* partials, unsigned* ticket, long long* out, AsyncTarget target,
                        Prefill<typename F::Bits> prefill) {
  run_prefill(prefill);
  Partial p = empty_partial();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    classify<F>(__ldg(data + strided_offset(g, i)), i, p);
  }
  finish_block(p, partials, ticket, out, target);
}

template <typename Bits>
__global__ void __launch_bounds__(kSmallThreads) prefill_kernel(Prefill<Bits> prefill) {
  run_prefill(prefill);
}

__global__ void __launch_bounds__(kThreads)
    scan_finish_kernel(const Partial* partials, int count, long long* out, AsyncTarget target) {
  Partial p = empty_partial();
  for (int i = threadIdx.x; i < count; i += blockDim.x) p = combine(p, partials[i]);
  p = block_reduce(p);
  if (threadIdx.x == 0) write_result(p, out, target);
}

int sm_count_of_current_device() {
  static thread_local int cached_device = -1;
  static thread_local int sm_count = 0;
  const int device = current_cuda_device();
  if (device != cached_device) {
    sm_count = cuda_device_properties(device).multiProcessorCount;
    cached_device = device;
  }
  return sm_count;
}

// Blocks for a prefill of n columns of m rows: one block per column up to
// four per SM; a small output takes one block.
int prefill_grid(long long m, long long n) {
  if (m * n <= kSingleBlockMax) return 1;
  return static_cast<int>(std::max<long long>(1, std::min<long long>(n, 4LL * sm_count_of_current_device())));
}

// The multi-block partials of the current stream: one buffer per device and
// stream, as large as the largest grid (4 blocks per SM), allocated once.
// Kernels on one stream run in order, so its scans can share it.
struct PartialsKey {
  int device;
  cudaStream_t stream;
  bool operator==(const PartialsKey& o) const { return device == o.device && stream == o.stream; }
};
struct PartialsKeyHash {
  size_t operator()(const PartialsKey& k) const {
    return std::hash<const void*>()(k.stream) ^ static_cast<size_t>(k.device);
  }
};

// After the partials: the ticket word of the one-launch finish (zero between scans).
// `device_like`: a tensor on the current device (the buffer is made there).
Partial* stream_partials(int grid, cudaStream_t stream, const Tensor& device_like, unsigned** ticket) {
  const int device = current_cuda_device();
  const int capacity = 4 * sm_count_of_current_device();
  static thread_local PartialsKey last_key{-1, nullptr};
  static thread_local Partial* last = nullptr;
  if (last != nullptr && last_key == PartialsKey{device, stream}) {
    *ticket = reinterpret_cast<unsigned*>(last + capacity);
    return last;
  }
  static std::mutex mutex;
  static auto* buffers =
      new std::unordered_map<PartialsKey, Tensor, PartialsKeyHash>();  // kept for the process
  CG_INTERNAL_ASSERT(grid <= capacity);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = buffers->find(PartialsKey{device, stream});
  if (it == buffers->end()) {
    // Zeroed on the stream that uses it, so the ticket is 0 before its first scan.
    Tensor buffer = empty({capacity + 1, 4}, kLong, device_like);
    zero(buffer);
    it = buffers->emplace(PartialsKey{device, stream}, std::move(buffer)).first;
  }
  last_key = PartialsKey{device, stream};
  last = reinterpret_cast<Partial*>(data_as<int64_t>(it->second));
  *ticket = reinterpret_cast<unsigned*>(last + capacity);
  return last;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // unknown: take the graph-safe allocation
  }
  return status != cudaStreamCaptureStatusNone;
}

int multi_block_grid(long long work_items, int threads) {
  const long long wanted = (work_items + threads - 1) / threads;
  return static_cast<int>(
      std::max<long long>(1, std::min<long long>(wanted, 4LL * sm_count_of_current_device())));
}

}  // namespace

namespace {

template <typename F>
void launch_scan(const Tensor& owner, const ScanGeometry& geometry, long long n, Tensor& partials_owner,
                 long long* out, const AsyncTarget& target, const std::string& layer,
                 const Prefill<typename F::Bits>& prefill) {
  using Bits = typename F::Bits;
  constexpr int kPerVector = 16 / sizeof(Bits);
  const cudaStream_t stream = current_cuda_stream();
  const Bits* data = n > 0 ? static_cast<const Bits*>(owner.data_ptr()) : nullptr;

  int grid = 1, threads = kSmallThreads;
  long long head = 0;
  if (geometry.contiguous) {
    // Elements before the first 16-byte boundary (a tensor's data is aligned
    // to its element size, so this is a whole number of elements).
    const auto address = reinterpret_cast<uintptr_t>(data);
    head = std::min<long long>(n, static_cast<long long>(((16 - address % 16) % 16) / sizeof(Bits)));
    if (n > kSingleBlockMax) {
      threads = kThreads;
      grid = multi_block_grid(((n - head) / kPerVector + kUnroll - 1) / kUnroll, threads);
    }
  } else if (n > kSingleBlockMax) {
    threads = kThreads;
    grid = multi_block_grid(n, threads);
  }
  if (prefill.out != nullptr) {
    const int wanted = prefill_grid(prefill.m, prefill.n);
    if (wanted > grid) {
      grid = wanted;
      threads = kThreads;
    }
  }

  Partial* partials_ptr = nullptr;
  unsigned* ticket = nullptr;  // set: the last block finishes (CUBLAS_GUARD_GEMM_PATH=lt), one launch
  if (grid > 1) {
    static_assert(sizeof(Partial) == 4 * sizeof(int64_t), "Partial is four int64");
    // Async mode knows whether it is captured; other scans ask the stream.
    const bool captured = target.record != nullptr ? target.captured : stream_is_capturing(stream);
    if (captured) {
      partials_owner = empty({grid, 4}, kLong, owner);  // the graph's pool
      partials_ptr = reinterpret_cast<Partial*>(data_as<int64_t>(partials_owner));
    } else {
      unsigned* stream_ticket = nullptr;
      partials_ptr = stream_partials(grid, stream, owner, &stream_ticket);
      if (gemm_path() == GemmPath::kLt) ticket = stream_ticket;
    }
  }
  if (geometry.contiguous) {
    check_launch_fits("cublas_guard scan_contiguous_kernel", dim3(grid), dim3(threads), 0, layer);
    scan_contiguous_kernel<F>
        <<<grid, threads, 0, stream>>>(data, n, head, partials_ptr, ticket, out, target, prefill);
    check_launch("cublas_guard scan_contiguous_kernel", layer);
  } else {
    StridedIndex g{};
    make_strided_index(g, geometry.ndim, geometry.sizes, geometry.strides, n);
    check_launch_fits("cublas_guard scan_strided_kernel", dim3(grid), dim3(threads), 0, layer);
    scan_strided_kernel<F>
        <<<grid, threads, 0, stream>>>(data, n, g, partials_ptr, ticket, out, target, prefill);
    check_launch("cublas_guard scan_strided_kernel", layer);
  }
  if (grid > 1 && ticket == nullptr) {
    check_launch_fits("cublas_guard scan_finish_kernel", dim3(1), dim3(kThreads), 0, layer);
    scan_finish_kernel<<<1, kThreads, 0, stream>>>(partials_ptr, grid, out, target);
    check_launch("cublas_guard scan_finish_kernel", layer);
  }
}

}  // namespace

namespace {

template <typename Bits>
Prefill<Bits> make_prefill(Tensor* out, const Tensor* bias) {
  Prefill<Bits> pf{nullptr, nullptr, 0, 0, 1};
  if (out == nullptr || out->numel() == 0) return pf;
  CG_INTERNAL_ASSERT(out->is_contiguous() && out->dim() == 2 && bias->stride(0) == 1 &&
                     out->element_size() == sizeof(Bits) && bias->element_size() == sizeof(Bits));
  pf.out = static_cast<Bits*>(out->data_ptr());
  pf.bias = static_cast<const Bits*>(bias->data_ptr());
  pf.m = out->size(1);
  pf.n = out->size(0);
  pf.ldc = out->size(1);
  return pf;
}

// The scan of `t`, and with `prefill_out` the bias prefill in the same launch.
void scan_impl(const Tensor& t, const Tensor& out_slot, const AsyncTarget* target_ptr,
               const std::string& layer, Tensor* prefill_out, const Tensor* prefill_bias) {
  CG_INTERNAL_ASSERT(is_guarded_dtype(t.scalar_type()));  // callers check (check_scannable)
  CG_INTERNAL_ASSERT(!out_slot.defined() ||
                     (out_slot.is_cuda() && out_slot.is_contiguous() && out_slot.scalar_type() == kLong));
  const CudaDeviceGuard device_guard(device_index(t));
  const AsyncTarget target = target_ptr != nullptr ? *target_ptr : AsyncTarget{};
  auto* out = out_slot.defined() ? reinterpret_cast<long long*>(data_as<int64_t>(out_slot)) : nullptr;
  const long long n = t.numel();

  ScanGeometry geometry;
  Tensor owner = t;
  if (n > 0 && !scan_geometry(t, geometry)) {
    owner = as_contiguous(t);  // more than kMaxScanDims unmergeable dims (documented)
    scan_geometry(owner, geometry);
  }
  if (n == 0) geometry.contiguous = true;
  clear_stale_launch_error(layer);
  Tensor partials;  // a captured scan's partials: alive until the kernels are enqueued
  switch (t.scalar_type()) {
    case kBFloat16:
      launch_scan<BFloat16Bits>(owner, geometry, n, partials, out, target, layer,
                                make_prefill<BFloat16Bits::Bits>(prefill_out, prefill_bias));
      break;
    case kHalf:
      launch_scan<Float16Bits>(owner, geometry, n, partials, out, target, layer,
                               make_prefill<Float16Bits::Bits>(prefill_out, prefill_bias));
      break;
    case kDouble:
      launch_scan<Float64Bits>(owner, geometry, n, partials, out, target, layer,
                               make_prefill<Float64Bits::Bits>(prefill_out, prefill_bias));
      break;
    default:
      launch_scan<Float32Bits>(owner, geometry, n, partials, out, target, layer,
                               make_prefill<Float32Bits::Bits>(prefill_out, prefill_bias));
      break;
  }
}

template <typename Bits>
void launch_prefill(const Prefill<Bits>& pf, const std::string& layer) {
  const int grid = prefill_grid(pf.m, pf.n);
  const int threads = grid == 1 ? kSmallThreads : kThreads;
  check_launch_fits("cublas_guard prefill_kernel", dim3(grid), dim3(threads), 0, layer);
  prefill_kernel<Bits><<<grid, threads, 0, current_cuda_stream()>>>(pf);
  check_launch("cublas_guard prefill_kernel", layer);
}

}  // namespace

void scan_cuda_into(const Tensor& t, Tensor out_slot, const AsyncTarget* target_ptr,
                    const std::string& layer) {
  scan_impl(t, out_slot, target_ptr, layer, nullptr, nullptr);
}

void scan_cuda_into_prefilling(const Tensor& t, Tensor out_slot, const AsyncTarget* target,
                               const std::string& layer, Tensor& out, const Tensor& bias) {
  const Tensor dense_bias = bias.stride(0) == 1 ? bias : as_contiguous(bias);
  scan_impl(t, out_slot, target, layer, &out, &dense_bias);
}

void prefill_bias_cuda(Tensor& out, const Tensor& bias, const std::string& layer) {
  if (out.numel() == 0) return;
  const CudaDeviceGuard device_guard(device_index(out));
  const Tensor dense_bias = bias.stride(0) == 1 ? bias : as_contiguous(bias);
  clear_stale_launch_error(layer);
  switch (out.element_size()) {
    case 2: launch_prefill(make_prefill<unsigned short>(&out, &dense_bias), layer); break;
    case 8: launch_prefill(make_prefill<unsigned long long>(&out, &dense_bias), layer); break;
    default: launch_prefill(make_prefill<unsigned int>(&out, &dense_bias), layer); break;
  }
}

void prefill_columns_cuda(void* c, const void* bias, int64_t m, int64_t n, int64_t ldc, int64_t element_size,
                          const std::string& layer) {
  if (m == 0 || n == 0) return;
  clear_stale_launch_error(layer);
  switch (element_size) {
    case 2:
      launch_prefill(Prefill<unsigned short>{static_cast<unsigned short*>(c),
                                             static_cast<const unsigned short*>(bias), m, n, ldc},
                     layer);
      break;
    case 8:
      launch_prefill(Prefill<unsigned long long>{static_cast<unsigned long long*>(c),
                                                 static_cast<const unsigned long long*>(bias), m, n, ldc},
                     layer);
      break;
    default:
      launch_prefill(Prefill<unsigned int>{static_cast<unsigned int*>(c),
                                           static_cast<const unsigned int*>(bias), m, n, ldc},
                     layer);
      break;
  }
}

}  // namespace cublas_guard
