// verify_inputs=True: values that no op wrote. While it is on (and only
// then), every output watch scans is also read on the host (a sync on CUDA:
// the option is for hunting a race, not for speed) and, when finite, kept in a
// storage -> (version, producer) map. Before each op, an input the map holds
// at the same version is scanned again: non-finite now, no op the watch saw
// wrote it (a write outside stream order, through numpy or .data, another
// process), and NonFiniteFromNowhereError names the producer and the reader.
#include "locked/watch/watch.h"

#include <c10/core/impl/LocalDispatchKeySet.h>

#include <unordered_map>

namespace cublas_guard {
namespace watch {

struct VerifyState {
  struct Produced {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{
        c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>())};
    uint32_t version = 0;
    const c10::FunctionSchema* producer = nullptr;
  };
  std::unordered_map<const c10::StorageImpl*, Produced> produced;
};

Session::Session() = default;  // here: VerifyState is complete
Session::~Session() = default;

void enable_verify(Session& s) {
  if (!s.verify) s.verify = std::make_unique<VerifyState>();
}

namespace {

const VerifyState::Produced* produced_finite(VerifyState& v, const at::Tensor& t) {
  if (!readable(t) || t.is_inference()) return nullptr;
  const auto it = v.produced.find(t.storage().unsafeGetStorageImpl());
  if (it == v.produced.end() || it->second.storage.expired()) return nullptr;
  if (it->second.version != t._version()) return nullptr;
  return &it->second;
}

}  // namespace

void verify_written(Session& s, const at::Tensor& t) {
  if (s.verify && t.defined() && t.has_storage())
    s.verify->produced.erase(t.storage().unsafeGetStorageImpl());
}

void verify_after(Session& s, const c10::OperatorHandle& op, const at::Tensor& out) {
  if (!s.verify || !readable(out) || out.is_inference()) return;
  VerifyState& v = *s.verify;
  const c10::StorageImpl* key = out.storage().unsafeGetStorageImpl();
  if (host_counts(out).bad()) {
    v.produced.erase(key);
    return;
  }
  VerifyState::Produced& p = v.produced[key];
  p.storage = out.storage().getWeakStorageImpl();
  p.version = out._version();
  p.producer = &op.schema();
}

void verify_before(Session& s, const c10::OperatorHandle& op, const OpInfo& info,
                   const std::vector<c10::IValue>& args) {
  VerifyState& v = *s.verify;
  const c10::FunctionSchema& schema = op.schema();
  for (size_t i = 0; i < args.size() && i < info.num_args; ++i) {
    if (info.is_out_arg[i]) continue;
    bool done = false;
    for_each_tensor(args[i], [&](const at::Tensor& t) {
      if (done) return;
      const VerifyState::Produced* p = produced_finite(v, t);
      if (p == nullptr) return;
      const HostCounts c = host_counts(t);
      if (!c.bad()) return;
      done = true;
      const c10::FunctionSchema* producer = p->producer;
      v.produced.erase(t.storage().unsafeGetStorageImpl());
      if (s.mode == kModeAsync && s.pending) return;
      ErrorReport r("watch_from_nowhere");
      r.add("reader", op_display_name(schema)).add("argument", schema.arguments()[i].name());
      r.add("producer", producer != nullptr ? op_display_name(*producer) : std::string("an op"));
      r.add("nan_count", c.nan).add("posinf_count", c.posinf).add("neginf_count", c.neginf);
      r.add("first_bad_index", c.first);
      r.add("shape", t.sizes()).add("dtype", std::string(c10::toString(t.scalar_type())));
      r.add("device", t.device().str());
      add_where(r, s, where_now(s));
      deliver(s, r.message("watch: non-finite values from no op"), /*as_pending=*/false);
    });
  }
}

}  // namespace watch
}  // namespace cublas_guard
