// The CPU scan: one pass, all cores (at::parallel_reduce over OpenMP), in
// logical element order so the first bad index means the same as on CUDA.
// Instantiated per format (float32, bfloat16, float16, float64): the same
// test on each format's own bits.
//
// The hot loop only asks "is any exponent all ones?" with integer ops (and,
// add, or) on explicit vectors with four independent accumulators; the
// counting pass runs only over the blocks where that answer is yes. On x86 an
// AVX2 copy of the hot loop is picked at run time (the build targets baseline
// x86-64, i.e. SSE2); see benchmarks/investigations/NOTES.md for why and what it gains.
#include "report/error_report.h"
#include "scan/scan_layout.h"

#ifdef CUBLAS_GUARD_STABLE
#include <torch/csrc/stable/ops.h>
#else
#include <ATen/Parallel.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

namespace cublas_guard {

namespace {

// Each format's bit layout. The tests below use only integer ops on the raw
// bits: an exponent field of all ones is Inf (mantissa 0) or NaN.
// kLargeStep: added to the masked exponent, it carries into the sign bit iff the biased exponent
// is at least bias + small_bound_exp (scan_layout.h): 256 - (127 + 62) = 67 for float32 and
// bfloat16, 2048 - (1023 + 510) = 515 for float64. float16 has no such bound: its step is the
// plain one ("large" is only non-finite there, and scan_cpu_counts never calls it small).
constexpr uint32_t large_step_count(int exponent_values, int bias, int small_exp) {
  return static_cast<uint32_t>(exponent_values - (bias + small_exp));
}
struct Float32Bits {
  using Bits = uint32_t;
  static constexpr Bits kExponent = 0x7f800000u, kMantissa = 0x007fffffu;
  static constexpr Bits kLargeStep = Bits{large_step_count(256, 127, kSmallBoundExp8)} << 23;
};
struct BFloat16Bits {
  using Bits = uint16_t;
  static constexpr Bits kExponent = 0x7f80u, kMantissa = 0x007fu;
  static constexpr Bits kLargeStep = static_cast<Bits>(large_step_count(256, 127, kSmallBoundExp8) << 7);
};
struct Float16Bits {
  using Bits = uint16_t;
  static constexpr Bits kExponent = 0x7c00u, kMantissa = 0x03ffu;
  static constexpr Bits kLargeStep = Bits{1} << 10;
};
struct Float64Bits {
  using Bits = uint64_t;
  static constexpr Bits kExponent = 0x7ff0000000000000ull, kMantissa = 0x000fffffffffffffull;
  static constexpr Bits kLargeStep = Bits{large_step_count(2048, 1023, kSmallBoundExp11)} << 52;
};
static_assert(Float32Bits::kLargeStep == (Float32Bits::Bits{67} << 23) &&
                  Float64Bits::kLargeStep == (Float64Bits::Bits{515} << 52),
              "the large steps of 2^62 and 2^510");
static_assert(small_bound_exp(kHalf) < 0, "float16 has no small bound: its kLargeStep is the plain step");

template <typename F>
struct Format {
  using Bits = typename F::Bits;
  static constexpr Bits kExponent = F::kExponent;
  static constexpr Bits kMantissa = F::kMantissa;
  static constexpr Bits kSign = static_cast<Bits>(Bits{1} << (8 * sizeof(Bits) - 1));
  static constexpr Bits kStep = static_cast<Bits>(kExponent & (~kExponent + 1));  // lowest exponent bit
  static constexpr Bits kLargeStep = F::kLargeStep;
};

constexpr int64_t kBlock = 4096;          // elements tested together before a detailed pass
constexpr int64_t kGrain = 1 << 16;       // elements per parallel task at least
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct Partial {
  int64_t nan = 0, posinf = 0, neginf = 0, first = kNone;
  bool large = false;  // some value's magnitude reaches the format's kLargeStep bound (or is not finite)

  void merge(const Partial& o) {
    large = large || o.large;
    nan += o.nan;
    posinf += o.posinf;
    neginf += o.neginf;
    first = std::min(first, o.first);
  }
};

template <typename Bits>
inline Bits load_bits(const Bits* data) {
  Bits b;
  std::memcpy(&b, data, sizeof(b));
  return b;
}

// The sign bit of the result is set iff some element's exponent is all ones:
// the masked exponent plus one exponent step carries into the sign bit only then
// (plus kLargeStep: iff some exponent reaches the large bound).
template <typename F, typename F::Bits Step = F::kStep>
inline typename F::Bits any_non_finite_scalar(const typename F::Bits* data, int64_t n) {
  using Bits = typename F::Bits;
  Bits acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= static_cast<Bits>((load_bits(data + i) & F::kExponent) + Step);
  }
  return static_cast<Bits>(acc & F::kSign);
}

#if defined(__GNUC__)
// The same test on GCC/Clang vectors of 16 bytes (SSE2, NEON) or 32 bytes
// (AVX2): 4/8 float32 lanes, 8/16 bfloat16 or float16 lanes, 2/4 float64
// lanes. Four independent accumulators: one accumulator makes every iteration
// wait for the previous `or`, which held the old loop to about 16 bytes per
// cycle, below what one core can pull from L3.
template <typename Bits, int Bytes>
struct VectorOf {
  typedef Bits type __attribute__((vector_size(Bytes)));
};

template <typename F, int Bytes, typename F::Bits Step>
__attribute__((always_inline)) inline bool any_non_finite_vec(const typename F::Bits* data, int64_t n) {
  using Bits = typename F::Bits;
  using V = typename VectorOf<Bits, Bytes>::type;
  constexpr int kLanes = Bytes / sizeof(Bits);
  constexpr int64_t kStep = 4 * kLanes;
  V mask, step;
  for (int l = 0; l < kLanes; ++l) {
    mask[l] = F::kExponent;
    step[l] = Step;
  }
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    V x0, x1, x2, x3;  // memcpy: unaligned loads without aliasing questions
    std::memcpy(&x0, data + i, sizeof(V));
    std::memcpy(&x1, data + i + kLanes, sizeof(V));
    std::memcpy(&x2, data + i + 2 * kLanes, sizeof(V));
    std::memcpy(&x3, data + i + 3 * kLanes, sizeof(V));
    a0 |= (x0 & mask) + step;
    a1 |= (x1 & mask) + step;
    a2 |= (x2 & mask) + step;
    a3 |= (x3 & mask) + step;
  }
  const V a = (a0 | a1) | (a2 | a3);
  Bits acc = 0;
  for (int l = 0; l < kLanes; ++l) acc |= a[l];
  return ((acc & F::kSign) | any_non_finite_scalar<F, Step>(data + i, n - i)) != 0;
}

template <typename F, typename F::Bits Step>
bool any_non_finite_generic(const typename F::Bits* data, int64_t n) {
  return any_non_finite_vec<F, 16, Step>(data, n);
}

#if defined(__x86_64__) || defined(__i386__)
#define CUBLAS_GUARD_SCAN_AVX2 1
template <typename F, typename F::Bits Step>
__attribute__((target("avx2"))) bool any_non_finite_avx2(const typename F::Bits* data, int64_t n) {
  return any_non_finite_vec<F, 32, Step>(data, n);
}
#endif

bool cpu_has_avx2() {
#if defined(CUBLAS_GUARD_SCAN_AVX2)
  __builtin_cpu_init();  // this runs from a static initializer: make sure the CPU model is read
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

// Chosen once, at load time.
const bool use_avx2 = cpu_has_avx2();

// Step = F::kLargeStep: whether any value is large (or not finite).
template <typename F, typename F::Bits Step = F::kStep>
inline bool any_non_finite(const typename F::Bits* data, int64_t n) {
#if defined(CUBLAS_GUARD_SCAN_AVX2)
  if (use_avx2) return any_non_finite_avx2<F, Step>(data, n);
#endif
  return any_non_finite_generic<F, Step>(data, n);
}
#else
template <typename F, typename F::Bits Step = F::kStep>
inline bool any_non_finite(const typename F::Bits* data, int64_t n) {
  return any_non_finite_scalar<F, Step>(data, n) != 0;
}
#endif

template <typename F, bool Large = false>
inline void classify(typename F::Bits b, int64_t index, Partial& p) {
  if constexpr (Large) {
    if (static_cast<typename F::Bits>((b & F::kExponent) + F::kLargeStep) & F::kSign) p.large = true;
  }
  if ((b & F::kExponent) != F::kExponent) return;
  if (b & F::kMantissa) {
    ++p.nan;
  } else if (b & F::kSign) {
    ++p.neginf;
  } else {
    ++p.posinf;
  }
  p.first = std::min(p.first, index);
}

// A contiguous run of n elements whose logical index starts at `base`. Large: the hot loop asks
// "any value large or not finite?" (the same instructions, another step), and a block that
// answers yes is asked the plain question before its detailed pass.
template <typename F, bool Large>
void scan_run(const typename F::Bits* data, int64_t n, int64_t base, Partial& p) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    if constexpr (Large) {
      if (!any_non_finite<F, F::kLargeStep>(data + start, len)) continue;
      p.large = true;
    }
    if (!any_non_finite<F>(data + start, len)) continue;
    for (int64_t i = 0; i < len; ++i) classify<F>(load_bits(data + start + i), base + start + i, p);
  }
}

// Logical indices [begin, end) of a strided tensor.
template <typename F, bool Large>
void scan_strided(const typename F::Bits* data, const ScanGeometry& g, int64_t begin, int64_t end,
                  Partial& p) {
  const int inner = g.ndim - 1;
  int64_t index[kMaxScanDims];
  int64_t rest = begin;
  int64_t offset = 0;
  for (int d = inner; d >= 0; --d) {
    index[d] = rest % g.sizes[d];
    rest /= g.sizes[d];
    offset += index[d] * g.strides[d];
  }
  int64_t pos = begin;
  while (pos < end) {
    const int64_t run = std::min(g.sizes[inner] - index[inner], end - pos);
    const int64_t stride = g.strides[inner];
    if (stride == 1) {
      scan_run<F, Large>(data + offset, run, pos, p);
    } else {
      for (int64_t i = 0; i < run; ++i) classify<F, Large>(load_bits(data + offset + i * stride), pos + i, p);
    }
    pos += run;
    // Advance the odometer past the run.
    offset += run * stride;
    index[inner] += run;
    for (int d = inner; d > 0 && index[d] == g.sizes[d]; --d) {
      offset -= g.sizes[d] * g.strides[d];
      index[d] = 0;
      ++index[d - 1];
      offset += g.strides[d - 1];
    }
  }
}

// One pass over the whole tensor, on all cores (torch's intra-op pool:
// at::parallel_reduce, or the stable ABI's parallel_for over fixed chunks
// whose partials are merged after, which is the same reduction).
template <typename F, bool Large = false>
Partial scan_all(const void* raw, const ScanGeometry& g, int64_t n) {
  const auto* data = static_cast<const typename F::Bits*>(raw);
  auto scan_range = [&](int64_t begin, int64_t end, Partial acc) {
    if (g.contiguous) {
      scan_run<F, Large>(data + begin, end - begin, begin, acc);
    } else {
      scan_strided<F, Large>(data, g, begin, end, acc);
    }
    return acc;
  };
#ifdef CUBLAS_GUARD_STABLE
  if (n <= kGrain) return scan_range(0, n, Partial{});
  const int64_t chunks = (n + kGrain - 1) / kGrain;
  std::vector<Partial> partials(static_cast<size_t>(chunks));
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      partials[c] = scan_range(c * kGrain, std::min(n, (c + 1) * kGrain), Partial{});
    }
  });
  Partial total;
  for (const Partial& p : partials) total.merge(p);
  return total;
#else
  return at::parallel_reduce(0, n, kGrain, Partial{}, scan_range, [](Partial a, const Partial& b) {
    a.merge(b);
    return a;
  });
#endif
}

void fill_record_cpu(const AsyncTarget& target, const Partial& p) {
  // The claim protocol of async_record.h: free while it equals the epoch.
  AsyncRecord& r = *target.record;
  const auto epoch = static_cast<uint32_t>(__atomic_load_n(&r.epoch, __ATOMIC_ACQUIRE));
  int expected = static_cast<int>(epoch);
  if (!__atomic_compare_exchange_n(target.claim, &expected, static_cast<int>(epoch + 1u), false,
                                   __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    return;  // an earlier bad call already owns the record
  }
  r.layer_id = target.layer_id;
  r.call_id = target.call_id;
  r.role = target.role;
  r.nan_count = p.nan;
  r.posinf_count = p.posinf;
  r.neginf_count = p.neginf;
  r.first_bad_index = p.first;
  r.numel = target.numel;
  r.ndim = target.ndim;
  for (int d = 0; d < kRecordMaxDims; ++d) r.shape[d] = target.shape[d];
  r.replay = 0;  // no CUDA graphs on the CPU
  __atomic_store_n(&r.flag, int64_t{1}, __ATOMIC_RELEASE);
}

// The whole tensor's partial (Large: also whether a value reaches the format's large bound).
template <bool Large>
Partial scan_tensor(const Tensor& t) {
  CG_CHECK(is_guarded_dtype(t.scalar_type()), "cublas_guard_ext: internal: scan of an unguarded dtype");
  const int64_t n = t.numel();
  if (n == 0) return Partial{};
  ScanGeometry g;
  Tensor owner = t;
  if (!scan_geometry(t, g)) {
    // More than kMaxScanDims non-mergeable dims: scan a contiguous copy (documented).
    owner = as_contiguous(t);
    scan_geometry(owner, g);
  }
  const void* data = owner.data_ptr();
  switch (t.scalar_type()) {
    case kBFloat16: return scan_all<Format<BFloat16Bits>, Large>(data, g, n);
    case kHalf: return scan_all<Format<Float16Bits>, Large>(data, g, n);
    case kDouble: return scan_all<Format<Float64Bits>, Large>(data, g, n);
    default: return scan_all<Format<Float32Bits>, Large>(data, g, n);
  }
}

void write_counts(const Partial& total, int64_t* out) {
  out[kNanCount] = total.nan;
  out[kPosInfCount] = total.posinf;
  out[kNegInfCount] = total.neginf;
  out[kFirstBadIndex] = total.first == kNone ? -1 : total.first;
}

}  // namespace

void scan_cpu_into(const Tensor& t, Tensor out_slot, const AsyncTarget* target,
                   const std::string& /*layer*/) {
  const Partial total = scan_tensor<false>(t);
  if (out_slot.defined()) write_counts(total, data_as<int64_t>(out_slot));
  if (target != nullptr && total.first != kNone) fill_record_cpu(*target, total);
}

bool scan_cpu_counts(const Tensor& t, int64_t* counts) {
  const Partial total = scan_tensor<true>(t);
  write_counts(total, counts);
  return !total.large && small_bound_exp(t.scalar_type()) >= 0;
}

// The scan's layout of a tensor (dims merged where their strides allow),
// computed on the host for the CPU scan above and the CUDA scan (cuda/scan.cu)
// alike.
bool scan_geometry(const Tensor& t, ScanGeometry& g) {
  // Merge dims from the innermost outwards, dropping size-1 dims, in logical order.
  int64_t sizes[64];
  int64_t strides[64];
  int n = 0;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (size == 1) continue;
    if (n > 0 && strides[n - 1] * sizes[n - 1] == stride) {
      sizes[n - 1] *= size;  // dim d continues dim n-1's run: one longer dim
      continue;
    }
    if (n == 64) return false;
    sizes[n] = size;
    strides[n] = stride;
    ++n;
  }
  if (n > kMaxScanDims) return false;
  g.ndim = n;
  for (int i = 0; i < n; ++i) {  // store outermost first, innermost last
    g.sizes[i] = sizes[n - 1 - i];
    g.strides[i] = strides[n - 1 - i];
  }
  g.contiguous = n == 0 || (n == 1 && g.strides[0] == 1);
  return true;
}

}  // namespace cublas_guard
