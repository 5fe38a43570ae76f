// Error reports: structured fields -> the JSON payload line Python parses,
// with the fields of the thread's report place (report/report_place.h).
#include "report/error_report.h"
#include "report/report_place.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>

namespace cublas_guard {

namespace {

std::string json_string(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (unsigned char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (ch < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out.push_back(static_cast<char>(ch));
        }
    }
  }
  out.push_back('"');
  return out;
}

thread_local const ReportPlace* tls_place = nullptr;

}  // namespace

const ReportPlace* current_report_place() { return tls_place; }

ReportPlaceScope::ReportPlaceScope(const ReportPlace* place) : outer_(tls_place) { tls_place = place; }

ReportPlaceScope::~ReportPlaceScope() { tls_place = outer_; }

ErrorReport::ErrorReport(std::string kind) : kind_(std::move(kind)) {}

ErrorReport& ErrorReport::add(const char* key, int64_t value) {
  fields_.emplace_back(key, std::to_string(value));
  return *this;
}

ErrorReport& ErrorReport::add(const char* key, double value) {
  if (!std::isfinite(value)) {
    fields_.emplace_back(key, json_string(std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf")));
    return *this;
  }
  std::ostringstream os;
  os.precision(17);
  os << value;
  fields_.emplace_back(key, os.str());
  return *this;
}

ErrorReport& ErrorReport::add(const char* key, bool value) {
  fields_.emplace_back(key, value ? "true" : "false");
  return *this;
}

ErrorReport& ErrorReport::add(const char* key, const std::string& value) {
  fields_.emplace_back(key, json_string(value));
  return *this;
}

ErrorReport& ErrorReport::add(const char* key, const std::vector<int64_t>& values) {
  std::string list = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    if (i) list += ", ";
    list += std::to_string(values[i]);
  }
  list += "]";
  fields_.emplace_back(key, list);
  return *this;
}

#ifndef CUBLAS_GUARD_STABLE
ErrorReport& ErrorReport::add(const char* key, const c10::SymInt& value) {
  return add(key, value.guard_int(__FILE__, __LINE__));
}

ErrorReport& ErrorReport::add(const char* key, c10::SymIntArrayRef values) {
  std::vector<int64_t> concrete;
  concrete.reserve(values.size());
  for (const c10::SymInt& v : values) concrete.push_back(v.guard_int(__FILE__, __LINE__));
  return add(key, concrete);
}
#endif

ErrorReport& ErrorReport::attach(const char* name, const Tensor& tensor) {
  attached_.emplace_back(name, tensor);
  return *this;
}

std::string ErrorReport::json() const {
  std::string out = "{\"kind\": " + json_string(kind_);
  for (const auto& field : fields_) {
    out += ", " + json_string(field.first) + ": " + field.second;
  }
  // Raised inside one expert of a grouped call: where (unless the report says it itself).
  if (const ReportPlace* place = current_report_place()) {
    ErrorReport where(kind_);
    if (place->module != nullptr) where.add("experts_module", *place->module);
    if (place->parameter != nullptr) where.add("parameter", *place->parameter);
    if (place->expert >= 0) {
      where.add("expert", place->expert);
      where.add("expert_rows", std::vector<int64_t>{place->first_row, place->end_row});
    }
    for (const auto& field : where.fields_) {
      const bool present = std::any_of(fields_.begin(), fields_.end(),
                                       [&](const auto& own) { return own.first == field.first; });
      if (!present) out += ", " + json_string(field.first) + ": " + field.second;
    }
  }
  out += "}";
  return out;
}

std::string ErrorReport::message(const std::string& summary) const {
  return "cublas_guard_ext: " + summary + "\n" + kPayloadMarker + json();
}

void add_memory_fields(ErrorReport& report, const MemoryFacts& m) {
  const std::pair<const char*, int64_t> fields[] = {{"free_bytes", m.free_bytes},
                                                    {"total_bytes", m.total_bytes},
                                                    {"torch_allocated_bytes", m.torch_allocated},
                                                    {"torch_reserved_bytes", m.torch_reserved},
                                                    {"workspace_bytes", m.workspace_bytes}};
  for (const auto& f : fields) {
    if (f.second >= 0) report.add(f.first, f.second);
  }
}

void describe_tensor(ErrorReport& report, const char* prefix, const Tensor& t) {
  const std::string p(prefix);
#ifdef CUBLAS_GUARD_STABLE
  report.add((p + "_shape").c_str(), sizes_of(t));
  report.add((p + "_strides").c_str(), strides_of(t));
#else
  report.add((p + "_shape").c_str(), t.sym_sizes());
  report.add((p + "_strides").c_str(), t.sym_strides());
#endif
  report.add((p + "_dtype").c_str(), dtype_name(t.scalar_type()));
  report.add((p + "_device").c_str(), device_str(t));
}

}  // namespace cublas_guard
