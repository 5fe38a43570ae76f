// Whether a known-values entry still describes the storage it was made for,
// without keeping a freed storage's StorageImpl allocated.
//
// The table is keyed by StorageImpl address, and a new storage can be made at
// a freed one's address. A weak reference to the StorageImpl tells them apart,
// but it keeps every freed tensor's StorageImpl (112 bytes) allocated until
// the entry goes: thousands per training step, which moved where glibc put
// the next allocations, so its heap top was trimmed and regrown and a watched
// MiniLM step took 7-16k more page faults than a plain one
// (benchmarks/investigations/NOTES.md section 7). Instead, a CPU storage from
// the default allocator gets a deleter that wraps the allocator's own (what
// DataPtr::compare_exchange_deleter is for) and, when the data is freed, drops
// its pointer from a process-wide registry of stamped data. An entry holds the
// data pointer and its stamp, and is alive while the registry holds that
// pointer with that stamp and the storage still points at it: a new
// allocation at the same address has no stamp or a newer one, whatever
// StorageImpl it belongs to. Everything else (from_blob, numpy, shared
// memory, COW storages, CUDA) keeps the weak reference.
#include "watch/watch.h"

#include <c10/core/CPUAllocator.h>

#include <pthread.h>

#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace cublas_guard {
namespace watch {
namespace {

c10::DeleterFnPtr allocator_deleter() {
  static const c10::DeleterFnPtr d = c10::GetDefaultCPUAllocator()->raw_deleter();
  return d;
}

// Data pointer -> stamp (an AddressTable: no allocation per storage;
// allocations that follow the tensors' lifetimes are what this file removes
// from the heap's history).
class StampRegistry {
 public:
  std::mutex mu;

  uint64_t find(const void* data) {
    const uint64_t* stamp = stamps_.find(data);
    return stamp != nullptr ? *stamp : 0;
  }
  uint64_t insert(const void* data) { return stamps_.insert(data) = ++last_stamp_; }
  void erase(const void* data) { stamps_.erase(data); }
  size_t size() const { return stamps_.size(); }

 private:
  AddressTable<const void*, uint64_t> stamps_;
  uint64_t last_stamp_ = 0;
};

// Never destroyed: stamped storages are freed until the process exits. Held
// across fork() (as glibc's malloc holds its arenas): a child forked while
// another thread held the lock (a DataLoader worker, say) would otherwise
// deadlock at its first free of a stamped storage.
StampRegistry& stamp_registry() {
  static StampRegistry* r = [] {
    auto* made = new StampRegistry();
    pthread_atfork([] { stamp_registry().mu.lock(); }, [] { stamp_registry().mu.unlock(); },
                   [] { stamp_registry().mu.unlock(); });
    return made;
  }();
  return *r;
}

// The stamped storages' deleter: the allocator's, after the registry forgets
// the pointer (before the memory can be handed out again).
void free_stamped(void* data) {
  {
    StampRegistry& r = stamp_registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.erase(data);
  }
  allocator_deleter()(data);
}

}  // namespace

void Known::track(const at::Tensor& t) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  c10::DataPtr& ptr = impl->_mutable_data_ptr_no_checks();
  data = ptr.get();
  stamp = 0;
  storage = c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
  const c10::DeleterFnPtr deleter = ptr.get_deleter();
  // The wrapped deleter is called with the context: only where it is the data.
  if (data != nullptr && ptr.get_context() == data && impl->device_type() == c10::DeviceType::CPU &&
      (deleter == &free_stamped || deleter == allocator_deleter())) {
    StampRegistry& r = stamp_registry();
    std::lock_guard<std::mutex> lock(r.mu);  // also serializes the swap of the deleter
    if (deleter == &free_stamped) {
      stamp = r.find(data);
    } else {
      stamp = r.insert(data);
      if (!ptr.compare_exchange_deleter(deleter, &free_stamped)) {
        r.erase(data);
        stamp = 0;
      }
    }
  }
  if (stamp == 0) storage = t.storage().getWeakStorageImpl();
}

bool Known::alive() const {
  if (stamp == 0) return !storage.expired();
  StampRegistry& r = stamp_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.find(data) == stamp;
}

bool Known::describes(const at::Tensor& t) const {
  if (stamp == 0) return !storage.expired();
  return t.storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() == data && alive();
}

void hold_stamp_lock(double seconds) {
  std::lock_guard<std::mutex> lock(stamp_registry().mu);
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

size_t stamped_storages() {
  StampRegistry& r = stamp_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.size();
}

}  // namespace watch
}  // namespace cublas_guard
