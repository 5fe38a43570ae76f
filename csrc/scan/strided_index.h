// The strided scan's logical index -> element offset, free of the CUDA
// headers: cuda/scan.cu's strided kernel runs it per element, and the CPU
// twin (torch.ops.cublas_guard_testing.strided_offsets, gemm_route.cpp)
// runs the very same functions, so the CPU tests check what the GPU computes.
//
// Dims are merged on the host (scan_geometry), outermost first. The
// innermost-to-outermost walk takes, per dim but the outermost, a quotient
// and a remainder. A 64-bit division costs tens of instructions on a GPU;
// when the tensor has fewer than 2^31 elements (every index and size then
// fits 31 bits) each division is a multiply-high, an add and a shift with a
// divisor-specific magic number precomputed on the host (torch's
// IntDivider<unsigned int>, ATen/cuda/detail/IntegerDivider.cuh; exact for
// dividends and divisors below 2^31). Larger tensors take the 64-bit
// division, still without a division for the outermost dim.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CUBLAS_GUARD_INDEX_HD __host__ __device__
#else
#define CUBLAS_GUARD_INDEX_HD
#endif

namespace cublas_guard {

constexpr int kStridedIndexMaxDims = 16;  // linear/linear_op.h's kMaxScanDims (scan.cu asserts it)

// n / divisor for n, divisor in [1, 2^31) (n may be 0).
struct FastDivider32 {
  uint32_t divisor = 1;
  uint32_t magic = 0;
  uint32_t shift = 0;

  // Host side: divisor must be in [1, 2^31).
  static FastDivider32 make(uint32_t d) {
    FastDivider32 f;
    f.divisor = d;
    while (f.shift < 32 && (uint64_t{1} << f.shift) < d) ++f.shift;
    f.magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }

  CUBLAS_GUARD_INDEX_HD uint32_t div(uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(n, magic);
#else
    const auto t = static_cast<uint32_t>((static_cast<uint64_t>(n) * magic) >> 32);
#endif
    return (t + n) >> shift;  // t <= n < 2^31: no overflow
  }
};

// A strided tensor's index geometry, as the kernel receives it.
struct StridedIndex {
  int ndim = 0;
  bool index32 = false;  // numel < 2^31: the dividers are valid and used
  long long sizes[kStridedIndexMaxDims];
  long long strides[kStridedIndexMaxDims];  // in elements
  FastDivider32 dividers[kStridedIndexMaxDims];
};

// Host side: fills `out` from merged dims (outermost first) of a tensor of `numel` elements.
inline void make_strided_index(StridedIndex& out, int ndim, const int64_t* sizes, const int64_t* strides,
                               int64_t numel) {
  out.ndim = ndim;
  out.index32 = numel < (int64_t{1} << 31);
  for (int d = 0; d < ndim; ++d) {
    out.sizes[d] = sizes[d];
    out.strides[d] = strides[d];
    out.dividers[d] =
        out.index32 && sizes[d] >= 1 ? FastDivider32::make(static_cast<uint32_t>(sizes[d])) : FastDivider32{};
  }
}

// The element offset of logical (row-major) index i, 0 <= i < numel.
CUBLAS_GUARD_INDEX_HD inline long long strided_offset(const StridedIndex& g, long long i) {
  long long offset = 0;
  if (g.index32) {
    auto rest = static_cast<uint32_t>(i);
    for (int d = g.ndim - 1; d > 0; --d) {
      const uint32_t q = g.dividers[d].div(rest);
      offset += static_cast<long long>(rest - q * g.dividers[d].divisor) * g.strides[d];
      rest = q;
    }
    return g.ndim > 0 ? offset + static_cast<long long>(rest) * g.strides[0] : offset;
  }
  long long rest = i;
  for (int d = g.ndim - 1; d > 0; --d) {
    const long long q = rest / g.sizes[d];
    offset += (rest - q * g.sizes[d]) * g.strides[d];
    rest = q;
  }
  return g.ndim > 0 ? offset + rest * g.strides[0] : offset;
}

}  // namespace cublas_guard
