// worker/comm/tcp_bootstrap.h — a Bootstrap over plain TCP: rank 0 listens,
// every other rank connects to it; AllGather collects every rank's blob at
// rank 0 and sends the whole set back. Works across boxes and network
// namespaces; it carries setup traffic (UCX worker addresses, NCCL ids), not
// tensors.
//
//   TcpBootstrapOptions options{.rank = r, .world_size = n, .host = "10.0.0.1", .port = 29500};
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<TcpBootstrap> bootstrap,
//                         TcpBootstrap::Create(options, Deadline(absl::Seconds(30))));
//   EXL3_ASSIGN_OR_RETURN(std::vector<std::string> blobs, bootstrap->AllGather(mine, deadline));
//
// Protocol (all integers little-endian): every message is a frame
//   u32 magic "EXB1" | u32 kind | u64 length | length bytes.
//   kind 1 hello    (peer -> 0, once after connecting): u32 rank, u32 world_size, u64 group_id
//   kind 2 blob     (peer -> 0, per AllGather): the peer's blob
//   kind 3 all      (0 -> peer, per AllGather): u32 n, then n × (u64 length, bytes)
//   kind 4 error    (0 -> peer, when rank 0 fails): u32 absl status code, message
//   kind 5 challenge (0 -> peer, on accept, with auth_key): 32 random bytes N0
//   kind 6 welcome   (0 -> peer, after a valid hello, with auth_key):
//                   HMAC-SHA256(key, "exl3serve bootstrap welcome v1" | Np | N0)
// With auth_key the hello is sent at the peer's first AllGather, after the
// challenge, as  hello(16) | Np (32 random bytes) |
//   HMAC-SHA256(key, "exl3serve bootstrap hello v1" | N0 | hello(16) | Np),
// and the peer sends its blob only after checking the welcome: each side
// proves it knows the cluster's rank token before any setup data (UCX
// addresses, NCCL ids) moves, and a replayed hello fails on a fresh N0.
// Rank 0 refuses (closes, logs the peer's address) a hello without a MAC or
// with a wrong one and keeps waiting for the real ranks; a connection that
// has not sent a valid hello within handshake_timeout (a slow loris, a port
// scanner) is closed the same way, and at most kMaxPendingConnections wait
// at once. With auth_key, every later frame (blob, all, error) is sealed
// with AES-256-GCM under per-direction keys derived from the token and both
// nonces (HMAC-SHA256(key, "exl3serve bootstrap key v1 peer->root" | N0 | Np)
// and "... root->peer"), a per-direction sequence number as nonce and the
// kind in the AAD: setup data (UCX addresses, NCCL ids) is encrypted and a
// tampered, replayed or reordered frame fails the group (Unauthenticated).
// Why not TLS: the ranks share a secret, not certificates, and the PSK
// handshake above already authenticates both ends. The collective data
// plane (shm, UCX, NCCL) itself stays on the trusted network
// (docs/design/deploy.md).
// Rank 0 accepts connections lazily, inside AllGather, so Create() on rank 0
// returns at once (and port() is known before any peer starts). A hello with
// another world size or group id (a stale rank of another run) is closed and
// ignored; a rank that connects twice fails the group.
//
// Failure: every wait is a poll() bounded by the call's deadline.
//   * DeadlineExceeded names the ranks not heard from (rank 0 knows which;
//     it also sends its error to the connected peers before closing).
//   * Unavailable when a peer's connection drops (EOF or reset) mid-call.
//   * After any failure the bootstrap is broken: rank 0 closes every socket,
//     so the other ranks' calls fail promptly too, and later calls return
//     FailedPrecondition with the first error.
// Thread safety: thread-compatible (one thread at a time), as Bootstrap.
// Ownership: owns its sockets; closes them on destruction.
#ifndef EXL3SERVE_WORKER_COMM_TCP_BOOTSTRAP_H_
#define EXL3SERVE_WORKER_COMM_TCP_BOOTSTRAP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"

namespace exl3serve::worker::comm {

struct SealedLink;  // tcp_bootstrap.cc: the AES-GCM state of one authenticated connection

struct TcpBootstrapOptions {
  int rank = 0;
  int world_size = 1;
  // Rank 0: the address to listen on (an IP literal or a host name;
  // "0.0.0.0" listens on every interface). Other ranks: rank 0's address.
  std::string host = "127.0.0.1";
  // Rank 0: the port to listen on; 0 lets the kernel pick one (read it back
  // with port() and hand it to the other ranks). Other ranks: rank 0's port.
  uint16_t port = 0;
  // Must be equal on every rank of one group; lets rank 0 turn away a rank
  // left over from another run that reuses the same address.
  uint64_t group_id = 0;
  // The cluster's rank token (worker --rank-token-file): peers and rank 0
  // prove they know it (HMAC challenge above). Empty = unauthenticated (a
  // trusted network); it must be set on every rank or on none.
  std::string auth_key{};
  // Rank 0 closes a connection that has not sent a valid hello this long
  // after it was accepted.
  absl::Duration handshake_timeout = absl::Seconds(5);
};

class TcpBootstrap final : public Bootstrap {
 public:
  // Rank 0 binds and listens, and returns at once (peers are accepted inside
  // AllGather). Other ranks connect, retrying refused connections until
  // `deadline` (rank 0 may start later), and send their hello.
  // Errors: InvalidArgument (rank/world/port), Unavailable (cannot bind,
  // cannot resolve), DeadlineExceeded (rank 0 not reachable in time).
  static absl::StatusOr<std::unique_ptr<TcpBootstrap>> Create(const TcpBootstrapOptions& options,
                                                              absl::Time deadline);

  ~TcpBootstrap() override;
  TcpBootstrap(const TcpBootstrap&) = delete;
  TcpBootstrap& operator=(const TcpBootstrap&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  // The port rank 0 listens on (the chosen one when options.port was 0);
  // on other ranks, the port they connected to.
  uint16_t port() const { return port_; }

  absl::StatusOr<std::vector<std::string>> AllGather(const std::string& blob,
                                                     absl::Time deadline) override;

 private:
  struct Peer;  // rank 0's view of one connection (tcp_bootstrap.cc)

  TcpBootstrap(const TcpBootstrapOptions& options);
  absl::StatusOr<std::vector<std::string>> RootAllGather(const std::string& blob,
                                                         absl::Time deadline);
  absl::StatusOr<std::vector<std::string>> PeerAllGather(const std::string& blob,
                                                         absl::Time deadline);
  // Records the first failure, tells connected peers (rank 0) and closes
  // every socket. Returns `status`.
  absl::Status Fail(absl::Status status);
  void CloseAll();
  // Ranks > 0 with auth_key: challenge -> hello -> welcome, before the first blob.
  absl::Status PeerHandshake(absl::Time deadline, const std::string& what);

  const int rank_;
  const int world_size_;
  const std::string host_;
  const uint64_t group_id_;
  const std::string auth_key_;
  const absl::Duration handshake_timeout_;
  bool handshaken_ = false;                          // ranks > 0: the welcome was checked
  std::unique_ptr<SealedLink> root_link_;            // ranks > 0 with auth: sealed frames
  uint16_t port_ = 0;
  int listen_fd_ = -1;                               // rank 0
  int root_fd_ = -1;                                 // ranks > 0: the connection to rank 0
  std::vector<std::unique_ptr<Peer>> peers_;         // rank 0: index = rank (0 unused)
  std::vector<std::unique_ptr<Peer>> unidentified_;  // rank 0: accepted, hello not yet read
  int64_t calls_ = 0;                                // AllGather calls so far (for messages)
  absl::Status broken_;                              // first failure; OK while usable
};

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_TCP_BOOTSTRAP_H_
