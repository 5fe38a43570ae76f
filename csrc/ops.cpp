// Every public op schema (torch.ops.cublas_guard) and the device-independent
// ops, in both builds of the core (core/tensor_api.h). The Meta kernels that
// torch.compile / FakeTensor use are the locked library's (locked/ops_meta.cpp: they
// need SymInts); the stable core's are Python's (register_fake in
// cublas_guard_ext/_native/core_twins/stable_core.py and stable_core_grouped.py, which
// call argument_rules below for the rules). The test
// hooks have their own namespace (testing.cpp), the package's private entry
// points theirs (cublas_guard_internal, defined where they are implemented),
// so what a user sees under torch.ops.cublas_guard is the product only.
#include "core/registration.h"
#include "linear/linear_op.h"
#include "moe/grouped_op.h"

#include <string>

namespace cublas_guard {
namespace {

void async_check_op(bool synchronize) { raise_if_async_recorded(synchronize); }

// The argument rules of an op, alone: what the locked library's Meta kernels run
// (locked/ops_meta.cpp). The stable core's fake kernels are Python's (_native/core_twins/stable_core.py)
// and call this for the rules, whenever the sizes are concrete, so a traced call
// or one on meta tensors refuses the same inputs with the same errors.
void argument_rules_op(StringArg op, const Tensor& a, const Tensor& b, const std::optional<Tensor>& bias,
                       StringArg layer_arg, int64_t mode) {
  const std::string which(op), layer(layer_arg);
  if (which == "linear") {
    parse_mode(mode);
    check_linear_args(a, b, bias, layer);
  } else if (which == "linear_grad_input") {
    check_grad_args(a, b, sym_size_at(b, 0), "weight", layer);
  } else if (which == "linear_grad_weight") {
    check_grad_args(a, b, sym_size_at(a, -1), "input", layer);
  } else if (which == "scan") {
    check_scannable(a);
  } else if (which == "check_features") {
    check_input(a, mode, layer);  // `mode` carries in_features here
  } else {
    throw_value_error("cublas_guard_ext: argument_rules: unknown op '" + which + "'");
  }
}

std::string build_info_op() { return build_info_json(); }

std::string (*&cuda_build_info_provider())() {
  static std::string (*provider)() = nullptr;
  return provider;
}

#define CUBLAS_GUARD_STRINGIFY2(...) #__VA_ARGS__
#define CUBLAS_GUARD_STRINGIFY(...) CUBLAS_GUARD_STRINGIFY2(__VA_ARGS__)

// The grouped linear's rules alone (moe/grouped_checks.cpp), as argument_rules_op.
void grouped_argument_rules_op(StringArg op, const Tensor& a, const Tensor& b,
                               const std::optional<Tensor>& bias, const Tensor& offs, StringArg layer,
                               StringArg parameter, int64_t mode, bool transposed) {
  const GroupedNames names{std::string(layer), std::string(parameter)};
  const std::string which(op);
  if (which == "grouped_linear") {
    parse_mode(mode);
    check_grouped_args(a, b, bias, offs, transposed, names);
  } else if (which == "grouped_linear_grad_input") {
    if (b.dim() != 3) raise_shape(b, "weight", "[experts, ., .]", names.label());
    check_grouped_grad_args(a, b, "weight", sym_size_at(b, transposed ? 2 : 1), offs, names);
  } else if (which == "grouped_linear_grad_weight") {
    check_grouped_grad_args(a, b, "input", sym_size_at(a, -1), offs, names);
  } else {
    throw_value_error("cublas_guard_ext: grouped_argument_rules: unknown op '" + which + "'");
  }
}

}  // namespace

void set_cuda_build_info(std::string (*provider)()) { cuda_build_info_provider() = provider; }

std::string build_info_json() {
  std::string out = "{\"built_with_torch\": \"";
#if defined(CUBLAS_GUARD_STABLE)
  // The stable core is built for every torch from its floor on, not for one.
  out += "stable ABI\", \"library\": \"stable core\", \"stable_abi_floor\": \"";
  out +=
      std::to_string(TORCH_TARGET_VERSION >> 56) + "." + std::to_string((TORCH_TARGET_VERSION >> 48) & 0xff);
#elif defined(CUBLAS_GUARD_TORCH_VERSION)
  out += CUBLAS_GUARD_STRINGIFY(CUBLAS_GUARD_TORCH_VERSION);
  out += "\", \"library\": \"locked";
#else
  out += "unknown";
#endif
  out += "\", \"cuda_compiled\": ";
  const auto provider = cuda_build_info_provider();
  out += provider != nullptr ? "true, " + provider() : std::string("false");
  return out + "}";
}

}  // namespace cublas_guard

CG_LIBRARY(cublas_guard, m) {
  m.def("scan(Tensor x) -> Tensor");
  m.def(
      "linear(Tensor x, Tensor weight, Tensor? bias, str layer=\"\", int mode=1, "
      "bool scan_grad=False) -> Tensor");
  m.def("linear_grad_input(Tensor grad_output, Tensor weight, str layer=\"\") -> Tensor");
  m.def("linear_grad_weight(Tensor grad_output, Tensor x, str layer=\"\") -> Tensor");
  m.def("check_features(Tensor x, int in_features, str layer=\"\") -> ()");
  // A mixture of experts' expert GEMMs (moe/grouped_op.h): rows of x sorted by
  // expert, offs their int32 cumulative group ends (torch's grouped_mm's offs).
  m.def(
      "grouped_linear(Tensor x, Tensor weight, Tensor? bias, Tensor offs, str layer=\"\", "
      "str parameter=\"\", int mode=1, bool transposed=False) -> Tensor");
  m.def(
      "grouped_linear_grad_input(Tensor grad_output, Tensor weight, Tensor offs, str layer=\"\", "
      "str parameter=\"\", bool transposed=False) -> Tensor");
  m.def(
      "grouped_linear_grad_weight(Tensor grad_output, Tensor x, Tensor offs, str layer=\"\", "
      "str parameter=\"\", bool transposed=False) -> Tensor");
  m.def("guard_values(Tensor t, str layer, int role, int mode) -> ()");
  m.def("async_check(bool synchronize=True) -> ()");
  m.def("build_info() -> str");
}

CG_LIBRARY_FRAGMENT(cublas_guard_internal, m) {
  m.def("argument_rules(str op, Tensor a, Tensor b, Tensor? bias, str layer, int mode) -> ()");
  m.def(
      "grouped_argument_rules(str op, Tensor a, Tensor b, Tensor? bias, Tensor offs, str layer, "
      "str parameter, int mode, bool transposed) -> ()");
}
CG_LIBRARY_IMPL(cublas_guard_internal, CompositeExplicitAutograd, m) {
  CG_IMPL(m, "argument_rules", &cublas_guard::argument_rules_op);
  CG_IMPL(m, "grouped_argument_rules", &cublas_guard::grouped_argument_rules_op);
}

CG_LIBRARY_IMPL(cublas_guard, CompositeExplicitAutograd, m) {
  using namespace cublas_guard;
  CG_IMPL(m, "async_check", &async_check_op);
  CG_IMPL(m, "build_info", &build_info_op);
}
