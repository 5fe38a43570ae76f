// watch's tags, host side, part two (watch_device.h says why): the op's hooks
// that turn one watched op into one scan launch per output with the inputs'
// tags as arguments, an unhooked optimizer step's first sights and writes, the
// sinks and entries the Python side reports, and the poll of the records. No
// host read of a tag on the hot path on a GPU: the host never knows whether a
// value is finite there, only where its tag lives (an input on another device
// than the output is the exception: its tag is read on the host and passed by
// value); on the CPU the host reads tags where that spares a scan. The reports
// are built in watch_device_report.cpp; the slots and launches are in
// watch_slots.cpp.
#include "locked/watch/watch_device.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/function.h>

#include <algorithm>
#include <limits>
#include <mutex>

namespace cublas_guard {
namespace watch {

namespace {

// The module of the op running now (where_now() without the node's name).
int32_t module_now(const Session& s, const torch::autograd::Node* node) {
  if (!s.module_stack.empty()) return s.module_stack.back();
  if (node != nullptr && node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
    const uint64_t i = node->sequence_nr() - s.seq_base;
    if (i < s.seq_module.size()) return s.seq_module[i];
  }
  return node == nullptr && s.optimizer_depth > 0 ? kModuleOptimizerStep : -1;
}

// Calls fn(argument, tensor) for the inputs of one output: every tensor
// argument, and of a tensor list as long as the op's output list, only the
// element at the output's position (the _foreach_ ops pair them up: an
// output's scan reads its own inputs' tags, in O(1) per list).
template <typename Fn>
void for_each_input(const OpInfo& info, const std::vector<c10::IValue>& args, int64_t list_len,
                    int64_t position, Fn&& fn) {
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    const c10::IValue& v = args[i];
    if (position >= 0 && v.isList()) {
      const auto list = v.toListRef();
      if (static_cast<int64_t>(list.size()) == list_len) {
        if (list[position].isTensor()) fn(i, list[position].toTensor());
        continue;
      }
    }
    for_each_tensor(v, [&](const at::Tensor& t) { fn(i, t); });
  }
}

// A tensor input's descriptor item (the first kDescItems); its input index.
// A grouped GEMM's group ends and weight name (OpInfo::offs_arg), kept for its report.
void set_groups(CallDesc& c, const OpInfo& info, const std::vector<c10::IValue>& args) {
  c.offs =
      info.offs_arg >= 0 && args[info.offs_arg].isTensor() ? args[info.offs_arg].toTensor() : at::Tensor();
  if (info.parameter_arg >= 0 && args[info.parameter_arg].isString()) {
    c.parameter = args[info.parameter_arg].toStringRef();
  } else if (!c.parameter.empty()) {
    c.parameter.clear();
  }
}

int32_t describe_tensor(CallDesc& c, size_t arg, const at::Tensor& t) {
  if (c.n_items < kDescItems) {
    DescItem& item = c.items[c.n_items++];
    item.arg = static_cast<int16_t>(arg);
    item.scalar = false;
    item.tensor.set(t);
  }
  return static_cast<int32_t>(c.num_inputs++);
}

// The descriptor's scalar items (non-finite Scalar arguments and doubles).
void describe_scalars(CallDesc& c, const OpInfo& info, const std::vector<c10::IValue>& args) {
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i] || c.n_items >= kDescItems || !(args[i].isDouble() || args[i].isComplexDouble()))
      continue;
    if (scalar_non_finite(args[i]) || args[i].isDouble()) {
      DescItem& item = c.items[c.n_items++];
      item.arg = static_cast<int16_t>(i);
      item.scalar = true;
      item.value = args[i].isDouble() ? args[i].toDouble() : 0.0;
    }
  }
}

// The written-sink id of output t, -1 if none: a tagged value written into a
// parameter or buffer of the model, or into any tensor outside the model's
// forward and backward (an optimizer's state, a running total).
int64_t written_sink_id(Session& s, TagState& w, const c10::OperatorHandle& op, const OpInfo& info,
                        const std::vector<c10::IValue>& args, const at::Tensor& t, bool in_node,
                        bool is_written_arg) {
  if (info.written_args.empty() || !t.has_storage()) return -1;
  // Not inside a kernel's own steps, not an intermediate autograd still differentiates.
  if (tls_depth > tls_kernel_depth || (t.requires_grad() && !t.is_leaf())) return -1;
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  bool written = is_written_arg;  // a _foreach_ op's output is the argument it wrote
  for (size_t i = 0; i < info.written_args.size() && !written; ++i) {
    for_each_tensor(args[info.written_args[i]], [&](const at::Tensor& x) {
      written = written || (x.defined() && x.has_storage() && x.storage().unsafeGetStorageImpl() == key);
    });
  }
  if (!written) return -1;
  const auto state = s.state.find(key);
  const bool outside = state == s.state.end() && s.config.has_model && s.module_stack.empty() && !in_node;
  if (state == s.state.end() && !outside) return -1;
  const auto cache_key = std::make_pair(static_cast<const void*>(&op.schema()),
                                        outside ? nullptr : static_cast<const void*>(key));
  const auto it = w.sink_ids.find(cache_key);
  if (it != w.sink_ids.end()) return it->second;
  const std::string name = op_display_name(op.schema());
  w.names.push_back(outside ? "a tensor written by " + name +
                                  " outside the model's forward and backward (state such as an optimizer's)"
                            : "the model's parameter or buffer '" + state->second + "', written by " + name);
  const int64_t id = static_cast<int64_t>(w.names.size()) - 1;
  w.sink_ids.emplace(cache_key, id);
  return id;
}

// The tag of an input for a scan on `out`: a slot of out's array, or (an
// input on another device) its tag read on the host from its own array.
void add_input(TagState& w, TagArgs& a, DeviceTags& out, const at::Tensor& t) {
  if (!readable(t) || a.n_in >= kMaxTagInputs) return;
  DeviceTags* home = tags_for(w, t);
  if (home == nullptr) return;
  const int32_t slot = home->slots.find(t.storage().unsafeGetStorageImpl());
  if (slot < 0) return;
  if (home == &out) {
    a.in_slots[a.n_in] = slot;
    a.in_values[a.n_in++] = kTagFinite;
    return;
  }
  a.in_slots[a.n_in] = -1;
  a.in_values[a.n_in++] = home->kernels->read_tag(home->home.device, home->tags.data_ptr<int32_t>(), slot);
}

}  // namespace

void describe_inputs(ErrorReport& r, const c10::FunctionSchema& schema, const std::vector<c10::IValue>& args,
                     const OpInfo& info) {
  CallDesc c;
  for_each_input(info, args, -1, -1, [&](size_t arg, const at::Tensor& t) {
    if (t.defined()) describe_tensor(c, arg, t);
  });
  describe_scalars(c, info, args);
  add_call_inputs(r, schema, c);
}

void tags_before(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args) {
  TagState& w = *s.tags;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t) { first_sight(w, t); });
  }
}

// Whether `t`'s values are already judged and need no scan: a composite op's output that an op
// it ran scanned (`first_seq` on), or the storage of an input of an op that writes nothing
// (_unsafe_view's result) outside forward's autograd recording (there the node's tag is written
// by the scan). Its slot's tag is then the tag of those very values.
static bool already_judged(const DeviceTags& d, const OpInfo& info, const std::vector<c10::IValue>& args,
                           const at::Tensor& t, int64_t seq_index, int64_t first_seq) {
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  const int32_t slot = d.slots.find(key);
  if (slot < 0) return false;  // values no op of the block judged
  if (info.composite && static_cast<size_t>(slot) < d.slot_seq.size() && d.slot_seq[slot] >= first_seq)
    return true;
  if (!info.written_args.empty() || seq_index >= 0) return false;
  bool shared = false;
  for (size_t i = 0; i < args.size() && i < info.num_args && !shared; ++i) {
    for_each_tensor(args[i], [&](const at::Tensor& in) {
      shared = shared || (in.defined() && in.has_storage() && in.storage().unsafeGetStorageImpl() == key);
    });
  }
  return shared;
}

// A float dtype that holds every value of `from` (a cast to it cannot overflow).
static bool widens(at::ScalarType from, at::ScalarType to) {
  if (from == to) return true;
  if (to == at::kDouble) return from == at::kFloat || from == at::kHalf || from == at::kBFloat16;
  return to == at::kFloat && (from == at::kHalf || from == at::kBFloat16);
}

// OpInfo::finite_from_finite on the CPU: every floating input's tag, read on the host, is
// finite (and a cast widens), so the output is finite without reading it. Its slot is then
// tagged finite here (a whole storage only: a partial write keeps the rest's tag, so it is
// scanned). Values an op of this kind turns non-finite do not exist; finite ones need no record.
static bool finite_by_rule(DeviceTags& d, const OpInfo& info, const std::vector<c10::IValue>& args,
                           const at::Tensor& t, int64_t list_len, int64_t position) {
  if (!info.finite_from_finite || !d.home.device.is_cpu() || !covers_storage(t)) return false;
  bool finite = true;
  for_each_input(info, args, list_len, position, [&](size_t, const at::Tensor& in) {
    if (!finite || !in.defined()) return;
    if (!in.is_floating_point()) {  // an integer cast: int64's 9.2e18 overflows only float16
      finite = t.scalar_type() != at::kHalf;
      return;
    }
    if (!widens(in.scalar_type(), t.scalar_type())) {
      finite = false;
      return;
    }
    const int32_t slot = in.has_storage() ? d.slots.find(in.storage().unsafeGetStorageImpl()) : -1;
    finite = slot >= 0 && raw(d.tags)[slot] == kTagFinite;  // tags_before gave every input a slot
  });
  return finite;
}

// OpInfo::bounded_sum on the CPU: embedding_dense_backward(grad_output, indices, ...) adds each
// row of grad_output into the row its index names (scaled down by the index's count under
// scale_grad_by_freq; the padding row zeroed), so no output value sums more than indices.numel()
// values of magnitude at most A, grad_output's largest: finite when numel x A stays below half the
// dtype's largest value (half: rounding's headroom). grad_output is small (tokens x width) and
// finite-tagged; the output, a vocabulary-sized gradient, is then tagged finite without a scan.
// *bound_exp: the small bound (small_bound_exp) when numel x A stays below half of it too.
static bool bounded_by_rule(DeviceTags& d, const OpInfo& info, const std::vector<c10::IValue>& args,
                            const at::Tensor& t, int32_t* bound_exp) {
  if (!info.bounded_sum || !d.home.device.is_cpu() || !covers_storage(t) || args.size() < 2 ||
      !args[0].isTensor() || !args[1].isTensor()) {
    return false;
  }
  const at::Tensor& grad = args[0].toTensor();
  if (grad.scalar_type() != t.scalar_type() || !grad.has_storage() || !grad.is_cpu()) return false;
  const int32_t slot = d.slots.find(grad.storage().unsafeGetStorageImpl());
  if (slot < 0 || raw(d.tags)[slot] != kTagFinite) return false;
  const InputView view = dense_view(grad);
  if (view.dtype == kViewNone) return false;
  double largest = 0;
  switch (t.scalar_type()) {
    case at::kFloat: largest = std::numeric_limits<float>::max(); break;
    case at::kDouble: largest = std::numeric_limits<double>::max(); break;
    case at::kHalf: largest = 65504.0; break;
    case at::kBFloat16: largest = 3.3895313892515355e38; break;
    default: return false;
  }
  const double terms = static_cast<double>(std::max<int64_t>(args[1].toTensor().numel(), 1));
  const double bound = absmax_host(view) * terms;
  const int32_t small = small_bound_exp(t.scalar_type());
  *bound_exp = small >= 0 && bound < std::ldexp(1.0, small) / 2 ? small : -1;
  return bound < largest / 2;
}

void tags_after(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                const std::vector<c10::IValue>& args, const torch::jit::Stack& stack, int64_t seq_index,
                int64_t first_seq) {
  TagState& w = *s.tags;
  const bool consequence = s.report == kReportConsequence;
  const c10::FunctionSchema& schema = op.schema();
  const auto node = torch::autograd::get_current_node();
  const int32_t module = module_now(s, node.get());
  TagArgs base;
  base.birth = consequence ? 0 : 1;
  base.backward = node != nullptr ? 1 : 0;
  bool allowed = op_allowed(s, schema);
  if (module >= 0 && static_cast<size_t>(module) < s.config.module_allowed.size() &&
      s.config.module_allowed[module]) {
    allowed = true;
  }
  base.allowed = allowed ? 1 : 0;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    const c10::IValue& v = args[i];
    if (info.is_out_arg[i] || !(v.isDouble() || v.isComplexDouble())) continue;  // tensors: no call
    if (scalar_non_finite(v)) base.scalar_bad = 1;
  }
  // The forward node this backward op computes the gradient of (its tag: a
  // consequence of a tagged forward value is no birth).
  int64_t seq_read = -1;
  if (consequence && node && node->thread_id() == s.thread_id && node->sequence_nr() >= s.seq_base) {
    seq_read = static_cast<int64_t>(node->sequence_nr() - s.seq_base);
  }
  w.op_first_seq = w.next_seq;
  bool first_output = true;
  auto scan_output = [&](const at::Tensor& t, int64_t index, int64_t list_len, int64_t position) {
    if (!readable(t)) return;
    DeviceTags* d = tags_for(w, t);
    if (d == nullptr || (!s.verify && already_judged(*d, info, args, t, seq_index, first_seq))) return;
    int32_t bound_exp = -1;  // a cast or copy keeps no bound here: only the sum's rule gives one
    if (!s.verify && base.scalar_bad == 0 &&
        (finite_by_rule(*d, info, args, t, list_len, position) ||
         bounded_by_rule(*d, info, args, t, &bound_exp))) {
      tag_finite_unscanned(*d, t, w.next_seq, bound_exp);  // judged by this op, as a scan would have
      return;
    }
    ++s.outputs_scanned;
    const int64_t seq = w.next_seq++;
    CallDesc& c = w.ring[seq & (w.capacity - 1)];
    c.n_items = 0;
    c.num_inputs = 0;
    TagArgs a = base;
    for_each_input(info, args, list_len, position, [&](size_t arg, const at::Tensor& in) {
      if (!in.defined()) return;
      add_input(w, a, *d, in);
      // An unhooked optimizer step's inputs after its gradient are what it already overwrote:
      // their tags count, their shapes and values would mislead (the message reads the state).
      if (info.step_writes && c.num_inputs > 0) return;
      const int32_t input = describe_tensor(c, arg, in);
      add_view(a, info, arg, in, input, home_of(w, in) == d->home);
    });
    describe_scalars(c, info, args);
    if (seq_read >= 0 && static_cast<size_t>(seq_read) < w.seq_home.size() &&
        w.seq_home[seq_read] != nullptr) {
      DeviceTags* forward = w.seq_home[seq_read];
      if (forward == d) {
        a.seq_read = static_cast<int32_t>(seq_read);
      } else {  // the forward op's output lives on another device: its tag read there
        a.seq_value = forward->kernels->read_tag(forward->home.device, forward->seq_tags.data_ptr<int32_t>(),
                                                 static_cast<int32_t>(seq_read));
      }
    }
    if (consequence && seq_index >= 0) {
      if (seq_index >= d->seq_capacity) {
        int64_t grown = d->seq_capacity;
        while (seq_index >= grown) grown *= 2;
        grow(*d, &DeviceTags::seq_tags, grown);
        d->seq_capacity = grown;
      }
      a.seq_write = static_cast<int32_t>(seq_index);
      if (static_cast<size_t>(seq_index) >= w.seq_home.size()) w.seq_home.resize(seq_index + 1, nullptr);
      if (first_output) w.seq_home[seq_index] = d;
    }
    bool fresh = false;
    a.out_slot = slot_of(*d, t, &fresh);
    a.whole = covers_storage(t) ? 1 : 0;
    a.fresh = fresh || (!info.composite && a.whole) ? 1 : 0;
    a.output_index = index;
    a.seq_merge = first_output ? 0 : 1;
    first_output = false;
    a.sink =
        consequence ? written_sink_id(s, w, op, info, args, t, node != nullptr, info.scan_written_args) : -1;
    a.seq = static_cast<int32_t>(seq);
    c.seq = seq;
    c.entry = false;
    c.schema = &schema;
    c.product = info.product;
    c.module = module;
    c.backward = node != nullptr;
    c.node = node;
    c.output_index = index;
    c.out.set(t);
    set_groups(c, info, args);
    d->slot_seq[a.out_slot] = seq;
    launch(*d, t, a);
    if (s.verify) verify_after(s, op, t);
  };
  // An output list (a _foreach_ op's): each element with its position.
  auto scan_value = [&](const c10::IValue& out, int64_t index) {
    if (out.isTensor()) {
      scan_output(out.toTensor(), index, -1, -1);
    } else if (out.isList()) {
      const auto list = out.toListRef();
      for (size_t k = 0; k < list.size(); ++k) {
        if (list[k].isTensor()) scan_output(list[k].toTensor(), index, static_cast<int64_t>(list.size()), k);
      }
    }
  };
  if (info.scan_written_args) {
    for (int a : info.written_args) scan_value(args[a], a);
  } else if (stack.size() >= info.scan_return.size()) {
    const size_t num_returns = info.scan_return.size();
    for (size_t r = 0; r < num_returns; ++r) {
      if (info.scan_return[r]) scan_value(stack[stack.size() - num_returns + r], static_cast<int64_t>(r));
    }
  }
  if (!w.seam.late_harvest) harvest(s, /*synchronize=*/false, /*as_pending=*/false, /*at_op=*/true);
}

// A CPU tensor's tag array and slot, whose tag the host reads itself (-1: not a readable CPU
// tensor, or no slot yet).
static int32_t host_slot(Session& s, const at::Tensor& t, DeviceTags** d) {
  *d = readable(t) && t.is_cpu() ? tags_for(*s.tags, t) : nullptr;
  return *d != nullptr ? (*d)->slots.find(t.storage().unsafeGetStorageImpl()) : -1;
}

void tags_before_step(Session& s, const std::vector<at::Tensor>& tensors,
                      const std::vector<at::Tensor>& finite, const std::vector<at::Tensor>& bounded) {
  for (const at::Tensor& t : tensors) first_sight(*s.tags, t);
  // A slot this block already gave one keeps its tag: that is what the block knows.
  for (const at::Tensor& t : finite) tags_known_finite(s, t);
  // A bound holds on a slot no op has judged since it was given (slot_seq -1: the block's entry
  // or the line above gave it for the same values, whose versions watching/optimizer_step.py
  // checked).
  for (const at::Tensor& t : bounded) {
    DeviceTags* d = nullptr;
    const int32_t slot = host_slot(s, t, &d);
    const int32_t small = small_bound_exp(t.scalar_type());
    if (slot >= 0 && small >= 0 && d->slot_seq[slot] == -1 && raw(d->tags)[slot] == kTagFinite) {
      note_bound(*d, slot, 2 * small + 1);
    }
  }
}

bool tags_finite_on_host(Session& s, const at::Tensor& t) {
  DeviceTags* d = nullptr;
  const int32_t slot = host_slot(s, t, &d);
  return slot >= 0 && raw(d->tags)[slot] == kTagFinite;
}

// The Adam family's second moment after the step, v' = b2 v + (1 - b2) g g (watching/optimizer_step.py
// passes its index only for Adam, AdamW, NAdam and RAdam with the gradient as the step reads it:
// no amsgrad, no coupled weight decay, not fused or differentiable, 0 <= b2 <= 1 - 1e-6),
// proven to stay below 2^(2s+1) without reading it, s being the dtype's small bound (2^62 for
// float32, 2^510 for float64): the gradient's last scan found every |g| < 2^s (so g g < 2^2s,
// no overflow) and v was already below 2^(2s+1) (the previous step's proof, or a scan finding it
// below 2^s). Then b2 v + (1 - b2) g g < 2^(2s+1) (1 - (1 - b2)/2), a margin of at least 5e-7
// relative, and three roundings (float32's 6e-8 each) cannot cross it. bfloat16 is left out: its
// rounding (4e-3) is coarser than 1 - b2. A gradient or state a later write touched has no bound
// (bound_of), and their tags must still read finite.
static bool second_moment_proven(DeviceTags& d, const at::Tensor& grad, const at::Tensor& v) {
  const int32_t small = v.scalar_type() == at::kBFloat16 ? -1 : small_bound_exp(v.scalar_type());
  if (small < 0 || grad.scalar_type() != v.scalar_type() || !grad.is_cpu() || !readable(grad)) return false;
  const int32_t g_slot = d.slots.find(grad.storage().unsafeGetStorageImpl());
  const int32_t v_slot = d.slots.find(v.storage().unsafeGetStorageImpl());
  if (g_slot < 0 || v_slot < 0) return false;
  const int32_t* tags = raw(d.tags);
  return tags[g_slot] == kTagFinite && tags[v_slot] == kTagFinite && bound_of(d, g_slot) <= small &&
         bound_of(d, v_slot) <= 2 * small + 1;
}

// One parameter's writes on the CPU, when all of them read finite: each tagged finite as a scan
// would tag it (a finite output covering its storage gets the finite tag whatever its inputs:
// apply_rule), without the per-output bookkeeping of tags_after (its record, the inputs' slots
// and descriptions: most of an unhooked step's end on small parameters). The parameter is read
// first: for the Adam family (`implied`: exp_avg's index) a finite parameter proves exp_avg finite,
// since the update adds exp_avg over a positive denominator times a step size that may be 0, so a
// non-finite exp_avg makes a non-finite parameter (Inf/d = Inf, Inf/Inf = NaN, NaN/d = NaN,
// 0 x Inf = NaN); exp_avg is then not read (91 MB of a MiniLM step's 272). exp_avg_sq
// (`second_moment`) is not read where second_moment_proven holds (91 MB more). False when a
// tensor is not finite (or not a whole CPU storage): the caller scans every written tensor in
// order then, so a state that went non-finite is named as before. *bounded: whether the second
// moment holds its bound now.
static bool step_writes_finite(Session& s, const std::vector<at::Tensor>& read,
                               const std::vector<at::Tensor>& written, int64_t implied, int64_t second_moment,
                               bool* bounded) {
  *bounded = false;
  if (s.verify || written.empty()) return false;
  DeviceTags* d = nullptr;
  for (const at::Tensor& t : written) {
    if (!t.is_cpu() || !readable(t) || !covers_storage(t)) return false;
    DeviceTags* home = tags_for(*s.tags, t);
    if (home == nullptr || (d != nullptr && home != d)) return false;
    d = home;
  }
  const int64_t last = static_cast<int64_t>(written.size()) - 1;  // the parameter
  if (second_moment == last) second_moment = -1;
  if (implied == last) implied = -1;
  constexpr size_t kMaxStepWrites = 8;  // a parameter and its states (Adam with amsgrad: 4)
  if (written.size() > kMaxStepWrites) return false;
  const bool proven = second_moment >= 0 && second_moment_proven(*d, read.front(), written[second_moment]);
  int32_t exps[kMaxStepWrites];
  int64_t reads = 0;
  for (int64_t i = last; i >= 0; --i) {  // the parameter first
    exps[i] = -1;
    if (i == implied) continue;
    if (i == second_moment && proven) {
      exps[i] = 2 * small_bound_exp(written[i].scalar_type()) + 1;
      continue;
    }
    bool small = false;
    if (!host_finite_cpu(written[i], &small)) return false;
    ++reads;
    exps[i] = small ? small_bound_exp(written[i].scalar_type()) : -1;
  }
  s.outputs_scanned += reads;
  for (int64_t i = 0; i <= last; ++i) tag_finite_unscanned(*d, written[i], s.tags->next_seq, exps[i]);
  *bounded = second_moment >= 0 && exps[second_moment] >= 0;
  return true;
}

bool tags_after_step(Session& s, const std::vector<at::Tensor>& read, const std::vector<at::Tensor>& written,
                     int64_t implied, int64_t second_moment) {
  TORCH_INTERNAL_ASSERT(read.size() == written.size() + 1);
  bool bounded = false;
  if (step_writes_finite(s, read, written, implied, second_moment, &bounded)) return bounded;
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("cublas_guard_internal::optimizer_step_writes", "");
  const OpInfo& info = op_info(op);
  // `read` is one longer than `written` (the gradient first), so tags_after gives every written
  // tensor all of `read` as inputs (its parameter's tensors as they were before the step: a NaN
  // already in exp_avg is not born in the parameter it reaches) and, by position, its own old tag.
  // No first sight here: a state the step made has no slot, so it is no input of its own scan.
  const torch::jit::Stack none;
  const std::vector<c10::IValue> args{c10::IValue(read), c10::IValue(written)};
  tags_after(s, op, info, args, none, /*seq_index=*/-1, /*first_seq=*/s.tags->next_seq);
  // Each written tensor was scanned whole: a second moment found small has its bound.
  if (second_moment < 0 || second_moment >= static_cast<int64_t>(written.size())) return false;
  const at::Tensor& v = written[second_moment];
  DeviceTags* d = nullptr;
  const int32_t slot = host_slot(s, v, &d);
  return slot >= 0 && raw(d->tags)[slot] == kTagFinite &&
         bound_of(*d, slot) <= small_bound_exp(v.scalar_type());
}

void poll(Session& s) {
  SessionLock lock(*s.mu);  // a device thread may be adding a device's arrays
  poll_locked(s);
}

void poll_locked(Session& s) {
  TagState& w = *s.tags;
  if (w.seam.late_harvest) return;
  bool flagged = false;
  for (const DeviceTags& d : w.devices) flagged = flagged || load_acquire(&d.record->flag) != 0;
  if (flagged) harvest(s, /*synchronize=*/false, /*as_pending=*/true);
}

void tags_known_finite(Session& s, const at::Tensor& t) {
  if (!readable(t)) return;
  DeviceTags* d = tags_for(*s.tags, t);
  bool fresh = false;
  if (d != nullptr) slot_of(*d, t, &fresh);
}

void tags_reached(Session& s, const at::Tensor& t, const std::string& where) {
  TagState& w = *s.tags;
  if (!readable(t)) return;
  DeviceTags* d = tags_for(w, t);
  if (d == nullptr) return;
  const int32_t slot = d->slots.find(t.storage().unsafeGetStorageImpl());
  if (slot < 0) return;  // untagged: finite, or from nowhere the watch saw
  // A sink's finding needs an origin's tag (findings_of); on the CPU the host reads the tag
  // itself (no sync), so a finite-tagged gradient is not read again (90 MB a MiniLM step).
  if (d->home.device.is_cpu() && raw(d->tags)[slot] < kTagFirst) return;
  w.names.push_back(where);
  TagArgs a;
  a.kind = kScanSink;
  a.out_slot = slot;
  a.sink = static_cast<int64_t>(w.names.size()) - 1;
  launch(*d, t, a);
  if (!w.seam.late_harvest) harvest(s, /*synchronize=*/false, /*as_pending=*/false);
}

void tags_entry(Session& s, const at::Tensor& t, const std::string& name, bool allowed, bool buffer) {
  TagState& w = *s.tags;
  if (!readable(t)) return;
  DeviceTags* d = tags_for(w, t);
  if (d == nullptr) return;
  bool fresh = false;
  TagArgs a;
  a.kind = kScanEntry;
  a.out_slot = slot_of(*d, t, &fresh);
  a.fresh = fresh ? 1 : 0;  // an argument an op of the block made keeps that op's earlier origin
  a.whole = covers_storage(t) ? 1 : 0;
  a.allowed = allowed ? 1 : 0;
  const int64_t seq = w.next_seq++;
  w.op_first_seq = seq;
  a.seq = static_cast<int32_t>(seq);
  CallDesc& c = w.ring[seq & (w.capacity - 1)];
  c.seq = seq;
  c.entry = true;
  c.schema = nullptr;
  c.node.reset();
  c.out.set(t);
  c.n_items = 0;
  c.offs.reset();
  w.names.push_back(name);
  c.entry_name = static_cast<int32_t>(w.names.size()) - 1;
  c.entry_buffer = buffer;
  launch(*d, t, a);
  if (!w.seam.late_harvest) harvest(s, /*synchronize=*/false, /*as_pending=*/false, /*at_op=*/true);
}

uint32_t input_origin(Session& s, const OpInfo& info, const std::vector<c10::IValue>& args) {
  harvest(s, /*synchronize=*/true, /*as_pending=*/true);
  TagState& w = *s.tags;
  c10::impl::ExcludeDispatchKeyGuard no_watch(kWatchKey);
  uint32_t origin = kNoOrigin;
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (!readable(t)) return;
      DeviceTags* d = tags_for(w, t);
      if (d == nullptr) return;
      const int32_t slot = d->slots.find(t.storage().unsafeGetStorageImpl());
      if (slot < 0) return;
      const int32_t tag = d->kernels->read_tag(d->home.device, d->tags.data_ptr<int32_t>(), slot);
      if (tag < kTagFirst) return;
      const auto it = w.origin_of_seq.find(tag - kTagFirst);
      if (it == w.origin_of_seq.end()) return;
      if (origin == kNoOrigin || it->second < origin) origin = it->second;
    });
  }
  return origin;
}

}  // namespace watch
}  // namespace cublas_guard
