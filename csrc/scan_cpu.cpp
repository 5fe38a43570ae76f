// The CPU scan: one pass, all cores (at::parallel_reduce over OpenMP), in
// logical element order so the first bad index means the same as on CUDA.
//
// The hot loop only asks "is any exponent all ones?" with integer ops (and,
// add, or) on explicit vectors with four independent accumulators; the
// counting pass runs only over the blocks where that answer is yes. On x86 an
// AVX2 copy of the hot loop is picked at run time (the build targets baseline
// x86-64, i.e. SSE2); see benchmarks/NOTES.md for why and what it gains.
#include "guard.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>

namespace cublas_guard {

namespace {

constexpr uint32_t kExponentMask = 0x7f800000u;
constexpr uint32_t kMantissaMask = 0x007fffffu;
constexpr int64_t kBlock = 4096;          // elements tested together before a detailed pass
constexpr int64_t kGrain = 1 << 16;       // elements per parallel task at least
constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

struct Partial {
  int64_t nan = 0, posinf = 0, neginf = 0, first = kNone;

  void merge(const Partial& o) {
    nan += o.nan;
    posinf += o.posinf;
    neginf += o.neginf;
    first = std::min(first, o.first);
  }
};

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

// Bit 31 of the result is set iff some element's exponent is all ones: the
// masked exponent plus one exponent step carries into bit 31 only then.
inline uint32_t any_non_finite_scalar(const float* data, int64_t n) {
  uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= (bits_of(data[i]) & kExponentMask) + 0x00800000u;
  return acc & 0x80000000u;
}

#if defined(__GNUC__)
// The same test on GCC/Clang vectors of 4 (16 bytes: SSE2, NEON) or 8 (32
// bytes: AVX2) lanes. Four independent accumulators: one accumulator makes
// every iteration wait for the previous `or`, which held the old loop to
// about 16 bytes per cycle, below what one core can pull from L3.
typedef uint32_t U32x4 __attribute__((vector_size(16)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

template <typename V>
__attribute__((always_inline)) inline uint32_t any_non_finite_vec(const float* data, int64_t n) {
  constexpr int kLanes = sizeof(V) / sizeof(uint32_t);
  constexpr int64_t kStep = 4 * kLanes;
  V mask, step;
  for (int l = 0; l < kLanes; ++l) {
    mask[l] = kExponentMask;
    step[l] = 0x00800000u;
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
  uint32_t acc = 0;
  for (int l = 0; l < kLanes; ++l) acc |= a[l];
  return (acc | any_non_finite_scalar(data + i, n - i)) & 0x80000000u;
}

uint32_t any_non_finite_generic(const float* data, int64_t n) {
  return any_non_finite_vec<U32x4>(data, n);
}

#if defined(__x86_64__) || defined(__i386__)
#define CUBLAS_GUARD_SCAN_AVX2 1
__attribute__((target("avx2"))) uint32_t any_non_finite_avx2(const float* data, int64_t n) {
  return any_non_finite_vec<U32x8>(data, n);
}
#endif

using BlockTest = uint32_t (*)(const float*, int64_t);

BlockTest pick_block_test() {
#if defined(CUBLAS_GUARD_SCAN_AVX2)
  __builtin_cpu_init();  // this runs from a static initializer: make sure the CPU model is read
  if (__builtin_cpu_supports("avx2")) return any_non_finite_avx2;
#endif
  return any_non_finite_generic;
}

// Chosen once, at load time.
const BlockTest any_non_finite = pick_block_test();
#else
inline uint32_t any_non_finite(const float* data, int64_t n) {
  return any_non_finite_scalar(data, n);
}
#endif

inline void classify(float v, int64_t index, Partial& p) {
  const uint32_t b = bits_of(v);
  if ((b & kExponentMask) != kExponentMask) return;
  if (b & kMantissaMask) {
    ++p.nan;
  } else if (b >> 31) {
    ++p.neginf;
  } else {
    ++p.posinf;
  }
  p.first = std::min(p.first, index);
}

// A contiguous run of n elements whose logical index starts at `base`.
void scan_run(const float* data, int64_t n, int64_t base, Partial& p) {
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = std::min(kBlock, n - start);
    if (!any_non_finite(data + start, len)) continue;
    for (int64_t i = 0; i < len; ++i) classify(data[start + i], base + start + i, p);
  }
}

// Logical indices [begin, end) of a strided tensor.
void scan_strided(const float* data, const ScanGeometry& g, int64_t begin, int64_t end,
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
      scan_run(data + offset, run, pos, p);
    } else {
      for (int64_t i = 0; i < run; ++i) classify(data[offset + i * stride], pos + i, p);
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

}  // namespace

void scan_cpu_into(const at::Tensor& t, at::Tensor out_slot, const AsyncTarget* target,
                   const std::string& /*layer*/) {
  TORCH_INTERNAL_ASSERT(t.scalar_type() == at::kFloat);  // callers check (check_scannable)
  Partial total;
  const int64_t n = t.numel();
  if (n > 0) {
    ScanGeometry g;
    at::Tensor owner = t;
    if (!scan_geometry(t, g)) {
      // More than kMaxScanDims non-mergeable dims: scan a contiguous copy (documented).
      owner = t.contiguous();
      scan_geometry(owner, g);
    }
    const float* data = owner.data_ptr<float>();
    total = at::parallel_reduce(
        0, n, kGrain, Partial{},
        [&](int64_t begin, int64_t end, Partial acc) {
          if (g.contiguous) {
            scan_run(data + begin, end - begin, begin, acc);
          } else {
            scan_strided(data, g, begin, end, acc);
          }
          return acc;
        },
        [](Partial a, const Partial& b) {
          a.merge(b);
          return a;
        });
  }
  if (out_slot.defined()) {
    int64_t* out = out_slot.data_ptr<int64_t>();
    out[kNanCount] = total.nan;
    out[kPosInfCount] = total.posinf;
    out[kNegInfCount] = total.neginf;
    out[kFirstBadIndex] = total.first == kNone ? -1 : total.first;
  }
  if (target != nullptr && total.first != kNone) fill_record_cpu(*target, total);
}

}  // namespace cublas_guard
