#include "worker/metrics.h"

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace exl3serve::worker {
namespace {

using Labels = std::map<std::string, std::string>;
using Buckets = prometheus::Histogram::BucketBoundaries;

// One forward on a rank: 0.5 ms (a decode row of a small model) .. 30 s (a
// long prefill on CPU).
const Buckets& ForwardBuckets() {
  static const Buckets b = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                            0.25,   0.5,   1.0,    2.5,   5.0,  10.0,  30.0};
  return b;
}
// One collective: 5 us (shm, small all-reduce) .. 5 s (a straggler near the
// deadline).
// One spill-store read: the store's own latency buckets (10 us .. 250 ms).
const Buckets& SpillReadBuckets() {
  static const Buckets b = [] {
    Buckets bounds;
    for (uint64_t us : sharding::SpillStoreStats::kReadLatencyBoundsUs) bounds.push_back(us * 1e-6);
    return bounds;
  }();
  return b;
}
const Buckets& CollectiveBuckets() {
  static const Buckets b = {0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
                            0.001,    0.0025,  0.005,    0.01,    0.025,  0.05,    0.1,
                            0.25,     1.0,     5.0};
  return b;
}

}  // namespace

struct RankMetrics::Impl {
  Impl(prometheus::Registry& registry, const RankMetricsOptions& o)
      : base{{"model_name", o.model_name}, {"rank", absl::StrCat(o.rank)}},
        forward_seconds(prometheus::BuildHistogram()
                            .Name("exl3serve:rank_forward_seconds")
                            .Help("Histogram of one forward on this rank (its share of a step, "
                                  "collectives included) in seconds, by phase.")
                            .Register(registry)),
        forward_tokens(prometheus::BuildCounter()
                           .Name("exl3serve:rank_forward_tokens_total")
                           .Help("New tokens through this rank's forwards, by phase.")
                           .Register(registry)),
        collective_seconds(prometheus::BuildHistogram()
                               .Name("exl3serve:collective_latency_seconds")
                               .Help("Histogram of one collective call in seconds, by backend, "
                                     "operation and message-size class.")
                               .Register(registry)),
        collective_bytes(prometheus::BuildCounter()
                             .Name("exl3serve:collective_bytes_total")
                             .Help("Payload bytes this rank contributed to collectives.")
                             .Register(registry)),
        timeouts(prometheus::BuildCounter()
                     .Name("exl3serve:collective_timeouts_total")
                     .Help("Collective calls that passed their deadline.")
                     .Register(registry)),
        failures(prometheus::BuildCounter()
                     .Name("exl3serve:collective_failures_total")
                     .Help("Collective calls that failed otherwise (peer lost, group aborted).")
                     .Register(registry)),
        spill_lookups(prometheus::BuildCounter()
                          .Name("exl3serve:spill_lookups_total")
                          .Help("Rows looked up in a spilled row table (cache hits and misses).")
                          .Register(registry)),
        spill_hits(prometheus::BuildCounter()
                       .Name("exl3serve:spill_cache_hits_total")
                       .Help("Looked-up rows of a spilled table served from its row cache.")
                       .Register(registry)),
        spill_reads(prometheus::BuildCounter()
                        .Name("exl3serve:spill_reads_total")
                        .Help("Disk reads (coalesced preads) of a spilled row table.")
                        .Register(registry)),
        spill_read_bytes(prometheus::BuildCounter()
                             .Name("exl3serve:spill_read_bytes_total")
                             .Help("Bytes read from disk for a spilled row table.")
                             .Register(registry)),
        spill_read_seconds(prometheus::BuildHistogram()
                               .Name("exl3serve:spill_read_latency_seconds")
                               .Help("Histogram of one disk read of a spilled row table (pread "
                                     "and checksum check) in seconds.")
                               .Register(registry)),
        kv_disk(prometheus::BuildCounter()
                    .Name("exl3serve:kv_disk_written_bytes_total")
                    .Help("Prefix cache disk tier: KV page bytes written to this rank's file.")
                    .Register(registry)),
        kv_disk_read(prometheus::BuildCounter()
                         .Name("exl3serve:kv_disk_read_bytes_total")
                         .Help("Prefix cache disk tier: KV page bytes read from this rank's file.")
                         .Register(registry)),
        kv_disk_hits(prometheus::BuildCounter()
                         .Name("exl3serve:kv_disk_hits_total")
                         .Help("Prefix cache disk tier: blocks read back and verified.")
                         .Register(registry)),
        kv_disk_misses(prometheus::BuildCounter()
                           .Name("exl3serve:kv_disk_misses_total")
                           .Help("Prefix cache disk tier: loads that failed on this rank.")
                           .Register(registry)),
        kv_disk_checksum(prometheus::BuildCounter()
                             .Name("exl3serve:kv_disk_checksum_failures_total")
                             .Help("Prefix cache disk tier: slots whose header or data CRC32C "
                                   "did not match (a miss, never wrong output).")
                             .Register(registry)),
        kv_disk_dropped(prometheus::BuildCounter()
                            .Name("exl3serve:kv_disk_dropped_saves_total")
                            .Help("Prefix cache disk tier: saves dropped because the write queue "
                                  "was full (a step never waits for the disk).")
                            .Register(registry)),
        kv_disk_errors(prometheus::BuildCounter()
                           .Name("exl3serve:kv_disk_io_errors_total")
                           .Help("Prefix cache disk tier: failed reads and writes.")
                           .Register(registry)),
        expert_tokens(prometheus::BuildCounter()
                          .Name("exl3serve:expert_tokens_total")
                          .Help("Tokens routed to each MoE expert this rank holds, summed over "
                                "layers.")
                          .Register(registry)) {
    prometheus::BuildGauge()
        .Name("exl3serve:rank_info")
        .Help("This rank process (value 1).")
        .Register(registry)
        .Add(With({{"world_size", absl::StrCat(o.world_size)}}))
        .Set(1);
    for (const char* phase : {"prefill", "decode"}) {
      forward_seconds.Add(With({{"phase", phase}}), ForwardBuckets());
      forward_tokens.Add(With({{"phase", phase}}));
    }
  }

  Labels With(const Labels& extra) const {
    Labels labels = base;
    labels.insert(extra.begin(), extra.end());
    return labels;
  }

  const Labels base;
  prometheus::Family<prometheus::Histogram>& forward_seconds;
  prometheus::Family<prometheus::Counter>& forward_tokens;
  prometheus::Family<prometheus::Histogram>& collective_seconds;
  prometheus::Family<prometheus::Counter>& collective_bytes;
  prometheus::Family<prometheus::Counter>& timeouts;
  prometheus::Family<prometheus::Counter>& failures;
  prometheus::Family<prometheus::Counter>& spill_lookups;
  prometheus::Family<prometheus::Counter>& spill_hits;
  prometheus::Family<prometheus::Counter>& spill_reads;
  prometheus::Family<prometheus::Counter>& spill_read_bytes;
  prometheus::Family<prometheus::Histogram>& spill_read_seconds;
  prometheus::Family<prometheus::Counter>& kv_disk;
  prometheus::Family<prometheus::Counter>& kv_disk_read;
  prometheus::Family<prometheus::Counter>& kv_disk_hits;
  prometheus::Family<prometheus::Counter>& kv_disk_misses;
  prometheus::Family<prometheus::Counter>& kv_disk_checksum;
  prometheus::Family<prometheus::Counter>& kv_disk_dropped;
  prometheus::Family<prometheus::Counter>& kv_disk_errors;
  prometheus::Family<prometheus::Counter>& expert_tokens;

  // What OnModelCounters last saw, to export increments of the model's
  // cumulative counters (reset when the rank loads a new model).
  absl::Mutex mu;
  const Transformer* last_model ABSL_GUARDED_BY(mu) = nullptr;
  std::map<std::string, sharding::SpillStoreStats> last_spill ABSL_GUARDED_BY(mu);
  std::map<int, uint64_t> last_expert ABSL_GUARDED_BY(mu);
  KvDiskTierStats last_kv_disk ABSL_GUARDED_BY(mu);
};

RankMetrics::RankMetrics(prometheus::Registry& registry, const RankMetricsOptions& options)
    : impl_(std::make_unique<Impl>(registry, options)) {}

RankMetrics::~RankMetrics() = default;

void RankMetrics::OnForward(rank::ForwardPhase phase, int64_t tokens, absl::Duration elapsed,
                            const absl::Status& status) {
  if (!status.ok()) return;  // a failed forward is counted by its collective
  const Labels labels = impl_->With({{"phase", rank::ForwardPhaseName(phase)}});
  impl_->forward_seconds.Add(labels, ForwardBuckets()).Observe(absl::ToDoubleSeconds(elapsed));
  impl_->forward_tokens.Add(labels).Increment(static_cast<double>(tokens));
}

void RankMetrics::OnCollective(const std::string& backend, comm::CollectiveOp op, size_t bytes,
                               absl::Duration elapsed, const absl::Status& status) {
  Impl& m = *impl_;
  // Both failure series exist (at 0) from the first call on.
  prometheus::Counter& timeouts = m.timeouts.Add(m.With({{"backend", backend}}));
  prometheus::Counter& failures = m.failures.Add(m.With({{"backend", backend}}));
  if (!status.ok()) {
    (absl::IsDeadlineExceeded(status) ? timeouts : failures).Increment();
    return;
  }
  const char* name = comm::CollectiveOpName(op);
  m.collective_seconds
      .Add(m.With({{"backend", backend},
                   {"op", name},
                   {"size_class", comm::CollectiveSizeClass(bytes)}}),
           CollectiveBuckets())
      .Observe(absl::ToDoubleSeconds(elapsed));
  m.collective_bytes.Add(m.With({{"backend", backend}, {"op", name}}))
      .Increment(static_cast<double>(bytes));
}

void RankMetrics::OnKvDiskTier(const KvDiskTierStats& now) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  KvDiskTierStats& before = m.last_kv_disk;
  auto add = [&](prometheus::Family<prometheus::Counter>& family, uint64_t value, uint64_t seen) {
    family.Add(m.base).Increment(static_cast<double>(value >= seen ? value - seen : 0));
  };
  add(m.kv_disk, now.bytes_written, before.bytes_written);
  add(m.kv_disk_read, now.bytes_read, before.bytes_read);
  add(m.kv_disk_hits, now.hits, before.hits);
  add(m.kv_disk_misses, now.misses, before.misses);
  add(m.kv_disk_checksum, now.checksum_failures, before.checksum_failures);
  add(m.kv_disk_dropped, now.saves_dropped, before.saves_dropped);
  add(m.kv_disk_errors, now.read_errors + now.write_errors, before.read_errors + before.write_errors);
  before = now;
}

void RankMetrics::OnModelCounters(const Transformer& model) {
  Impl& m = *impl_;
  absl::MutexLock lock(&m.mu);
  if (m.last_model != &model) {  // a new model: its counters start at zero
    m.last_model = &model;
    m.last_spill.clear();
    m.last_expert.clear();
  }
  auto delta = [](uint64_t now, uint64_t before) {
    return static_cast<double>(now >= before ? now - before : now);
  };
  for (const Transformer::SpillTableStats& table : model.spill_stats()) {
    const sharding::SpillStoreStats& now = table.stats;
    sharding::SpillStoreStats& before = m.last_spill[table.tensor];
    const Labels labels = m.With({{"tensor", table.tensor}});
    m.spill_lookups.Add(labels).Increment(delta(now.rows_requested, before.rows_requested));
    m.spill_hits.Add(labels).Increment(delta(now.hits, before.hits));
    m.spill_reads.Add(labels).Increment(delta(now.reads, before.reads));
    m.spill_read_bytes.Add(labels).Increment(delta(now.bytes_read, before.bytes_read));
    std::vector<double> buckets(now.read_latency_buckets.size());
    for (size_t i = 0; i < buckets.size(); ++i) {
      buckets[i] = delta(now.read_latency_buckets[i], before.read_latency_buckets[i]);
    }
    m.spill_read_seconds.Add(labels, SpillReadBuckets())
        .ObserveMultiple(buckets, delta(now.read_latency_sum_ns, before.read_latency_sum_ns) * 1e-9);
    before = now;
  }
  for (const auto& [expert, tokens] : model.expert_tokens()) {
    uint64_t& before = m.last_expert[expert];
    m.expert_tokens.Add(m.With({{"expert", absl::StrCat(expert)}}))
        .Increment(delta(tokens, before));
    before = tokens;
  }
}

}  // namespace exl3serve::worker
