// common/metrics.h — one Prometheus /metrics HTTP endpoint per process: a
// registry the process's metrics (coordinator/metrics.h, worker/metrics.h)
// register in, served by prometheus-cpp's Exposer on host:port.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<MetricsEndpoint> endpoint,
//                         MetricsEndpoint::Start("127.0.0.1", 9400));
//   auto metrics = std::make_unique<CoordinatorMetrics>(endpoint->registry(), "llama");
//   endpoint->SetScrapeHook([&] { metrics->Refresh(engine->GetServerInfo()); });
//
// prometheus-cpp's headers stay out of this header (Registry is only
// forward-declared): only the files that declare metrics include them.
//
// Thread safety: scrapes run on the Exposer's own threads; SetScrapeHook and
// the destructor may be called from any thread. The hook runs before every
// scrape on a scrape thread, under a mutex that SetScrapeHook also takes, so
// after SetScrapeHook(nullptr) returns no hook call is running or will run.
#ifndef EXL3SERVE_COMMON_METRICS_H_
#define EXL3SERVE_COMMON_METRICS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace exl3serve {

class MetricsEndpoint {
 public:
  // Binds host:port (port 0 = any free port) and serves /metrics at once
  // (an empty exposition until metrics register).
  // Errors: InvalidArgument for a port outside [0, 65535] or an empty host;
  // Unavailable naming the address when it cannot be bound (in use, or not
  // an address of this machine).
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& host,
                                                                int port);
  // A registry without a server of its own: another server (the
  // coordinator's HTTP API) serves RenderText() at its /metrics. port() is 0.
  static std::unique_ptr<MetricsEndpoint> Unexposed(const std::string& host);

  // Stops serving (waits for scrapes in progress).
  ~MetricsEndpoint();

  // The Prometheus text exposition of the registry, after the scrape hook
  // (what a scrape of url() returns).
  std::string RenderText() const;

  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  // The registry scraped at /metrics; lives as long as the endpoint.
  prometheus::Registry& registry();

  // Runs `hook` before every scrape (to refresh gauges read from elsewhere);
  // nullptr removes it. See the thread-safety note above.
  void SetScrapeHook(std::function<void()> hook);

  // The bound port (the chosen one for port 0) and "http://host:port/metrics".
  int port() const { return port_; }
  std::string url() const;

 private:
  struct Impl;
  explicit MetricsEndpoint(std::unique_ptr<Impl> impl, std::string host, int port);

  std::unique_ptr<Impl> impl_;
  const std::string host_;
  const int port_;
};

// The model_name label for a model directory: its last path component
// ("/models/llama-3-exl3/" -> "llama-3-exl3"); "unknown" when empty.
std::string ModelNameLabel(const std::string& model_dir);

}  // namespace exl3serve

#endif  // EXL3SERVE_COMMON_METRICS_H_
