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
//    index -> offset conversion per element; no copy;
//  * the hot path tests only "is any exponent all ones"; classification runs
//    in the rare branch;
//  * each block reduces (warp shuffles, then shared memory) and writes one
//    partial; no atomics and no zero-init launch. A grid of one block writes
//    the result directly; a larger grid is finished by a one-block kernel.
//    Both leave the result deterministic.
//  * async mode: the finishing thread fills the host-mapped record, only if it
//    found something.
#include "cuda_backend.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

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

// Kernel argument: ScanGeometry's dims, outermost first.
struct Geometry {
  int ndim;
  long long sizes[kMaxScanDims];
  long long strides[kMaxScanDims];
};

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

// Block-level epilogue shared by both scan kernels.
__device__ __forceinline__ void finish_block(Partial p, Partial* partials, long long* out,
                                             const AsyncTarget& target) {
  p = block_reduce(p);
  if (threadIdx.x != 0) return;
  if (gridDim.x == 1) {
    write_result(p, out, target);
  } else {
    partials[blockIdx.x] = p;
  }
}

template <typename F>
__global__ void scan_contiguous_kernel(const typename F::Bits* __restrict__ data, long long n,
                                       long long head, Partial* partials, long long* out,
                                       AsyncTarget target) {
  constexpr int kPerVector = 16 / sizeof(typename F::Bits);
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
  finish_block(p, partials, out, target);
}

template <typename F>
__global__ void scan_strided_kernel(const typename F::Bits* __restrict__ data, long long n, Geometry g,
                                    Partial* partials, long long* out, AsyncTarget target) {
  Partial p = empty_partial();
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    long long rest = i, offset = 0;
    for (int d = g.ndim - 1; d >= 0; --d) {
      const long long size = g.sizes[d];
      offset += (rest % size) * g.strides[d];
      rest /= size;
    }
    classify<F>(__ldg(data + offset), i, p);
  }
  finish_block(p, partials, out, target);
}

__global__ void scan_finish_kernel(const Partial* partials, int count, long long* out,
                                   AsyncTarget target) {
  Partial p = empty_partial();
  for (int i = threadIdx.x; i < count; i += blockDim.x) p = combine(p, partials[i]);
  p = block_reduce(p);
  if (threadIdx.x == 0) write_result(p, out, target);
}

int multi_block_grid(long long work_items, int threads) {
  static thread_local int cached_device = -1;
  static thread_local int sm_count = 0;
  const int device = c10::cuda::current_device();
  if (device != cached_device) {
    sm_count = at::cuda::getDeviceProperties(device)->multiProcessorCount;
    cached_device = device;
  }
  const long long wanted = (work_items + threads - 1) / threads;
  return static_cast<int>(std::max<long long>(1, std::min<long long>(wanted, 4LL * sm_count)));
}

}  // namespace

namespace {

template <typename F>
void launch_scan(const at::Tensor& owner, const ScanGeometry& geometry, long long n,
                 at::Tensor& partials_owner, long long* out, const AsyncTarget& target,
                 const std::string& layer) {
  using Bits = typename F::Bits;
  constexpr int kPerVector = 16 / sizeof(Bits);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
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

  Partial* partials_ptr = nullptr;
  if (grid > 1) {
    static_assert(sizeof(Partial) == 4 * sizeof(int64_t), "Partial is four int64");
    partials_owner = at::empty({grid, 4}, owner.options().dtype(at::kLong));
    partials_ptr = reinterpret_cast<Partial*>(partials_owner.data_ptr<int64_t>());
  }
  if (geometry.contiguous) {
    scan_contiguous_kernel<F><<<grid, threads, 0, stream>>>(data, n, head, partials_ptr, out, target);
    check_launch("cublas_guard scan_contiguous_kernel", layer);
  } else {
    Geometry g{};
    g.ndim = geometry.ndim;
    for (int d = 0; d < geometry.ndim; ++d) {
      g.sizes[d] = geometry.sizes[d];
      g.strides[d] = geometry.strides[d];
    }
    scan_strided_kernel<F><<<grid, threads, 0, stream>>>(data, n, g, partials_ptr, out, target);
    check_launch("cublas_guard scan_strided_kernel", layer);
  }
  if (grid > 1) {
    scan_finish_kernel<<<1, kThreads, 0, stream>>>(partials_ptr, grid, out, target);
    check_launch("cublas_guard scan_finish_kernel", layer);
  }
}

}  // namespace

void scan_cuda_into(const at::Tensor& t, at::Tensor out_slot, const AsyncTarget* target_ptr,
                    const std::string& layer) {
  TORCH_INTERNAL_ASSERT(is_guarded_dtype(t.scalar_type()));  // callers check (check_scannable)
  TORCH_INTERNAL_ASSERT(!out_slot.defined() || (out_slot.is_cuda() && out_slot.is_contiguous() &&
                                                 out_slot.scalar_type() == at::kLong));
  const c10::cuda::CUDAGuard device_guard(t.device());
  const AsyncTarget target = target_ptr != nullptr ? *target_ptr : AsyncTarget{};
  auto* out = out_slot.defined() ? reinterpret_cast<long long*>(out_slot.data_ptr<int64_t>())
                                 : nullptr;
  const long long n = t.numel();

  ScanGeometry geometry;
  at::Tensor owner = t;
  if (n > 0 && !scan_geometry(t, geometry)) {
    owner = t.contiguous();  // more than kMaxScanDims unmergeable dims (documented)
    scan_geometry(owner, geometry);
  }
  if (n == 0) geometry.contiguous = true;
  at::Tensor partials;  // kept alive until the kernels are enqueued (stream-ordered reuse)
  switch (t.scalar_type()) {
    case at::kBFloat16:
      launch_scan<BFloat16Bits>(owner, geometry, n, partials, out, target, layer);
      break;
    case at::kHalf:
      launch_scan<Float16Bits>(owner, geometry, n, partials, out, target, layer);
      break;
    case at::kDouble:
      launch_scan<Float64Bits>(owner, geometry, n, partials, out, target, layer);
      break;
    default:
      launch_scan<Float32Bits>(owner, geometry, n, partials, out, target, layer);
      break;
  }
}

}  // namespace cublas_guard
