// How a report is raised in the version-locked library: as the typed Python
// exception when Python runs (locked/report/python_errors.cpp), else as the c10 error
// of the built-in class users catch, with the payload line.
#ifndef CUBLAS_GUARD_STABLE
#include "report/error_report.h"

#include <c10/util/Exception.h>

namespace cublas_guard {

void ErrorReport::raise_value_error(const std::string& summary) const {
  throw_python_error_if_possible(message(summary), this);
  C10_THROW_ERROR(ValueError, message(summary));
}

void ErrorReport::raise_type_error(const std::string& summary) const {
  throw_python_error_if_possible(message(summary), this);
  C10_THROW_ERROR(TypeError, message(summary));
}

void ErrorReport::raise_runtime_error(const std::string& summary) const {
  throw_python_error_if_possible(message(summary), this);
  C10_THROW_ERROR(Error, message(summary));
}

void ErrorReport::raise_out_of_memory(const std::string& summary) const {
  throw_python_error_if_possible(message(summary), this);
  C10_THROW_ERROR(OutOfMemoryError, message(summary));
}

}  // namespace cublas_guard
#endif  // !CUBLAS_GUARD_STABLE
