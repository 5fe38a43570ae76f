// csrc/locked/watch/watch_device_logic.h: watch's rule, the one decision, shared word
// for word by the CPU kernels (watch_device_cpu.cpp) and the CUDA kernel
// (locked/watch/watch_scan.cu).
//
// Why a header of plain structs and inline functions: the decision a scan
// makes from its counts and its inputs' tags (new origin, inherited origin,
// quiet, finite) and what it writes into the record is the whole protocol.
// Written once here, the CPU runs exactly what the GPU runs, so a machine
// without a GPU tests the logic on every run; each backend adds only the
// counting loop. Nothing here includes ATen: nvcc and the C++ compiler both
// see only these PODs.
//
// Tags (int32, one slot per storage, in the tag array of the storage's device):
//   0             finite (or never written non-finite)
//   kTagUntracked non-finite with no origin this watch saw (values from before the block)
//   kTagQuiet     intended non-finite (a Scalar -inf argument, allow=): never a finding
//   kTagInf       +/-Inf and no NaN, with no origin: a Scalar -inf argument's output (a
//                 masked_fill(-inf) mask), a tensor from before the block holding Inf but no
//                 NaN, and what they become without NaN. A NaN made from such inputs alone
//                 (softmax over a row of -inf, x - x of infinities, 0 * inf) is a birth.
//   >= kTagFirst  an origin: the call with sequence number tag - kTagFirst
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CG_WATCH_HD __host__ __device__ __forceinline__
#else
#define CG_WATCH_HD inline
#endif

namespace cublas_guard {
namespace watch {

constexpr int32_t kTagFinite = 0;
constexpr int32_t kTagUntracked = -1;
constexpr int32_t kTagQuiet = 1;
constexpr int32_t kTagFirst = 2;
constexpr int32_t kTagInf = -2;

constexpr int kMaxTagInputs = 24;  // input tags one scan reads (more: the first 24)
constexpr int kMaxViews = 4;       // inputs whose absolute maximum a birth records

// What one launch does.
enum ScanKind : int32_t {
  kScanOutput = 0,      // an op's output: judge it, tag it (a birth if it is a new origin)
  kScanFirstSight = 1,  // a tensor no watched op wrote: tag it kTagUntracked if non-finite
  kScanEntry = 2,       // an argument of the watched model: a non-finite one is an entry origin
  kScanSink = 3,        // a result that matters: a tagged non-finite value is a finding
};

// Sink ids below 0 are fixed kinds; >= 0 index the host's list of sink descriptions.
constexpr int64_t kSinkBirth = -2;          // report="birth": the birth itself is the finding
constexpr int64_t kSinkBackwardBirth = -3;  // born in backward from finite values: a gradient

// The dtypes a view is read as (the kernels' own codes, no c10 here). kViewValue: a Python
// number (a wrapped 0-dim CPU tensor, also beside a CUDA op), its magnitude read on the host when
// the op is tagged, free, and carried in `value`.
enum ViewDtype : int32_t {
  kViewNone = 0,
  kViewFloat = 1,
  kViewDouble = 2,
  kViewHalf = 3,
  kViewBFloat16 = 4,
  kViewValue = 5,
};

// An input of the op, read only on a birth (its absolute maximum): dense and on
// the output's device, `numel` elements from `data` (a dense tensor's elements
// fill one block of its storage, in some order).
struct InputView {
  const void* data = nullptr;
  int64_t numel = 0;
  int32_t dtype = kViewNone;
  int32_t input = 0;  // which tensor input of the op (the report's input<n>_absmax)
  double value = 0;   // kViewValue: the number's absolute value
};

// The kernel's arguments (by value).
struct TagArgs {
  int32_t kind = kScanOutput;
  int32_t out_slot = -1;  // the scanned tensor's storage slot; -1 none
  int32_t whole = 1;      // the tensor covers its storage (else a finite scan keeps the old tag)
  int32_t fresh = 1;      // the slot was (re)assigned for this write: its old tag is not read
  int32_t n_in = 0;
  // The inputs' tags: in_slots[i] >= 0 is a slot of this device's array (in-place
  // arguments' old tags included); -1: in_values[i], read on the host from the
  // input's own device (a copy between devices).
  int32_t in_slots[kMaxTagInputs];
  int32_t in_values[kMaxTagInputs];
  int32_t seq_read = -1;   // backward: the forward node's index in seq_tags; -1: seq_value
  int32_t seq_value = 0;   // backward: the forward node's tag, read on the host from another device
  int32_t seq_write = -1;  // forward: this op's node's index in seq_tags; -1 none
  int32_t seq_merge = 0;   // not the op's first output: merge into seq_tags[seq_write]
  int32_t seq = 0;         // this call's sequence number
  int32_t scalar_bad = 0;  // a Scalar argument is non-finite
  int32_t allowed = 0;     // the op or module is in allow= (entry: the argument is)
  int32_t birth = 0;       // report="birth"
  int32_t backward = 0;    // the op runs in backward
  int64_t sink = -1;       // a finding's sink id when the output's tag is an origin; -1 none
  int64_t output_index = 0;
  int32_t n_views = 0;
  InputView views[kMaxViews];
};

// What a scan leaves in the record, only when it found something. Entries are
// a ring: claim i goes to entry i % capacity, and `ready` (i + 1, written last,
// zeroed first) says which claim an entry holds, so the host tells a lapped
// entry (a claim it never read: lost, and counted) from a new one.
struct BirthEntry {
  int64_t ready;
  int64_t seq;
  int64_t output_index;
  int64_t nan_count, posinf_count, neginf_count, zero_count, first_bad_index;
  double first_bad_value;
  double input_absmax[kMaxViews];  // per view; NaN: not known
  int64_t input_index[kMaxViews];  // per view: which tensor input of the op it is
};
struct FindingEntry {
  int64_t ready;
  int64_t origin_seq;
  int64_t sink;
};

// The record of one thread's watch on one device: pinned host memory mapped
// into the device on CUDA (async_record.h's pattern: the kernel writes over
// the bus only when it finds something; the host reads it with acquire loads),
// plain host memory on the CPU. The arrays follow the header in one allocation.
struct WatchRecord {
  int64_t flag;      // 0 until a scan wrote an entry (stays 1 for the block)
  int64_t capacity;  // entries of each ring
  BirthEntry* births;
  FindingEntry* findings;
};

// Claim counters (device memory on CUDA): [0] births, [1] findings.
constexpr int kWatchCounters = 2;

// Which of two tags an output inherits: an origin (the earliest), else quiet, else Inf-only,
// else finite (untracked counts as finite here: the caller says non-finite).
CG_WATCH_HD int32_t better_tag(int32_t a, int32_t b) {
  if (a == kTagUntracked) a = kTagFinite;
  if (b == kTagUntracked) b = kTagFinite;
  if (a >= kTagFirst && b >= kTagFirst) return a < b ? a : b;
  if (a >= kTagFirst) return a;
  if (b >= kTagFirst) return b;
  if (a == kTagQuiet || b == kTagQuiet) return kTagQuiet;
  return a == kTagInf || b == kTagInf ? kTagInf : kTagFinite;
}

// The rule: the new tag of a scanned output from its counts and its inputs'
// tags. *new_origin: it is a birth. `has_nan`: the output holds a NaN (not only Inf).
CG_WATCH_HD int32_t decide_tag(const TagArgs& a, const int32_t* tags, const int32_t* seq_tags, bool bad,
                               bool has_nan, bool* new_origin) {
  *new_origin = false;
  if (a.kind == kScanSink) return a.out_slot >= 0 ? tags[a.out_slot] : kTagFinite;
  if (!bad) return kTagFinite;
  if (a.kind == kScanFirstSight) return has_nan ? kTagUntracked : kTagInf;
  if (a.kind == kScanEntry) {
    if (a.allowed) return kTagQuiet;
    *new_origin = true;
    return kTagFirst + a.seq;
  }
  bool any_bad = false;
  bool nan_in = false;  // an input that may hold a NaN (every non-finite tag but kTagInf)
  int32_t inherited = kTagFinite;
  for (int i = 0; i < a.n_in && i < kMaxTagInputs; ++i) {
    const int32_t t = a.in_slots[i] >= 0 ? tags[a.in_slots[i]] : a.in_values[i];
    if (t != kTagFinite) any_bad = true;
    if (t != kTagFinite && t != kTagInf) nan_in = true;
    inherited = better_tag(inherited, t);
  }
  const int32_t seq_tag = a.seq_read >= 0 ? seq_tags[a.seq_read] : a.seq_value;
  int32_t r;
  if (a.scalar_bad) {
    // A Scalar -inf (a mask filled in): Inf-only while no NaN comes of it.
    const bool inf_only = !has_nan && (inherited == kTagFinite || inherited == kTagInf);
    r = inf_only ? kTagInf : better_tag(kTagQuiet, inherited);
  } else if (any_bad && (nan_in || !has_nan)) {
    // A NaN among NaN-capable inputs is theirs; Inf-only inputs give Inf-only.
    r = has_nan && inherited == kTagInf ? kTagUntracked : inherited;
  } else if (!a.birth && seq_tag != kTagFinite) {
    r = seq_tag == kTagInf && has_nan ? kTagQuiet : seq_tag;
  } else if (a.allowed) {
    r = kTagQuiet;
  } else {
    *new_origin = true;
    r = kTagFirst + a.seq;
  }
  return r == kTagFinite ? kTagUntracked : r;  // non-finite: never 0
}

// The slot's new value after a scan: a write the op's kernel made (fresh)
// replaces the old tag; a composite op's output, scanned again, keeps the
// earlier origin; a finite part of a storage leaves the rest's tag.
CG_WATCH_HD int32_t merged_tag(const TagArgs& a, int32_t old_tag, int32_t tag, bool bad) {
  if (a.fresh) old_tag = kTagFinite;
  if (!bad) return a.whole ? kTagFinite : old_tag;
  if (old_tag >= kTagFirst || old_tag == kTagQuiet) return better_tag(old_tag, tag);
  return tag;
}

// The findings one scan makes (at most two); returns how many sink ids it
// wrote. Birth mode: the birth entry itself is the finding (the host reads it
// so), so no finding entry is written.
CG_WATCH_HD int findings_of(const TagArgs& a, int32_t tag, bool bad, bool new_origin, int64_t sinks[2]) {
  int n = 0;
  if (a.birth || !bad) return 0;
  if (a.kind == kScanSink) {
    if (tag >= kTagFirst && a.sink >= 0) sinks[n++] = a.sink;
    return n;
  }
  if (a.kind != kScanOutput) return 0;
  if (new_origin && a.backward) sinks[n++] = kSinkBackwardBirth;
  if (tag >= kTagFirst && a.sink >= 0) sinks[n++] = a.sink;
  return n;
}

// The whole decision after the counting: the slot, the node's tag, and what to
// record. Both backends call it with the counts (`has_nan`: the NaN count is
// not zero); `*birth` and the sinks tell them what to write into the record.
CG_WATCH_HD int32_t apply_rule(const TagArgs& a, int32_t* tags, int32_t* seq_tags, bool bad, bool has_nan,
                               bool* birth, int64_t sinks[2], int* n_sinks) {
  const int32_t tag = decide_tag(a, tags, seq_tags, bad, has_nan, birth);
  if (a.kind != kScanSink && a.out_slot >= 0) tags[a.out_slot] = merged_tag(a, tags[a.out_slot], tag, bad);
  if (a.seq_write >= 0 && (tag >= kTagQuiet || tag == kTagInf)) {
    seq_tags[a.seq_write] = a.seq_merge ? better_tag(seq_tags[a.seq_write], tag) : tag;
  }
  *n_sinks = findings_of(a, tag, bad, *birth, sinks);
  return tag;
}

}  // namespace watch
}  // namespace cublas_guard
