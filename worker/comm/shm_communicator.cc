// worker/comm/shm_communicator.cc — the shm backend (shm_communicator.h).
//
// ============================================================================
// 1. What and when
//   Every collective is a sequence of ROUNDS. A round has a number, the
//   EPOCH: a per-communicator counter that every rank increments by one per
//   round, identically (calls are collective, so all ranks run the same
//   rounds in the same order). Epochs only grow; they start at 1 and are
//   never reset (2^64 rounds never wrap).
//     AllReduce ≤ one_shot_max_bytes: one round (ONE-SHOT): copy the input into
//       my slot, arrive, wait for every arrival, sum all slots in rank order
//       (my own term read from my input, the same bytes).
//     AllReduce above: TWO-SHOT rounds of ≤ slot_bytes each, the chunk cut
//       into N cache-line-aligned blocks: copy every block but mine into my
//       slot (peers read only "their" block of it), arrive, wait; sum block r
//       of every slot (mine: of my input) in rank order into block r of MY
//       slot and of my output (reduce-scatter: only rank r touches block r
//       of slot r in this phase); publish `reduced`, wait for every
//       `reduced`; copy block p of slot p for every p != r (all-gather).
//     AllGather(V), Broadcast: rounds of ≤ slot_bytes per rank: copy in,
//       arrive, wait, copy the peers' slots out.
//     ReduceScatter: rounds of ≤ slot_bytes/N per block: copy my pieces for
//       the peers in, arrive, wait, sum piece r of every slot (mine: of my
//       input) in rank order.
//     AllToAllV: rounds with a header (my send sizes) and one sub-slot per
//       destination; round 0's headers give every rank the whole size matrix,
//       hence the same round count and a cross-check of send/recv sizes.
//     Barrier: one round without data.
//   The threshold and slot size are rank 0's options, stored in the segment
//   header; defaults measured by tests/bench/allreduce_bench.sh.
//
// 2. Layout and ownership (one segment, created by rank 0, mapped by all,
//    name unlinked by rank 0 once all joined, unmapped by each destructor)
//     line 0          SegmentHeader: magic (written last), version, world size,
//                     slot_bytes, one_shot_max_bytes, total size
//     GroupState      `broken` word; `joined` count (futex); first reason text
//     RankState[N]    per rank, each on its own 64-byte lines:
//                       pid       registered at join
//                       arrive    epoch of my last arrival + per-parity call
//                                 descriptors (op, type, size) on the same line
//                       reduced   epoch of my last reduce-scatter result (two-shot)
//                       bell      futex word my sleeping peers wait on, and the
//                                 number of them (`waiters`)
//     slots           per rank two buffers of slot_bytes, 4 KiB aligned:
//                     buffer (epoch & 1) is used in round `epoch` (DOUBLE
//                     BUFFERING). Each rank writes only its own slots;
//                     peers only read them.
//
// 3. Epochs and flags
//   arrive[r] = e  means: rank r has finished every read of round e-1 (it only
//                  starts round e after finishing e-1), its data for round e
//                  is in slot(r, e&1) and its descriptor for e in desc[e&1].
//   reduced[r] = e means: block r of slot(r, e&1) holds the reduced block.
//   Waits test `flag >= e`, never `==`: a peer may already be one round ahead.
//
// 4. Invariants
//   I1 A rank writes slot(r, e&1) only in round e, and only after it has seen
//      arrive[p] >= e-1 for every peer p (BeginRound). Every round that reads
//      peers' data waits for all arrivals first, so this check is normally
//      already satisfied and costs nothing.
//   I2 Whoever reads slot(p, e&1) does so during round e only, after seeing
//      arrive[p] >= e (or reduced[p] >= e), and before publishing arrive = e+1.
//   I3 Hence no rank is ever more than one round ahead of the slowest rank
//      in the data it touches: to write slot(r, e&1) again (round e+2) rank r
//      needs arrive[p] >= e+1 from every p, which p publishes only after its
//      last read of round e (I2) — no write-after-read race; a peer's read in
//      round e sees data published with release (O2) and acquired (O3) — no
//      read-before-write race. Buffers of rounds e and e+1 are disjoint
//      (parity), so a rank one round ahead never disturbs a round-e reader.
//      The same holds for the descriptors (parity-indexed) and, in two-shot,
//      for block r of slot r (written by r between its arrival wait and
//      `reduced`, read by peers after `reduced`, not written again until
//      round e+2).
//   I4 Sums run in rank order 0..N-1 (worker/comm/reduce_sum.h) over the same
//      bytes on every rank; two-shot's reduced blocks are copied, not
//      recomputed. So all ranks hold bit-identical results, and one-shot and
//      two-shot give the same bits.
//   I5 A caller's buffers are touched only by its own process, during the call.
//
// 5. Memory ordering (every atomic access names its order and cites a row)
//   O1 header.magic: store release by rank 0 after the whole layout and all
//      flags are initialised; load acquire by joiners before reading them.
//   O2 arrive/reduced: store seq_cst by the owner after its slot writes
//      (release for the data; seq_cst for O5). Descriptor words are relaxed,
//      written before and read after this edge.
//   O3 arrive/reduced: load acquire by waiters before reading the slot.
//   O4 pid (release CAS) then joined (acq_rel add); joiners load joined
//      acquire, then the pids.
//   O5 Sleeping (Dekker handshake, all seq_cst): waiter: waiters += 1; read
//      bell; re-check flag and broken; FUTEX_WAIT(bell, value read). Owner:
//      store flag (O2); if waiters != 0 { bell += 1; FUTEX_WAKE(bell) }.
//      Either the owner sees the waiter and rings (the futex value changed or
//      the waiter is woken), or the waiter's re-check sees the flag. A missed
//      wake-up would cost at most one poll interval (the FUTEX_WAIT timeout).
//   O6 broken: CAS 0->1 (acq_rel) claims the reason text, store 2 release
//      after writing it; readers load acquire and read the text once it is 2.
//
// 6. Waiting and failure
//   A wait spins spin_iterations polls (PAUSE), then polls yield_iterations
//   times with sched_yield() (ranks may outnumber cores: the core goes to a
//   runnable peer at once), then sleeps on the awaited peer's bell with a
//   timeout of min(poll_interval, time to the deadline).
//   It checks `broken` on every poll and, at least every poll_interval, the
//   deadline and the liveness (pidfd readable = exited) of the peers it still
//   waits for (a peer that finished its part and exited is no error). Any
//   failure — deadline (DeadlineExceeded naming the missing ranks), a dead
//   peer (Unavailable "rank R (pid P) exited"), a call mismatch
//   (InvalidArgument), Abort() — claims `broken` with its reason and rings
//   every bell, so sleepers wake and fail with Aborted "communicator broken:
//   <reason>". Broken is final: every later call fails the same way.
// ============================================================================
#include "worker/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "worker/comm/reduce_sum.h"

namespace exl3serve::worker::comm {
namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<int32_t>::is_always_lock_free);
static_assert(kShmMaxWorldSize <= kMaxSumSources);

constexpr size_t kLineBytes = 64;
constexpr size_t kPageBytes = 4096;
constexpr size_t kMinSlotBytes = 64 << 10;
constexpr uint64_t kMagic = 0x314d48533358454cull;  // "LEX3SHM1"
constexpr uint32_t kLayoutVersion = 1;
constexpr size_t kReasonBytes = 1024;

struct alignas(kLineBytes) SegmentHeader {
  std::atomic<uint64_t> magic{0};  // O1
  uint32_t version = 0;
  uint32_t world_size = 0;
  uint64_t slot_bytes = 0;
  uint64_t one_shot_max_bytes = 0;
  uint64_t total_bytes = 0;
};

struct GroupState {
  alignas(kLineBytes) std::atomic<uint32_t> broken{0};  // O6: 0 ok, 1 claimed, 2 reason written
  alignas(kLineBytes) std::atomic<uint32_t> joined{0};  // O4, futex word during join
  alignas(kLineBytes) char reason[kReasonBytes] = {};
};

struct RankState {
  alignas(kLineBytes) std::atomic<int32_t> pid{0};  // O4
  alignas(kLineBytes) std::atomic<uint64_t> arrive{0};  // O2/O3
  std::atomic<uint64_t> desc[2][2] = {};                // [epoch & 1][word], relaxed
  alignas(kLineBytes) std::atomic<uint64_t> reduced{0};  // O2/O3
  alignas(kLineBytes) std::atomic<uint32_t> bell{0};     // O5, futex word
  std::atomic<uint32_t> waiters{0};                      // O5
};

size_t RoundUp(size_t x, size_t to) { return (x + to - 1) / to * to; }
size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

struct Layout {
  size_t group_offset = 0;
  size_t ranks_offset = 0;
  size_t slots_offset = 0;
  size_t slot_bytes = 0;
  size_t total_bytes = 0;
};

Layout ComputeLayout(int world_size, size_t slot_bytes) {
  Layout l;
  l.group_offset = RoundUp(sizeof(SegmentHeader), kLineBytes);
  l.ranks_offset = RoundUp(l.group_offset + sizeof(GroupState), kLineBytes);
  l.slots_offset = RoundUp(l.ranks_offset + world_size * sizeof(RankState), kPageBytes);
  l.slot_bytes = RoundUp(slot_bytes, kPageBytes);
  l.total_bytes = l.slots_offset + 2 * static_cast<size_t>(world_size) * l.slot_bytes;
  return l;
}

std::string ErrnoText(int err) { return std::strerror(err); }

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return;
  timespec ts = absl::ToTimespec(timeout);
  // Shared (not FUTEX_PRIVATE): the word lives in memory mapped by several processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Sleeps min(d, deadline - now) without a futex (only while waiting for the
// segment file to appear during join).
void SleepUntilNoLaterThan(absl::Duration d, absl::Time deadline) {
  const absl::Duration left = std::min(d, deadline - absl::Now());
  if (left <= absl::ZeroDuration()) return;
  timespec ts = absl::ToTimespec(left);
  nanosleep(&ts, nullptr);
}

// kShmAutoSpin: spin only when every rank can have a core of its own.
int AutoSpin(int world_size) {
  cpu_set_t set;
  CPU_ZERO(&set);
  int cpus = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 0;
  if (cpus <= 0) cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  return world_size <= cpus ? kShmSpinWhenCoresSuffice : 0;
}

int PidfdOpen(int32_t pid) { return static_cast<int>(syscall(SYS_pidfd_open, pid, 0)); }

// Liveness without pidfds (kernels before 5.3 or a seccomp filter): the
// process is gone or a zombie. Weaker (pid reuse) but only a fallback.
bool ProcessExitedByProc(int32_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() &&
         (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

enum class OpCode : uint8_t {
  kAllReduce = 1,
  kAllGather,
  kAllGatherV,
  kReduceScatter,
  kAllToAllV,
  kBroadcast,
  kBarrier,
};

const char* OpName(OpCode op) {
  switch (op) {
    case OpCode::kAllReduce:
      return "all_reduce";
    case OpCode::kAllGather:
      return "all_gather";
    case OpCode::kAllGatherV:
      return "all_gather_v";
    case OpCode::kReduceScatter:
      return "reduce_scatter";
    case OpCode::kAllToAllV:
      return "all_to_all_v";
    case OpCode::kBroadcast:
      return "broadcast";
    case OpCode::kBarrier:
      return "barrier";
  }
  return "?";
}

// What one rank says it is calling, compared across ranks every round.
struct CallDesc {
  uint64_t word0 = 0;  // op | (dtype + 1) << 8 | root << 16
  uint64_t word1 = 0;  // count, bytes or a hash of the sizes

  bool operator==(const CallDesc&) const = default;
};

CallDesc MakeDesc(OpCode op, int dtype, int root, uint64_t size) {
  return CallDesc{static_cast<uint64_t>(op) | static_cast<uint64_t>(dtype + 1) << 8 |
                      static_cast<uint64_t>(root) << 16,
                  size};
}

std::string DescribeDesc(const CallDesc& d) {
  const auto op = static_cast<OpCode>(d.word0 & 0xff);
  const int dtype = static_cast<int>((d.word0 >> 8) & 0xff) - 1;
  const int root = static_cast<int>(d.word0 >> 16);
  std::string s = OpName(op);
  switch (op) {
    case OpCode::kAllReduce:
    case OpCode::kReduceScatter:
      absl::StrAppend(&s, "(", dtype >= 0 ? CommDataTypeName(static_cast<CommDataType>(dtype)) : "?",
                      ", count ", d.word1, ")");
      break;
    case OpCode::kAllGather:
      absl::StrAppend(&s, "(bytes ", d.word1, ")");
      break;
    case OpCode::kBroadcast:
      absl::StrAppend(&s, "(bytes ", d.word1, ", root ", root, ")");
      break;
    case OpCode::kAllGatherV:
      absl::StrAppend(&s, "(sizes hash ", d.word1, ")");
      break;
    default:
      break;
  }
  return s;
}

uint64_t HashSizes(std::span<const size_t> sizes) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t v : sizes) {
    for (int b = 0; b < 8; ++b) {
      h ^= (static_cast<uint64_t>(v) >> (8 * b)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return h;
}

// A mapping that unmaps itself unless released.
class Mapping {
 public:
  Mapping() = default;
  Mapping(void* base, size_t bytes) : base_(static_cast<std::byte*>(base)), bytes_(bytes) {}
  ~Mapping() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  Mapping(Mapping&& other) noexcept
      : base_(std::exchange(other.base_, nullptr)), bytes_(other.bytes_) {}
  Mapping& operator=(Mapping&& other) noexcept {
    std::swap(base_, other.base_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  std::byte* base() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  std::byte* base_ = nullptr;
  size_t bytes_ = 0;
};

absl::Status ValidateOptions(const ShmOptions& o) {
  const std::string& n = o.name;
  if (n.size() < 2 || n.size() > 201 || n[0] != '/' || n.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm: segment name must be \"/\" followed by 1..200 characters without \"/\", got \"", n,
        "\""));
  }
  if (o.world_size < 1 || o.world_size > kShmMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat("shm ", n, ": world_size must be in [1, ",
                                                   kShmMaxWorldSize, "], got ", o.world_size));
  }
  if (o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("shm ", n, ": rank must be in [0, ",
                                                   o.world_size, "), got ", o.rank));
  }
  if (o.rank == 0) {
    if (o.slot_bytes < kMinSlotBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shm ", n, ": slot_bytes must be >= ", kMinSlotBytes, ", got ", o.slot_bytes));
    }
    if (o.one_shot_max_bytes != kShmAutoOneShot && o.one_shot_max_bytes > o.slot_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("shm ", n, ": one_shot_max_bytes (",
                                                     o.one_shot_max_bytes, ") must be <= slot_bytes (",
                                                     o.slot_bytes, ")"));
    }
  }
  if (o.poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("shm ", n, ": poll_interval must be > 0, got ",
                                                   absl::FormatDuration(o.poll_interval)));
  }
  if (o.spin_iterations < 0 && o.spin_iterations != kShmAutoSpin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm ", n, ": spin_iterations must be >= 0 or kShmAutoSpin, got ", o.spin_iterations));
  }
  if (o.yield_iterations < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm ", n, ": yield_iterations must be >= 0, got ", o.yield_iterations));
  }
  return absl::OkStatus();
}

class ShmCommunicator final : public Communicator {
 public:
  // Joins the group (see CreateShmCommunicator).
  static absl::StatusOr<std::unique_ptr<Communicator>> Join(const ShmOptions& options);

  ~ShmCommunicator() override {
    for (int fd : pidfds_) {
      if (fd >= 0) close(fd);
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "shm"; }

  absl::Status AllReduce(void* data, size_t count, CommDataType type,
                         absl::Time deadline) override;
  absl::Status AllGather(const void* send, size_t bytes, void* recv,
                         absl::Time deadline) override;
  absl::Status AllGatherV(const void* send, std::span<const size_t> bytes_per_rank, void* recv,
                          absl::Time deadline) override;
  absl::Status ReduceScatter(const void* data, size_t count, CommDataType type, void* recv,
                             absl::Time deadline) override;
  absl::Status AllToAllV(const void* send, std::span<const size_t> send_bytes, void* recv,
                         std::span<const size_t> recv_bytes, absl::Time deadline) override;
  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Time deadline) override;
  absl::Status Barrier(absl::Time deadline) override;
  void Abort(const absl::Status& reason) override;
  absl::Status health() const override;

 private:
  enum class Flag { kArrive, kReduced };

  // One collective call as the round machinery sees it.
  struct Call {
    OpCode op;
    CallDesc desc;
    absl::Time deadline;
  };

  ShmCommunicator(const ShmOptions& options, Mapping mapping, const Layout& layout,
                  size_t one_shot_max_bytes);

  // Join steps (Join() runs them in order).
  absl::Status WaitForAllJoined(absl::Time deadline);
  absl::Status OpenPidfd(int peer);

  RankState& Rank(int r) const { return ranks_[r]; }
  std::atomic<uint64_t>& FlagWord(int r, Flag flag) const {
    return flag == Flag::kArrive ? ranks_[r].arrive : ranks_[r].reduced;
  }
  std::byte* Slot(int r, uint64_t epoch) const {
    return slots_ + (static_cast<size_t>(r) * 2 + (epoch & 1)) * slot_bytes_;
  }

  // OK, or the status to return when the communicator is already broken.
  absl::Status Enter(const Call& call);
  // Starts the next round (I1); returns its epoch.
  absl::StatusOr<uint64_t> BeginRound(const Call& call);
  // Publishes my descriptor and arrival for `epoch` (O2).
  void Arrive(uint64_t epoch, const Call& call);
  // Waits until every peer arrived for `epoch` and checks the descriptors.
  absl::Status AwaitArrivals(uint64_t epoch, const Call& call);
  // Stores `epoch` into my flag and rings my bell if someone sleeps on it (O5).
  void Publish(Flag flag, uint64_t epoch);
  // Waits until FlagWord(p, flag) >= epoch for every peer p.
  absl::Status AwaitPeers(Flag flag, uint64_t epoch, const Call& call);
  // Fails with Unavailable if a peer we still wait for has exited.
  absl::Status CheckWaitedPeersAlive(Flag flag, uint64_t epoch, const Call& call);
  bool PeerExited(int peer) const;

  // Records `status` as this rank's failure (the first one stays), marks the
  // group broken with it and returns it.
  absl::Status Fail(absl::Status status);
  // Marks the segment broken with `reason` unless it already is; rings every bell.
  void MarkBroken(const std::string& reason);
  // Aborted "communicator broken: <first reason in the segment>".
  absl::Status BrokenStatus() const;
  bool SegmentBroken() const {
    return group_->broken.load(std::memory_order_acquire) != 0;  // O6
  }

  absl::Status GatherV(const Call& call, const void* send, std::span<const size_t> bytes_per_rank,
                       void* recv);

  // --- constant after construction
  const int rank_;
  const int world_;
  const std::string name_;
  const Mapping mapping_;
  SegmentHeader* const header_;
  GroupState* const group_;
  RankState* const ranks_;
  std::byte* const slots_;
  const size_t slot_bytes_;
  const size_t one_shot_max_bytes_;
  const absl::Duration poll_interval_;
  const int spin_iterations_;
  const int yield_iterations_;
  const std::function<void(uint64_t)> round_hook_;
  // Set during Join, then constant.
  std::vector<int32_t> pids_;
  // A pidfd per peer, or one of these:
  static constexpr int kNoPeer = -1;    // self, or not registered yet
  static constexpr int kNoPidfd = -2;   // no pidfd support: liveness from /proc
  static constexpr int kPeerGone = -3;  // exited before its pidfd was opened
  std::vector<int> pidfds_;

  // --- the caller thread only
  uint64_t epoch_ = 0;      // the last round started
  uint64_t confirmed_ = 0;  // every peer's arrive >= confirmed_ has been seen

  // --- own synchronisation (Abort and health may come from other threads)
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  absl::Status failure_;  // guarded by mu_: the first failure of this rank
};

ShmCommunicator::ShmCommunicator(const ShmOptions& options, Mapping mapping, const Layout& layout,
                                 size_t one_shot_max_bytes)
    : rank_(options.rank),
      world_(options.world_size),
      name_(options.name),
      mapping_(std::move(mapping)),
      header_(reinterpret_cast<SegmentHeader*>(mapping_.base())),
      group_(reinterpret_cast<GroupState*>(mapping_.base() + layout.group_offset)),
      ranks_(reinterpret_cast<RankState*>(mapping_.base() + layout.ranks_offset)),
      slots_(mapping_.base() + layout.slots_offset),
      slot_bytes_(layout.slot_bytes),
      one_shot_max_bytes_(one_shot_max_bytes),
      poll_interval_(options.poll_interval),
      spin_iterations_(options.spin_iterations == kShmAutoSpin ? AutoSpin(options.world_size)
                                                               : options.spin_iterations),
      yield_iterations_(options.yield_iterations),
      round_hook_(options.round_hook_for_testing),
      pids_(options.world_size, 0),
      pidfds_(options.world_size, -1) {}

// ---------------------------------------------------------------- joining

absl::StatusOr<std::unique_ptr<Communicator>> ShmCommunicator::Join(const ShmOptions& o) {
  const char* name = o.name.c_str();
  const std::string where = absl::StrCat("shm join ", o.name, " (rank ", o.rank, ")");
  Mapping mapping;
  Layout layout;
  size_t one_shot_max_bytes = o.one_shot_max_bytes;
  if (o.rank == 0) {
    layout = ComputeLayout(o.world_size, o.slot_bytes);
    if (one_shot_max_bytes == kShmAutoOneShot) {
      one_shot_max_bytes = std::min(ShmAutoOneShotMaxBytes(o.world_size), layout.slot_bytes);
    }
    const int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
      if (errno == EEXIST) {
        return absl::AlreadyExistsError(absl::StrCat(
            where, ": the segment already exists (a stale group? remove it with UnlinkShmSegment)"));
      }
      return absl::InternalError(absl::StrCat(where, ": shm_open: ", ErrnoText(errno)));
    }
    if (ftruncate(fd, static_cast<off_t>(layout.total_bytes)) != 0) {
      const int err = errno;
      close(fd);
      shm_unlink(name);
      return absl::InternalError(absl::StrCat(where, ": ftruncate to ", layout.total_bytes,
                                              " bytes: ", ErrnoText(err)));
    }
    void* base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (base == MAP_FAILED) {
      shm_unlink(name);
      return absl::InternalError(absl::StrCat(where, ": mmap of ", layout.total_bytes,
                                              " bytes: ", ErrnoText(err)));
    }
    mapping = Mapping(base, layout.total_bytes);
    auto* header = new (mapping.base()) SegmentHeader();
    new (mapping.base() + layout.group_offset) GroupState();
    for (int r = 0; r < o.world_size; ++r) {
      new (mapping.base() + layout.ranks_offset + r * sizeof(RankState)) RankState();
    }
    header->version = kLayoutVersion;
    header->world_size = static_cast<uint32_t>(o.world_size);
    header->slot_bytes = layout.slot_bytes;
    header->one_shot_max_bytes = one_shot_max_bytes;
    header->total_bytes = layout.total_bytes;
    header->magic.store(kMagic, std::memory_order_release);  // O1
  } else {
    // Wait for rank 0 to create and initialise the segment. There is no way
    // to block on a name appearing, so poll every poll_interval.
    while (true) {
      const int fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
      if (fd < 0) {
        if (errno != ENOENT) {
          return absl::InternalError(absl::StrCat(where, ": shm_open: ", ErrnoText(errno)));
        }
      } else {
        struct stat st {};
        bool ready = false;
        if (fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= kPageBytes) {
          void* head = mmap(nullptr, kPageBytes, PROT_READ, MAP_SHARED, fd, 0);
          if (head != MAP_FAILED) {
            const auto* h = static_cast<const SegmentHeader*>(head);
            if (h->magic.load(std::memory_order_acquire) == kMagic) {  // O1
              ready = true;
              const uint32_t version = h->version;
              const uint32_t world = h->world_size;
              const size_t slot_bytes = h->slot_bytes;
              const size_t total = h->total_bytes;
              one_shot_max_bytes = h->one_shot_max_bytes;
              munmap(head, kPageBytes);
              absl::Status bad;
              if (version != kLayoutVersion) {
                bad = absl::InvalidArgumentError(absl::StrCat(
                    where, ": segment layout version ", version, ", this build speaks ",
                    kLayoutVersion));
              } else if (static_cast<int>(world) != o.world_size) {
                bad = absl::InvalidArgumentError(
                    absl::StrCat(where, ": the segment was created for world size ", world,
                                 ", this rank was started with ", o.world_size));
              }
              layout = ComputeLayout(static_cast<int>(world), slot_bytes);
              if (bad.ok() && (layout.total_bytes != total ||
                               static_cast<size_t>(st.st_size) < total)) {
                bad = absl::InvalidArgumentError(
                    absl::StrCat(where, ": segment size ", st.st_size, " does not match its header (",
                                 total, " bytes)"));
              }
              if (!bad.ok()) {
                close(fd);
                return bad;
              }
              void* base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
              const int err = errno;
              close(fd);
              if (base == MAP_FAILED) {
                return absl::InternalError(
                    absl::StrCat(where, ": mmap of ", total, " bytes: ", ErrnoText(err)));
              }
              mapping = Mapping(base, total);
            } else {
              munmap(head, kPageBytes);
            }
          }
        }
        if (ready) break;
        close(fd);
      }
      if (absl::Now() >= o.join_deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            where, ": rank 0 did not create and initialise the segment by the join deadline"));
      }
      SleepUntilNoLaterThan(o.poll_interval, o.join_deadline);
    }
  }

  std::unique_ptr<ShmCommunicator> comm(
      new ShmCommunicator(o, std::move(mapping), layout, one_shot_max_bytes));
  absl::Status status = comm->WaitForAllJoined(o.join_deadline);
  if (o.rank == 0) shm_unlink(name);  // all joined, or the group is given up
  if (!status.ok()) return status;
  return std::unique_ptr<Communicator>(std::move(comm));
}

absl::Status ShmCommunicator::OpenPidfd(int peer) {
  const int32_t pid = pids_[peer];
  const int fd = PidfdOpen(pid);
  if (fd >= 0) {
    pidfds_[peer] = fd;
    return absl::OkStatus();
  }
  if (errno == ESRCH) {
    pidfds_[peer] = kPeerGone;
    return absl::UnavailableError(absl::StrCat("rank ", peer, " (pid ", pid, ") exited"));
  }
  pidfds_[peer] = kNoPidfd;  // no pidfd support here: fall back to /proc
  return absl::OkStatus();
}

absl::Status ShmCommunicator::WaitForAllJoined(absl::Time deadline) {
  const std::string where = absl::StrCat("shm join ", name_, " (rank ", rank_, ")");
  const int32_t my_pid = static_cast<int32_t>(getpid());
  int32_t expected = 0;
  if (!Rank(rank_).pid.compare_exchange_strong(expected, my_pid,
                                               std::memory_order_release)) {  // O4
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(where, ": rank ", rank_, " already joined (pid ", expected, ")")));
  }
  pids_[rank_] = my_pid;
  group_->joined.fetch_add(1, std::memory_order_acq_rel);  // O4
  FutexWakeAll(&group_->joined);
  if (round_hook_) round_hook_(0);
  auto all_joined = [&] {
    return group_->joined.load(std::memory_order_acquire) >= static_cast<uint32_t>(world_);  // O4
  };
  // Every failure below is re-checked against all_joined(): a peer may join
  // and then exit or break the group before this rank looks again; that is
  // the first collective's business, not the join's.
  while (true) {
    const uint32_t joined = group_->joined.load(std::memory_order_acquire);  // O4
    if (joined >= static_cast<uint32_t>(world_)) break;
    absl::Status failure;
    for (int p = 0; p < world_ && failure.ok(); ++p) {
      if (p == rank_ || pidfds_[p] != kNoPeer) continue;
      const int32_t pid = Rank(p).pid.load(std::memory_order_acquire);
      if (pid == 0) continue;
      pids_[p] = pid;
      failure = Annotate(OpenPidfd(p), where);
    }
    for (int p = 0; p < world_ && failure.ok(); ++p) {
      if (p != rank_ && pidfds_[p] != kNoPeer && PeerExited(p)) {
        failure = absl::UnavailableError(
            absl::StrCat(where, ": rank ", p, " (pid ", pids_[p], ") exited"));
      }
    }
    // A peer that gave up marked the group broken before exiting: its reason
    // says more than its exit.
    if (SegmentBroken()) failure = BrokenStatus();
    const absl::Time now = absl::Now();
    if (failure.ok() && now >= deadline) {
      std::vector<int> missing;
      for (int p = 0; p < world_; ++p) {
        if (Rank(p).pid.load(std::memory_order_acquire) == 0) missing.push_back(p);
      }
      failure = absl::DeadlineExceededError(absl::StrCat(
          where, ": ranks ", absl::StrJoin(missing, ", "), " did not join by the join deadline"));
    }
    if (!failure.ok()) {
      if (all_joined()) break;
      return Fail(failure);
    }
    FutexWait(&group_->joined, joined, std::min(poll_interval_, deadline - now));
  }
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || pidfds_[p] != kNoPeer) continue;
    pids_[p] = Rank(p).pid.load(std::memory_order_acquire);  // O4
    // A peer that already exited is marked gone; the first call that needs it fails.
    OpenPidfd(p).IgnoreError();
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- failure

absl::Status ShmCommunicator::Fail(absl::Status status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = status;
  }
  failed_.store(true, std::memory_order_release);
  MarkBroken(absl::StrCat("rank ", rank_, ": ", status.ToString()));
  return status;
}

void ShmCommunicator::MarkBroken(const std::string& reason) {
  uint32_t expected = 0;
  if (group_->broken.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {  // O6
    const size_t n = std::min(reason.size(), kReasonBytes - 1);
    std::memcpy(group_->reason, reason.data(), n);
    group_->reason[n] = '\0';
    group_->broken.store(2, std::memory_order_release);  // O6
  }
  for (int p = 0; p < world_; ++p) {
    Rank(p).bell.fetch_add(1, std::memory_order_seq_cst);  // O5
    FutexWakeAll(&Rank(p).bell);
  }
  FutexWakeAll(&group_->joined);
}

absl::Status ShmCommunicator::BrokenStatus() const {
  // The claimant writes the reason right after its CAS; give it a moment.
  const absl::Time give_up = absl::Now() + absl::Milliseconds(100);
  while (group_->broken.load(std::memory_order_acquire) == 1 && absl::Now() < give_up) {  // O6
    SleepUntilNoLaterThan(absl::Microseconds(50), give_up);
  }
  if (group_->broken.load(std::memory_order_acquire) != 2) {
    return absl::AbortedError("communicator broken: (the reason was not written)");
  }
  return absl::AbortedError(absl::StrCat("communicator broken: ", group_->reason));
}

void ShmCommunicator::Abort(const absl::Status& reason) {
  const std::string text =
      absl::StrCat("rank ", rank_, " aborted: ", reason.ok() ? "no reason given" : reason.ToString());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = absl::AbortedError(absl::StrCat("communicator broken: ", text));
  }
  failed_.store(true, std::memory_order_release);
  MarkBroken(text);
}

absl::Status ShmCommunicator::health() const {
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
  }
  if (SegmentBroken()) return BrokenStatus();
  return absl::OkStatus();
}

// ---------------------------------------------------------------- rounds

absl::Status ShmCommunicator::Enter(const Call& call) {
  if (failed_.load(std::memory_order_acquire) || SegmentBroken()) {
    absl::Status broken = BrokenStatus();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.ok()) failure_ = broken;
    }
    failed_.store(true, std::memory_order_release);
    return broken;
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> ShmCommunicator::BeginRound(const Call& call) {
  const uint64_t epoch = ++epoch_;
  if (confirmed_ + 1 < epoch) {  // I1 (normally already true)
    EXL3_RETURN_IF_ERROR(AwaitPeers(Flag::kArrive, epoch - 1, call));
    confirmed_ = epoch - 1;
  }
  return epoch;
}

void ShmCommunicator::Publish(Flag flag, uint64_t epoch) {
  RankState& me = Rank(rank_);
  FlagWord(rank_, flag).store(epoch, std::memory_order_seq_cst);  // O2, O5
  if (me.waiters.load(std::memory_order_seq_cst) != 0) {         // O5
    me.bell.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&me.bell);
  }
}

void ShmCommunicator::Arrive(uint64_t epoch, const Call& call) {
  RankState& me = Rank(rank_);
  me.desc[epoch & 1][0].store(call.desc.word0, std::memory_order_relaxed);  // ordered by O2
  me.desc[epoch & 1][1].store(call.desc.word1, std::memory_order_relaxed);
  Publish(Flag::kArrive, epoch);
  if (round_hook_) round_hook_(epoch);
}

absl::Status ShmCommunicator::AwaitArrivals(uint64_t epoch, const Call& call) {
  EXL3_RETURN_IF_ERROR(AwaitPeers(Flag::kArrive, epoch, call));
  confirmed_ = epoch;
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const CallDesc theirs{Rank(p).desc[epoch & 1][0].load(std::memory_order_relaxed),  // after O3
                          Rank(p).desc[epoch & 1][1].load(std::memory_order_relaxed)};
    if (!(theirs == call.desc)) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "shm ", OpName(call.op), ": collective mismatch at epoch ", epoch, ": rank ", rank_,
          " called ", DescribeDesc(call.desc), ", rank ", p, " called ", DescribeDesc(theirs))));
    }
  }
  return absl::OkStatus();
}

bool ShmCommunicator::PeerExited(int peer) const {
  const int fd = pidfds_[peer];
  if (fd == kPeerGone) return true;
  if (fd == kNoPidfd) return ProcessExitedByProc(pids_[peer]);
  if (fd < 0) return false;
  pollfd pfd{fd, POLLIN, 0};
  return poll(&pfd, 1, 0) > 0 && (pfd.revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

absl::Status ShmCommunicator::CheckWaitedPeersAlive(Flag flag, uint64_t epoch, const Call& call) {
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    if (FlagWord(p, flag).load(std::memory_order_acquire) >= epoch) continue;  // O3
    if (PeerExited(p)) {
      // A peer that failed marked the group broken before it exited.
      if (SegmentBroken()) return Fail(BrokenStatus());
      return Fail(absl::UnavailableError(absl::StrCat("rank ", p, " (pid ", pids_[p],
                                                      ") exited (shm ", OpName(call.op),
                                                      ", epoch ", epoch, ", seen by rank ", rank_,
                                                      ")")));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::AwaitPeers(Flag flag, uint64_t epoch, const Call& call) {
  int spins_left = spin_iterations_;
  int yields_left = yield_iterations_;
  absl::Time next_liveness_check = absl::InfinitePast();
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    std::atomic<uint64_t>& word = FlagWord(p, flag);
    if (word.load(std::memory_order_acquire) >= epoch) continue;  // O3
    uint32_t polls = 0;
    while (true) {
      if (SegmentBroken()) return Fail(BrokenStatus());
      if (spins_left > 0) {
        --spins_left;
        CpuRelax();
        if (word.load(std::memory_order_acquire) >= epoch) break;  // O3
        if ((++polls & 1023) != 0) continue;
      } else if (yields_left > 0) {
        // Hands the core to a runnable peer (ranks may outnumber cores)
        // without the cost of a futex sleep and wake.
        --yields_left;
        sched_yield();
        if (word.load(std::memory_order_acquire) >= epoch) break;  // O3
        if ((++polls & 15) != 0) continue;
      }
      const absl::Time now = absl::Now();
      if (now >= call.deadline) {
        std::vector<int> missing;
        for (int q = 0; q < world_; ++q) {
          if (q != rank_ && FlagWord(q, flag).load(std::memory_order_acquire) < epoch) {
            missing.push_back(q);
          }
        }
        if (missing.empty()) break;  // everyone made it after all
        return Fail(absl::DeadlineExceededError(absl::StrCat(
            "shm ", OpName(call.op), ": deadline passed at epoch ", epoch, " on rank ", rank_,
            ", not heard from ranks ", absl::StrJoin(missing, ", "))));
      }
      if (now >= next_liveness_check) {
        EXL3_RETURN_IF_ERROR(CheckWaitedPeersAlive(flag, epoch, call));
        next_liveness_check = now + poll_interval_;
      }
      if (spins_left > 0 || yields_left > 0) continue;
      RankState& peer = Rank(p);
      peer.waiters.fetch_add(1, std::memory_order_seq_cst);  // O5
      const uint32_t bell = peer.bell.load(std::memory_order_seq_cst);
      if (word.load(std::memory_order_seq_cst) < epoch &&
          group_->broken.load(std::memory_order_seq_cst) == 0) {
        FutexWait(&peer.bell, bell, std::min(poll_interval_, call.deadline - now));
      }
      peer.waiters.fetch_sub(1, std::memory_order_seq_cst);
      if (word.load(std::memory_order_acquire) >= epoch) break;  // O3
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------- collectives

absl::Status ShmCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                        absl::Time deadline) {
  const Call call{OpCode::kAllReduce,
                  MakeDesc(OpCode::kAllReduce, static_cast<int>(type), 0, count), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (count == 0 || world_ == 1) return absl::OkStatus();
  const size_t esize = CommDataTypeSize(type);
  auto* out = static_cast<std::byte*>(data);
  const void* srcs[kShmMaxWorldSize];
  if (count * esize <= one_shot_max_bytes_) {
    EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
    std::memcpy(Slot(rank_, epoch), out, count * esize);
    Arrive(epoch, call);
    EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
    // My own term straight from `out` (the same bytes as my slot; dst may alias a source).
    for (int p = 0; p < world_; ++p) srcs[p] = p == rank_ ? out : Slot(p, epoch);
    SumInOrder(type, srcs, world_, out, count);
    return absl::OkStatus();
  }
  // Two-shot. Block boundaries on cache lines; slot_bytes_ is a multiple of
  // 4 KiB, so whole chunks are too.
  const size_t align = kLineBytes / esize;
  const size_t chunk = slot_bytes_ / esize;
  for (size_t offset = 0; offset < count; offset += chunk) {
    const size_t n = std::min(chunk, count - offset);
    std::byte* part = out + offset * esize;
    const size_t block = RoundUp(CeilDiv(n, world_), align);
    auto block_begin = [&](int p) { return std::min(n, p * block) * esize; };
    auto block_end = [&](int p) { return std::min(n, (p + 1) * block) * esize; };
    EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
    std::byte* mine = Slot(rank_, epoch);
    // Peers read only block p of my slot, so my own block stays in `out`.
    for (int p = 0; p < world_; ++p) {
      if (p != rank_ && block_end(p) > block_begin(p)) {
        std::memcpy(mine + block_begin(p), part + block_begin(p), block_end(p) - block_begin(p));
      }
    }
    Arrive(epoch, call);
    EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
    const size_t begin = block_begin(rank_);
    const size_t end = block_end(rank_);
    if (end > begin) {
      for (int p = 0; p < world_; ++p) {
        srcs[p] = (p == rank_ ? part : Slot(p, epoch)) + begin;
      }
      SumInOrder(type, srcs, world_, mine + begin, (end - begin) / esize);
      std::memcpy(part + begin, mine + begin, end - begin);
    }
    Publish(Flag::kReduced, epoch);
    EXL3_RETURN_IF_ERROR(AwaitPeers(Flag::kReduced, epoch, call));
    for (int p = 0; p < world_; ++p) {
      if (p != rank_ && block_end(p) > block_begin(p)) {
        std::memcpy(part + block_begin(p), Slot(p, epoch) + block_begin(p),
                    block_end(p) - block_begin(p));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::GatherV(const Call& call, const void* send,
                                      std::span<const size_t> bytes_per_rank, void* recv) {
  auto* out = static_cast<std::byte*>(recv);
  const auto* in = static_cast<const std::byte*>(send);
  std::vector<size_t> offsets(world_ + 1, 0);
  size_t largest = 0;
  for (int p = 0; p < world_; ++p) {
    offsets[p + 1] = offsets[p] + bytes_per_rank[p];
    largest = std::max(largest, bytes_per_rank[p]);
  }
  const size_t mine = bytes_per_rank[rank_];
  const size_t rounds = world_ == 1 ? 0 : CeilDiv(largest, slot_bytes_);
  for (size_t k = 0; k < rounds; ++k) {
    const size_t start = k * slot_bytes_;
    EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
    if (mine > start) std::memcpy(Slot(rank_, epoch), in + start, std::min(slot_bytes_, mine - start));
    Arrive(epoch, call);
    EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
    for (int p = 0; p < world_; ++p) {
      if (p == rank_ || bytes_per_rank[p] <= start) continue;
      std::memcpy(out + offsets[p] + start, Slot(p, epoch),
                  std::min(slot_bytes_, bytes_per_rank[p] - start));
    }
  }
  // My own part last: `send` may be exactly recv + offsets[rank].
  if (mine > 0 && out + offsets[rank_] != in) std::memmove(out + offsets[rank_], in, mine);
  return absl::OkStatus();
}

absl::Status ShmCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                        absl::Time deadline) {
  const Call call{OpCode::kAllGather, MakeDesc(OpCode::kAllGather, -1, 0, bytes), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  std::vector<size_t> sizes(world_, bytes);
  return GatherV(call, send, sizes, recv);
}

absl::Status ShmCommunicator::AllGatherV(const void* send, std::span<const size_t> bytes_per_rank,
                                         void* recv, absl::Time deadline) {
  const Call call{OpCode::kAllGatherV,
                  MakeDesc(OpCode::kAllGatherV, -1, 0, HashSizes(bytes_per_rank)), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (bytes_per_rank.size() != static_cast<size_t>(world_)) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("shm all_gather_v: bytes_per_rank has ", bytes_per_rank.size(),
                     " entries, world size is ", world_)));
  }
  return GatherV(call, send, bytes_per_rank, recv);
}

absl::Status ShmCommunicator::ReduceScatter(const void* data, size_t count, CommDataType type,
                                            void* recv, absl::Time deadline) {
  const Call call{OpCode::kReduceScatter,
                  MakeDesc(OpCode::kReduceScatter, static_cast<int>(type), 0, count), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (count == 0) return absl::OkStatus();
  const size_t esize = CommDataTypeSize(type);
  const auto* in = static_cast<const std::byte*>(data);
  auto* out = static_cast<std::byte*>(recv);
  if (world_ == 1) {
    std::memmove(out, in, count * esize);
    return absl::OkStatus();
  }
  // Per round: `piece` elements of each of the N blocks, packed in my slot.
  const size_t align = kLineBytes / esize;
  const size_t piece = (slot_bytes_ / world_) / esize / align * align;
  const void* srcs[kShmMaxWorldSize];
  for (size_t offset = 0; offset < count; offset += piece) {
    const size_t n = std::min(piece, count - offset);
    EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
    std::byte* slot = Slot(rank_, epoch);
    for (int p = 0; p < world_; ++p) {  // peer p reads piece p; mine stays in `data`
      if (p != rank_) std::memcpy(slot + p * n * esize, in + (p * count + offset) * esize, n * esize);
    }
    Arrive(epoch, call);
    EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
    for (int p = 0; p < world_; ++p) {
      srcs[p] = p == rank_ ? in + (rank_ * count + offset) * esize : Slot(p, epoch) + rank_ * n * esize;
    }
    // `recv` may be data + rank·count (in place): dst then equals srcs[rank] exactly.
    SumInOrder(type, srcs, world_, out + offset * esize, n);
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::AllToAllV(const void* send, std::span<const size_t> send_bytes,
                                        void* recv, std::span<const size_t> recv_bytes,
                                        absl::Time deadline) {
  const Call call{OpCode::kAllToAllV, MakeDesc(OpCode::kAllToAllV, -1, 0, 0), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (send_bytes.size() != static_cast<size_t>(world_) ||
      recv_bytes.size() != static_cast<size_t>(world_)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "shm all_to_all_v: send_bytes has ", send_bytes.size(), " entries and recv_bytes ",
        recv_bytes.size(), ", world size is ", world_)));
  }
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
        "shm all_to_all_v: rank ", rank_, " sends itself ", send_bytes[rank_],
        " bytes but expects to receive ", recv_bytes[rank_])));
  }
  const auto* in = static_cast<const std::byte*>(send);
  auto* out = static_cast<std::byte*>(recv);
  std::vector<size_t> send_offsets(world_ + 1, 0), recv_offsets(world_ + 1, 0);
  for (int p = 0; p < world_; ++p) {
    send_offsets[p + 1] = send_offsets[p] + send_bytes[p];
    recv_offsets[p + 1] = recv_offsets[p] + recv_bytes[p];
  }
  if (world_ > 1) {
    // Slot: [header: my send_bytes row as uint64][sub-slot per destination].
    const size_t header = RoundUp(world_ * sizeof(uint64_t), kLineBytes);
    const size_t sub = (slot_bytes_ - header) / world_ / kLineBytes * kLineBytes;
    size_t rounds = 1;  // known after round 0 (every rank's header)
    for (size_t k = 0; k < rounds; ++k) {
      const size_t start = k * sub;
      EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
      std::byte* slot = Slot(rank_, epoch);
      for (int p = 0; p < world_; ++p) {
        const uint64_t v = send_bytes[p];
        std::memcpy(slot + p * sizeof(uint64_t), &v, sizeof(v));
        if (p != rank_ && send_bytes[p] > start) {
          std::memcpy(slot + header + p * sub, in + send_offsets[p] + start,
                      std::min(sub, send_bytes[p] - start));
        }
      }
      Arrive(epoch, call);
      EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
      if (k == 0) {
        size_t largest = 0;
        for (int p = 0; p < world_; ++p) {
          for (int d = 0; d < world_; ++d) {
            uint64_t v;
            std::memcpy(&v, Slot(p, epoch) + d * sizeof(uint64_t), sizeof(v));
            if (d != p) largest = std::max<size_t>(largest, v);
            if (d == rank_ && p != rank_ && v != recv_bytes[p]) {
              return Fail(absl::InvalidArgumentError(absl::StrCat(
                  "shm all_to_all_v: rank ", p, " sends ", v, " bytes to rank ", rank_,
                  ", which expects ", recv_bytes[p])));
            }
          }
        }
        rounds = std::max<size_t>(1, CeilDiv(largest, sub));
      }
      for (int p = 0; p < world_; ++p) {
        if (p == rank_ || recv_bytes[p] <= start) continue;
        std::memcpy(out + recv_offsets[p] + start, Slot(p, epoch) + header + rank_ * sub,
                    std::min(sub, recv_bytes[p] - start));
      }
    }
  }
  if (send_bytes[rank_] > 0) {
    std::memmove(out + recv_offsets[rank_], in + send_offsets[rank_], send_bytes[rank_]);
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Broadcast(void* data, size_t bytes, int root, absl::Time deadline) {
  const Call call{OpCode::kBroadcast, MakeDesc(OpCode::kBroadcast, -1, root, bytes), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (root < 0 || root >= world_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat("shm broadcast: root must be in [0, ", world_, "), got ", root)));
  }
  auto* buf = static_cast<std::byte*>(data);
  if (world_ == 1) return absl::OkStatus();
  const size_t rounds = CeilDiv(bytes, slot_bytes_);
  for (size_t k = 0; k < rounds; ++k) {
    const size_t start = k * slot_bytes_;
    const size_t n = std::min(slot_bytes_, bytes - start);
    EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
    if (rank_ == root) std::memcpy(Slot(rank_, epoch), buf + start, n);
    Arrive(epoch, call);
    EXL3_RETURN_IF_ERROR(AwaitArrivals(epoch, call));
    if (rank_ != root) std::memcpy(buf + start, Slot(root, epoch), n);
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Barrier(absl::Time deadline) {
  const Call call{OpCode::kBarrier, MakeDesc(OpCode::kBarrier, -1, 0, 0), deadline};
  EXL3_RETURN_IF_ERROR(Enter(call));
  if (world_ == 1) return absl::OkStatus();
  EXL3_ASSIGN_OR_RETURN(const uint64_t epoch, BeginRound(call));
  Arrive(epoch, call);
  return AwaitArrivals(epoch, call);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(const ShmOptions& options) {
  EXL3_RETURN_IF_ERROR(ValidateOptions(options));
  return ShmCommunicator::Join(options);
}

void UnlinkShmSegment(const std::string& name) { shm_unlink(name.c_str()); }

}  // namespace exl3serve::worker::comm
