// Diagnostic variants of the CPU scan's hot loop, for benchmarks/investigations/scan_variants.py.
// Each variant runs at::parallel_reduce(grain 1 << 16) over a contiguous float32 tensor
// exactly as csrc/scan/scan_cpu.cpp does, and returns only "any non-finite?" (no counting pass:
// the inputs are clean, so that pass never runs in the real scan either).
//   v0_single_acc : the scan before this change (one scalar-loop accumulator, auto-vectorized
//                   to SSE2 by -O3 with one vector accumulator)
//   v1_vec4_sse2  : four 16-byte vector accumulators (GCC vector extensions, SSE2)
//   v1_vec4_avx2  : four 32-byte vector accumulators in an AVX2 function (run-time dispatch)
//   v1_noblock    : v1_vec4_avx2 over the whole chunk, no 4096-element blocks (drops the
//                   per-block early exit: the block structure's cost)
//   v2_max        : and + unsigned max (two vector ops per 32 bytes instead of three), AVX2
//   v1_prefetch   : v1_vec4_avx2 with a software prefetch 2 KiB ahead
//   read_or       : the least work that still reads every byte: OR of all words (AVX2)
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstring>

namespace {
constexpr uint32_t kExp = 0x7f800000u, kStep = 0x00800000u;
constexpr int64_t kBlock = 4096, kGrain = 1 << 16;

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}

uint32_t v0(const float* d, int64_t n) {
  uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= (bits_of(d[i]) & kExp) + kStep;
  return acc & 0x80000000u;
}

typedef uint32_t U4 __attribute__((vector_size(16)));
typedef uint32_t U8 __attribute__((vector_size(32)));

template <typename V>
__attribute__((always_inline)) inline uint32_t vec(const float* d, int64_t n) {
  constexpr int L = sizeof(V) / 4;
  V m, s;
  for (int l = 0; l < L; ++l) {
    m[l] = kExp;
    s[l] = kStep;
  }
  V a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 4 * L <= n; i += 4 * L) {
    V x0, x1, x2, x3;
    std::memcpy(&x0, d + i, sizeof(V));
    std::memcpy(&x1, d + i + L, sizeof(V));
    std::memcpy(&x2, d + i + 2 * L, sizeof(V));
    std::memcpy(&x3, d + i + 3 * L, sizeof(V));
    a0 |= (x0 & m) + s;
    a1 |= (x1 & m) + s;
    a2 |= (x2 & m) + s;
    a3 |= (x3 & m) + s;
  }
  V a = (a0 | a1) | (a2 | a3);
  uint32_t r = 0;
  for (int l = 0; l < L; ++l) r |= a[l];
  return (r | v0(d + i, n - i)) & 0x80000000u;
}
uint32_t v1_sse2(const float* d, int64_t n) { return vec<U4>(d, n); }
__attribute__((target("avx2"))) uint32_t v1_avx2(const float* d, int64_t n) { return vec<U8>(d, n); }
__attribute__((target("avx2"))) uint32_t read_or(const float* d, int64_t n) {
  U8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    U8 x0, x1, x2, x3;
    std::memcpy(&x0, d + i, 32);
    std::memcpy(&x1, d + i + 8, 32);
    std::memcpy(&x2, d + i + 16, 32);
    std::memcpy(&x3, d + i + 24, 32);
    a0 |= x0;
    a1 |= x1;
    a2 |= x2;
    a3 |= x3;
  }
  U8 a = (a0 | a1) | (a2 | a3);
  uint32_t r = 0;
  for (int l = 0; l < 8; ++l) r |= a[l];
  for (; i < n; ++i) r |= bits_of(d[i]);
  return r & 1u;
}

// v2_max: two ops per vector instead of three: the largest |bits| (sign cleared) is >= the
// all-ones exponent iff some element is non-finite (and + unsigned max, AVX2).
__attribute__((target("avx2"))) uint32_t v2_max(const float* d, int64_t n) {
  U8 m, a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int l = 0; l < 8; ++l) m[l] = 0x7fffffffu;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    U8 x0, x1, x2, x3;
    std::memcpy(&x0, d + i, 32);
    std::memcpy(&x1, d + i + 8, 32);
    std::memcpy(&x2, d + i + 16, 32);
    std::memcpy(&x3, d + i + 24, 32);
    x0 &= m;
    x1 &= m;
    x2 &= m;
    x3 &= m;
    a0 = a0 > x0 ? a0 : x0;
    a1 = a1 > x1 ? a1 : x1;
    a2 = a2 > x2 ? a2 : x2;
    a3 = a3 > x3 ? a3 : x3;
  }
  a0 = a0 > a1 ? a0 : a1;
  a2 = a2 > a3 ? a2 : a3;
  a0 = a0 > a2 ? a0 : a2;
  uint32_t r = 0;
  for (int l = 0; l < 8; ++l) r = r > a0[l] ? r : a0[l];
  return (r >= kExp ? 0x80000000u : 0u) | v0(d + i, n - i);
}
// v1_prefetch: v1_vec4_avx2 plus a software prefetch 2 KiB ahead.
__attribute__((target("avx2"))) uint32_t v1_prefetch(const float* d, int64_t n) {
  U8 m, s;
  for (int l = 0; l < 8; ++l) {
    m[l] = kExp;
    s[l] = kStep;
  }
  U8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __builtin_prefetch(d + i + 512);
    U8 x0, x1, x2, x3;
    std::memcpy(&x0, d + i, 32);
    std::memcpy(&x1, d + i + 8, 32);
    std::memcpy(&x2, d + i + 16, 32);
    std::memcpy(&x3, d + i + 24, 32);
    a0 |= (x0 & m) + s;
    a1 |= (x1 & m) + s;
    a2 |= (x2 & m) + s;
    a3 |= (x3 & m) + s;
  }
  U8 a = (a0 | a1) | (a2 | a3);
  uint32_t r = 0;
  for (int l = 0; l < 8; ++l) r |= a[l];
  return (r | v0(d + i, n - i)) & 0x80000000u;
}

using Fn = uint32_t (*)(const float*, int64_t);

bool run(const at::Tensor& x, Fn fn, bool blocked) {
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kFloat);
  const float* d = x.data_ptr<float>();
  const uint32_t any = at::parallel_reduce(
      0, x.numel(), kGrain, 0u,
      [&](int64_t b, int64_t e, uint32_t acc) {
        if (!blocked) return acc | fn(d + b, e - b);
        for (int64_t s = b; s < e; s += kBlock) acc |= fn(d + s, std::min(kBlock, e - s));
        return acc;
      },
      [](uint32_t a, uint32_t b) { return a | b; });
  return any != 0;
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("v0_single_acc", [](const at::Tensor& x) { return run(x, v0, true); });
  m.def("v1_vec4_sse2", [](const at::Tensor& x) { return run(x, v1_sse2, true); });
  m.def("v1_vec4_avx2", [](const at::Tensor& x) { return run(x, v1_avx2, true); });
  m.def("v1_noblock", [](const at::Tensor& x) { return run(x, v1_avx2, false); });
  m.def("v2_max", [](const at::Tensor& x) { return run(x, v2_max, true); });
  m.def("v1_prefetch", [](const at::Tensor& x) { return run(x, v1_prefetch, true); });
  m.def("read_or", [](const at::Tensor& x) { return run(x, read_or, false); });
}
