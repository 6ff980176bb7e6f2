// http_scripted_server: the HTTP API over tests/http/scripted_engine.h, for
// client conformance tests that need output a random model cannot give (tool
// calls, reasoning): tests/cli/openai_client_test.sh drives it with the
// official openai npm client. Prints "http: listening on HOST:PORT"; SIGUSR1
// toggles the engine's readiness; runs until SIGTERM/SIGINT.
#include <csignal>
#include <cstdio>
#include <unistd.h>

#include "coordinator/http/http_server.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/http/scripted_engine.h"

int main() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGUSR1);  // toggles the engine's readiness (503 tests)
  pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any thread starts
  exl3serve::testing::ScriptedEngine engine;
  prometheus::Registry registry;
  exl3serve::coordinator::http::HttpServerOptions options;
  options.port = 0;
  options.served_model_names = {"scripted"};
  options.tool_call_parser = "hermes";
  options.reasoning_parser = "think";
  options.registry = &registry;
  options.metrics_text = [&] { return prometheus::TextSerializer().Serialize(registry.Collect()); };
  auto server = exl3serve::coordinator::http::HttpServer::Start(engine, options);
  if (!server.ok()) {
    std::fprintf(stderr, "http_scripted_server: %s\n", std::string(server.status().message()).c_str());
    return 1;
  }
  std::printf("http: listening on %s\n", (*server)->address().c_str());
  std::fflush(stdout);
  int signal = 0;
  while (sigwait(&set, &signal) == 0 && signal == SIGUSR1) engine.ready_flag = !engine.ready_flag;
  (*server)->Shutdown(absl::Seconds(1));
  engine.Shutdown();
  return 0;
}
