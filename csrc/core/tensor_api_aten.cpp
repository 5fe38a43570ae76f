// tensor_api.h in the version-locked library: ATen, unboxed (the same calls
// the core made before it had a stable build).
#ifndef CUBLAS_GUARD_STABLE
#include "core/tensor_api.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

namespace cublas_guard {

void throw_value_error(const std::string& message) { C10_THROW_ERROR(ValueError, message); }
void throw_type_error(const std::string& message) { C10_THROW_ERROR(TypeError, message); }
void throw_runtime_error(const std::string& message) { C10_THROW_ERROR(Error, message); }

std::vector<int64_t> sizes_of(const Tensor& t) { return t.sizes().vec(); }
std::vector<int64_t> strides_of(const Tensor& t) { return t.strides().vec(); }
int device_index(const Tensor& t) { return t.is_cpu() ? -1 : t.device().index(); }
std::string device_str(const Tensor& t) { return t.device().str(); }
std::string device_name(const Device& d) { return d.str(); }
Device cpu_device() { return Device(c10::kCPU); }
bool same_device(const Tensor& a, const Tensor& b) { return a.device() == b.device(); }
std::string dtype_name(ScalarType t) { return c10::toString(t); }

SymSize sym_size_at(const Tensor& t, int64_t dim) { return t.sym_size(dim); }
std::string sym_str(const SymSize& s) { return c10::str(s); }
std::string sizes_str(const Tensor& t) { return c10::str(t.sym_sizes()); }
std::string list_str(const std::vector<int64_t>& v) { return c10::str(c10::IntArrayRef(v)); }

Tensor empty(const std::vector<int64_t>& sizes, ScalarType dtype, const Tensor& device_like) {
  return at::empty(sizes, device_like.options().dtype(dtype));
}
Tensor empty_cpu(const std::vector<int64_t>& sizes, ScalarType dtype) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype));
}
Tensor from_blob(const void* data, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 ScalarType dtype, const Device& device) {
  return at::from_blob(const_cast<void*>(data), sizes, strides,
                       at::TensorOptions().dtype(dtype).device(device));
}
Tensor as_view(const Tensor& t, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
               int64_t extra_offset) {
  return t.as_strided(sizes, strides, t.storage_offset() + extra_offset);
}
Tensor transposed_view(const Tensor& t) { return t.t(); }
Tensor row(const Tensor& t, int64_t i) { return t[i]; }
Tensor first_rows(const Tensor& t, int64_t begin, int64_t count) { return t.narrow(0, begin, count); }
Tensor reshaped(const Tensor& t, const std::vector<int64_t>& sizes) { return t.reshape(sizes); }
Tensor as_contiguous(const Tensor& t) { return t.contiguous(); }
Tensor to_cpu(const Tensor& t) { return t.cpu(); }
void copy_into(Tensor& dst, const Tensor& src) { dst.copy_(src); }
void zero(Tensor& t) { t.zero_(); }
void add_into(Tensor& t, const Tensor& other) { t.add_(other); }
void addmm_cpu(Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha) {
  c.addmm_(a, b, beta, alpha);
}
bool out_of_memory_detail(const std::exception& e, std::string& detail) {
  const auto* oom = dynamic_cast<const c10::OutOfMemoryError*>(&e);
  if (oom == nullptr) return false;
  detail = oom->what_without_backtrace();
  detail = detail.substr(0, detail.find('\n'));
  return true;
}
double element_as_double(const Tensor& t, int64_t flat_index) {
  return t.reshape({-1})[flat_index].item<double>();
}

}  // namespace cublas_guard
#endif  // !CUBLAS_GUARD_STABLE
