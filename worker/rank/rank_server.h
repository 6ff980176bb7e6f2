// worker/rank/rank_server.h — one rank process of a tensor/expert-parallel
// group (`exl3serve worker`): joins the group's communicator, plans the
// shards (every rank computes the same plan from the same inputs), loads only
// its slices, then executes the driver's commands from the control channel
// (control_wire.h) until told to shut down.
//
// Protocol, per command frame from the driver: every rank executes it and
// answers with a status; for kForward rank 0 adds the logits (every rank has
// them; one copy crosses the channel). The first frame a rank sends, after
// loading, is its hello: version, status, vocab size, bytes read from the
// checkpoint, its planned bytes.
//
// Failure: when a collective fails (a peer died or hung past the deadline, or
// the group was aborted), the rank answers the command with that error, logs
// "rank R: lost its peers: ..." and returns the error (the process exits
// nonzero): a broken group is re-formed by starting new ranks, not repaired.
// End of file on the control channel (the driver is gone) ends the rank
// cleanly.
#ifndef EXL3SERVE_WORKER_RANK_RANK_SERVER_H_
#define EXL3SERVE_WORKER_RANK_RANK_SERVER_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/comm/comm_factory.h"
#include "worker/model/kv_cache.h"
#include "worker/rank/rank_executor.h"

namespace exl3serve::worker::rank {

struct RankServerOptions {
  std::string model_dir;
  int rank = 0;
  int world_size = 1;
  int expert_parallel = 0;  // sharding::ShardOptions::expert_parallel
  comm::CommSpec comm;
  int control_fd = -1;      // this rank's end of the driver's socketpair
  int threads = 1;          // kernel threads of this process
  KvCacheOptions kv;
  std::string kv_disk_path;  // RankSetup::kv_disk_*
  int64_t kv_disk_slots = 0;
  absl::Duration join_timeout = absl::Seconds(60);
  absl::Duration collective_timeout = absl::Seconds(60);
  // Row tables read from disk (RankSetup::spill).
  sharding::SpillPolicy spill;
  // Per-rank capacities (RankSetup::capacities); empty = uniform.
  std::vector<double> capacities;
  // EXL3 linear arithmetic (RankSetup::prefill_precision / decode_precision).
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
  // The rank's metrics; borrowed, must outlive the call. Null = none.
  RankObserver* observer = nullptr;
};

// Runs the rank until shutdown or end of file (OK) or a broken group (the
// error). Load errors are sent in the hello and returned.
absl::Status RunRankServer(const RankServerOptions& options);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_RANK_SERVER_H_
