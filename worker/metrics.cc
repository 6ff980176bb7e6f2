#include "worker/metrics.h"

#include <map>
#include <string>

#include "absl/strings/str_cat.h"
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

}  // namespace exl3serve::worker
