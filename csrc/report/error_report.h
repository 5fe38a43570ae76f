// The error report every layer raises (errors.cpp): a kind plus structured
// fields, thrown as the c10 error Python users expect with a JSON payload line
// that cublas_guard_ext.errors turns into the typed exception. The lowest
// layer of the tree after core/: it includes nothing but the tensor API.
#pragma once

#include "core/tensor_api.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace cublas_guard {

// ---------------------------------------------------------------------------
// Error reports. A report is a kind plus key/value fields; it is thrown as the
// c10 error type Python users expect (ValueError, TypeError, RuntimeError,
// OutOfMemoryError) with a one-line summary followed by a JSON payload line.
// cublas_guard_ext.errors parses the payload into a typed exception and is the
// one place where the full, user-facing message is written.
// ---------------------------------------------------------------------------
constexpr const char* kPayloadMarker = "[cublas_guard_ext payload] ";

class ErrorReport {
 public:
  explicit ErrorReport(std::string kind);

  ErrorReport& add(const char* key, int64_t value);
  ErrorReport& add(const char* key, int value) { return add(key, static_cast<int64_t>(value)); }
  ErrorReport& add(const char* key, double value);
  ErrorReport& add(const char* key, bool value);
  ErrorReport& add(const char* key, const std::string& value);
  ErrorReport& add(const char* key, const char* value) { return add(key, std::string(value)); }
  ErrorReport& add(const char* key, const std::vector<int64_t>& values);
#ifndef CUBLAS_GUARD_STABLE
  ErrorReport& add(const char* key, c10::IntArrayRef values) { return add(key, values.vec()); }
  // Sizes of a tensor being traced with symbolic shapes (torch.compile, torch.export)
  // are SymInts; a report states their concrete value (guarding on it: it raises anyway).
  ErrorReport& add(const char* key, const c10::SymInt& value);
  ErrorReport& add(const char* key, c10::SymIntArrayRef values);
#endif
  // A tensor handed to the Python error constructor with the payload, never
  // serialized into it (the failure capsule's GEMM buffers: report/call_scope.h).
  ErrorReport& attach(const char* name, const Tensor& tensor);
  const std::vector<std::pair<std::string, Tensor>>& attached() const { return attached_; }

  std::string json() const;
  std::string message(const std::string& summary) const;

  [[noreturn]] void raise_value_error(const std::string& summary) const;
  [[noreturn]] void raise_type_error(const std::string& summary) const;
  [[noreturn]] void raise_runtime_error(const std::string& summary) const;
  [[noreturn]] void raise_out_of_memory(const std::string& summary) const;

 private:
  std::string kind_;
  std::vector<std::pair<std::string, std::string>> fields_;  // value already JSON-encoded
  std::vector<std::pair<std::string, Tensor>> attached_;
};

// When Python is running: throws the typed Python exception for `message`
// (locked/report/python_errors.cpp), handing it the report's attached tensors and the
// operands of this thread's guarded call (report/call_scope.h); otherwise
// returns and the caller throws the c10 error.
void throw_python_error_if_possible(const std::string& message, const ErrorReport* report = nullptr);

// Device memory at some moment (-1 = unknown), and the fields it adds to a report.
struct MemoryFacts {
  int64_t free_bytes = -1, total_bytes = -1;
  int64_t torch_allocated = -1, torch_reserved = -1;  // torch's caching allocator
  int64_t workspace_bytes = -1;                       // cuBLAS workspace torch attaches
};
void add_memory_fields(ErrorReport& report, const MemoryFacts& memory);

// Fields every report about a tensor carries: its shape, strides, dtype, device.
void describe_tensor(ErrorReport& report, const char* prefix, const Tensor& t);

}  // namespace cublas_guard
