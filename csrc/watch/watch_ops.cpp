// Op traits for watch: what each operator writes, which of its outputs may
// hold new values, whether it is composite. Computed once per operator (per
// thread) from its schema and its kernels; see watch.h for the whole design.
#include "watch/watch.h"

#include "op_handles.h"

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
  info.sealed = starts_with(name, "cublas_guard::") || starts_with(name, "cublas_guard_internal::");
  info.product = aten && products.find(" " + base + " ") != std::string::npos;
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
    if (is_guarded_dtype(t.scalar_type())) {
      counts.push_back(fused_scan(t));  // one launch per tensor on CUDA
    } else {
      flags.push_back(at::logical_not(at::isfinite(t)).any());
    }
  }
  if (!counts.empty() && at::stack(counts).select(1, kFirstBadIndex).max().item<int64_t>() >= 0) return false;
  return flags.empty() || !at::stack(flags).any().item<bool>();
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
