// Where, inside a bigger guarded op, the piece that raised a report sits: one
// expert of a mixture of experts' experts module (moe/grouped_common.cpp).
//
// The grouped linear runs one scan and one GEMM per expert through the same
// shared code the linear op uses (raise_if_non_finite, matmul_into and its
// CublasError report, the argument checks), which know nothing of experts.
// Rather than thread an expert through every one of them, the grouped op sets
// this thread-local place around each expert's work, and ErrorReport::json()
// (report/errors.cpp) adds the place's fields to any report raised meanwhile:
// experts_module, parameter, expert and expert_rows. The place holds pointers
// only: no string is built on the clean path.
#pragma once

#include <cstdint>
#include <string>

namespace cublas_guard {

struct ReportPlace {
  const std::string* module = nullptr;     // the experts module's qualified name
  const std::string* parameter = nullptr;  // the weight's name in it ("gate_up_proj")
  int64_t expert = -1;                     // -1: no single expert (a rule about all of them)
  int64_t first_row = 0, end_row = 0;      // the expert's rows [first_row, end_row) of the input
};

// The innermost place of this thread, or nullptr.
const ReportPlace* current_report_place();

class ReportPlaceScope {
 public:
  explicit ReportPlaceScope(const ReportPlace* place);  // the place must outlive the scope
  ~ReportPlaceScope();
  ReportPlaceScope(const ReportPlaceScope&) = delete;
  ReportPlaceScope& operator=(const ReportPlaceScope&) = delete;

 private:
  const ReportPlace* outer_;
};

}  // namespace cublas_guard
