// tensor_api.h in the stable core: LibTorch's stable C ABI only. Allocation
// and views go through the AOTI shims (direct calls); what they lack goes
// through the boxed dispatcher (the stable headers' ops), which costs a few
// microseconds a call and is kept off the clean path where it can be.
#ifdef CUBLAS_GUARD_STABLE
#include "core/tensor_api.h"

#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <sstream>

namespace cublas_guard {

void throw_value_error(const std::string& message) { throw std::runtime_error(kValueErrorTag + message); }
void throw_type_error(const std::string& message) { throw std::runtime_error(kTypeErrorTag + message); }
void throw_runtime_error(const std::string& message) { throw std::runtime_error(message); }

std::vector<int64_t> sizes_of(const Tensor& t) {
  const auto s = t.sizes();
  return std::vector<int64_t>(s.begin(), s.end());
}
std::vector<int64_t> strides_of(const Tensor& t) {
  const auto s = t.strides();
  return std::vector<int64_t>(s.begin(), s.end());
}
int device_index(const Tensor& t) { return t.is_cpu() ? -1 : static_cast<int>(t.get_device_index()); }
std::string device_str(const Tensor& t) { return device_name(t.device()); }
std::string device_name(const Device& d) {
  // As torch prints a device: the type's lower-case name, then ":index" when it has one.
  std::string type = "device";
  switch (d.type()) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::Meta: return "meta";
    case DeviceType::CUDA: type = "cuda"; break;
    case DeviceType::XPU: type = "xpu"; break;
    case DeviceType::MPS: type = "mps"; break;
    case DeviceType::PrivateUse1: type = "privateuseone"; break;
    default: break;
  }
  return d.has_index() ? type + ":" + std::to_string(d.index()) : type;
}
Device cpu_device() { return Device(DeviceType::CPU); }
bool same_device(const Tensor& a, const Tensor& b) {
  return a.is_cpu() == b.is_cpu() && a.is_cuda() == b.is_cuda() && device_index(a) == device_index(b);
}
std::string dtype_name(ScalarType t) { return c10::toString(t); }

SymSize sym_size_at(const Tensor& t, int64_t dim) { return size_at(t, dim); }
std::string sym_str(const SymSize& s) { return std::to_string(s); }
std::string list_str(const std::vector<int64_t>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}
std::string sizes_str(const Tensor& t) { return list_str(sizes_of(t)); }

namespace {

int32_t device_type_code(const Tensor& t) {
  int32_t type = 0;
  CG_SHIM(aoti_torch_get_device_type(t.get(), &type));
  return type;
}

std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d) {
    strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  }
  return strides;
}

Tensor empty_on(const std::vector<int64_t>& sizes, ScalarType dtype, int32_t device_type, int32_t index) {
  const std::vector<int64_t> strides = contiguous_strides(sizes);
  AtenTensorHandle out = nullptr;
  CG_SHIM(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(),
                                   static_cast<int32_t>(dtype), device_type, index, &out));
  return Tensor(out);
}

// Whether `sizes` can view `t` (contiguous in its logical order) without a copy.
bool viewable_as_contiguous(const Tensor& t) { return t.is_contiguous(); }

}  // namespace

Tensor empty(const std::vector<int64_t>& sizes, ScalarType dtype, const Tensor& device_like) {
  return empty_on(sizes, dtype, device_type_code(device_like), std::max(device_index(device_like), 0));
}
Tensor empty_cpu(const std::vector<int64_t>& sizes, ScalarType dtype) {
  return empty_on(sizes, dtype, aoti_torch_device_type_cpu(), 0);
}
Tensor from_blob(const void* data, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 ScalarType dtype, const Device& device) {
  AtenTensorHandle out = nullptr;
  // The shims' device type codes are c10::DeviceType's values.
  CG_SHIM(aoti_torch_create_tensor_from_blob(const_cast<void*>(data), static_cast<int64_t>(sizes.size()),
                                             sizes.data(), strides.data(), 0, static_cast<int32_t>(dtype),
                                             static_cast<int32_t>(device.type()),
                                             device.has_index() ? device.index() : 0, &out));
  return Tensor(out);
}
Tensor as_view(const Tensor& t, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
               int64_t extra_offset) {
  AtenTensorHandle out = nullptr;
  // The shim's last argument is added to t's own storage offset (inductor's
  // _reinterpret_tensor takes an offset increment, whatever the header calls it).
  CG_SHIM(aoti_torch__reinterpret_tensor(t.get(), static_cast<int64_t>(sizes.size()), sizes.data(),
                                         strides.data(), extra_offset, &out));
  return Tensor(out);
}
Tensor transposed_view(const Tensor& t) {
  return as_view(t, {t.size(1), t.size(0)}, {t.stride(1), t.stride(0)});
}
Tensor row(const Tensor& t, int64_t i) {
  std::vector<int64_t> sizes = sizes_of(t), strides = strides_of(t);
  sizes.erase(sizes.begin());
  strides.erase(strides.begin());
  return as_view(t, sizes, strides, i * t.stride(0));
}
Tensor first_rows(const Tensor& t, int64_t begin, int64_t count) {
  std::vector<int64_t> sizes = sizes_of(t);
  sizes[0] = count;
  return as_view(t, sizes, strides_of(t), begin * t.stride(0));
}
Tensor reshaped(const Tensor& t, const std::vector<int64_t>& sizes) {
  if (viewable_as_contiguous(t)) return as_view(t, sizes, contiguous_strides(sizes));
  return torch::stable::reshape(t, sizes);  // the dispatcher decides view or copy
}
Tensor as_contiguous(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }
Tensor to_cpu(const Tensor& t) {
  if (t.is_cpu()) return t;
  Tensor out = empty_cpu(sizes_of(t), t.scalar_type());
  CG_SHIM(aoti_torch_copy_(out.get(), t.get(), 0));
  return out;
}
void copy_into(Tensor& dst, const Tensor& src) { CG_SHIM(aoti_torch_copy_(dst.get(), src.get(), 0)); }
void zero(Tensor& t) { CG_SHIM(aoti_torch_zero_(t.get())); }
// t - (-1) * other: the negation is exact and so is x - (-y) == x + y, bit for bit as add_.
void add_into(Tensor& t, const Tensor& other) { copy_into(t, torch::stable::subtract(t, other, -1.0)); }
void addmm_cpu(Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha) {
  CG_SHIM(aoti_torch_cpu_addmm_out(c.get(), c.get(), a.get(), b.get(), beta, alpha));
}
bool out_of_memory_detail(const std::exception& e, std::string& detail) {
  // Only the message crosses the stable ABI: torch's allocators say "out of memory".
  const std::string what = e.what();
  if (what.find("out of memory") == std::string::npos) return false;
  detail = what.substr(0, what.find('\n'));
  return true;
}
double element_as_double(const Tensor& t, int64_t flat_index) {
  Tensor one = to_cpu(as_contiguous(t));
  const int64_t i = flat_index;
  switch (t.scalar_type()) {
    case ScalarType::Double: return data_as<double>(one)[i];
    case ScalarType::Half: return static_cast<float>(data_as<c10::Half>(one)[i]);
    case ScalarType::BFloat16: return static_cast<float>(data_as<c10::BFloat16>(one)[i]);
    case ScalarType::Long: return static_cast<double>(data_as<int64_t>(one)[i]);
    default: return data_as<float>(one)[i];
  }
}

}  // namespace cublas_guard
#endif  // CUBLAS_GUARD_STABLE
