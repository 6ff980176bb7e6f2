// worker/comm/ucx_communicator.h — the `ucx` Communicator: CPU ranks on any
// number of boxes, over UCX's tag-matching API (UCP), usually its TCP
// transport. The group forms through a Bootstrap (TcpBootstrap across boxes).
//
//   TcpBootstrapOptions boot{.rank = r, .world_size = n, .host = "10.0.0.1", .port = 29500};
//   EXL3_ASSIGN_OR_RETURN(auto bootstrap, TcpBootstrap::Create(boot, Deadline(absl::Seconds(30))));
//   UcxOptions options;
//   options.tls = "tcp";
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, CreateUcxCommunicator(options,
//   *bootstrap)); EXL3_RETURN_IF_ERROR(comm->AllReduce(buf, n, CommDataType::kF32,
//   Deadline(absl::Seconds(5))));
//
// 1. What and when. Every operation is direct (every pair of ranks exchanges
//    at most one message per round), which for the 2–8 ranks we run is as
//    cheap in bytes as a ring and has 1–2 rounds of latency instead of N−1:
//    * AllReduce, count·size <= one_shot_max_bytes (64 KiB): one-shot —
//      every rank sends its whole buffer to every peer and sums all N in
//      rank order.
//    * AllReduce, larger: two-shot — element block b = [count·b/N,
//      count·(b+1)/N) is owned by rank b; round 1 sends block b to its owner,
//      which sums the N contributions in rank order 0..N−1; round 2 sends the
//      owner's result to every rank. Traffic per rank: 2·(N−1)/N of the buffer.
//    * ReduceScatter: round 1 of the two-shot. AllGather(V), AllToAllV: one
//      round of N−1 sends and N−1 receives. Broadcast: root sends to each
//      rank. Barrier: a zero-byte message from every rank to every rank.
//    World sizes 1..64 (kMaxSumSources: a reduction sums all ranks in one
//    SumInOrder call).
//    Determinism: both AllReduce algorithms compute each element as
//    ((x_0 + x_1) + x_2) + ... in fp32 in rank order (SumInOrder,
//    reduce_sum.h), bf16 rounded once at the end, so the result is the
//    same bits on every rank, for every size, on either side of the
//    threshold.
// 2. Tags (64 bits): kind (2) | op (4) | step (2) | source rank (16) |
//    reserved (8) | sequence (32). Every collective call takes the next
//    sequence number on every rank; a data receive matches the full tag, so
//    a message of one call can never land in another's buffer. While
//    waiting, a rank probes for messages with its current sequence number
//    from the same source but another op (a rank that called a different
//    collective) and fails with InvalidArgument; a size mismatch (a message
//    larger or smaller than posted) fails the same way. Control messages
//    (kind abort, kind bye) carry no sequence and have receives posted for
//    the communicator's whole life.
// 3. Progress and waiting: calls post non-blocking sends/receives
//    (ucp_tag_send_nbx / ucp_tag_recv_nbx) and progress the worker until all
//    complete; when progress finds nothing (after `busy_poll` of spinning,
//    default none) the thread sleeps on the worker's event fd
//    (ucp_worker_arm, then poll) for at most `max_poll_interval` or until the
//    deadline, so 4 ranks on 2 cores do not starve each other. Each wake-up
//    checks the deadline and the broken flag.
// 4. Failure (the Communicator contract):
//    * Two endpoints per peer, both UCP_ERR_HANDLING_MODE_PEER: the data
//      lane (collectives, and the bye notice, which must stay behind the
//      data) and the abort lane (abort notices only, so a notice never waits
//      behind a large send the peer is not draining). Both are connected by
//      two barriers during creation (UCX wires up lazily, and a wire-up
//      needs the peer to progress).
//    * An endpoint's error callback marks the communicator broken (a killed
//      peer's TCP connection resets at once; seen within milliseconds). The
//      error is applied after progress has drained what already arrived, so
//      a notice that came with the close (an abort with its reason, a bye)
//      is seen first.
//    * Any failed call (deadline, mismatch, transport error, Abort()) marks
//      the communicator broken and sends an abort notice with the reason on
//      the abort lane to every reachable peer; a peer that receives it is
//      broken too, relays it once (the sender may have died before reaching
//      everyone), and its current or next call returns
//      Aborted("communicator broken: rank R (host pid P) aborted: <reason>").
//    * On failure the call cancels its receives and waits (bounded) for its
//      sends; sends still pending after that close their endpoint forcibly,
//      so user buffers are never touched after the call returns.
//    * Destruction of a healthy communicator sends "bye" to every peer
//      before closing its endpoints; a peer that receives it ignores the
//      connection's later close (the rank finished, it did not die).
// 5. Transport settings: UcxOptions names them explicitly and they are
//    applied with ucp_config_modify, overriding the UCX_* environment
//    variables UCX itself reads (ucp_config_read), which stay as a fallback
//    for settings we do not name. Note: Debian's UCX disables the shared
//    memory transports' peer-failure support (UCX_POSIX_ERROR_HANDLING=n),
//    so with error handling on, ranks on one box talk over tcp (and cma)
//    even with the default `tls`; use the `shm` backend inside a box.
//
// Thread safety: one thread at a time calls collectives; Abort() and
// health() may be called from any thread (an internal mutex serialises UCX
// calls; the calling thread drops it while it sleeps on the event fd).
// Ownership: owns its UCX context, worker and endpoints; borrows the
// Bootstrap only during CreateUcxCommunicator. Buffers passed to calls are
// borrowed for the call only.
#ifndef EXL3SERVE_WORKER_COMM_UCX_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_UCX_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

struct UcxOptions {
  // --- behaviour
  // UCX transports (UCX_TLS), e.g. "tcp" (what crosses boxes without RDMA),
  // "tcp,cma", "rc,tcp". Empty: UCX's own choice (its default is "all").
  std::string tls;
  // Network devices for tcp/RDMA (UCX_NET_DEVICES), e.g. "eth0" or
  // "mlx5_0:1,eth0". Empty: UCX's default ("all").
  std::string net_devices;
  // Any other UCX setting, name without the UCX_ prefix, e.g.
  // {"KEEPALIVE_INTERVAL", "1s"}. Applied after tls/net_devices. UCX 1.13
  // rejects bad values (InvalidArgument here) but ignores unknown names.
  std::vector<std::pair<std::string, std::string>> config;
  // Bound on forming the group: the bootstrap exchange of worker addresses
  // and the first barrier that connects every endpoint.
  absl::Duration setup_timeout = absl::Seconds(60);

  // --- performance
  // AllReduce payloads up to this many bytes use one-shot (one round, N−1
  // full-size messages per rank); larger ones two-shot. Measured with
  // tests/bench/ucx_allreduce_bench (--one-shot-max-bytes 0 vs 1 MiB, tcp,
  // 2-core CI box under load): 2 ranks, one-shot wins up to 256 KiB (64 KiB:
  // 53 vs 118 us); 4 ranks, even at 16–64 KiB (91 vs 113, 350 vs 364 us),
  // two-shot wins from 256 KiB (1.03 vs 1.57 ms). 64 KiB suits both.
  size_t one_shot_max_bytes = 64 << 10;
  // How long a waiting call keeps calling ucp_worker_progress before it
  // sleeps on the worker's event fd (it always progresses once first).
  // Default 0: measured with tests/bench/ucx_allreduce_bench on the 2-core
  // CI box (load average ~6 from parallel builds), 2 ranks, 4 B–16 KiB over
  // tcp: 12–24 us per AllReduce at 0, 26–42 us at 10 us, 84–106 us at 50 us
  // (4 ranks: ~80 / ~140 / ~200 us) — spinning steals the core the peer
  // needs. Raise it only where every rank has a core of its own.
  absl::Duration busy_poll = absl::ZeroDuration();
  // Longest single sleep on the event fd; bounds how late a missed wake-up
  // or a deadline is noticed.
  absl::Duration max_poll_interval = absl::Milliseconds(5);
};

// Creates this rank's communicator: reads the UCX configuration and applies
// `options`, creates a context and worker, exchanges worker addresses
// through `bootstrap` (one AllGather), connects an endpoint to every peer
// and runs one barrier, all within options.setup_timeout. Collective over
// the bootstrap's ranks; rank() and world_size() are the bootstrap's.
// Errors: InvalidArgument (options), Unavailable (UCX init, unreachable
// peers), DeadlineExceeded, or the bootstrap's error.
absl::StatusOr<std::unique_ptr<Communicator>> CreateUcxCommunicator(const UcxOptions& options,
                                                                    Bootstrap& bootstrap);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_UCX_COMMUNICATOR_H_
