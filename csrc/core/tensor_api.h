// The one spelling of every tensor operation the core uses, in two builds.
//
// The core (the guarded linear op and its GEMMs, the fused scan, the argument
// rules, the error payloads) is compiled twice from the same sources:
//   * into the stable core, `cublas_guard_ext._core` (CUBLAS_GUARD_STABLE
//     defined): only LibTorch's stable C ABI (torch/csrc/stable, the AOTI
//     shims), so one binary loads beside every torch from its floor on;
//   * into the version-locked library, `cublas_guard_ext._C`: ATen itself,
//     unboxed and with SymInts, which also carries what the stable ABI has no
//     word for (C++ autograd and autocast, the fast eager entry, watch).
// At run time exactly one of them registers the ops (cublas_guard_ext/_native/
// loader.py): the locked library where it was built for the running torch,
// the core everywhere else. So a rule is written once and both paths run it.
//
// What the two builds do differently is written here and in the few files
// named *_stable.cpp / *_aten.cpp; everything else uses this header's names.
// Views and allocation use the AOTI shims directly where the stable headers
// would go through the boxed dispatcher: they are on every guarded call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#ifdef CUBLAS_GUARD_STABLE
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <stdexcept>
#else
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#endif

namespace cublas_guard {

using ScalarType = c10::ScalarType;  // one enum in both builds (torch/headeronly)
constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kByte = ScalarType::Byte;

#ifdef CUBLAS_GUARD_STABLE
using Tensor = torch::stable::Tensor;
using Device = torch::stable::Device;
using DeviceType = torch::headeronly::DeviceType;
// A size that may be symbolic under torch.compile. The stable ABI has no
// symbolic sizes: the core's fake kernels are Python's (register_fake in
// cublas_guard_ext/_native/core_twins/stable_core.py and stable_core_grouped.py).
using SymSize = int64_t;
using StringArg = std::string;  // how an op's `str` argument arrives
using IntList = std::vector<int64_t>;

// The AOTI shims report failures as codes; the stable headers' own check
// turns them into std::runtime_error with torch's message.
#define CG_SHIM(call) STABLE_TORCH_ERROR_CODE_CHECK(call)
#else
using Tensor = at::Tensor;
using Device = c10::Device;
using DeviceType = c10::DeviceType;
using SymSize = c10::SymInt;
using StringArg = c10::string_view;
using IntList = c10::IntArrayRef;
#endif

// ---------------------------------------------------------------------------
// Errors that carry no report (an op's misuse, not a guarded call's finding):
// the built-in class users catch. The stable core can only throw
// std::runtime_error across the ABI; it prefixes the class, and Python's
// translation (errors/parse.py) raises that class with the rest of the message.
// ---------------------------------------------------------------------------
constexpr const char* kValueErrorTag = "[ValueError] ";
constexpr const char* kTypeErrorTag = "[TypeError] ";

[[noreturn]] void throw_value_error(const std::string& message);
[[noreturn]] void throw_type_error(const std::string& message);
[[noreturn]] void throw_runtime_error(const std::string& message);

// ---------------------------------------------------------------------------
// Reading a tensor.
// ---------------------------------------------------------------------------
inline int64_t size_at(const Tensor& t, int64_t dim) { return t.size(dim < 0 ? dim + t.dim() : dim); }
inline int64_t stride_at(const Tensor& t, int64_t dim) { return t.stride(dim < 0 ? dim + t.dim() : dim); }
std::vector<int64_t> sizes_of(const Tensor& t);
std::vector<int64_t> strides_of(const Tensor& t);
inline bool is_cpu(const Tensor& t) { return t.is_cpu(); }
inline bool is_cuda(const Tensor& t) { return t.is_cuda(); }
int device_index(const Tensor& t);  // -1 on the CPU
std::string device_str(const Tensor& t);  // "cpu", "cuda:0", as torch prints it
std::string device_name(const Device& d);
Device cpu_device();
bool same_device(const Tensor& a, const Tensor& b);
std::string dtype_name(ScalarType t);  // "Float", "BFloat16": c10::toString's names
template <typename T>
inline T* data_as(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Sizes as the op's Meta kernels see them (SymInts in the locked build).
SymSize sym_size_at(const Tensor& t, int64_t dim);
std::string sym_str(const SymSize& s);
std::string sizes_str(const Tensor& t);  // "[2, 3]"
std::string list_str(const std::vector<int64_t>& v);
// A tensor's sizes as a report states them (a traced SymInt's concrete value).
#ifdef CUBLAS_GUARD_STABLE
inline std::vector<int64_t> report_sizes(const Tensor& t) { return sizes_of(t); }
#else
inline c10::SymIntArrayRef report_sizes(const Tensor& t) { return t.sym_sizes(); }
#endif

// ---------------------------------------------------------------------------
// Making tensors (contiguous unless strides are given).
// ---------------------------------------------------------------------------
Tensor empty(const std::vector<int64_t>& sizes, ScalarType dtype, const Tensor& device_like);
Tensor empty_cpu(const std::vector<int64_t>& sizes, ScalarType dtype);
// A tensor over memory someone else owns (no deleter), on `device`.
Tensor from_blob(const void* data, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
                 ScalarType dtype, const Device& device);
// A view of `t`'s storage with other sizes/strides (offset in elements, from t's own).
Tensor as_view(const Tensor& t, const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides,
               int64_t extra_offset = 0);
Tensor transposed_view(const Tensor& t);          // t() of a 2-D tensor, a view
Tensor row(const Tensor& t, int64_t i);      // t[i], a view
Tensor first_rows(const Tensor& t, int64_t begin, int64_t count);  // t[begin:begin+count], a view
Tensor reshaped(const Tensor& t, const std::vector<int64_t>& sizes);  // a view when strides allow
Tensor as_contiguous(const Tensor& t);
Tensor to_cpu(const Tensor& t);
void copy_into(Tensor& dst, const Tensor& src);  // broadcasts src, as Tensor::copy_
void zero(Tensor& t);
void add_into(Tensor& t, const Tensor& other);  // t += other (broadcast), in place
// c = beta * c + alpha * a @ b, torch's CPU addmm (MKL/OpenBLAS/oneDNN).
void addmm_cpu(Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha);
// Whether `e` is torch's allocator running out of memory; if so, its first line.
bool out_of_memory_detail(const std::exception& e, std::string& detail);
// One element of `t` (flat, row-major logical index) as double: an error path's copy.
double element_as_double(const Tensor& t, int64_t flat_index);

}  // namespace cublas_guard

// ---------------------------------------------------------------------------
// Checks with a message built from its parts (as TORCH_CHECK's), raising the
// built-in class users catch (see throw_value_error).
// ---------------------------------------------------------------------------
#include <sstream>

namespace cublas_guard {
namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
inline void append(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  append(os, rest...);
}
}  // namespace detail
template <typename... Parts>
inline std::string cat(const Parts&... parts) {
  std::ostringstream os;
  detail::append(os, parts...);
  return os.str();
}
}  // namespace cublas_guard

#define CG_CHECK_VALUE(cond, ...)                                                     \
  do {                                                                                \
    if (!(cond)) ::cublas_guard::throw_value_error(::cublas_guard::cat(__VA_ARGS__)); \
  } while (0)
#define CG_CHECK_TYPE(cond, ...)                                                     \
  do {                                                                               \
    if (!(cond)) ::cublas_guard::throw_type_error(::cublas_guard::cat(__VA_ARGS__)); \
  } while (0)
#define CG_CHECK(cond, ...)                                                             \
  do {                                                                                  \
    if (!(cond)) ::cublas_guard::throw_runtime_error(::cublas_guard::cat(__VA_ARGS__)); \
  } while (0)
