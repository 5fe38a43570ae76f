// Op traits for watch: what each operator writes, which of its outputs may
// hold new values, whether it is composite, and which outputs are finite by
// construction (so their scan can be skipped). Computed once per operator
// (per thread) from its schema and its kernels; see watch.h for the whole design.
#include "watch/watch.h"

#include <cmath>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

namespace cublas_guard {
namespace watch {

namespace {
thread_local std::unordered_map<const void*, OpInfo> tls_op_info;
}  // namespace

bool starts_with(const std::string& s, const char* prefix) { return s.rfind(prefix, 0) == 0; }

// The explicit lists behind Values (aten ops only; tests/test_watch.py plants
// a non-finite input through each kMoves/kZeroOne op and overflows through
// the arithmetic ones). Whole names cover every overload; an op whose
// overloads differ (scatter's reduce=, index_put's accumulate=) is not listed.
Values value_class(const std::string& base, const std::string& overload) {
  static const std::unordered_map<std::string, Values> by_name = [] {
    std::unordered_map<std::string, Values> m;
    for (const char* n : {
             // copies and layout changes
             "clone",
             "copy_",
             "_to_copy",
             "_unsafe_view",
             "lift_fresh_copy",
             "contiguous",
             "expand_copy",
             "permute_copy",
             "transpose_copy",
             "t_copy",
             "squeeze_copy",
             "unsqueeze_copy",
             "slice_copy",
             "select_copy",
             "diagonal_copy",
             "as_strided_copy",
             "alias_copy",
             "detach_copy",
             "view_copy",
             "_reshape_copy",
             "narrow_copy",
             "unfold_copy",
             "repeat",
             "roll",
             "flip",
             // gathering and joining
             "cat",
             "stack",
             "index_select",
             "gather",
             "take",
             "embedding",
             "masked_select",
             "masked_scatter",
             "masked_scatter_",
             // scattering into zeros, zeroing parts
             "slice_backward",
             "select_backward",
             "diagonal_backward",
             "tril",
             "triu",
             "tril_",
             "triu_",
             "constant_pad_nd",
             // choosing between inputs and scalars
             "where",
             "masked_fill",
             "masked_fill_",
             "relu",
             "relu_",
             "clamp",
             "clamp_",
             "clamp_min",
             "clamp_min_",
             "clamp_max",
             "clamp_max_",
             // sign changes
             "neg",
             "neg_",
             "abs",
             "abs_",
             // filling with a scalar
             "fill_",
             "zero_",
             "zeros",
             "zeros_like",
             "ones",
             "ones_like",
             "full",
             "full_like",
             "new_zeros",
             "new_ones",
             "new_full",
             "scalar_tensor",
         }) {
      m.emplace(n, Values::kMoves);
    }
    m.emplace("bernoulli", Values::kZeroOne);
    m.emplace("bernoulli_", Values::kZeroOne);
    for (const char* n : {"mul", "mul_", "div", "div_"}) m.emplace(n, Values::kScaleDown);
    for (const char* n : {"add", "add_", "sub", "sub_"}) m.emplace(n, Values::kAddSmall);
    return m;
  }();
  if (base == "index") return overload == "Tensor" ? Values::kMoves : Values::kComputed;  // a gather
  const auto it = by_name.find(base);
  if (it == by_name.end()) return Values::kComputed;
  if (it->second == Values::kScaleDown || it->second == Values::kAddSmall) {
    // Tensor/Scalar overloads only (not div's rounding modes, not out=)
    if (overload != "Tensor" && overload != "Scalar") return Values::kComputed;
  }
  return it->second;
}

// The ops watch_bounds.cpp bounds (their functional and in-place forms; not out=).
Rule bounds_rule(const std::string& base, const std::string& overload) {
  const bool tensor_or_scalar = overload == "Tensor" || overload == "Scalar";
  if ((base == "mul" || base == "mul_") && tensor_or_scalar) return Rule::kScale;
  if ((base == "div" || base == "div_") && tensor_or_scalar) return Rule::kDivide;
  if ((base == "add" || base == "add_") && tensor_or_scalar) return Rule::kAdd;
  if ((base == "sub" || base == "sub_") && tensor_or_scalar) return Rule::kSubtract;
  if ((base == "lerp" || base == "lerp_") && overload == "Scalar") return Rule::kLerp;
  if ((base == "addcmul" || base == "addcmul_") && overload.empty()) return Rule::kAddcmul;
  if ((base == "addcdiv" || base == "addcdiv_") && overload.empty()) return Rule::kAddcdiv;
  if ((base == "sqrt" || base == "sqrt_") && overload.empty()) return Rule::kSqrt;
  return Rule::kNone;
}

const OpInfo& op_info(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  auto it = tls_op_info.find(key);
  if (it != tls_op_info.end()) return it->second;
  const c10::FunctionSchema& schema = op.schema();
  OpInfo info;
  const std::string& name = schema.name();
  const auto sep = name.find("::");
  const std::string base = sep == std::string::npos ? name : name.substr(sep + 2);
  info.skip = starts_with(base, "empty") || starts_with(base, "new_empty") || starts_with(base, "_empty") ||
              starts_with(base, "resize") || starts_with(base, "_resize") || base == "set_" ||
              base == "_local_scalar_dense";
  info.num_args = schema.arguments().size();
  info.is_out_arg.resize(info.num_args, 0);
  // In-place ops whose result does not depend on the old values: the written
  // argument is an output only (like out=), never pre-scanned.
  const bool overwrites = base == "fill_" || base == "zero_" || base == "copy_" || base == "normal_" ||
                          base == "uniform_" || base == "random_" || base == "bernoulli_" ||
                          base == "exponential_";
  for (size_t i = 0; i < info.num_args; ++i) {
    const auto& arg = schema.arguments()[i];
    const c10::AliasInfo* alias = arg.alias_info();
    if (alias != nullptr && alias->isWrite()) info.written_args.push_back(static_cast<int>(i));
    if (arg.is_out() || (overwrites && alias != nullptr && alias->isWrite())) {
      info.is_out_arg[i] = 1;
    } else if (alias != nullptr && alias->isWrite()) {
      info.inplace_args.push_back(static_cast<int>(i));
    }
  }
  for (const auto& ret : schema.returns()) {
    const c10::AliasInfo* alias = ret.alias_info();
    info.scan_return.push_back(alias == nullptr || alias->isWrite() ? 1 : 0);
  }
  info.scan_written_args = schema.returns().empty() && !info.written_args.empty();
  for (size_t i = 0; i < info.num_args; ++i) {
    c10::TypePtr type = schema.arguments()[i].type();
    if (const auto opt = type->castRaw<c10::OptionalType>()) type = opt->getElementType();
    if (type->kind() == c10::TypeKind::NumberType) info.scalar_args.push_back(static_cast<int>(i));
  }
  // CompositeImplicitAutograd kernels are made of dispatcher calls only (they
  // must be, to be differentiable): their outputs are what inner ops returned.
  // An op with its own backend kernel uses that one instead. aten's Autograd
  // kernels of such ops (linear, matmul: VariableType) only redispatch to the
  // composite kernel; another namespace's Autograd kernel may compute.
  using K = c10::DispatchKey;
  const bool aten = starts_with(name, "aten::");
  info.composite =
      op.hasKernelForDispatchKey(K::CompositeImplicitAutograd) && !op.hasKernelForDispatchKey(K::CPU) &&
      !op.hasKernelForDispatchKey(K::CUDA) &&
      (aten || (!op.hasKernelForDispatchKey(K::Autograd) && !op.hasKernelForDispatchKey(K::AutogradCPU) &&
                !op.hasKernelForDispatchKey(K::AutogradCUDA))) &&
      !op.hasKernelForDispatchKey(K::CompositeExplicitAutograd) &&
      !op.hasKernelForDispatchKey(K::CompositeExplicitAutogradNonFunctional);
  if (aten) info.values = value_class(base, schema.overload_name());
  if (aten) info.rule = bounds_rule(base, schema.overload_name());
  info.divides = starts_with(base, "div");
  return tls_op_info.emplace(key, std::move(info)).first->second;
}

// Tensors whose values this file can read: dense, with storage, not a wrapper

bool scalar_non_finite(const c10::IValue& v) {
  if (v.isDouble()) return !std::isfinite(v.toDouble());
  if (v.isComplexDouble()) {
    const auto z = v.toComplexDouble();
    return !std::isfinite(z.real()) || !std::isfinite(z.imag());
  }
  return false;
}

// Calls fn(tensor) for every tensor in an argument (a tensor, a list of tensors

// ---------------------------------------------------------------------------
// Outputs that are finite by construction (Values). Skipping their scan never
// hides a finding: a kMoves/kZeroOne output can only be non-finite where an
// input is (or never), which makes the op a propagator that is never blamed;
// the arithmetic classes are skipped only when the input is known finite and
// the scalar cannot take a finite value out of range (IEEE rounding is
// monotonic: |round(x * s)| <= |x| for |s| <= 1). What is skipped with finite
// inputs is remembered finite, as a scan would have.
// ---------------------------------------------------------------------------

// The largest finite value of a floating dtype (0: not one this file handles).
double max_finite(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return std::numeric_limits<float>::max();
    case at::kDouble: return std::numeric_limits<double>::max();
    case at::kHalf: return 65504.0;
    case at::kBFloat16: return 3.3895313892515355e38;
    default: return 0.0;
  }
}

// |c| up to which x + c cannot round past the dtype's largest finite value:
// at most a quarter of the gap between it and the next power of two (half
// that gap is where round-to-nearest overflows; fp16/bf16 arithmetic runs in
// float32 and rounds once more, hence the margin).
double add_bound(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return std::ldexp(1.0, 102);
    case at::kDouble: return std::ldexp(1.0, 968);
    case at::kHalf: return 4.0;
    case at::kBFloat16: return std::ldexp(1.0, 118);
    default: return 0.0;
  }
}

// Every value of dtype `from` is a finite value of dtype `to` (no overflow).
bool widens(at::ScalarType from, at::ScalarType to) {
  using S = at::ScalarType;
  if (max_finite(to) == 0.0) return false;
  switch (from) {
    case S::Bool:
    case S::Byte:
    case S::Char:
    case S::Short: return true;  // |v| <= 32767 < 65504
    case S::Int:
    case S::Long: return to != S::Half;
    case S::Half: return true;  // fp16's max is finite in bf16, fp32, fp64
    case S::BFloat16: return to != S::Half;
    case S::Float: return to == S::Float || to == S::Double;
    case S::Double: return to == S::Double;
    default: return false;
  }
}

// A real number from a Scalar argument or a wrapped number (a Python scalar
// passed where a tensor goes: x * 0.5 calls mul.Tensor).
bool real_value(const c10::IValue& v, double& out) {
  if (v.isDouble()) {
    out = v.toDouble();
  } else if (v.isInt()) {
    out = static_cast<double>(v.toInt());
  } else if (v.isBool()) {
    out = v.toBool() ? 1.0 : 0.0;
  } else if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.defined() || !t.unsafeGetTensorImpl()->is_wrapped_number() || !t.device().is_cpu()) {
      return false;
    }
    switch (t.scalar_type()) {
      case at::kDouble: out = *static_cast<const double*>(t.const_data_ptr()); break;
      case at::kLong: out = static_cast<double>(*static_cast<const int64_t*>(t.const_data_ptr())); break;
      case at::kBool: out = *static_cast<const bool*>(t.const_data_ptr()) ? 1.0 : 0.0; break;
      default: return false;
    }
  } else {
    return false;
  }
  return std::isfinite(out);
}

// The value of a one-element CPU tensor (the wrapped numbers that kernels cast
// to the op's dtype: x * 0.5 on float32 copies a float64 0.5 to float32).
bool single_value(const at::Tensor& t, double& out) {
  if (t.numel() != 1 || !t.device().is_cpu() || !t.has_storage() || t.layout() != at::kStrided) {
    return false;
  }
  const void* p = t.const_data_ptr();
  switch (t.scalar_type()) {
    case at::kDouble: out = *static_cast<const double*>(p); return true;
    case at::kFloat: out = *static_cast<const float*>(p); return true;
    case at::kHalf: out = static_cast<float>(*static_cast<const at::Half*>(p)); return true;
    case at::kBFloat16: out = static_cast<float>(*static_cast<const at::BFloat16*>(p)); return true;
    case at::kLong: out = static_cast<double>(*static_cast<const int64_t*>(p)); return true;
    case at::kInt: out = static_cast<double>(*static_cast<const int32_t*>(p)); return true;
    default: return false;
  }
}

// |sqrt(y)| for every finite y of the dtype is at most this (a power of two at
// or above the square root of the largest finite value; 0: not handled).
double root_bound(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
    case at::kBFloat16: return std::ldexp(1.0, 64);
    case at::kDouble: return std::ldexp(1.0, 512);
    case at::kHalf: return 256.0;
    default: return 0.0;
  }
}

// Whether t's values are known finite and are a square root's output, unchanged
// since (the table's entry: same storage range and version, recorded when
// aten::sqrt's or aten::sqrt_'s output was scanned).
bool from_root(Session& s, const at::Tensor& t) {
  const Known* k = lookup(s, t);
  if (k == nullptr || !k->finite || k->producer == nullptr) return false;
  const std::string& name = k->producer->name();
  return name == "aten::sqrt" || name == "aten::sqrt_";
}

bool is_inplace_arg(const OpInfo& info, int a) {
  for (int i : info.inplace_args) {
    if (i == a) return true;
  }
  return false;
}

// Whether `out` (an output of the op) is finite by construction: its scan
// can be skipped. `known`: whether it may be remembered as finite.
bool finite_by_construction(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args,
                            bool inplace_bad_before, const at::Tensor& out, bool& known) {
  known = false;
  const at::ScalarType dtype = out.scalar_type();
  const double limit = max_finite(dtype);
  if (info.values == Values::kComputed || limit == 0.0 || args.size() < info.num_args) return false;
  if (info.values == Values::kZeroOne) {
    known = true;
    return true;
  }
  if (info.values == Values::kMoves) {
    for (int a : info.scalar_args) {
      double v = 0.0;
      if (args[a].isNone()) continue;
      if (!real_value(args[a], v) || std::fabs(v) > limit) return false;
    }
    bool ok = true;
    bool all_known = true;
    for (size_t i = 0; i < info.num_args && ok; ++i) {
      if (info.is_out_arg[i]) continue;
      const bool inplace = is_inplace_arg(info, static_cast<int>(i));
      for_each_tensor(args[i], [&](const at::Tensor& t) {
        if (!ok || !t.defined()) return;
        double v = 0.0;
        if (!widens(t.scalar_type(), dtype) &&
            !(single_value(t, v) && std::isfinite(v) && std::fabs(v) <= limit)) {
          ok = false;  // a narrowing cast: scanned (fp32 -> fp16 overflows)
          return;
        }
        if (!t.is_floating_point()) return;  // integers and bools are finite
        if (inplace) {
          all_known = all_known && !inplace_bad_before;
        } else if (single_value(t, v)) {
          all_known = all_known && std::isfinite(v);
        } else {
          all_known = all_known && readable(t) && known_finite(s, t);
        }
      });
    }
    known = ok && all_known;
    return ok;
  }
  // kScaleDown, kAddSmall: self (or mul's other) is the tensor, the other a real scalar.
  if (args.size() < 2) return false;
  int x = 0;
  double v = 0.0;
  if (!real_value(args[1], v)) {
    if (info.values != Values::kScaleDown || info.divides || !info.inplace_args.empty() ||
        !real_value(args[0], v) || !args[1].isTensor()) {
      return false;
    }
    // 0.5 * x, on mul only (div's scalar must be the divisor)
    x = 1;
  }
  if (!args[x].isTensor()) return false;
  const at::Tensor& t = args[x].toTensor();
  if (!readable(t) || t.unsafeGetTensorImpl()->is_wrapped_number() || t.scalar_type() != dtype) {
    return false;
  }
  const bool inplace_x = is_inplace_arg(info, x);
  const bool x_finite = inplace_x ? !inplace_bad_before : known_finite(s, t);
  if (!x_finite) return false;
  bool safe = false;
  if (info.values == Values::kScaleDown) {
    // mul: |v| <= 1; div (the divisor is args[1]): |v| >= 1
    safe = info.divides ? (x == 0 && std::fabs(v) >= 1.0) : std::fabs(v) <= 1.0;
    // A square root's values, unchanged since (AdamW's exp_avg_sq.sqrt() / bias_correction2_sqrt):
    // |x| <= root_bound, so |x * v| and |x / v| stay below a quarter of the largest finite value
    // (the margin covers the scalar's cast to the op's dtype and the final rounding).
    if (!safe && !inplace_x && (x == 0 || !info.divides) && std::fabs(v) > 0.0 && root_bound(dtype) > 0.0 &&
        from_root(s, t)) {
      const double scaled =
          info.divides ? root_bound(dtype) / std::fabs(v) : root_bound(dtype) * std::fabs(v);
      safe = scaled <= limit / 4.0;
    }
  } else {
    double alpha = 1.0;
    if (args.size() > 2 && !args[2].isNone() && !real_value(args[2], alpha)) return false;
    // each factor in range too: the kernel casts both to the op's math type first
    const double bound = add_bound(dtype);
    safe = std::fabs(alpha) <= limit && std::fabs(v) <= limit && std::fabs(alpha * v) <= bound;
  }
  known = safe;
  return safe;
}

std::string op_display_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  const auto sep = name.find("::");
  if (sep != std::string::npos) name.replace(sep, 2, ".");
  return name + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
}

bool op_allowed(const Session& s, const c10::FunctionSchema& schema) {
  if (s.allowed_ops.empty()) return false;
  const std::string packet = schema.name();
  const std::string full =
      packet + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
  for (const auto& a : s.allowed_ops) {
    if (a == packet || a == full) return true;
  }
  return false;
}

}  // namespace watch
}  // namespace cublas_guard
