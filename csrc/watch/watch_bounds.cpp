// Value bounds for watch: outputs whose finiteness follows from bounds on
// their inputs' values, so that their scan can be skipped.
//
// Why: an optimizer's arithmetic (AdamW: lerp_, addcmul_, sqrt, div, add_,
// addcdiv_) can overflow in general, so watch scanned every output of it,
// about a third of the bytes a watched MiniLM training step read
// (benchmarks/investigations/NOTES.md section 7). The CPU scan's range pass
// gives each finite tensor it reads an interval [lo, hi] (the table keeps it
// with the entry); from its inputs' intervals an op's output interval
// follows, and when that interval and every intermediate stay below a
// quarter of the dtype's largest finite value the output is finite by
// construction: not scanned, remembered finite with its interval.
//
// Soundness. Each rule computes the exact (real-number) interval of the
// results and widens it by a rounding allowance: kRoundings units of
// roundoff of the output dtype times the magnitudes the computation adds,
// plus the smallest normal number (underflow, flushed denormals). Where a
// result is a single rounded operation of exact inputs that is monotonic in
// each input (x * s, x / s, x + s, x * y, x + y, sqrt), each end is widened
// by its own magnitude (so a lower bound above zero, a denominator's,
// survives); elsewhere (lerp, addcmul, addcdiv) by the sum of the terms'
// magnitudes at both ends. A result is also known non-negative only where
// sign rules make every rounded step non-negative (addcmul of a square with
// a non-negative value onto a non-negative tensor; products, quotients and
// sums of non-negative values; sqrt): rounding is monotonic and maps 0 to 0,
// so each rounded step of non-negative operands is non-negative. Scalars must be
// finite values of the output dtype (kernels cast them to it); every tensor
// input must have the output's dtype (no promotion) and be on the CPU.
// tests/test_watch_bounds.py checks every rule against planted overflows and
// random inputs near the limits (no non-finite output is ever spared, and
// every remembered interval holds the values).
#include "watch/watch.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

namespace cublas_guard {
namespace watch {

namespace {

struct Numbers {
  double limit = 0.0;  // the largest finite value
  double unit = 0.0;   // unit roundoff
  double tiny = 0.0;   // the smallest normal value
};

bool numbers_of(at::ScalarType t, Numbers& n) {
  switch (t) {
    case at::kFloat: n = {3.4028234663852886e38, std::ldexp(1.0, -24), std::ldexp(1.0, -126)}; return true;
    case at::kBFloat16: n = {3.3895313892515355e38, std::ldexp(1.0, -8), std::ldexp(1.0, -126)}; return true;
    case at::kHalf: n = {65504.0, std::ldexp(1.0, -11), std::ldexp(1.0, -14)}; return true;
    default: return false;
  }
}

// Roundings allowed per element (a few per op: the scalar's cast, opmath and
// the final cast for bf16/fp16, the operations), with a margin.
constexpr double kRoundings = 8.0;

double magnitude(const Range& r) { return std::max(std::fabs(r.lo), std::fabs(r.hi)); }

// Every magnitude finite and at most a quarter of the largest finite value.
bool within(const Numbers& n, std::initializer_list<double> magnitudes) {
  for (double m : magnitudes) {
    if (!(std::fabs(m) <= n.limit / 4.0)) return false;  // also false for NaN
  }
  return true;
}

// [lo, hi] widened at each end by the rounding of terms summing to the given magnitudes.
Range widen(double lo, double hi, double terms_lo, double terms_hi, const Numbers& n) {
  const double e = kRoundings * n.unit;
  Range r;
  r.lo = lo - e * terms_lo - n.tiny;
  r.hi = hi + e * terms_hi + n.tiny;
  return r;
}

Range sorted(double a, double b) {
  Range r;
  r.lo = std::min(a, b);
  r.hi = std::max(a, b);
  return r;
}

// The bounds of tensor argument `a`: before the op for the argument it
// writes, else the table's. False unless it is a bounded tensor of `dtype`.
bool tensor_range(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args, int a,
                  const Range& inplace_before, at::ScalarType dtype, Range& r) {
  if (!args[a].isTensor()) return false;
  const at::Tensor& t = args[a].toTensor();
  if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number() || t.scalar_type() != dtype ||
      !t.device().is_cpu() || !readable(t)) {
    return false;
  }
  r = is_inplace_arg(info, a) ? inplace_before : known_range(s, t);
  return r.bounded();
}

// A real Scalar argument that is a finite value of the output dtype (absent or None: `fallback`).
bool scalar_arg(const std::vector<c10::IValue>& args, size_t a, const Numbers& n, double fallback,
                double& v) {
  if (a >= args.size() || args[a].isNone()) {
    v = fallback;
    return true;
  }
  return real_value(args[a], v) && std::fabs(v) <= n.limit;
}

// x * y or x + alpha * y: the interval of each end's products.
Range product(const Range& x, const Range& y) {
  const double p[] = {x.lo * y.lo, x.lo * y.hi, x.hi * y.lo, x.hi * y.hi};
  Range r;
  r.lo = *std::min_element(p, p + 4);
  r.hi = *std::max_element(p, p + 4);
  return r;
}

Range scaled(const Range& x, double v) { return sorted(x.lo * v, x.hi * v); }

}  // namespace

bool bounded_by_construction(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                             const Range& inplace_before, const at::Tensor& out, Range& range) {
  Numbers n;
  if (info.rule == Rule::kNone || args.size() < info.num_args || !out.device().is_cpu() ||
      !numbers_of(out.scalar_type(), n)) {
    return false;
  }
  const at::ScalarType dtype = out.scalar_type();
  Range x;
  switch (info.rule) {
    case Rule::kScale: {  // x * s, s * x (functional), x * y
      double v = 0.0;
      int tensor = 0;
      if (!real_value(args[1], v)) {
        if (!info.inplace_args.empty() || !real_value(args[0], v)) {
          Range y;  // two tensors
          if (!tensor_range(s, info, args, 0, inplace_before, dtype, x) ||
              !tensor_range(s, info, args, 1, inplace_before, dtype, y)) {
            return false;
          }
          const Range p = product(x, y);
          range = widen(p.lo, p.hi, std::fabs(p.lo), std::fabs(p.hi), n);
          if (x.lo >= 0.0 && y.lo >= 0.0) range.lo = std::max(range.lo, 0.0);
          return within(n, {magnitude(range)});
        }
        tensor = 1;
      }
      if (std::fabs(v) > n.limit || !tensor_range(s, info, args, tensor, inplace_before, dtype, x))
        return false;
      const Range p = scaled(x, v);
      range = widen(p.lo, p.hi, std::fabs(p.lo), std::fabs(p.hi), n);
      if (x.lo >= 0.0 && v >= 0.0) range.lo = std::max(range.lo, 0.0);
      return within(n, {magnitude(range)});
    }
    case Rule::kDivide: {  // x / s (CPU kernels may multiply by 1 / s)
      double v = 0.0;
      if (!real_value(args[1], v) || v == 0.0 || std::fabs(v) > n.limit ||
          !tensor_range(s, info, args, 0, inplace_before, dtype, x)) {
        return false;
      }
      const Range q = scaled(x, 1.0 / v);
      range = widen(q.lo, q.hi, std::fabs(q.lo), std::fabs(q.hi), n);
      if (x.lo >= 0.0 && v > 0.0) range.lo = std::max(range.lo, 0.0);
      return within(n, {1.0 / v, magnitude(range)});
    }
    case Rule::kAdd:
    case Rule::kSubtract: {  // x + alpha * s, x + alpha * y (sub: -alpha)
      double alpha = 1.0;
      if (!scalar_arg(args, 2, n, 1.0, alpha)) return false;
      if (info.rule == Rule::kSubtract) alpha = -alpha;
      if (!tensor_range(s, info, args, 0, inplace_before, dtype, x)) return false;
      Range y;
      double v = 0.0;
      if (real_value(args[1], v)) {
        if (std::fabs(v) > n.limit) return false;
        y.lo = y.hi = v;
      } else if (!tensor_range(s, info, args, 1, inplace_before, dtype, y)) {
        return false;
      }
      const Range a = scaled(y, alpha);
      // fl(x + fl(alpha * y)) is monotonic in x and in y: each end is its ends' sum
      range = widen(x.lo + a.lo, x.hi + a.hi, std::fabs(x.lo) + std::fabs(a.lo),
                    std::fabs(x.hi) + std::fabs(a.hi), n);
      if (x.lo >= 0.0 && a.lo >= 0.0) range.lo = std::max(range.lo, 0.0);
      return within(n, {magnitude(a), magnitude(range)});
    }
    case Rule::kLerp: {  // self + w * (end - self), 0 <= w <= 1
      Range end;
      double w = 0.0;
      if (!real_value(args[2], w) || w < 0.0 || w > 1.0 ||
          !tensor_range(s, info, args, 0, inplace_before, dtype, x) ||
          !tensor_range(s, info, args, 1, inplace_before, dtype, end)) {
        return false;
      }
      const double terms = magnitude(x) + magnitude(end);
      range = widen(std::min(x.lo, end.lo), std::max(x.hi, end.hi), terms, terms, n);
      return within(n, {terms, magnitude(range)});
    }
    case Rule::kAddcmul:
    case Rule::kAddcdiv: {  // self + value * t1 * t2, self + value * t1 / t2
      Range t1, t2;
      double v = 1.0;
      if (!scalar_arg(args, 3, n, 1.0, v) || !tensor_range(s, info, args, 0, inplace_before, dtype, x) ||
          !tensor_range(s, info, args, 1, inplace_before, dtype, t1) ||
          !tensor_range(s, info, args, 2, inplace_before, dtype, t2)) {
        return false;
      }
      Range term;  // value * t1 * t2 or value * t1 / t2
      if (info.rule == Rule::kAddcmul) {
        Range p = product(t1, t2);
        if (args[1].toTensor().unsafeGetTensorImpl() == args[2].toTensor().unsafeGetTensorImpl()) {
          p.lo = 0.0;  // a square (grad * grad)
          p.hi = magnitude(t1) * magnitude(t1);
        }
        if (!within(n, {v * magnitude(t1), magnitude(t1) * magnitude(t2)})) return false;
        term = scaled(p, v);
      } else {
        const double least = t2.lo > 0.0 ? t2.lo : (t2.hi < 0.0 ? -t2.hi : 0.0);  // min |t2|
        if (!(least > 0.0)) return false;
        const double q = magnitude(t1) / least;
        if (!within(n, {v * magnitude(t1), q})) return false;
        term.lo = -std::fabs(v) * q;
        term.hi = std::fabs(v) * q;
      }
      const double terms = magnitude(x) + magnitude(term);
      range = widen(x.lo + term.lo, x.hi + term.hi, terms, terms, n);
      // Every rounded step of a non-negative sum of non-negative terms is non-negative.
      if (x.lo >= 0.0 && term.lo >= 0.0) range.lo = std::max(range.lo, 0.0);
      return within(n, {magnitude(term), magnitude(range)});
    }
    case Rule::kSqrt: {
      if (!tensor_range(s, info, args, 0, inplace_before, dtype, x) || x.lo < 0.0) return false;
      const double lo = std::sqrt(x.lo), hi = std::sqrt(x.hi);
      range = widen(lo, hi, lo, hi, n);
      range.lo = std::max(range.lo, 0.0);  // the square root of a number >= 0 (or -0.0)
      return within(n, {magnitude(range)});
    }
    case Rule::kNone: break;
  }
  return false;
}

}  // namespace watch
}  // namespace cublas_guard
