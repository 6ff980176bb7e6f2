// coordinator/metrics.h — every Prometheus metric the coordinator exports,
// declared (with help text) in metrics.cc. vLLM's metric set under the
// prefix `exl3serve:` (same suffixes, types, bucket boundaries and the
// model_name label; inter_token_latency_seconds adds buckets below 10 ms),
// plus the cluster's own:
//
//   gauge      num_requests_running, num_requests_waiting, kv_cache_usage_perc,
//              cache_config_info{block_size,num_gpu_blocks,cache_dtype} (= 1),
//              rank_up{rank}, rank_last_heartbeat_age_seconds{rank} (remote ranks only)
//   counter    prompt_tokens_total, generation_tokens_total,
//              request_success_total{finished_reason=stop|length|abort},
//              request_failure_total{reason=<gRPC code name>}, num_preemptions_total,
//              rank_restarts_total (rank group re-formations), request_replays_total,
//              engine_steps_total, engine_step_coordinator_seconds_total,
//              prefix_cache_queries_total, prefix_cache_hits_total (tokens, vLLM's),
//              prefix_cache_evicted_blocks_total
//              prefix_cache_disk_{saved,hit,miss,evicted}_blocks_total (the disk tier)
//   gauge      prefix_cache_blocks (blocks holding a known prefix),
//              prefix_cache_disk_used_blocks
// (bytes and checksum failures of the disk tier are the ranks':
// worker/metrics.h kv_disk_*)
//   histogram  time_to_first_token_seconds, inter_token_latency_seconds,
//              request_time_per_output_token_seconds, e2e_request_latency_seconds,
//              request_queue_time_seconds, request_inference_time_seconds,
//              request_prefill_time_seconds, request_decode_time_seconds,
//              request_prompt_tokens, request_generation_tokens,
//              request_params_max_tokens, engine_step_seconds
//
// Every series carries model_name. Counters and histograms move from the
// engine's events (EngineObserver); gauges and the cumulative counters the
// engine keeps itself (preemptions, replays) are refreshed from
// GetServerInfo before every scrape (Refresh, via MetricsEndpoint's hook).
//
//   CoordinatorMetrics metrics(endpoint->registry(), {.model_name = "llama", ...});
//   options.observer = &metrics;
//   endpoint->SetScrapeHook([&] { metrics.Refresh(engine->GetServerInfo()); });
//
// Thread safety: every method is thread-safe (prometheus-cpp metrics are).
#ifndef EXL3SERVE_COORDINATOR_METRICS_H_
#define EXL3SERVE_COORDINATOR_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "coordinator/engine.h"
#include "coordinator/engine_observer.h"
#include "coordinator/local_engine.h"
#include "exl3serve/v1/generation.pb.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace exl3serve::coordinator {

struct CoordinatorMetricsOptions {
  std::string model_name;      // the model_name label
  int64_t max_model_len = 0;   // upper end of the token-count histograms (1-2-5 series)
  int64_t kv_block_size = 16;  // cache_config_info labels
  int64_t kv_num_blocks = 0;
  std::string kv_cache_dtype = "auto";
  int world_size = 1;          // ranks; rank_up when GetServerInfo lists none
};

class CoordinatorMetrics final : public EngineObserver {
 public:
  // Registers every family in `registry`, which must outlive this object.
  CoordinatorMetrics(prometheus::Registry& registry, const CoordinatorMetricsOptions& options);
  ~CoordinatorMetrics() override;

  // Gauges and engine-kept totals from the engine's server info. Ranks come
  // from info.ranks (remote and local groups; the heartbeat age only where
  // set, i.e. remote ranks); without them rank_up follows info.ready for
  // ranks 0..world_size-1.
  void Refresh(const v1::GetServerInfoResponse& info);

  // EngineObserver.
  void OnFirstToken(absl::Duration ttft, int64_t prompt_tokens) override;
  void OnInterTokenLatency(absl::Duration itl) override;
  void OnRequestFinished(const RequestRecord& record) override;
  void OnRequestFailed(absl::StatusCode code) override;
  void OnStep(const StepRecord& record) override;
  void OnGroupReformed(int64_t replayed) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The coordinator process's whole metrics setup, for `serve` and
// `coordinator`: the /metrics endpoint, CoordinatorMetrics as the engine's
// observer, and the scrape-time refresh from the engine.
//
//   // before the engine: sets engine_options.observer
//   EXL3_ASSIGN_OR_RETURN(auto metrics, ServingMetrics::Start(host, port, &engine_options));
//   auto engine = ...(engine_options...);
//   auto attached = metrics->Attach(*engine);  // declared after the engine
class ServingMetrics {
 public:
  // Serves /metrics on host:port and sets engine_options->observer (the
  // returned object must outlive the engine). world_size: the ranks, for
  // rank_up when the engine lists none. Errors: MetricsEndpoint::Start's.
  // port < 0: no server of its own (the HTTP API serves RenderText()).
  static absl::StatusOr<std::unique_ptr<ServingMetrics>> Start(const std::string& host, int port,
                                                               int world_size,
                                                               EngineOptions* engine_options);

  // Refreshes the gauges from engine.GetServerInfo() before every scrape
  // until the returned handle is destroyed; declare it after the engine so
  // that it goes first.
  class Attachment {
   public:
    explicit Attachment(MetricsEndpoint* endpoint) : endpoint_(endpoint) {}
    ~Attachment() { endpoint_->SetScrapeHook(nullptr); }
    Attachment(const Attachment&) = delete;
    Attachment& operator=(const Attachment&) = delete;

   private:
    MetricsEndpoint* const endpoint_;
  };
  [[nodiscard]] std::unique_ptr<Attachment> Attach(const Engine& engine);

  std::string url() const { return endpoint_->url(); }
  int port() const { return endpoint_->port(); }
  // The exposition a scrape returns (for the HTTP API's /metrics), and the
  // registry further series (the HTTP API's) register in.
  std::string RenderText() const { return endpoint_->RenderText(); }
  prometheus::Registry& registry() { return endpoint_->registry(); }

 private:
  ServingMetrics() = default;
  std::unique_ptr<MetricsEndpoint> endpoint_;     // destroyed last: stops scrapes first
  std::unique_ptr<CoordinatorMetrics> metrics_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_METRICS_H_
