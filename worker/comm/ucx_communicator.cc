#include "worker/comm/ucx_communicator.h"

#include <poll.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/comm/reduce_sum.h"

namespace exl3serve::worker::comm {
namespace {

// --- Tags (see the header, point 2) -----------------------------------------
enum class TagKind : uint64_t { kData = 0, kAbort = 1, kBye = 2 };

// Which collective (and algorithm) a data message belongs to. Two ranks that
// disagree on it for the same sequence number called different collectives
// (or AllReduce with sizes on different sides of the one-shot threshold).
enum class OpCode : uint64_t {
  kAllReduceOneShot = 1,
  kAllReduceTwoShot = 2,
  kAllGather = 3,
  kAllGatherV = 4,
  kReduceScatter = 5,
  kAllToAllV = 6,
  kBroadcast = 7,
  kBarrier = 8,
};

const char* OpName(OpCode op) {
  switch (op) {
    case OpCode::kAllReduceOneShot:
      return "AllReduce(one-shot)";
    case OpCode::kAllReduceTwoShot:
      return "AllReduce(two-shot)";
    case OpCode::kAllGather:
      return "AllGather";
    case OpCode::kAllGatherV:
      return "AllGatherV";
    case OpCode::kReduceScatter:
      return "ReduceScatter";
    case OpCode::kAllToAllV:
      return "AllToAllV";
    case OpCode::kBroadcast:
      return "Broadcast";
    case OpCode::kBarrier:
      return "Barrier";
  }
  return "?";
}

constexpr int kKindShift = 62;
constexpr int kOpShift = 58;
constexpr int kStepShift = 56;
constexpr int kSourceShift = 40;
constexpr ucp_tag_t kKindMask = ucp_tag_t{0x3} << kKindShift;
constexpr ucp_tag_t kOpMask = ucp_tag_t{0xf} << kOpShift;
constexpr ucp_tag_t kSourceMask = ucp_tag_t{0xffff} << kSourceShift;
constexpr ucp_tag_t kSequenceMask = 0xffffffffu;
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};
// Reductions sum all ranks in one SumInOrder call (reduce_sum.h).
constexpr int kMaxWorldSize = kMaxSumSources;

ucp_tag_t MakeTag(TagKind kind, OpCode op, int step, int source, uint32_t sequence) {
  return (static_cast<ucp_tag_t>(kind) << kKindShift) | (static_cast<ucp_tag_t>(op) << kOpShift) |
         (static_cast<ucp_tag_t>(step & 0x3) << kStepShift) |
         (static_cast<ucp_tag_t>(source) << kSourceShift) | sequence;
}
ucp_tag_t ControlTag(TagKind kind, int source) {
  return (static_cast<ucp_tag_t>(kind) << kKindShift) |
         (static_cast<ucp_tag_t>(source) << kSourceShift);
}
OpCode TagOp(ucp_tag_t tag) { return static_cast<OpCode>((tag & kOpMask) >> kOpShift); }

// --- Limits and fixed sizes ----------------------------------------------------
// Room for an abort reason (u32 code + text); longer reasons are cut.
constexpr size_t kControlBytes = 1024;
// How long a failing rank keeps progressing so its abort notices leave (an
// eager send of a few hundred bytes: immediate unless a socket is full).
constexpr absl::Duration kAbortNoticeTimeout = absl::Milliseconds(100);
// A failed call gives its cancelled receives and pending sends this long to
// finish before it force-closes the endpoints that still hold them (a send
// the peer never matched cannot finish), then this long for the close. The
// first bounds how late a failed call returns past its deadline.
constexpr absl::Duration kCleanupGrace = absl::Milliseconds(20);
constexpr absl::Duration kCleanupTimeout = absl::Milliseconds(500);
// Teardown: bye notices, then endpoint flushes.
constexpr absl::Duration kTeardownTimeout = absl::Seconds(1);
constexpr uint32_t kBlobMagic = 0x31555845;  // "EXU1"

std::string UcsText(ucs_status_t status) { return ucs_status_string(status); }

absl::Status UcsError(ucs_status_t status, const std::string& what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", UcsText(status)));
}

std::string RankList(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// One outstanding UCX operation. Heap-allocated so its address (the
// callback's user_data) stays put while vectors of them grow.
struct Pending {
  void* request = nullptr;  // UCX request; null when it completed at once
  int peer = -1;
  bool is_send = false;
  bool done = false;
  ucs_status_t status = UCS_OK;
  size_t expected_bytes = 0;
  ucp_tag_recv_info_t info{};  // receives: what arrived
};

void SendDone(void* /*request*/, ucs_status_t status, void* user_data) {
  auto* p = static_cast<Pending*>(user_data);
  p->status = status;
  p->done = true;
}

void RecvDone(void* /*request*/, ucs_status_t status, const ucp_tag_recv_info_t* info,
              void* user_data) {
  auto* p = static_cast<Pending*>(user_data);
  p->status = status;
  if (status == UCS_OK && info != nullptr) p->info = *info;
  p->done = true;
}

// Milliseconds to sleep on the event fd: up to `cap`, never past `until`,
// at least 1 so a sleep is a sleep.
int SleepMs(absl::Time until, absl::Duration cap) {
  absl::Duration left = std::min(until - absl::Now(), cap);
  return static_cast<int>(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1)))));
}

class UcxCommunicator final : public Communicator {
 public:
  UcxCommunicator(int rank, int world_size, const UcxOptions& options)
      : rank_(rank),
        world_(world_size),
        options_(options),
        peer_hosts_(world_size),
        peer_pids_(world_size, 0),
        peer_slots_(2 * world_size),
        eps_(world_size, nullptr),
        abort_eps_(world_size, nullptr),
        ep_failed_(world_size, 0),
        abort_ep_failed_(world_size, 0),
        departed_(world_size, 0) {}
  ~UcxCommunicator() override;

  absl::Status Init(Bootstrap& bootstrap, absl::Time deadline);

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string backend_name() const override { return "ucx"; }

  absl::Status AllReduce(void* data, size_t count, CommDataType type, absl::Time deadline) override;
  absl::Status AllGather(const void* send, size_t bytes, void* recv, absl::Time deadline) override;
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
  using Lock = std::unique_lock<std::mutex>;

  // A peer endpoint's error-callback argument.
  struct PeerSlot {
    UcxCommunicator* self = nullptr;
    int rank = -1;
    bool abort_lane = false;
  };
  // A receive posted for the communicator's life: one abort and one bye
  // notice per peer.
  struct ControlRecv {
    UcxCommunicator* self = nullptr;
    Pending pending;
    TagKind kind = TagKind::kAbort;
    char buffer[kControlBytes];
  };

  static void EpError(void* arg, ucp_ep_h ep, ucs_status_t status);
  static void ControlRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                              void* user_data);

  // Starts a collective: takes the next sequence number, fails at once when
  // broken or when a peer has left.
  absl::Status Begin(OpCode op);
  absl::Status PostSend(int peer, const void* data, size_t bytes, int step,
                        bool abort_lane = false);
  absl::Status PostRecv(int peer, void* data, size_t bytes, int step);
  // Progresses until every posted operation completes; on any failure marks
  // the group broken, tells the peers, cleans up and returns the error.
  absl::Status WaitAll(absl::Time deadline);
  // Marks broken (first reason wins), tells peers, cleans up the call's
  // operations; returns `status`.
  absl::Status Fail(absl::Status status);
  absl::Status BrokenStatus() const;

  // All below: ucx_mu_ held.
  void MarkBrokenLocked(const absl::Status& status, bool tell_peers);
  void HandleControlLocked(ControlRecv& control);
  void FreeCompletedControlLocked();
  // ucp_worker_progress until idle, then frees finished control receives
  // and applies a deferred endpoint error.
  void DrainLocked();
  void OnEpErrorLocked(const PeerSlot& slot, ucs_status_t status);
  void BroadcastAbortIfPendingLocked(Lock& lock);
  void CleanupInflightLocked(Lock& lock);
  // Progresses (sleeping on the event fd after a short spin) until `done()`
  // or `until`; returns done().
  bool ProgressUntilLocked(Lock& lock, const std::function<bool()>& done, absl::Time until);
  void CloseEndpointLocked(ucp_ep_h& ep, bool force);
  std::string PeerName(int peer) const;
  bool PeerUsable(int peer) const {
    return eps_[peer] != nullptr && !ep_failed_[peer] && !departed_[peer];
  }

  // --- constant after Init
  const int rank_;
  const int world_;
  const UcxOptions options_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::vector<std::string> peer_hosts_;
  std::vector<int> peer_pids_;
  std::vector<std::unique_ptr<PeerSlot>> peer_slots_;  // 2 per peer: data, abort lane

  // --- own synchronisation
  std::atomic<bool> broken_{false};
  std::atomic<bool> abort_pending_{false};  // an abort notice still has to go out
  mutable std::mutex state_mu_;
  absl::Status first_failure_;  // guarded by state_mu_; OK while healthy

  // --- guarded by ucx_mu_ (every UCX call, and whatever UCX callbacks touch)
  std::mutex ucx_mu_;
  // Two endpoints per peer: data (collectives and the bye notice, which
  // must stay behind the data) and abort (abort notices only, so they never
  // queue behind a large send the peer is not draining).
  std::vector<ucp_ep_h> eps_;  // null for self and closed endpoints
  std::vector<ucp_ep_h> abort_eps_;
  std::vector<char> ep_failed_;  // an error callback fired (either endpoint)
  std::vector<char> abort_ep_failed_;
  std::vector<char> departed_;                           // the peer said bye
  std::vector<std::unique_ptr<Pending>> inflight_;       // this call's operations
  std::vector<std::unique_ptr<Pending>> control_sends_;  // abort and bye notices
  std::vector<std::unique_ptr<ControlRecv>> control_recvs_;
  std::vector<void*> close_requests_;
  std::string abort_payload_;  // u32 code + reason, stays alive while sends run
  absl::Status ep_error_;      // the first endpoint error not yet applied
  int ep_error_peer_ = -1;
  bool abort_sent_ = false;

  // --- the calling thread's own
  uint32_t sequence_ = 0;
  OpCode op_ = OpCode::kBarrier;
  std::string what_;  // "ucx AllReduce(two-shot) #7 (rank 0 of 4)"
  std::vector<char> scratch_;
};

// --- setup ----------------------------------------------------------------------

absl::Status UcxCommunicator::Init(Bootstrap& bootstrap, absl::Time deadline) {
  const std::string what = absl::StrCat("ucx setup (rank ", rank_, " of ", world_, ")");
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsError(st, absl::StrCat(what, ": ucp_config_read"));
  std::vector<std::pair<std::string, std::string>> settings;
  if (!options_.tls.empty()) settings.emplace_back("TLS", options_.tls);
  if (!options_.net_devices.empty()) settings.emplace_back("NET_DEVICES", options_.net_devices);
  for (const auto& kv : options_.config) settings.push_back(kv);
  for (const auto& [name, value] : settings) {
    st = ucp_config_modify(config, name.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": UCX rejected setting ", name, "=", value, " (", UcsText(st), ")"));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_ESTIMATED_NUM_EPS;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  params.estimated_num_eps = static_cast<size_t>(world_);
  st = ucp_init(&params, config, &context_);
  ucp_config_release(config);
  if (st != UCS_OK) {
    context_ = nullptr;
    return UcsError(st, absl::StrCat(what, ": ucp_init (tls=\"", options_.tls, "\", net_devices=\"",
                                     options_.net_devices, "\")"));
  }
  ucp_worker_params_t wparams{};
  wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(context_, &wparams, &worker_);
  if (st != UCS_OK) {
    worker_ = nullptr;
    return UcsError(st, absl::StrCat(what, ": ucp_worker_create"));
  }
  st = ucp_worker_get_efd(worker_, &event_fd_);
  if (st != UCS_OK) return UcsError(st, absl::StrCat(what, ": ucp_worker_get_efd"));

  // Blob: magic, rank, world, pid, host name (for messages), worker address.
  ucp_address_t* address = nullptr;
  size_t address_len = 0;
  st = ucp_worker_get_address(worker_, &address, &address_len);
  if (st != UCS_OK) return UcsError(st, absl::StrCat(what, ": ucp_worker_get_address"));
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string blob;
  PutU32(blob, kBlobMagic);
  PutU32(blob, static_cast<uint32_t>(rank_));
  PutU32(blob, static_cast<uint32_t>(world_));
  PutU32(blob, static_cast<uint32_t>(getpid()));
  PutU32(blob, static_cast<uint32_t>(strlen(host)));
  blob += host;
  blob.append(reinterpret_cast<const char*>(address), address_len);
  ucp_worker_release_address(worker_, address);

  EXL3_ASSIGN_OR_RETURN(std::vector<std::string> blobs, bootstrap.AllGather(blob, deadline));
  if (blobs.size() != static_cast<size_t>(world_)) {
    return absl::InternalError(absl::StrCat(what, ": bootstrap returned ", blobs.size(), " blobs"));
  }
  Lock lock(ucx_mu_);
  for (int p = 0; p < world_; ++p) {
    const std::string& b = blobs[p];
    if (b.size() < 20 || GetU32(b.data()) != kBlobMagic ||
        GetU32(b.data() + 4) != static_cast<uint32_t>(p) ||
        GetU32(b.data() + 8) != static_cast<uint32_t>(world_)) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": rank ", p,
                       "'s setup blob is not a ucx worker address of this group "
                       "(another backend or another world size on that rank?)"));
    }
    peer_pids_[p] = static_cast<int>(GetU32(b.data() + 12));
    size_t host_len = GetU32(b.data() + 16);
    if (20 + host_len > b.size())
      return absl::InvalidArgumentError(absl::StrCat(what, ": rank ", p, "'s blob is truncated"));
    peer_hosts_[p] = b.substr(20, host_len);
    if (p == rank_) continue;
    for (bool abort_lane : {false, true}) {
      auto& slot = peer_slots_[2 * p + (abort_lane ? 1 : 0)];
      slot = std::make_unique<PeerSlot>(PeerSlot{this, p, abort_lane});
      ucp_ep_params_t ep_params{};
      ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                             UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep_params.address = reinterpret_cast<const ucp_address_t*>(b.data() + 20 + host_len);
      ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      ep_params.err_handler.cb = &UcxCommunicator::EpError;
      ep_params.err_handler.arg = slot.get();
      ucp_ep_h& ep = abort_lane ? abort_eps_[p] : eps_[p];
      st = ucp_ep_create(worker_, &ep_params, &ep);
      if (st != UCS_OK) {
        ep = nullptr;
        return UcsError(st, absl::StrCat(what, ": cannot create an endpoint to ", PeerName(p),
                                         " (no common transport? tls=\"", options_.tls, "\")"));
      }
    }
  }
  // Control receives: one abort and one bye notice per peer, for life.
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    for (TagKind kind : {TagKind::kAbort, TagKind::kBye}) {
      auto control = std::make_unique<ControlRecv>();
      control->self = this;
      control->kind = kind;
      control->pending.peer = p;
      ucp_request_param_t param{};
      param.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.cb.recv = &UcxCommunicator::ControlRecvDone;
      param.user_data = control.get();
      ucs_status_ptr_t r = ucp_tag_recv_nbx(worker_, control->buffer, kControlBytes,
                                            ControlTag(kind, p), kFullMask, &param);
      if (UCS_PTR_IS_ERR(r))
        return UcsError(UCS_PTR_STATUS(r), absl::StrCat(what, ": posting control receives"));
      ControlRecv& ref = *control;
      control_recvs_.push_back(std::move(control));
      if (r == nullptr) {  // a notice was already waiting
        ref.pending.done = true;
        HandleControlLocked(ref);
      } else {
        ref.pending.request = r;
      }
    }
  }
  lock.unlock();
  // Connects every endpoint (UCX wires up lazily, and a wire-up needs both
  // sides to progress: an abort lane first used during a failure, towards a
  // peer that is stuck, would never connect) and proves the transports reach
  // every peer before anyone relies on them. Two barriers: the data lane,
  // then the abort lane.
  EXL3_RETURN_IF_ERROR(Annotate(Barrier(deadline), what));
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kBarrier));
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, nullptr, 0, 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, nullptr, 0, 0, /*abort_lane=*/true));
  }
  return Annotate(WaitAll(deadline), absl::StrCat(what, ", abort lane"));
}

UcxCommunicator::~UcxCommunicator() {
  if (worker_ != nullptr) {
    Lock lock(ucx_mu_);
    absl::Time until = absl::Now() + kTeardownTimeout;
    if (!broken_.load()) {
      static const char kNothing = 0;
      for (int p = 0; p < world_; ++p) {
        if (p == rank_ || !PeerUsable(p)) continue;
        auto pending = std::make_unique<Pending>();
        pending->peer = p;
        pending->is_send = true;
        ucp_request_param_t param{};
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = &SendDone;
        param.user_data = pending.get();
        ucs_status_ptr_t r =
            ucp_tag_send_nbx(eps_[p], &kNothing, 0, ControlTag(TagKind::kBye, rank_), &param);
        if (UCS_PTR_IS_ERR(r) || r == nullptr) {
          pending->done = true;
        } else {
          pending->request = r;
        }
        control_sends_.push_back(std::move(pending));
      }
    } else {
      BroadcastAbortIfPendingLocked(lock);
    }
    CleanupInflightLocked(lock);
    auto sends_done = [this] {
      for (auto& s : control_sends_)
        if (!s->done) return false;
      return true;
    };
    ProgressUntilLocked(lock, sends_done, until);
    // Endpoints: flush what is queued (the byes), then release; failed ones
    // (and everything once broken) are released without a flush.
    for (int p = 0; p < world_; ++p) {
      if (eps_[p] != nullptr)
        CloseEndpointLocked(eps_[p], /*force=*/broken_.load() || ep_failed_[p]);
      if (abort_eps_[p] != nullptr) {
        CloseEndpointLocked(abort_eps_[p], /*force=*/broken_.load() || abort_ep_failed_[p]);
      }
    }
    auto closed = [this] {
      for (void* r : close_requests_)
        if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      return true;
    };
    if (!ProgressUntilLocked(lock, closed, absl::Now() + kTeardownTimeout)) {
      EXL3_LOG(kWarning) << "ucx rank " << rank_
                         << ": endpoint close did not finish within the teardown timeout";
    }
    for (void* r : close_requests_) {
      if (ucp_request_check_status(r) != UCS_INPROGRESS) ucp_request_free(r);
    }
    close_requests_.clear();
    for (auto& c : control_recvs_) {
      if (!c->pending.done && c->pending.request != nullptr)
        ucp_request_cancel(worker_, c->pending.request);
    }
    auto recvs_done = [this] {
      for (auto& c : control_recvs_)
        if (!c->pending.done) return false;
      return true;
    };
    ProgressUntilLocked(lock, recvs_done, absl::Now() + kTeardownTimeout);
    for (auto& c : control_recvs_) {
      if (c->pending.done && c->pending.request != nullptr) ucp_request_free(c->pending.request);
    }
    for (auto& s : control_sends_) {
      if (s->done && s->request != nullptr) ucp_request_free(s->request);
    }
    lock.unlock();
    ucp_worker_destroy(worker_);
  }
  if (context_ != nullptr) ucp_cleanup(context_);
}

// --- failure state ------------------------------------------------------------------

std::string UcxCommunicator::PeerName(int peer) const {
  if (peer < 0 || peer >= static_cast<int>(peer_hosts_.size())) return absl::StrCat("rank ", peer);
  return absl::StrCat("rank ", peer, " (", peer_hosts_[peer], " pid ", peer_pids_[peer], ")");
}

absl::Status UcxCommunicator::health() const {
  std::lock_guard<std::mutex> l(state_mu_);
  return first_failure_;
}

absl::Status UcxCommunicator::BrokenStatus() const {
  std::lock_guard<std::mutex> l(state_mu_);
  return absl::AbortedError(absl::StrCat("communicator broken: ", first_failure_.message()));
}

void UcxCommunicator::MarkBrokenLocked(const absl::Status& status, bool tell_peers) {
  {
    std::lock_guard<std::mutex> l(state_mu_);
    if (!first_failure_.ok()) return;
    first_failure_ = status.ok() ? absl::AbortedError("aborted with an OK status") : status;
    broken_.store(true);
  }
  if (tell_peers && !abort_sent_) {
    abort_payload_.clear();
    PutU32(abort_payload_, static_cast<uint32_t>(status.code()));
    abort_payload_ += std::string(status.message()).substr(0, kControlBytes - 4);
    abort_pending_.store(true);
  }
}

void UcxCommunicator::BroadcastAbortIfPendingLocked(Lock& lock) {
  if (!abort_pending_.exchange(false) || abort_sent_) return;
  abort_sent_ = true;
  size_t first = control_sends_.size();
  for (int p = 0; p < world_; ++p) {
    if (p == rank_ || abort_eps_[p] == nullptr || abort_ep_failed_[p] || departed_[p]) continue;
    auto pending = std::make_unique<Pending>();
    pending->peer = p;
    pending->is_send = true;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &SendDone;
    param.user_data = pending.get();
    ucs_status_ptr_t r =
        ucp_tag_send_nbx(abort_eps_[p], abort_payload_.data(), abort_payload_.size(),
                         ControlTag(TagKind::kAbort, rank_), &param);
    if (UCS_PTR_IS_ERR(r) || r == nullptr) {
      pending->done = true;
    } else {
      pending->request = r;
    }
    control_sends_.push_back(std::move(pending));
  }
  auto sent = [this, first] {
    for (size_t i = first; i < control_sends_.size(); ++i)
      if (!control_sends_[i]->done) return false;
    return true;
  };
  ProgressUntilLocked(lock, sent, absl::Now() + kAbortNoticeTimeout);
}

void UcxCommunicator::EpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* slot = static_cast<PeerSlot*>(arg);
  slot->self->OnEpErrorLocked(*slot, status);
}

void UcxCommunicator::OnEpErrorLocked(const PeerSlot& slot, ucs_status_t status) {
  const int peer = slot.rank;
  ep_failed_[peer] = 1;
  if (slot.abort_lane) abort_ep_failed_[peer] = 1;
  // Applied by DrainLocked once progress has nothing left: a notice that
  // arrived together with the close (an abort with its reason, a bye) wins.
  if (ep_error_.ok()) {
    ep_error_peer_ = peer;
    ep_error_ = absl::UnavailableError(absl::StrCat("ucx rank ", rank_, ": connection to ",
                                                    PeerName(peer), " failed: ", UcsText(status)));
  }
}

void UcxCommunicator::DrainLocked() {
  while (ucp_worker_progress(worker_) != 0) {
  }
  FreeCompletedControlLocked();
  if (ep_error_.ok()) return;
  // A peer that said bye finished: its connection closing is no failure.
  if (!departed_[ep_error_peer_]) MarkBrokenLocked(ep_error_, /*tell_peers=*/true);
  ep_error_ = absl::OkStatus();
  for (int p = 0; p < world_; ++p) {
    if (ep_failed_[p] && !departed_[p] && !broken_.load()) {
      MarkBrokenLocked(absl::UnavailableError(absl::StrCat("ucx rank ", rank_, ": connection to ",
                                                           PeerName(p), " failed")),
                       /*tell_peers=*/true);
    }
  }
}

void UcxCommunicator::ControlRecvDone(void* /*request*/, ucs_status_t status,
                                      const ucp_tag_recv_info_t* info, void* user_data) {
  auto* control = static_cast<ControlRecv*>(user_data);
  control->pending.status = status;
  if (status == UCS_OK && info != nullptr) control->pending.info = *info;
  control->pending.done = true;
  // Runs inside ucp_worker_progress, so under ucx_mu_. Handled here rather
  // than after progress returns so that an abort notice and the close of
  // the same connection are seen in the order they arrived (the notice
  // first, and its reason wins). The request is freed by the progress loops.
  control->self->HandleControlLocked(*control);
}

void UcxCommunicator::HandleControlLocked(ControlRecv& control) {
  if (control.pending.status != UCS_OK) return;  // cancelled at teardown
  const int peer = control.pending.peer;
  if (control.kind == TagKind::kBye) {
    departed_[peer] = 1;
    return;
  }
  size_t len = std::min(control.pending.info.length, kControlBytes);
  std::string reason =
      len > 4 ? std::string(control.buffer + 4, len - 4) : std::string("no reason given");
  // Relayed to the other peers: the sender may have died (or closed the
  // connection) before its notice reached everyone.
  MarkBrokenLocked(absl::AbortedError(absl::StrCat(PeerName(peer), " aborted: ", reason)),
                   /*tell_peers=*/true);
}

void UcxCommunicator::FreeCompletedControlLocked() {
  for (auto& c : control_recvs_) {
    if (c->pending.done && c->pending.request != nullptr) {
      ucp_request_free(c->pending.request);
      c->pending.request = nullptr;
    }
  }
}

void UcxCommunicator::Abort(const absl::Status& reason) {
  absl::Status status =
      reason.ok() ? absl::AbortedError("Abort() called with an OK status") : reason;
  if (worker_ == nullptr) return;
  {
    // Set the flag first, without the UCX lock, so a call spinning in
    // another thread notices at its next progress round.
    std::lock_guard<std::mutex> l(state_mu_);
    if (!first_failure_.ok()) return;
    first_failure_ =
        absl::Status(status.code(), absl::StrCat("rank ", rank_, ": ", status.message()));
    broken_.store(true);
  }
  ucp_worker_signal(worker_);
  Lock lock(ucx_mu_);
  abort_payload_.clear();
  PutU32(abort_payload_, static_cast<uint32_t>(status.code()));
  abort_payload_ += std::string(status.message()).substr(0, kControlBytes - 4);
  abort_pending_.store(true);
  BroadcastAbortIfPendingLocked(lock);
}

// --- progress -------------------------------------------------------------------

bool UcxCommunicator::ProgressUntilLocked(Lock& lock, const std::function<bool()>& done,
                                          absl::Time until) {
  const absl::Time spin_until = absl::Now() + options_.busy_poll;
  while (true) {
    DrainLocked();
    if (done()) return true;
    absl::Time now = absl::Now();
    if (now >= until) return false;
    if (now < spin_until) continue;
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    lock.unlock();
    pollfd p{event_fd_, POLLIN, 0};
    poll(&p, 1, SleepMs(until, options_.max_poll_interval));
    lock.lock();
  }
}

absl::Status UcxCommunicator::Begin(OpCode op) {
  ++sequence_;
  op_ = op;
  what_ = absl::StrCat("ucx ", OpName(op), " #", sequence_, " (rank ", rank_, " of ", world_, ")");
  if (broken_.load()) return BrokenStatus();
  Lock lock(ucx_mu_);
  DrainLocked();
  BroadcastAbortIfPendingLocked(lock);
  if (broken_.load()) return BrokenStatus();
  std::vector<int> gone;
  for (int p = 0; p < world_; ++p) {
    if (departed_[p]) gone.push_back(p);
  }
  lock.unlock();
  if (!gone.empty()) {
    return Fail(absl::FailedPreconditionError(
        absl::StrCat(what_, ": ", RankList(gone), " left the group (destroyed its communicator)")));
  }
  return absl::OkStatus();
}

absl::Status UcxCommunicator::PostSend(int peer, const void* data, size_t bytes, int step,
                                       bool abort_lane) {
  static const char kNothing = 0;
  auto pending = std::make_unique<Pending>();
  pending->peer = peer;
  pending->is_send = true;
  pending->expected_bytes = bytes;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &SendDone;
  param.user_data = pending.get();
  Lock lock(ucx_mu_);
  ucp_ep_h ep = abort_lane ? abort_eps_[peer] : eps_[peer];
  if (ep == nullptr) {
    lock.unlock();
    return Fail(absl::InternalError(absl::StrCat(what_, ": no endpoint to ", PeerName(peer))));
  }
  ucs_status_ptr_t r =
      ucp_tag_send_nbx(ep, bytes == 0 ? &kNothing : data, bytes,
                       MakeTag(TagKind::kData, op_, step, rank_, sequence_), &param);
  if (r == nullptr) {
    pending->done = true;
  } else if (UCS_PTR_IS_ERR(r)) {
    pending->done = true;
    pending->status = UCS_PTR_STATUS(r);
  } else {
    pending->request = r;
  }
  inflight_.push_back(std::move(pending));
  return absl::OkStatus();
}

absl::Status UcxCommunicator::PostRecv(int peer, void* data, size_t bytes, int step) {
  static char sink = 0;
  auto pending = std::make_unique<Pending>();
  pending->peer = peer;
  pending->expected_bytes = bytes;
  ucp_request_param_t param{};
  // No immediate completion: UCX 1.13 leaves recv_info unfilled when a
  // receive completes inside the call, and we need the length to detect a
  // size mismatch; the callback always gets it.
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = &RecvDone;
  param.user_data = pending.get();
  Lock lock(ucx_mu_);
  ucs_status_ptr_t r =
      ucp_tag_recv_nbx(worker_, bytes == 0 ? &sink : data, bytes,
                       MakeTag(TagKind::kData, op_, step, peer, sequence_), kFullMask, &param);
  if (r == nullptr) {
    pending->done = true;
  } else if (UCS_PTR_IS_ERR(r)) {
    pending->done = true;
    pending->status = UCS_PTR_STATUS(r);
  } else {
    pending->request = r;
  }
  inflight_.push_back(std::move(pending));
  return absl::OkStatus();
}

absl::Status UcxCommunicator::WaitAll(absl::Time deadline) {
  Lock lock(ucx_mu_);
  const absl::Time spin_until = absl::Now() + options_.busy_poll;
  while (true) {
    DrainLocked();
    BroadcastAbortIfPendingLocked(lock);

    // Size mismatches are this call's own finding; transport errors of
    // single operations come second to the group's state (DrainLocked has
    // already turned a failed endpoint into "broken" with a better reason).
    absl::Status size_error, transport_error;
    bool all_done = true;
    std::vector<int> not_heard, not_delivered;
    for (const auto& p : inflight_) {
      if (!p->done) {
        all_done = false;
        (p->is_send ? not_delivered : not_heard).push_back(p->peer);
        continue;
      }
      if (p->is_send) {
        // A send that fails towards a peer that already said bye was
        // delivered: that peer finished this call before leaving.
        if (p->status != UCS_OK && !departed_[p->peer] && transport_error.ok()) {
          transport_error = absl::UnavailableError(absl::StrCat(
              what_, ": send to ", PeerName(p->peer), " failed: ", UcsText(p->status)));
        }
      } else if (p->status == UCS_ERR_MESSAGE_TRUNCATED ||
                 (p->status == UCS_OK && p->info.length != p->expected_bytes)) {
        std::string got =
            p->status == UCS_OK ? absl::StrCat(p->info.length, " bytes") : "more bytes";
        if (size_error.ok()) {
          size_error = absl::InvalidArgumentError(absl::StrCat(
              what_, ": size mismatch: rank ", p->peer, " sent ", got, ", this rank expected ",
              p->expected_bytes, " (every rank must pass matching sizes)"));
        }
      } else if (p->status != UCS_OK && transport_error.ok()) {
        transport_error = absl::UnavailableError(absl::StrCat(
            what_, ": receive from ", PeerName(p->peer), " failed: ", UcsText(p->status)));
      }
    }
    if (!size_error.ok()) {
      lock.unlock();
      return Fail(size_error);
    }
    if (broken_.load()) {
      CleanupInflightLocked(lock);
      return BrokenStatus();
    }
    if (!transport_error.ok()) {
      lock.unlock();
      return Fail(transport_error);
    }
    // A peer that said bye finished every call it will make; still waiting
    // on it means it left before this call (it never delivers).
    std::vector<int> gone;
    for (const auto& p : inflight_) {
      if (!p->done && departed_[p->peer]) gone.push_back(p->peer);
    }
    if (!gone.empty()) {
      std::sort(gone.begin(), gone.end());
      gone.erase(std::unique(gone.begin(), gone.end()), gone.end());
      lock.unlock();
      return Fail(absl::FailedPreconditionError(absl::StrCat(
          what_, ": ", RankList(gone), " left the group (destroyed its communicator)")));
    }
    if (all_done) {
      for (auto& p : inflight_) {
        if (p->request != nullptr) ucp_request_free(p->request);
      }
      inflight_.clear();
      return absl::OkStatus();
    }
    const absl::Time now = absl::Now();
    if (now >= spin_until) {
      // A rank that called another collective under this sequence number
      // left a message that no receive of ours matches: probe for it.
      for (int peer : not_heard) {
        ucp_tag_recv_info_t info{};
        ucp_tag_message_h msg =
            ucp_tag_probe_nb(worker_, MakeTag(TagKind::kData, op_, 0, peer, sequence_),
                             kKindMask | kSourceMask | kSequenceMask, /*remove=*/0, &info);
        if (msg != nullptr && TagOp(info.sender_tag) != op_) {
          lock.unlock();
          return Fail(absl::InvalidArgumentError(
              absl::StrCat(what_, ": collective mismatch: rank ", peer, " called ",
                           OpName(TagOp(info.sender_tag)), " as its call #", sequence_,
                           " (every rank must call the same collectives, with the "
                           "same sizes, in the same order)")));
        }
      }
    }
    if (now >= deadline) {
      std::sort(not_heard.begin(), not_heard.end());
      not_heard.erase(std::unique(not_heard.begin(), not_heard.end()), not_heard.end());
      std::sort(not_delivered.begin(), not_delivered.end());
      not_delivered.erase(std::unique(not_delivered.begin(), not_delivered.end()),
                          not_delivered.end());
      std::string detail;
      if (!not_heard.empty()) detail = absl::StrCat("; not heard from ", RankList(not_heard));
      if (!not_delivered.empty())
        absl::StrAppend(&detail, "; sends not completed to ", RankList(not_delivered));
      lock.unlock();
      return Fail(absl::DeadlineExceededError(absl::StrCat(what_, ": deadline exceeded", detail)));
    }
    if (now < spin_until) continue;
    ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    lock.unlock();
    pollfd pfd{event_fd_, POLLIN, 0};
    poll(&pfd, 1, SleepMs(deadline, options_.max_poll_interval));
    lock.lock();
  }
}

absl::Status UcxCommunicator::Fail(absl::Status status) {
  Lock lock(ucx_mu_);
  MarkBrokenLocked(status, /*tell_peers=*/true);
  BroadcastAbortIfPendingLocked(lock);
  CleanupInflightLocked(lock);
  return status;
}

void UcxCommunicator::CloseEndpointLocked(ucp_ep_h& ep, bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &param);
  ep = nullptr;
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) close_requests_.push_back(r);
}

void UcxCommunicator::CleanupInflightLocked(Lock& lock) {
  if (inflight_.empty()) return;
  for (auto& p : inflight_) {
    if (!p->done && !p->is_send && p->request != nullptr) ucp_request_cancel(worker_, p->request);
  }
  auto all_done = [this] {
    for (auto& p : inflight_)
      if (!p->done) return false;
    return true;
  };
  if (!ProgressUntilLocked(lock, all_done, absl::Now() + kCleanupGrace)) {
    // Sends the peer never took (a hung peer, a rendezvous in flight): only
    // closing the endpoint releases them, and with them the user's buffer.
    std::vector<char> close(world_, 0);
    for (auto& p : inflight_) {
      if (!p->done) close[p->peer] = 1;
    }
    for (int peer = 0; peer < world_; ++peer) {
      if (close[peer] && eps_[peer] != nullptr) {
        ep_failed_[peer] = 1;
        CloseEndpointLocked(eps_[peer], /*force=*/true);
      }
    }
    if (!ProgressUntilLocked(lock, all_done, absl::Now() + kCleanupTimeout)) {
      EXL3_LOG(kError) << what_ << ": operations still pending after closing their endpoints";
    }
  }
  std::vector<std::unique_ptr<Pending>> left;
  for (auto& p : inflight_) {
    if (p->done) {
      if (p->request != nullptr) ucp_request_free(p->request);
    } else {
      left.push_back(std::move(p));  // kept alive: UCX still holds its address
    }
  }
  inflight_.clear();
  for (auto& p : left) control_sends_.push_back(std::move(p));
}

// --- collectives ------------------------------------------------------------------

absl::Status UcxCommunicator::AllReduce(void* data, size_t count, CommDataType type,
                                        absl::Time deadline) {
  const size_t esize = CommDataTypeSize(type);
  const size_t bytes = count * esize;
  const bool one_shot = bytes <= options_.one_shot_max_bytes;
  EXL3_RETURN_IF_ERROR(Begin(one_shot ? OpCode::kAllReduceOneShot : OpCode::kAllReduceTwoShot));
  if (world_ == 1) return absl::OkStatus();
  char* base = static_cast<char*>(data);
  std::vector<const void*> sources(world_);
  if (one_shot) {
    scratch_.resize(bytes * world_);
    for (int p = 0; p < world_; ++p) {
      sources[p] = p == rank_ ? static_cast<const void*>(base) : scratch_.data() + bytes * p;
      if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, scratch_.data() + bytes * p, bytes, 0));
    }
    for (int p = 0; p < world_; ++p) {
      if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, base, bytes, 0));
    }
    EXL3_RETURN_IF_ERROR(WaitAll(deadline));
    SumInOrder(type, sources.data(), world_, base, count);
    return absl::OkStatus();
  }
  // Two-shot: block b = elements [count·b/N, count·(b+1)/N), owned by rank b.
  auto block_begin = [&](int b) {
    return count * static_cast<size_t>(b) / static_cast<size_t>(world_);
  };
  const size_t mine_begin = block_begin(rank_);
  const size_t mine_count = block_begin(rank_ + 1) - mine_begin;
  const size_t mine_bytes = mine_count * esize;
  scratch_.resize(mine_bytes * world_);
  for (int p = 0; p < world_; ++p) {
    sources[p] = p == rank_ ? static_cast<const void*>(base + mine_begin * esize)
                            : scratch_.data() + mine_bytes * p;
    if (p != rank_)
      EXL3_RETURN_IF_ERROR(PostRecv(p, scratch_.data() + mine_bytes * p, mine_bytes, 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const size_t b0 = block_begin(p), b1 = block_begin(p + 1);
    EXL3_RETURN_IF_ERROR(PostSend(p, base + b0 * esize, (b1 - b0) * esize, 0));
  }
  EXL3_RETURN_IF_ERROR(WaitAll(deadline));
  SumInOrder(type, sources.data(), world_, base + mine_begin * esize, mine_count);
  for (int p = 0; p < world_; ++p) {
    if (p == rank_) continue;
    const size_t b0 = block_begin(p), b1 = block_begin(p + 1);
    EXL3_RETURN_IF_ERROR(PostRecv(p, base + b0 * esize, (b1 - b0) * esize, 1));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, base + mine_begin * esize, mine_bytes, 1));
  }
  return WaitAll(deadline);
}

absl::Status UcxCommunicator::ReduceScatter(const void* data, size_t count, CommDataType type,
                                            void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kReduceScatter));
  const size_t bytes = count * CommDataTypeSize(type);
  const char* base = static_cast<const char*>(data);
  std::vector<const void*> sources(world_);
  scratch_.resize(bytes * world_);
  for (int p = 0; p < world_; ++p) {
    sources[p] =
        p == rank_ ? static_cast<const void*>(base + bytes * rank_) : scratch_.data() + bytes * p;
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, scratch_.data() + bytes * p, bytes, 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, base + bytes * p, bytes, 0));
  }
  EXL3_RETURN_IF_ERROR(WaitAll(deadline));
  SumInOrder(type, sources.data(), world_, recv, count);
  return absl::OkStatus();
}

absl::Status UcxCommunicator::AllGather(const void* send, size_t bytes, void* recv,
                                        absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kAllGather));
  char* out = static_cast<char*>(recv);
  if (out + bytes * rank_ != send && bytes > 0) std::memmove(out + bytes * rank_, send, bytes);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, out + bytes * p, bytes, 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, out + bytes * rank_, bytes, 0));
  }
  return WaitAll(deadline);
}

absl::Status UcxCommunicator::AllGatherV(const void* send, std::span<const size_t> bytes_per_rank,
                                         void* recv, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kAllGatherV));
  if (bytes_per_rank.size() != static_cast<size_t>(world_)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(what_, ": bytes_per_rank has ",
                                                        bytes_per_rank.size(),
                                                        " entries, expected world_size ", world_)));
  }
  std::vector<size_t> offset(world_ + 1, 0);
  for (int p = 0; p < world_; ++p) offset[p + 1] = offset[p] + bytes_per_rank[p];
  char* out = static_cast<char*>(recv);
  const size_t mine = bytes_per_rank[rank_];
  if (out + offset[rank_] != send && mine > 0) std::memmove(out + offset[rank_], send, mine);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, out + offset[p], bytes_per_rank[p], 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, out + offset[rank_], mine, 0));
  }
  return WaitAll(deadline);
}

absl::Status UcxCommunicator::AllToAllV(const void* send, std::span<const size_t> send_bytes,
                                        void* recv, std::span<const size_t> recv_bytes,
                                        absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kAllToAllV));
  if (send_bytes.size() != static_cast<size_t>(world_) ||
      recv_bytes.size() != static_cast<size_t>(world_)) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(what_, ": send_bytes/recv_bytes have ",
                                                        send_bytes.size(), "/", recv_bytes.size(),
                                                        " entries, expected world_size ", world_)));
  }
  if (send_bytes[rank_] != recv_bytes[rank_]) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(what_, ": send_bytes[", rank_, "] = ", send_bytes[rank_], " but recv_bytes[",
                     rank_, "] = ", recv_bytes[rank_], " (what a rank sends itself must match)")));
  }
  std::vector<size_t> send_off(world_ + 1, 0), recv_off(world_ + 1, 0);
  for (int p = 0; p < world_; ++p) {
    send_off[p + 1] = send_off[p] + send_bytes[p];
    recv_off[p + 1] = recv_off[p] + recv_bytes[p];
  }
  const char* in = static_cast<const char*>(send);
  char* out = static_cast<char*>(recv);
  if (send_bytes[rank_] > 0)
    std::memmove(out + recv_off[rank_], in + send_off[rank_], send_bytes[rank_]);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, out + recv_off[p], recv_bytes[p], 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, in + send_off[p], send_bytes[p], 0));
  }
  return WaitAll(deadline);
}

absl::Status UcxCommunicator::Broadcast(void* data, size_t bytes, int root, absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kBroadcast));
  if (root < 0 || root >= world_) {
    return Fail(absl::InvalidArgumentError(
        absl::StrCat(what_, ": root must be in [0, ", world_, "), got ", root)));
  }
  if (rank_ == root) {
    for (int p = 0; p < world_; ++p) {
      if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, data, bytes, 0));
    }
  } else {
    EXL3_RETURN_IF_ERROR(PostRecv(root, data, bytes, 0));
  }
  return WaitAll(deadline);
}

absl::Status UcxCommunicator::Barrier(absl::Time deadline) {
  EXL3_RETURN_IF_ERROR(Begin(OpCode::kBarrier));
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostRecv(p, nullptr, 0, 0));
  }
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) EXL3_RETURN_IF_ERROR(PostSend(p, nullptr, 0, 0));
  }
  return WaitAll(deadline);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateUcxCommunicator(const UcxOptions& options,
                                                                    Bootstrap& bootstrap) {
  const int rank = bootstrap.rank();
  const int world = bootstrap.world_size();
  if (world < 1 || world > kMaxWorldSize || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("ucx: world_size must be in [1, ", kMaxWorldSize,
                                                   "] and rank in [0, world_size), got rank ", rank,
                                                   " of ", world));
  }
  if (options.busy_poll < absl::ZeroDuration() ||
      options.max_poll_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("ucx: busy_poll must be >= 0 and max_poll_interval > 0");
  }
  auto comm = std::make_unique<UcxCommunicator>(rank, world, options);
  EXL3_RETURN_IF_ERROR(comm->Init(bootstrap, absl::Now() + options.setup_timeout));
  return std::unique_ptr<Communicator>(std::move(comm));
}

}  // namespace exl3serve::worker::comm
