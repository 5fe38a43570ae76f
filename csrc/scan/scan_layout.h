// What the scans share, below the linear op: the result layout (a small int64
// tensor), the dtypes a scan reads, the CPU scan and the strided layout both
// scans take (scan_cpu.cpp; the CUDA scan in cuda/scan.cu). Free of the linear
// op's declarations, so the scan layer includes nothing above it.
#pragma once

#include "core/tensor_api.h"
#include "report/async_record.h"

#include <cstdint>
#include <string>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Scan result: a small int64 tensor on the scanned tensor's device.
// ---------------------------------------------------------------------------
enum ScanField : int64_t {
  kNanCount = 0,
  kPosInfCount = 1,
  kNegInfCount = 2,
  kFirstBadIndex = 3,  // flat (row-major, logical) index; -1 when all finite
  kScanFields = 4,
};

// The floating dtypes nn.Linear takes, and so the guard and the scans: float32,
// bfloat16, float16, float64.
inline bool is_guarded_dtype(ScalarType dtype) {
  return dtype == kFloat || dtype == kBFloat16 || dtype == kHalf || dtype == kDouble;
}

// The CPU scan (also the reference the CUDA scan is tested against).
void scan_cpu_into(const Tensor& t, Tensor out_slot, const AsyncTarget* target, const std::string& layer);
// The same counts into counts[kScanFields], and whether t is small: every value finite with a
// magnitude below 2^small_bound_exp(dtype), so its square cannot overflow (watch's proofs of an
// optimizer's second moment). The hot loop is the plain scan's with another constant; only
// blocks holding a large value are read twice.
bool scan_cpu_counts(const Tensor& t, int64_t* counts);
// The small bound's exponent: 62 for float32 and bfloat16 (8-bit exponents), 510 for float64;
// -1 for float16 and the rest (float16's 2^15.99 leaves no bound worth having). The one source
// of the bound: the scan's constants (scan_cpu.cpp) and watch's inline count derive from it.
constexpr int kSmallBoundExp8 = 62, kSmallBoundExp11 = 510;
constexpr int small_bound_exp(ScalarType dtype) {
  return dtype == kFloat || dtype == kBFloat16 ? kSmallBoundExp8 : dtype == kDouble ? kSmallBoundExp11 : -1;
}

// Strided iteration support shared by the CPU and CUDA scans: dims merged where
// their strides allow, so that most views become one or two dims.
constexpr int kMaxScanDims = 16;
struct ScanGeometry {
  int ndim = 0;
  int64_t sizes[kMaxScanDims];    // innermost last
  int64_t strides[kMaxScanDims];  // in elements
  bool contiguous = true;          // one dim of stride 1 (or empty/scalar)
};
// Returns false when the tensor needs more than kMaxScanDims dims even after merging.
bool scan_geometry(const Tensor& t, ScanGeometry& geometry);

}  // namespace cublas_guard
