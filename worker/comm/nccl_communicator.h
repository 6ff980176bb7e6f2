// worker/comm/nccl_communicator.h — the `nccl` backend: GPU ranks on one or
// many boxes (NVLink, PCIe, InfiniBand/RoCE or TCP sockets) through NCCL.
// Buffers are device memory of the rank's device.
//
//   NcclOptions options;
//   options.device = local_rank;
//   options.socket_ifname = "eth1";
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
//                         CreateNcclCommunicator(options, bootstrap));
//   EXL3_RETURN_IF_ERROR(
//       comm->AllReduce(d_buf, n, CommDataType::kBF16, Deadline(absl::Seconds(5))));
//
// Built only when NCCL is found (EXL3_HAVE_NCCL=1, a public definition of
// exl3_worker_comm); guard calls with `#if EXL3_HAVE_NCCL`.
//
// How the Communicator contract (communicator.h) is met:
//   * Deadlines: the communicator is created non-blocking (ncclConfig_t
//     blocking = 0). Each call enqueues the NCCL operation(s) on the
//     communicator's stream, records an event, then polls cudaEventQuery and
//     ncclCommGetAsyncError until the event completes, NCCL reports an error,
//     or the deadline passes. The call returns once the operation and every
//     piece of work enqueued on the stream before it are done.
//   * Failure: at a deadline, an NCCL or CUDA error, or Abort(), the rank
//     calls ncclCommAbort (which also stops kernels still running) and marks
//     itself broken: later calls fail with Aborted("communicator broken:
//     <first reason>"). NCCL has no out-of-band abort message, so the PEERS of
//     an aborting rank learn of it through their own failure: their NCCL
//     kernels wait for data that never comes, and they fail with
//     DeadlineExceeded at their own deadline (or earlier with the ncclRemoteError
//     NCCL's proxy reports when a connection drops). Size mismatches between
//     ranks are not detected by NCCL; they surface as a deadline or garbage.
//   * Determinism: NCCL does NOT sum in rank order 0..N-1 as the contract
//     asks. Its ring / tree algorithms reduce each chunk in an order fixed by
//     the topology, the algorithm and protocol chosen (which depend on the
//     message size), and the channel count; the reduced chunk is then
//     broadcast, so every rank receives bit-identical results, and repeating a
//     call of the same size on the same machines with the same NCCL version and
//     settings repeats the bits. Results differ in the last bits from a
//     rank-order sum and from the cuda_p2p backend. Pin `algorithm` ("Ring")
//     to keep the order the same across message sizes. For kBF16 NCCL rounds
//     to bf16 after every reduction step (not once), so the error grows with
//     the world size (up to about N bf16 ulps of the magnitudes summed). Where bit-exact rank-order
//     sums matter, use cuda_p2p inside a box.
//   * Settings: NCCL reads its network settings only from environment
//     variables, most of them once per process at its first initialisation.
//     NcclOptions carries them as configuration; CreateNcclCommunicator
//     applies them with setenv() just before ncclCommInitRankConfig (see
//     NcclEnvironment). A second communicator in the same process that asks
//     for a different value of a variable already applied fails with
//     FailedPrecondition, since NCCL would silently keep the first value.
//   * CUDA graphs: when the stream is capturing, calls enqueue and return OK
//     without waiting (no deadline applies to graph replays; failures surface
//     in the next eager call or in health()).
//
// Thread safety: one thread at a time for the collective calls (each call
// makes the communicator's device current on that thread); Abort() and
// health() from any thread.
#ifndef EXL3SERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/bootstrap.h"
#include "worker/comm/communicator.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; no CUDA header needed here

namespace exl3serve::worker::comm {

struct NcclOptions {
  // --- behaviour -----------------------------------------------------------
  // CUDA device ordinal of this rank (in this process's numbering); -1 uses
  // the calling thread's current device. Two ranks of one communicator must
  // not share a GPU (NCCL refuses it; checked at creation by PCI bus id).
  int device = -1;
  // Stream the operations run on (borrowed; must outlive the communicator,
  // and belong to `device`). Null: the communicator creates and owns a
  // non-blocking stream. Calls wait for everything enqueued on it before them.
  CUstream_st* stream = nullptr;
  // Bound on creation: the set-up exchange and ncclCommInitRankConfig.
  // NCCL's first init on a large group can take tens of seconds.
  absl::Duration init_timeout = absl::Seconds(120);
  // Name shown in NCCL's logs (ncclConfig_t.commName); empty: none.
  std::string comm_name;

  // --- network; applied as environment variables (see the file comment) ---
  // NCCL_SOCKET_IFNAME: interfaces for bootstrap and socket traffic, e.g.
  // "eth1", "=eth1" (exact), "^docker,lo" (exclude). Empty: NCCL's choice.
  std::string socket_ifname;
  // NCCL_SOCKET_FAMILY: "" (NCCL's choice), "AF_INET" or "AF_INET6".
  std::string socket_family;
  // NCCL_IB_DISABLE=1 when false: never use InfiniBand/RoCE verbs.
  bool enable_ib = true;
  // NCCL_IB_HCA: HCAs and ports to use, e.g. "mlx5_0:1,mlx5_1:1". Requires
  // enable_ib.
  std::string ib_hca;
  // NCCL_IB_GID_INDEX: the RoCE GID index (RoCE v2 over IPv4 is usually 3);
  // -1: NCCL's default. Range 0..255.
  int ib_gid_index = -1;
  // ncclConfig_t.trafficClass (per communicator; IB traffic class / RoCE
  // DSCP); -1: NCCL's default. Range 0..255.
  int ib_traffic_class = -1;
  // NCCL_NET_PLUGIN: the network plugin library suffix or path; "none"
  // disables plugin loading. Empty: NCCL's default search.
  std::string net_plugin;
  // ncclConfig_t.netName: the network to use ("IB", "Socket", or a plugin's
  // name). Empty: NCCL picks.
  std::string net_name;
  // NCCL_P2P_DISABLE=1 / NCCL_SHM_DISABLE=1 when false (e.g. containers
  // without a shared IPC namespace).
  bool enable_p2p_transport = true;
  bool enable_shm_transport = true;
  // NCCL_ALGO: "" (NCCL's choice per size), "Ring" or "Tree"; pinning one
  // keeps the reduction order the same across message sizes.
  std::string algorithm;
  // NCCL_DEBUG: "" (NCCL's default, WARN), "VERSION", "WARN", "INFO", "TRACE".
  std::string debug_level;
  // Any other NCCL variable, as (name, value). Names must start with NCCL_
  // and must not be one the fields above set.
  std::vector<std::pair<std::string, std::string>> extra_env;
};

// OK, or InvalidArgument naming the field (as "nccl.<field>"), the rule and
// the value given.
absl::Status ValidateNcclOptions(const NcclOptions& options);

// The environment assignments CreateNcclCommunicator makes for `options`, in
// a fixed order (dedicated fields first, then extra_env). Requires: options
// valid.
std::vector<std::pair<std::string, std::string>> NcclEnvironment(const NcclOptions& options);

// Creates this rank's communicator over the group `bootstrap` describes
// (rank and world size are the bootstrap's). Collective: every rank calls it.
// Rank 0 calls ncclGetUniqueId; the id travels through bootstrap.AllGather
// together with every rank's set-up status, so a rank that cannot start (no
// device, bad options) makes every rank fail with its reason instead of
// leaving them waiting. `bootstrap` is borrowed for the call only.
// Errors: InvalidArgument (options), FailedPrecondition (no device, two ranks
// on one GPU, an NCCL variable already applied with another value),
// DeadlineExceeded (init_timeout), Unavailable / Internal (bootstrap, NCCL).
// Cost: blocks for the whole NCCL initialisation (seconds).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const NcclOptions& options,
                                                                     Bootstrap& bootstrap);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_NCCL_COMMUNICATOR_H_
