#include "common/metrics.h"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <exception>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"

// The /metrics server's threads need more stack than civetweb gives them.
// Debian's libcivetweb (under prometheus-cpp's Exposer) creates its worker
// threads with pthread_attr_setstacksize(USE_STACK_SIZE = 100 KiB), and glibc
// carves the process's static TLS out of that size; in a CUDA build NCCL and
// the CUDA runtime alone hold ~16 KiB of static TLS, and a scrape then ran
// the worker off its stack (SIGSEGV 106 KiB below the thread pointer, found
// by tests/cli/metrics_test.sh). civetweb has no runtime option for it, so
// this process-wide definition (exported from the executable by
// exl3_metrics' link option, so it interposes libc's for every library)
// raises any explicit request below kThreadStackFloorBytes to that floor and
// passes everything else through unchanged. It only ever grows a stack
// (virtual memory; pages are touched on use).
namespace {
constexpr size_t kThreadStackFloorBytes = size_t{1} << 20;
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t stack_size) noexcept {
  using SetStackSize = int (*)(pthread_attr_t*, size_t);
  static const SetStackSize libc_set_stack_size =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  if (libc_set_stack_size == nullptr) return ENOSYS;
  return libc_set_stack_size(attr, std::max(stack_size, kThreadStackFloorBytes));
}

namespace exl3serve {
namespace {

// What the Exposer scrapes: runs the hook, then collects the registry.
class HookedCollectable final : public prometheus::Collectable {
 public:
  explicit HookedCollectable(std::shared_ptr<prometheus::Registry> registry)
      : registry_(std::move(registry)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      absl::MutexLock lock(&mu_);
      if (hook_) hook_();
    }
    return registry_->Collect();
  }

  void SetHook(std::function<void()> hook) {
    absl::MutexLock lock(&mu_);
    hook_ = std::move(hook);
  }

 private:
  const std::shared_ptr<prometheus::Registry> registry_;
  mutable absl::Mutex mu_;
  std::function<void()> hook_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

struct MetricsEndpoint::Impl {
  // Shared with `collectable` (which the Exposer holds weakly).
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<HookedCollectable> collectable = std::make_shared<HookedCollectable>(registry);
  std::unique_ptr<prometheus::Exposer> exposer;
};

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(const std::string& host,
                                                                        int port) {
  if (host.empty()) return absl::InvalidArgumentError("metrics: the host is empty (--metrics-host)");
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics: port must be in [0, 65535], got ", port, " (--metrics-port)"));
  }
  const std::string address =
      host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                          : absl::StrCat(host, ":", port);
  auto impl = std::make_unique<Impl>();
  // The Exposer binds in its constructor and throws when it cannot (civetweb
  // reports a null context); that is an operator error, not a crash.
  try {
    impl->exposer = std::make_unique<prometheus::Exposer>(address, /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "metrics: cannot serve /metrics on ", address,
        " (port in use, or not an address of this machine; pick another --metrics-port): ",
        e.what()));
  }
  impl->exposer->RegisterCollectable(impl->collectable);
  int bound = port;
  if (const std::vector<int> ports = impl->exposer->GetListeningPorts(); !ports.empty()) {
    bound = ports.front();
  }
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::move(impl), host, bound));
}

std::unique_ptr<MetricsEndpoint> MetricsEndpoint::Unexposed(const std::string& host) {
  return std::unique_ptr<MetricsEndpoint>(new MetricsEndpoint(std::make_unique<Impl>(), host, 0));
}

std::string MetricsEndpoint::RenderText() const {
  return prometheus::TextSerializer().Serialize(impl_->collectable->Collect());
}

MetricsEndpoint::MetricsEndpoint(std::unique_ptr<Impl> impl, std::string host, int port)
    : impl_(std::move(impl)), host_(std::move(host)), port_(port) {}

MetricsEndpoint::~MetricsEndpoint() {
  impl_->collectable->SetHook(nullptr);
  impl_->exposer.reset();  // stop serving before the registry goes
}

prometheus::Registry& MetricsEndpoint::registry() { return *impl_->registry; }

void MetricsEndpoint::SetScrapeHook(std::function<void()> hook) {
  impl_->collectable->SetHook(std::move(hook));
}

std::string ModelNameLabel(const std::string& model_dir) {
  std::string dir = model_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const size_t slash = dir.rfind('/');
  std::string name = slash == std::string::npos ? dir : dir.substr(slash + 1);
  return name.empty() ? "unknown" : name;
}

std::string MetricsEndpoint::url() const {
  return host_.find(':') != std::string::npos
             ? absl::StrCat("http://[", host_, "]:", port_, "/metrics")
             : absl::StrCat("http://", host_, ":", port_, "/metrics");
}

}  // namespace exl3serve
