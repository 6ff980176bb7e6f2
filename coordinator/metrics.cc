#include "coordinator/metrics.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace exl3serve::coordinator {
namespace {

using prometheus::Counter;
using prometheus::Gauge;
using prometheus::Histogram;
using Buckets = Histogram::BucketBoundaries;

// vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), kept identical so
// dashboards built for vLLM read ours.
const Buckets& TtftBuckets() {
  static const Buckets b = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                            1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
  return b;
}
// vLLM's ITL buckets start at 10 ms, too coarse for fast decode: a superset
// with four boundaries below (1, 2.5, 5, 7.5 ms).
const Buckets& ItlBuckets() {
  static const Buckets b = {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075,
                            0.1,   0.15,   0.2,   0.3,    0.4,  0.5,   0.75, 1.0,
                            2.5,   5.0,    7.5,   10.0,   20.0, 40.0,  80.0};
  return b;
}
const Buckets& RequestLatencyBuckets() {
  static const Buckets b = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,    10.0,   15.0,  20.0,
                            30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  return b;
}
// Ours: one coordinator step (not a vLLM metric).
const Buckets& StepBuckets() {
  static const Buckets b = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                            0.1,    0.25,  0.5,    1.0,   2.5,  5.0,   10.0};
  return b;
}
// vLLM's build_1_2_5_buckets(max_model_len): 1, 2, 5, 10, 20, 50, ... <= max.
Buckets OneTwoFiveBuckets(int64_t max_value) {
  Buckets b;
  for (int64_t exponent = 1;; exponent *= 10) {
    for (int64_t m : {1, 2, 5}) {
      const int64_t v = m * exponent;
      if (v > max_value) return b;
      b.push_back(static_cast<double>(v));
    }
  }
}

const char* CodeName(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kDeadlineExceeded: return "deadline_exceeded";
    case absl::StatusCode::kUnavailable: return "unavailable";
    case absl::StatusCode::kResourceExhausted: return "resource_exhausted";
    case absl::StatusCode::kInvalidArgument: return "invalid_argument";
    case absl::StatusCode::kAborted: return "aborted";
    case absl::StatusCode::kCancelled: return "cancelled";
    default: return "internal";
  }
}

}  // namespace

struct CoordinatorMetrics::Impl {
  Impl(prometheus::Registry& registry, const CoordinatorMetricsOptions& o)
      : options(o),
        model{{"model_name", o.model_name}},
        running(prometheus::BuildGauge()
                    .Name("exl3serve:num_requests_running")
                    .Help("Number of requests in model execution batches.")
                    .Register(registry)
                    .Add(model)),
        waiting(prometheus::BuildGauge()
                    .Name("exl3serve:num_requests_waiting")
                    .Help("Number of requests waiting to be processed.")
                    .Register(registry)
                    .Add(model)),
        kv_usage(prometheus::BuildGauge()
                     .Name("exl3serve:kv_cache_usage_perc")
                     .Help("KV-cache usage. 1 means 100 percent usage.")
                     .Register(registry)
                     .Add(model)),
        state_bytes(prometheus::BuildGauge()
                        .Name("exl3serve:recurrent_state_bytes_per_sequence")
                        .Help("Bytes of recurrent state one sequence holds over all ranks "
                              "(Gated DeltaNet hybrids; 0: KV only).")
                        .Register(registry)
                        .Add(model)),
        state_sequences(prometheus::BuildGauge()
                            .Name("exl3serve:recurrent_state_sequences")
                            .Help("Sequences holding a recurrent state now.")
                            .Register(registry)
                            .Add(model)),
        state_snapshots(prometheus::BuildGauge()
                            .Name("exl3serve:state_snapshots")
                            .Help("Recurrent-state snapshots the prefix cache holds now "
                                  "(each recurrent_state_bytes_per_sequence over the ranks).")
                            .Register(registry)
                            .Add(model)),
        state_snapshot_saves(prometheus::BuildCounter()
                                 .Name("exl3serve:state_snapshot_saves_total")
                                 .Help("Recurrent-state snapshots taken at block boundaries.")
                                 .Register(registry)
                                 .Add(model)),
        state_snapshot_hits(prometheus::BuildCounter()
                                .Name("exl3serve:state_snapshot_hits_total")
                                .Help("Admissions that resumed from a recurrent-state snapshot.")
                                .Register(registry)
                                .Add(model)),
        cache_config(prometheus::BuildGauge()
                         .Name("exl3serve:cache_config_info")
                         .Help("Information of the KV cache configuration (value 1).")
                         .Register(registry)),
        rank_up(prometheus::BuildGauge()
                    .Name("exl3serve:rank_up")
                    .Help("1 while the rank is registered (remote) or its group is ready (local).")
                    .Register(registry)),
        heartbeat_age(prometheus::BuildGauge()
                          .Name("exl3serve:rank_last_heartbeat_age_seconds")
                          .Help("Seconds since the rank's last heartbeat (remote ranks only).")
                          .Register(registry)),
        prompt_tokens(prometheus::BuildCounter()
                          .Name("exl3serve:prompt_tokens_total")
                          .Help("Number of prefill tokens processed.")
                          .Register(registry)
                          .Add(model)),
        generation_tokens(prometheus::BuildCounter()
                              .Name("exl3serve:generation_tokens_total")
                              .Help("Number of generation tokens processed.")
                              .Register(registry)
                              .Add(model)),
        success(prometheus::BuildCounter()
                    .Name("exl3serve:request_success_total")
                    .Help("Count of successfully processed requests.")
                    .Register(registry)),
        failure(prometheus::BuildCounter()
                    .Name("exl3serve:request_failure_total")
                    .Help("Count of requests that ended with an error, by gRPC status code.")
                    .Register(registry)),
        preemptions(prometheus::BuildCounter()
                        .Name("exl3serve:num_preemptions_total")
                        .Help("Cumulative number of preemptions from the engine.")
                        .Register(registry)
                        .Add(model)),
        restarts(prometheus::BuildCounter()
                     .Name("exl3serve:rank_restarts_total")
                     .Help("Rank group re-formations after a rank failed (every rank restarted "
                           "or re-registered).")
                     .Register(registry)
                     .Add(model)),
        replays(prometheus::BuildCounter()
                    .Name("exl3serve:request_replays_total")
                    .Help("In-flight requests replayed (prompt + tokens so far) on a re-formed "
                          "rank group.")
                    .Register(registry)
                    .Add(model)),
        prefix_queries(prometheus::BuildCounter()
                           .Name("exl3serve:prefix_cache_queries_total")
                           .Help("Prefix cache: prompt tokens looked up at admission.")
                           .Register(registry)
                           .Add(model)),
        prefix_hits(prometheus::BuildCounter()
                        .Name("exl3serve:prefix_cache_hits_total")
                        .Help("Prefix cache: prompt tokens found cached (not computed).")
                        .Register(registry)
                        .Add(model)),
        prefix_evictions(prometheus::BuildCounter()
                             .Name("exl3serve:prefix_cache_evicted_blocks_total")
                             .Help("Prefix cache: cached KV blocks evicted for new ones.")
                             .Register(registry)
                             .Add(model)),
        disk_saved(prometheus::BuildCounter()
                       .Name("exl3serve:prefix_cache_disk_saved_blocks_total")
                       .Help("Prefix cache disk tier: evicted KV blocks sent to the ranks' disks.")
                       .Register(registry)
                       .Add(model)),
        disk_hits(prometheus::BuildCounter()
                      .Name("exl3serve:prefix_cache_disk_hit_blocks_total")
                      .Help("Prefix cache disk tier: KV blocks read back and verified on every rank.")
                      .Register(registry)
                      .Add(model)),
        disk_misses(prometheus::BuildCounter()
                        .Name("exl3serve:prefix_cache_disk_miss_blocks_total")
                        .Help("Prefix cache disk tier: loads that failed on some rank (missing, "
                              "dropped or corrupt; the positions were computed).")
                        .Register(registry)
                        .Add(model)),
        disk_evictions(prometheus::BuildCounter()
                           .Name("exl3serve:prefix_cache_disk_evicted_blocks_total")
                           .Help("Prefix cache disk tier: slots reused for other blocks.")
                           .Register(registry)
                           .Add(model)),
        spec_drafts(prometheus::BuildCounter()
                        .Name("exl3serve:spec_decode_num_drafts_total")
                        .Help("Speculative decoding: drafts verified (a sequence's draft "
                              "tokens in one step).")
                        .Register(registry)
                        .Add(model)),
        spec_draft_tokens(prometheus::BuildCounter()
                              .Name("exl3serve:spec_decode_num_draft_tokens_total")
                              .Help("Speculative decoding: draft tokens verified.")
                              .Register(registry)
                              .Add(model)),
        spec_accepted_tokens(prometheus::BuildCounter()
                                 .Name("exl3serve:spec_decode_num_accepted_tokens_total")
                                 .Help("Speculative decoding: draft tokens accepted (equal to "
                                       "the ranks' own draw). Mean accepted length = 1 + "
                                       "accepted / drafts.")
                                 .Register(registry)
                                 .Add(model)),
        constraint_masks(prometheus::BuildCounter()
                             .Name("exl3serve:structured_output_masks_total")
                             .Help("Structured output: allowed-token mask rows computed for "
                                   "constrained draws (one per draw, drafts included).")
                             .Register(registry)
                             .Add(model)),
        constraint_mask_seconds(prometheus::BuildCounter()
                                    .Name("exl3serve:structured_output_mask_seconds_total")
                                    .Help("Structured output: coordinator time spent computing "
                                          "allowed-token masks.")
                                    .Register(registry)
                                    .Add(model)),
        disk_used(prometheus::BuildGauge()
                      .Name("exl3serve:prefix_cache_disk_used_blocks")
                      .Help("Prefix cache disk tier: slots holding a block now.")
                      .Register(registry)
                      .Add(model)),
        prefix_blocks(prometheus::BuildGauge()
                          .Name("exl3serve:prefix_cache_blocks")
                          .Help("Prefix cache: KV blocks holding a known prefix now.")
                          .Register(registry)
                          .Add(model)),
        steps(prometheus::BuildCounter()
                  .Name("exl3serve:engine_steps_total")
                  .Help("Scheduler steps that ran a forward.")
                  .Register(registry)
                  .Add(model)),
        coordinator_seconds(prometheus::BuildCounter()
                                .Name("exl3serve:engine_step_coordinator_seconds_total")
                                .Help("Part of the steps' wall time the coordinator spent on its "
                                      "own work (not waiting for the ranks).")
                                .Register(registry)
                                .Add(model)),
        ttft(Hist(registry, "exl3serve:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", TtftBuckets())),
        itl(Hist(registry, "exl3serve:inter_token_latency_seconds",
                 "Histogram of inter-token latency in seconds.", ItlBuckets())),
        tpot(Hist(registry, "exl3serve:request_time_per_output_token_seconds",
                  "Histogram of time_per_output_token_seconds per request.", ItlBuckets())),
        e2e(Hist(registry, "exl3serve:e2e_request_latency_seconds",
                 "Histogram of e2e request latency in seconds.", RequestLatencyBuckets())),
        queue(Hist(registry, "exl3serve:request_queue_time_seconds",
                   "Histogram of time spent in WAITING phase for request.",
                   RequestLatencyBuckets())),
        inference(Hist(registry, "exl3serve:request_inference_time_seconds",
                       "Histogram of time spent in RUNNING phase for request.",
                       RequestLatencyBuckets())),
        prefill(Hist(registry, "exl3serve:request_prefill_time_seconds",
                     "Histogram of time spent in PREFILL phase for request.",
                     RequestLatencyBuckets())),
        decode(Hist(registry, "exl3serve:request_decode_time_seconds",
                    "Histogram of time spent in DECODE phase for request.",
                    RequestLatencyBuckets())),
        prompt_len(Hist(registry, "exl3serve:request_prompt_tokens",
                        "Number of prefill tokens processed.",
                        OneTwoFiveBuckets(o.max_model_len))),
        generation_len(Hist(registry, "exl3serve:request_generation_tokens",
                            "Number of generation tokens processed.",
                            OneTwoFiveBuckets(o.max_model_len))),
        max_tokens(Hist(registry, "exl3serve:request_params_max_tokens",
                        "Histogram of the max_tokens request parameter.",
                        OneTwoFiveBuckets(o.max_model_len))),
        step(Hist(registry, "exl3serve:engine_step_seconds",
                  "Histogram of one scheduler step's wall time (batch formed .. last token "
                  "handed to the streams) in seconds.",
                  StepBuckets())) {
    cache_config
        .Add({{"model_name", o.model_name},
              {"block_size", absl::StrCat(o.kv_block_size)},
              {"num_gpu_blocks", absl::StrCat(o.kv_num_blocks)},
              {"cache_dtype", o.kv_cache_dtype}})
        .Set(1);
    for (const char* reason : {"stop", "length", "abort"}) {
      success.Add({{"model_name", o.model_name}, {"finished_reason", reason}});
    }
    for (const char* reason : {"deadline_exceeded", "unavailable", "internal"}) {
      failure.Add({{"model_name", o.model_name}, {"reason", reason}});
    }
  }

  Histogram& Hist(prometheus::Registry& registry, const std::string& name, const std::string& help,
                  const Buckets& buckets) {
    return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(model,
                                                                                     buckets);
  }

  const CoordinatorMetricsOptions options;
  const std::map<std::string, std::string> model;
  Gauge &running, &waiting, &kv_usage, &state_bytes, &state_sequences, &state_snapshots;
  Counter &state_snapshot_saves, &state_snapshot_hits;
  prometheus::Family<Gauge>& cache_config;
  prometheus::Family<Gauge>& rank_up;
  prometheus::Family<Gauge>& heartbeat_age;
  Counter &prompt_tokens, &generation_tokens;
  prometheus::Family<Counter>& success;
  prometheus::Family<Counter>& failure;
  Counter &preemptions, &restarts, &replays, &prefix_queries, &prefix_hits, &prefix_evictions;
  Counter &disk_saved, &disk_hits, &disk_misses, &disk_evictions;
  Counter &spec_drafts, &spec_draft_tokens, &spec_accepted_tokens;
  Counter &constraint_masks, &constraint_mask_seconds;
  Gauge& disk_used;
  Gauge& prefix_blocks;
  Counter &steps, &coordinator_seconds;
  Histogram &ttft, &itl, &tpot, &e2e, &queue, &inference, &prefill, &decode;
  Histogram &prompt_len, &generation_len, &max_tokens, &step;

  absl::Mutex mu;  // Refresh's delta bookkeeping
  uint64_t preemptions_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t prefix_queries_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t prefix_hits_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t prefix_evictions_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t disk_saved_seen ABSL_GUARDED_BY(mu) = 0, disk_hits_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t disk_misses_seen ABSL_GUARDED_BY(mu) = 0, disk_evictions_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t spec_drafts_seen ABSL_GUARDED_BY(mu) = 0, spec_draft_tokens_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t spec_accepted_tokens_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t constraint_masks_seen ABSL_GUARDED_BY(mu) = 0;
  double constraint_mask_seconds_seen ABSL_GUARDED_BY(mu) = 0;
  uint64_t snapshot_saves_seen ABSL_GUARDED_BY(mu) = 0, snapshot_hits_seen ABSL_GUARDED_BY(mu) = 0;
};

namespace {
// Moves a counter to an engine's cumulative value (never backwards).
void CatchUp(prometheus::Counter& counter, uint64_t value, uint64_t* seen) {
  if (value > *seen) {
    counter.Increment(static_cast<double>(value - *seen));
    *seen = value;
  }
}
}  // namespace

CoordinatorMetrics::CoordinatorMetrics(prometheus::Registry& registry,
                                       const CoordinatorMetricsOptions& options)
    : impl_(std::make_unique<Impl>(registry, options)) {}

CoordinatorMetrics::~CoordinatorMetrics() = default;

void CoordinatorMetrics::Refresh(const v1::GetServerInfoResponse& info) {
  Impl& m = *impl_;
  m.running.Set(info.num_requests_running());
  m.waiting.Set(info.num_requests_waiting());
  m.kv_usage.Set(info.kv_cache_usage_perc());
  m.state_bytes.Set(static_cast<double>(info.recurrent_state_bytes_per_sequence()));
  m.state_sequences.Set(info.recurrent_state_sequences());
  m.state_snapshots.Set(info.state_snapshots());
  {
    absl::MutexLock lock(&m.mu);
    CatchUp(m.state_snapshot_saves, info.state_snapshot_saves(), &m.snapshot_saves_seen);
    CatchUp(m.state_snapshot_hits, info.state_snapshot_hits(), &m.snapshot_hits_seen);
    CatchUp(m.preemptions, info.num_preemptions(), &m.preemptions_seen);
    CatchUp(m.prefix_queries, info.prefix_cache_queries_tokens(), &m.prefix_queries_seen);
    CatchUp(m.prefix_hits, info.prefix_cache_hits_tokens(), &m.prefix_hits_seen);
    CatchUp(m.prefix_evictions, info.prefix_cache_evicted_blocks(), &m.prefix_evictions_seen);
    CatchUp(m.disk_saved, info.prefix_cache_disk_saved_blocks(), &m.disk_saved_seen);
    CatchUp(m.disk_hits, info.prefix_cache_disk_hit_blocks(), &m.disk_hits_seen);
    CatchUp(m.disk_misses, info.prefix_cache_disk_miss_blocks(), &m.disk_misses_seen);
    CatchUp(m.disk_evictions, info.prefix_cache_disk_evicted_blocks(), &m.disk_evictions_seen);
    CatchUp(m.spec_drafts, info.spec_decode_num_drafts(), &m.spec_drafts_seen);
    CatchUp(m.spec_draft_tokens, info.spec_decode_num_draft_tokens(), &m.spec_draft_tokens_seen);
    CatchUp(m.spec_accepted_tokens, info.spec_decode_num_accepted_tokens(),
            &m.spec_accepted_tokens_seen);
    CatchUp(m.constraint_masks, info.structured_output_masks(), &m.constraint_masks_seen);
    if (info.structured_output_mask_seconds_total() > m.constraint_mask_seconds_seen) {
      m.constraint_mask_seconds.Increment(info.structured_output_mask_seconds_total() -
                                          m.constraint_mask_seconds_seen);
      m.constraint_mask_seconds_seen = info.structured_output_mask_seconds_total();
    }
  }
  m.prefix_blocks.Set(info.prefix_cache_blocks());
  m.disk_used.Set(static_cast<double>(info.prefix_cache_disk_used_blocks()));
  auto labels = [&](uint32_t rank) {
    return std::map<std::string, std::string>{{"model_name", m.options.model_name},
                                              {"rank", absl::StrCat(rank)}};
  };
  if (info.ranks_size() > 0) {
    for (const v1::RankInfo& rank : info.ranks()) {
      m.rank_up.Add(labels(rank.rank())).Set(rank.up() ? 1 : 0);
      if (rank.has_last_heartbeat_age_seconds()) {  // ranks that heartbeat (remote ones)
        m.heartbeat_age.Add(labels(rank.rank())).Set(rank.last_heartbeat_age_seconds());
      }
    }
  } else {
    for (int r = 0; r < m.options.world_size; ++r) {
      m.rank_up.Add(labels(static_cast<uint32_t>(r))).Set(info.ready() ? 1 : 0);
    }
  }
}

void CoordinatorMetrics::OnFirstToken(absl::Duration ttft, int64_t prompt_tokens) {
  impl_->ttft.Observe(absl::ToDoubleSeconds(ttft));
  impl_->prompt_tokens.Increment(static_cast<double>(prompt_tokens));
}

void CoordinatorMetrics::OnInterTokenLatency(absl::Duration itl) {
  impl_->itl.Observe(absl::ToDoubleSeconds(itl));
}

void CoordinatorMetrics::OnRequestFinished(const RequestRecord& r) {
  Impl& m = *impl_;
  m.success.Add({{"model_name", m.options.model_name}, {"finished_reason", FinishKindName(r.finish)}})
      .Increment();
  m.e2e.Observe(absl::ToDoubleSeconds(r.finished - r.arrival));
  const absl::Time scheduled = r.scheduled.value_or(r.finished);
  m.queue.Observe(absl::ToDoubleSeconds(scheduled - r.arrival));
  m.inference.Observe(absl::ToDoubleSeconds(r.finished - scheduled));
  if (r.first_token) {
    m.prefill.Observe(absl::ToDoubleSeconds(*r.first_token - scheduled));
    m.decode.Observe(absl::ToDoubleSeconds(r.finished - *r.first_token));
    if (r.generation_tokens > 1) {
      m.tpot.Observe(absl::ToDoubleSeconds(r.finished - *r.first_token) /
                     static_cast<double>(r.generation_tokens - 1));
    }
  }
  m.prompt_len.Observe(static_cast<double>(r.prompt_tokens));
  m.generation_len.Observe(static_cast<double>(r.generation_tokens));
  m.max_tokens.Observe(static_cast<double>(r.max_tokens));
}

void CoordinatorMetrics::OnRequestFailed(absl::StatusCode code) {
  impl_->failure.Add({{"model_name", impl_->options.model_name}, {"reason", CodeName(code)}})
      .Increment();
}

void CoordinatorMetrics::OnStep(const StepRecord& r) {
  Impl& m = *impl_;
  m.steps.Increment();
  m.step.Observe(absl::ToDoubleSeconds(r.step));
  m.coordinator_seconds.Increment(std::max(0.0, absl::ToDoubleSeconds(r.step - r.forward)));
  m.generation_tokens.Increment(static_cast<double>(r.sampled_tokens));
}

void CoordinatorMetrics::OnGroupReformed(int64_t replayed) {
  impl_->restarts.Increment();
  impl_->replays.Increment(static_cast<double>(replayed));
}

absl::StatusOr<std::unique_ptr<ServingMetrics>> ServingMetrics::Start(
    const std::string& host, int port, int world_size, EngineOptions* engine_options) {
  std::unique_ptr<ServingMetrics> serving(new ServingMetrics());
  if (port < 0) {
    serving->endpoint_ = MetricsEndpoint::Unexposed(host);
  } else {
    auto endpoint = MetricsEndpoint::Start(host, port);
    if (!endpoint.ok()) return endpoint.status();
    serving->endpoint_ = std::move(*endpoint);
  }
  const worker::KvCacheOptions& kv = engine_options->kv;
  const char* dtype = kv.dtype == worker::KvCacheDtype::kFp32   ? "fp32"
                      : kv.dtype == worker::KvCacheDtype::kFp16 ? "fp16"
                      : kv.dtype == worker::KvCacheDtype::kInt8 ? "int8"
                                                                : "int4";
  serving->metrics_ = std::make_unique<CoordinatorMetrics>(
      serving->endpoint_->registry(),
      CoordinatorMetricsOptions{
          .model_name = ModelNameLabel(engine_options->model_dir),
          // The sequence length bound: max_context, else the KV pool's positions.
          .max_model_len = engine_options->max_context > 0 ? engine_options->max_context
                                                           : kv.num_pages * kv.page_size_tokens,
          .kv_block_size = kv.page_size_tokens,
          .kv_num_blocks = kv.num_pages,
          .kv_cache_dtype = dtype,
          .world_size = world_size});
  engine_options->observer = serving->metrics_.get();
  return serving;
}

std::unique_ptr<ServingMetrics::Attachment> ServingMetrics::Attach(const Engine& engine) {
  CoordinatorMetrics* metrics = metrics_.get();
  endpoint_->SetScrapeHook([metrics, &engine] { metrics->Refresh(engine.GetServerInfo()); });
  return std::make_unique<Attachment>(endpoint_.get());
}

}  // namespace exl3serve::coordinator
