// The GEMM plan (linear/gemm_plan.h): a row-major product as column-major
// cuBLAS calls, split within cuBLAS's 32-bit limit, each call checked against
// cuBLAS's argument rules before it is sent. The size limit lives here because
// every rule that reads it does.
#include "linear/gemm_plan.h"

#include "linear/linear_op.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <utility>

namespace cublas_guard {

namespace {

std::atomic<int64_t>& size_limit() {
  static std::atomic<int64_t> limit{2147483647};  // INT_MAX: cuBLAS's int arguments
  return limit;
}

std::atomic<bool>& allow_64bit() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

// A pointer `elements` elements of `element_size` bytes further on.
const void* advance(const void* p, int64_t elements, int64_t element_size) {
  return static_cast<const char*>(p) + elements * element_size;
}
void* advance(void* p, int64_t elements, int64_t element_size) {
  return static_cast<char*>(p) + elements * element_size;
}

std::string chunk_text(int64_t n0, int64_t n_len, int64_t n, int64_t k0, int64_t k_len, int64_t k) {
  return "n " + std::to_string(n0) + ".." + std::to_string(n0 + n_len) + " of " + std::to_string(n) + ", k " +
         std::to_string(k0) + ".." + std::to_string(k0 + k_len) + " of " + std::to_string(k);
}

}  // namespace

int64_t gemm_size_limit() { return size_limit().load(std::memory_order_relaxed); }

bool gemm_64bit_allowed() { return allow_64bit().load(std::memory_order_relaxed); }

int64_t set_gemm_size_limit(int64_t limit, bool allow_64bit_api) {
  allow_64bit().store(allow_64bit_api);
  return size_limit().exchange(limit);
}

void plan_gemm_call(GemmCall& call, bool has_64bit_api, const std::string& layer) {
  // cuBLAS's own INVALID_VALUE rules, checked here so the message can say which one failed.
  const int64_t rows_a = call.trans_a ? call.k : call.m;
  const int64_t rows_b = call.trans_b ? call.n : call.k;
  const char* broken = nullptr;
  if (call.m < 0 || call.n < 0 || call.k < 0) {
    broken = "m, n and k must be >= 0";
  } else if (call.lda < std::max<int64_t>(1, rows_a)) {
    broken = "lda >= max(1, rows of A as stored)";
  } else if (call.ldb < std::max<int64_t>(1, rows_b)) {
    broken = "ldb >= max(1, rows of B as stored)";
  } else if (call.ldc < std::max<int64_t>(1, call.m)) {
    broken = "ldc >= max(1, m)";
  }
  if (broken != nullptr) {
    // Never sent, and reported with the rule named: cuBLAS would only say INVALID_VALUE.
    raise_gemm_precheck(call, layer, 7, "CUBLAS_STATUS_INVALID_VALUE", broken,
                        "layer '" + layer + "': " + call.routine + " arguments break the rule " + broken);
  }
  // The caller splits n and k into pieces within the limit; m and the leading
  // dimensions cannot be split (ldc >= m, and a leading dimension is a stride).
  const int64_t limit = gemm_size_limit();
  const std::pair<const char*, int64_t> args[] = {{"m", call.m},     {"n", call.n},     {"k", call.k},
                                                  {"lda", call.lda}, {"ldb", call.ldb}, {"ldc", call.ldc}};
  for (const auto& arg : args) {
    if (arg.second <= limit) continue;
    if (has_64bit_api && gemm_64bit_allowed()) {
      call.use_64bit = true;
      return;
    }
    ErrorReport report("size_limit");
    report.add("layer", layer).add("argument", arg.first).add("value", arg.second);
    report.add("limit", limit).add("purpose", call.purpose);
    report.add("m", call.m).add("n", call.n).add("k", call.k);
    report.add("lda", call.lda).add("ldb", call.ldb).add("ldc", call.ldc);
    report.add("api", call.routine).add("data_type", call.data_type);
    report.raise_value_error("layer '" + layer + "': " + call.routine + " argument " + arg.first + " = " +
                             std::to_string(arg.second) + " exceeds cuBLAS's 32-bit limit " +
                             std::to_string(limit) + " and this cuBLAS has no 64-bit API");
  }
}

ColumnMajorView as_column_major(const Tensor& matrix, bool fit_limit) {
  ColumnMajorView view;
  const int64_t rows = matrix.size(0), cols = matrix.size(1);
  const int64_t row_stride = matrix.stride(0), col_stride = matrix.stride(1);
  // For a dim of size <= 1 its stride is meaningless; cuBLAS only needs ld >= the stored rows.
  // A leading dimension beyond cuBLAS's 32-bit limit (a huge batch stored as the
  // stride) cannot be split away: copy into the other layout when that one fits.
  const int64_t limit = fit_limit ? gemm_size_limit() : std::numeric_limits<int64_t>::max();
  const bool rows_contiguous =
      (cols <= 1 || col_stride == 1) && (rows <= 1 || row_stride >= std::max<int64_t>(1, cols));
  const bool cols_contiguous =
      (rows <= 1 || row_stride == 1) && (cols <= 1 || col_stride >= std::max<int64_t>(1, rows));
  const int64_t row_ld = rows <= 1 ? std::max<int64_t>(1, cols) : row_stride;
  const int64_t col_ld = cols <= 1 ? std::max<int64_t>(1, rows) : col_stride;
  // Keep a layout unless its ld is beyond the limit and the other layout's
  // (rows for column-major, cols for row-major) would fit.
  if (rows_contiguous && (row_ld <= limit || rows > limit)) {
    view.storage = matrix;
    view.transposed = true;  // stored as the column-major [cols x rows] matrix, i.e. R^T
    view.ld = row_ld;
  } else if (cols_contiguous && (col_ld <= limit || cols > limit)) {
    view.storage = matrix;
    view.transposed = false;
    view.ld = col_ld;
  } else if (rows <= cols) {
    // Zero strides (expand), overlapping or doubly strided views: one copy, in
    // the layout whose leading dimension is the smaller dim, so that a huge
    // batch dimension never becomes a leading dimension (32-bit limit).
    view.storage = transposed_view(as_contiguous(transposed_view(matrix)));
    view.transposed = false;
    view.ld = std::max<int64_t>(1, rows);
    view.copied = true;
  } else {
    view.storage = as_contiguous(matrix);
    view.transposed = true;
    view.ld = std::max<int64_t>(1, cols);
    view.copied = true;
  }
  view.data = view.storage.data_ptr();
  return view;
}

// Piece sizes for a GEMM beyond the 32-bit limit L. Every argument must be <= L,
// and, with the 32-bit API, no operand may span more than L elements (some
// cuBLAS(Lt) releases failed on a 32-bit call whose operand spans >= 2^31
// elements, although each argument fits). An operand stored column-major as
// [inner x outer] with leading dimension ld spans (outer - 1) * ld + inner
// elements: with every step <= L, capping the outer step at (L - inner) / ld + 1
// brings it within L, and since steps only shrink, every operand stays within.
// When an argument no split can shrink (m, lda, ldb, ldc) is beyond L the call
// goes to the 64-bit API, and only n and k are kept within L.
GemmSteps gemm_steps(const GemmCall& whole, int64_t limit) {
  GemmSteps s{whole.m, std::min(whole.n, limit), std::min(whole.k, limit)};
  if (std::max({whole.m, whole.lda, whole.ldb, whole.ldc}) > limit) return s;  // the 64-bit API
  const auto cap = [limit](int64_t& outer, int64_t inner, int64_t ld) {
    outer = std::max<int64_t>(1, std::min(outer, (limit - inner) / ld + 1));
  };
  // op(A) is m x k: stored [m x k] (lda), or [k x m] when transposed.
  if (whole.trans_a) cap(s.m, s.k, whole.lda);
  else cap(s.k, s.m, whole.lda);
  // op(B) is k x n: stored [k x n] (ldb), or [n x k] when transposed.
  if (whole.trans_b) cap(s.k, s.n, whole.ldb);
  else cap(s.n, s.k, whole.ldb);
  cap(s.n, s.m, whole.ldc);  // C is stored [m x n]
  return s;
}

// out[P x Q] (contiguous, row-major) = beta * out + L[P x R] * Rm[R x Q], as the
// column-major product out^T = Rm^T * L^T that cuBLAS computes.
// `roles` names left, right and out for error reports.
//
// Beyond cuBLAS's 32-bit limit: n (the rows of the row-major output, i.e. the
// batch in forward) is split into independent pieces and k (the reduction,
// the batch in grad_weight) into pieces accumulated with beta = 1; m too when
// an operand would span more than the limit (gemm_steps). m beyond the limit
// and the leading dimensions cannot be split (ldc >= m; a leading dimension is
// a stride), so a call still beyond the limit uses cuBLAS's 64-bit API.
//
// `bias` (forward, BiasHandling::kBiasInGemm): Q elements the GEMM adds to every
// output row; each piece with k0 = 0 gets its m range of them.
void matmul_into(const LinearBackend& be, Tensor& out, const Tensor& left, const Tensor& right, double beta,
                 const char* purpose, const std::array<const char*, 3>& roles, const std::string& layer,
                 const void* bias) {
  const int64_t P = left.size(0), R = left.size(1), Q = right.size(1);
  if (P == 0 || Q == 0) return;
  if (R == 0) {  // an empty sum: nothing for cuBLAS to do
    if (bias != nullptr) {
      copy_into(out, from_blob(bias, {Q}, {1}, out.scalar_type(), out.device()));  // broadcast over the rows
    } else if (beta == 0.0) {
      zero(out);
    }
    return;
  }
  const bool fit_limit = !(be.has_64bit_api && gemm_64bit_allowed());
  const ColumnMajorView lv = as_column_major(left, fit_limit);
  const ColumnMajorView rv = as_column_major(right, fit_limit);
  GemmCall whole;
  whole.dtype = out.scalar_type();
  const GemmNames names = be.gemm_names(whole.dtype);
  whole.routine = names.routine;
  whole.data_type = names.data_type;
  whole.compute_type = names.compute_type;
  whole.trans_a = !rv.transposed;
  whole.trans_b = !lv.transposed;
  whole.m = Q;
  whole.n = P;
  whole.k = R;
  whole.a = rv.data;
  whole.lda = rv.ld;
  whole.b = lv.data;
  whole.ldb = lv.ld;
  whole.c = out.data_ptr();
  whole.ldc = Q;
  whole.alpha = 1.0;
  whole.beta = beta;
  whole.purpose = purpose;

  GemmContext ctx;
  ctx.layer = layer;
  ctx.operand_a = &right;
  ctx.operand_b = &left;
  ctx.operand_c = &out;
  ctx.roles[0] = roles[1];  // A is the right factor, B the left one (out^T = R^T L^T)
  ctx.roles[1] = roles[0];
  ctx.roles[2] = roles[2];

  const GemmSteps steps = gemm_steps(whole, gemm_size_limit());
  const bool split = steps.m < whole.m || steps.n < whole.n || steps.k < whole.k;
  const int64_t es = out.element_size();
  for (int64_t m0 = 0; m0 < whole.m; m0 += steps.m) {
    for (int64_t n0 = 0; n0 < whole.n; n0 += steps.n) {
      for (int64_t k0 = 0; k0 < whole.k; k0 += steps.k) {
        GemmCall piece = whole;
        piece.m = std::min(steps.m, whole.m - m0);
        piece.n = std::min(steps.n, whole.n - n0);
        piece.k = std::min(steps.k, whole.k - k0);
        piece.a = advance(whole.a,
                          whole.trans_a ? k0 + m0 * whole.lda  // op(A): rows m0..,
                                        : m0 + k0 * whole.lda,
                          es);  //   columns k0..
        piece.b = advance(whole.b,
                          whole.trans_b ? n0 + k0 * whole.ldb  // op(B): rows k0..,
                                        : k0 + n0 * whole.ldb,
                          es);  //   columns n0..
        piece.c = advance(whole.c, m0 + n0 * whole.ldc, es);
        piece.beta = k0 == 0 ? whole.beta : 1.0;  // later k pieces accumulate
        piece.bias = bias != nullptr && k0 == 0 ? advance(bias, m0, es) : nullptr;  // added once
        if (split) {
          piece.chunk = (steps.m < whole.m ? "m " + std::to_string(m0) + ".." + std::to_string(m0 + piece.m) +
                                                 " of " + std::to_string(whole.m) + ", "
                                           : std::string()) +
                        chunk_text(n0, piece.n, whole.n, k0, piece.k, whole.k);
        }
        plan_gemm_call(piece, be.has_64bit_api, layer);
        if (piece.use_64bit) piece.routine = names.routine_64;
        const int status = be.gemm(piece, ctx);
        if (status != 0) raise_gemm_failure(status, piece, ctx);
      }
    }
  }
}

}  // namespace cublas_guard
