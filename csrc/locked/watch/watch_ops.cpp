// Op traits for watch: what each operator writes, which of its outputs may
// hold new values, whether it is composite. Computed once per operator (per
// thread) from its schema and its kernels; see watch.h for the whole design.
#include "locked/watch/watch.h"

#include "locked/op_handles.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/any.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/isnan.h>
#include <ATen/ops/isneginf.h>
#include <ATen/ops/isposinf.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/max.h>
#include <ATen/ops/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

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

namespace {
// A direct-mapped cache in front of the map (its values never move): the hot
// ops of a step hit it with one compare, no hashing.
struct OpInfoHit {
  const void* key = nullptr;
  const OpInfo* info = nullptr;
};
thread_local OpInfoHit tls_op_hits[256];

const OpInfo& op_info_slow(const c10::OperatorHandle& op) {
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
    if (arg.is_out() || (overwrites && alias != nullptr && alias->isWrite())) info.is_out_arg[i] = 1;
  }
  for (const auto& ret : schema.returns()) {
    const c10::AliasInfo* alias = ret.alias_info();
    info.scan_return.push_back(alias == nullptr || alias->isWrite() ? 1 : 0);
  }
  info.scan_written_args = schema.returns().empty() && !info.written_args.empty();
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
  // Products and squares: an input beyond the square root of the dtype's
  // largest value explains an overflow there (the message's range note).
  static const std::string products =
      " mm addmm bmm baddbmm matmul linear mul mul_ pow pow_ square dot mv addmv einsum mse_loss "
      "_scaled_dot_product_flash_attention addcmul addcmul_ prod ";
  const std::string& overload = schema.overload_name();
  if ((base == "clamp" || base == "clamp_" || base == "clip" || base == "clip_") && overload.empty())
    info.float8_step = 1;
  if (aten && base == "_to_copy" && overload.empty()) info.float8_step = 2;
  if (aten && base == "copy_" && overload.empty()) info.float8_step = 3;
  // Sealed too: the scaled GEMMs, one kernel on a GPU, on the CPU an upcast and an mm whose
  // overflow is the scaled GEMM's own (named there, as on the GPU); and the foreach ops (the
  // optimizers' and clip_grad_norm_'s), one fused kernel per list on a GPU, on the CPU a loop of
  // per-tensor ops that watch would check one by one and then again as the list's outputs (the
  // foreach AdamW step cost 3x): a birth is named at the foreach op, on both devices alike.
  info.sealed = starts_with(name, "cublas_guard::") || starts_with(name, "cublas_guard_internal::") ||
                (aten && (starts_with(base, "_scaled_mm") || starts_with(base, "_scaled_grouped_mm") ||
                          starts_with(base, "_foreach_")));
  info.product = aten && products.find(" " + base + " ") != std::string::npos;
  static const std::string finite_maps =
      " clone _unsafe_view _to_copy copy_ relu gelu bernoulli_ _softmax _safe_softmax softmax ";
  info.finite_from_finite = aten && finite_maps.find(" " + base + " ") != std::string::npos;
  info.bounded_sum = aten && base == "embedding_dense_backward";
  info.step_writes = name == "cublas_guard_internal::optimizer_step_writes";
  // Grouped GEMMs: rows sorted by group, `offs` their int32 group ends.
  for (size_t i = 0; i < info.num_args; ++i) {
    const auto& arg = schema.arguments()[i];
    const c10::TypeKind kind = arg.real_type()->kind();
    const bool tensor = kind == c10::TypeKind::TensorType ||
                        (kind == c10::TypeKind::OptionalType &&
                         arg.real_type()->castRaw<c10::OptionalType>()->getElementType()->kind() ==
                             c10::TypeKind::TensorType);
    if (arg.name() == "offs" && tensor) info.offs_arg = static_cast<int>(i);
    if (arg.name() == "parameter" && kind == c10::TypeKind::StringType)
      info.parameter_arg = static_cast<int>(i);
  }
  return tls_op_info.emplace(key, std::move(info)).first->second;
}

}  // namespace

const OpInfo& op_info(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  OpInfoHit& hit = tls_op_hits[(reinterpret_cast<uintptr_t>(key) >> 4) & 255];
  if (hit.key == key) return *hit.info;
  const OpInfo& info = op_info_slow(op);
  hit.key = key;
  hit.info = &info;
  return info;
}

bool scalar_non_finite(const c10::IValue& v) {
  if (v.isDouble()) return !std::isfinite(v.toDouble());
  if (v.isComplexDouble()) {
    const auto z = v.toComplexDouble();
    return !std::isfinite(z.real()) || !std::isfinite(z.imag());
  }
  return false;
}

std::string op_display_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  const auto sep = name.find("::");
  if (sep != std::string::npos) name.replace(sep, 2, ".");
  return name + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
}

bool readable(const at::Tensor& t) {
  if (!t.defined() || !t.is_floating_point() || t.layout() != at::kStrided || t.numel() == 0) return false;
  if (t.is_meta() || !t.has_storage()) return false;
  static const c10::DispatchKeySet wrappers = c10::DispatchKeySet({
      c10::DispatchKey::Python,
      c10::DispatchKey::PythonTLSSnapshot,
      c10::DispatchKey::Fake,
      c10::DispatchKey::Functionalize,
      c10::DispatchKey::FuncTorchBatched,
      c10::DispatchKey::FuncTorchGradWrapper,
      c10::DispatchKey::BatchedNestedTensor,
      c10::DispatchKey::Batched,
  });
  return (t.key_set() & wrappers).empty();
}

namespace {

// The project's fused scan (cublas_guard::scan: the CPU loop or the CUDA
// kernel), below autograd: its counts, on t's device.
at::Tensor fused_scan(const at::Tensor& t) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return scan_handle().call(t);
}

}  // namespace

HostCounts host_counts(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  // float8: ATen's isfinite has no CPU kernel for it; read as float32 (exact: every
  // float8 value, NaN and Inf included, is one), like the CUDA scan does.
  if (c10::isFloat8Type(t.scalar_type())) return host_counts(t.to(at::kFloat));
  if (is_guarded_dtype(t.scalar_type())) {
    const at::Tensor counts = fused_scan(t).cpu();  // one host read (a sync on CUDA)
    return HostCounts::of_scan(counts.data_ptr<int64_t>());
  }
  HostCounts c;
  if (at::isfinite(t).all().item<bool>()) return c;
  const at::Tensor flat = t.reshape({-1});
  c.nan = at::isnan(flat).sum().item<int64_t>();
  c.posinf = at::isposinf(flat).sum().item<int64_t>();
  c.neginf = at::isneginf(flat).sum().item<int64_t>();
  c.first = at::logical_not(at::isfinite(flat)).nonzero().select(1, 0).min().item<int64_t>();
  return c;
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  std::vector<at::Tensor> counts, flags;  // a fused scan's counts each; other dtypes: a flag each
  for (const at::Tensor& t : tensors) {
    if (c10::isFloat8Type(t.scalar_type())) {
      counts.push_back(fused_scan(t.to(at::kFloat)));  // float8: as float32 (host_counts says why)
    } else if (is_guarded_dtype(t.scalar_type())) {
      counts.push_back(fused_scan(t));  // one launch per tensor on CUDA
    } else {
      flags.push_back(at::logical_not(at::isfinite(t)).any());
    }
  }
  if (!counts.empty() && at::stack(counts).select(1, kFirstBadIndex).max().item<int64_t>() >= 0) return false;
  return flags.empty() || !at::stack(flags).any().item<bool>();
}

namespace {

// float8 formats by their largest value; those without an Inf lose one at any cast.
struct Float8Format {
  at::ScalarType type;
  const char* name;
  double max;
  bool has_inf;
};
constexpr Float8Format kFloat8Formats[] = {
    {at::ScalarType::Float8_e4m3fn, "float8_e4m3fn", 448.0, false},
    {at::ScalarType::Float8_e5m2, "float8_e5m2", 57344.0, true},
    {at::ScalarType::Float8_e4m3fnuz, "float8_e4m3fnuz", 240.0, false},
    {at::ScalarType::Float8_e5m2fnuz, "float8_e5m2fnuz", 57344.0, false},
};

const Float8Format* format_of(at::ScalarType type) {
  for (const auto& f : kFloat8Formats)
    if (f.type == type) return &f;
  return nullptr;
}

std::string number(double v) {
  std::string out = std::to_string(v);
  out.erase(out.find_last_not_of('0') + 1);
  if (!out.empty() && out.back() == '.') out.pop_back();
  return out;
}

}  // namespace

std::string float8_swallow(const OpInfo& info, const std::vector<c10::IValue>& args,
                           const at::Tensor** input) {
  if (info.float8_step == 0 || args.empty() || !args[0].isTensor()) return "";
  const at::Tensor& self = args[0].toTensor();
  if (info.float8_step == 1) {  // clamp(self, min, max): both bounds a float8 format's range
    if (args.size() < 3 || !args[1].isScalar() || !args[2].isScalar() || !readable(self)) return "";
    const double lo = args[1].toScalar().toDouble(), hi = args[2].toScalar().toDouble();
    for (const auto& f : kFloat8Formats) {
      if (lo != -f.max || hi != f.max) continue;
      *input = &self;
      const std::string m = number(f.max);
      return "aten.clamp to +-" + m + ", " + f.name +
             "'s range (the first step of a saturated FP8 cast, as " + "torchao's): +Inf becomes " + m +
             " and -Inf -" + m + " there, so the non-finite value is lost";
    }
    return "";
  }
  if (info.float8_step == 2) {  // _to_copy(self, *, dtype=...)
    if (args.size() < 2 || !args[1].isInt() || !readable(self)) return "";
    const Float8Format* f = format_of(static_cast<at::ScalarType>(args[1].toInt()));
    if (f == nullptr || f->has_inf) return "";
    *input = &self;
    const std::string m = number(f->max);
    return std::string("the cast to ") + f->name + " (aten._to_copy), a format without Inf: +Inf becomes " +
           m + " and -Inf -" + m +
           " there (torch >= 2.12 saturates; 2.11 made them NaN), so the value is lost";
  }
  // copy_(self, src): into a float8 tensor without Inf
  if (args.size() < 2 || !args[1].isTensor()) return "";
  const Float8Format* f = format_of(self.scalar_type());
  const at::Tensor& src = args[1].toTensor();
  if (f == nullptr || f->has_inf || !readable(src)) return "";
  *input = &src;
  const std::string m = number(f->max);
  return std::string("the copy into a ") + f->name +
         " tensor (aten.copy_), a format without Inf: +Inf becomes " + m + " and -Inf -" + m +
         " there (torch >= 2.12 saturates; 2.11 made them NaN), so the value is lost";
}

bool op_allowed(const Session& s, const c10::FunctionSchema& schema) {
  if (s.config.allowed_ops.empty()) return false;
  const std::string packet = schema.name();
  const std::string full =
      packet + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
  for (const auto& a : s.config.allowed_ops) {
    if (a == packet || a == full) return true;
  }
  return false;
}

}  // namespace watch
}  // namespace cublas_guard
