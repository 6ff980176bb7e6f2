// worker/metrics.h — every Prometheus metric a rank process exports,
// declared (with help text) in metrics.cc; the rank's RankObserver.
// Every series carries model_name and rank:
//
//   histogram  exl3serve:rank_forward_seconds{phase=prefill|decode|mixed}
//                one forward on this rank (its share of a step, collectives included)
//              exl3serve:collective_latency_seconds{backend,op,size_class}
//                one collective call (worker/comm/timed_communicator.h)
//   counter    exl3serve:rank_forward_tokens_total{phase}
//              exl3serve:collective_bytes_total{backend,op}   this rank's payload
//              exl3serve:collective_timeouts_total{backend}   calls that hit their deadline
//              exl3serve:collective_failures_total{backend}   other failed calls
//   gauge      exl3serve:rank_info{world_size} = 1
// Spilled row tables (sharding/spill_store.h), by tensor:
//   counter    exl3serve:spill_lookups_total{tensor}      rows looked up
//              exl3serve:spill_cache_hits_total{tensor}   of which served from the row cache
//                (hit ratio = rate(hits) / rate(lookups))
//              exl3serve:spill_reads_total{tensor}        preads (after coalescing)
//              exl3serve:spill_read_bytes_total{tensor}   bytes those preads returned
//   histogram  exl3serve:spill_read_latency_seconds{tensor}  one pread + checksum check
// The prefix cache's disk tier (worker/model/kv_disk_tier.h), when the rank has one:
//   counter    exl3serve:kv_disk_written_bytes_total, kv_disk_read_bytes_total,
//              kv_disk_hits_total, kv_disk_misses_total (all failed loads),
//              kv_disk_checksum_failures_total, kv_disk_dropped_saves_total (queue full),
//              kv_disk_io_errors_total
// MoE ranks:
//   counter    exl3serve:expert_tokens_total{expert}      tokens routed to each expert this
//                rank holds (summed over layers)
// These are taken from the model's cumulative counters after every forward
// (OnModelCounters), so they appear with the first forward.
//
//   RankMetrics metrics(endpoint->registry(), {.model_name = "llama", .rank = 0, ...});
//   options.observer = &metrics;   // RankServerOptions / RankClientOptions
//
// Thread safety: every method is thread-safe (prometheus-cpp metrics are).
#ifndef EXL3SERVE_WORKER_METRICS_H_
#define EXL3SERVE_WORKER_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "worker/rank/rank_executor.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace exl3serve::worker {

struct RankMetricsOptions {
  std::string model_name;  // the model_name label
  int rank = 0;
  int world_size = 1;
};

class RankMetrics final : public rank::RankObserver {
 public:
  // Registers every family in `registry`, which must outlive this object.
  RankMetrics(prometheus::Registry& registry, const RankMetricsOptions& options);
  ~RankMetrics() override;

  void OnForward(rank::ForwardPhase phase, int64_t tokens, absl::Duration elapsed,
                 const absl::Status& status) override;
  void OnCollective(const std::string& backend, comm::CollectiveOp op, size_t bytes,
                    absl::Duration elapsed, const absl::Status& status) override;
  void OnModelCounters(const Transformer& model) override;
  void OnKvDiskTier(const KvDiskTierStats& stats) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_METRICS_H_
