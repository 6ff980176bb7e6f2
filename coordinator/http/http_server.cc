#include "coordinator/http/http_server.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <variant>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "coordinator/http/openai_request.h"
#include "coordinator/http/openai_session.h"
#include "coordinator/http/tool_call_parser.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace exl3serve::coordinator::http {
namespace {

using ojson = nlohmann::ordered_json;

constexpr absl::Duration kPollInterval = absl::Milliseconds(50);

absl::StatusOr<std::string> ReadSmallFile(const std::string& path, std::string_view what) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    return absl::NotFoundError(absl::StrCat("cannot read ", std::string(what), " ", path, ": ", std::strerror(errno)));
  }
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0 && out.size() < (1 << 20)) out.append(buf, n);
  std::fclose(f);
  return out;
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::min(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// The socket of the connection `req` came on: httplib 0.11.4 hands handlers
// no socket, so it is found by its address pair among this process's
// descriptors (unique: one TCP connection per local/remote address pair).
// -1 when not found (then only failed writes reveal a gone client).
int FindConnectionSocket(const httplib::Request& req) {
#ifdef CPPHTTPLIB_OPENSSL_SUPPORT
  if (req.ssl != nullptr) return SSL_get_fd(req.ssl);
#endif
  auto same = [](const sockaddr_storage& a, const std::string& host, int port) {
    char text[INET6_ADDRSTRLEN] = {};
    int p = -1;
    if (a.ss_family == AF_INET) {
      const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
      inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
      p = ntohs(in->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
      inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
      p = ntohs(in6->sin6_port);
    } else {
      return false;
    }
    return p == port && host == text;
  };
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage local = {}, peer = {};
    socklen_t ll = sizeof local, pl = sizeof peer;
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (!same(local, req.local_addr, req.local_port)) continue;
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    if (!same(peer, req.remote_addr, req.remote_port)) continue;
    found = static_cast<int>(fd);
    break;
  }
  closedir(dir);
  return found;
}

// True when the peer of `fd` closed its side (EOF or an error). Data the
// client sent ahead (a pipelined request) is not a close.
bool PeerClosed(int fd) {
  if (fd < 0) return false;
  pollfd p = {fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
  if (p.revents & POLLIN) {
    char byte;
    const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0;
  }
  return false;
}

std::string_view StatusText(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return "server_error";
  }
}

}  // namespace

struct HttpServer::Impl {
  Engine* engine = nullptr;
  HttpServerOptions options;
  std::unique_ptr<httplib::Server> server;
  std::thread listener;
  int port = 0;
  std::string auth_token;
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  bool reasoning = false;
  int64_t started_unix = 0;
  std::atomic<bool> draining{false};
  std::atomic<bool> stopping{false};  // abort what is still running
  // Completion requests being served (drain waits for them).
  mutable absl::Mutex active_mu;
  int active ABSL_GUARDED_BY(active_mu) = 0;
  void Enter() {
    absl::MutexLock lock(&active_mu);
    ++active;
  }
  void Leave() {
    absl::MutexLock lock(&active_mu);
    --active;
  }
  // Waits until no completion request is served or `deadline`.
  void AwaitIdle(absl::Time deadline) {
    absl::MutexLock lock(&active_mu);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(active_mu) { return active == 0; };
    active_mu.AwaitWithDeadline(absl::Condition(&idle), deadline);
  }
  absl::Mutex shutdown_mu;
  bool shut_down = false;

  // Metrics (null without a registry).
  prometheus::Family<prometheus::Counter>* requests_family = nullptr;
  prometheus::Family<prometheus::Counter>* disconnects_family = nullptr;
  prometheus::Gauge* streams_active = nullptr;

  void CountRequest(std::string_view endpoint, int status) {
    if (requests_family == nullptr) return;
    requests_family
        ->Add({{"model_name", options.model_name_label},
               {"endpoint", std::string(endpoint)},
               {"status", absl::StrCat(status)}})
        .Increment();
  }
  void CountDisconnect(std::string_view endpoint) {
    if (disconnects_family == nullptr) return;
    disconnects_family->Add({{"model_name", options.model_name_label}, {"endpoint", std::string(endpoint)}})
        .Increment();
  }

  void SendError(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.retry_after_seconds > 0) res.set_header("Retry-After", absl::StrCat(e.retry_after_seconds));
    // 501 is not worth a retry; the openai client honours x-should-retry.
    if (e.status == 501) res.set_header("x-should-retry", "false");
    res.set_content(ErrorJson(e), "application/json");
  }
  static ApiError Error(int status, std::string message, std::string code = "") {
    ApiError e;
    e.status = status;
    e.type = std::string(StatusText(status));
    e.message = std::move(message);
    e.code = std::move(code);
    return e;
  }

  // 401 unless the request carries the bearer token (when one is set).
  bool Authorized(const httplib::Request& req, httplib::Response& res) {
    if (auth_token.empty()) return true;
    const std::string header = req.get_header_value("Authorization");
    if (header.empty()) {
      SendError(res, Error(401, "missing bearer token (Authorization: Bearer <token>)", "invalid_api_key"));
      return false;
    }
    if (!ConstantTimeEquals(header, absl::StrCat("Bearer ", auth_token))) {
      SendError(res, Error(401, "wrong bearer token", "invalid_api_key"));
      return false;
    }
    return true;
  }

  // 503 unless the engine is ready and the server not draining.
  bool Serving(httplib::Response& res) {
    if (draining) {
      ApiError e = Error(503, "the server is draining (shutting down); retry another replica");
      e.retry_after_seconds = 5;
      SendError(res, e);
      return false;
    }
    if (!engine->ready()) {
      ApiError e = Error(503, "the model is not ready: its ranks are loading or a rank is down");
      e.retry_after_seconds = 5;
      SendError(res, e);
      return false;
    }
    return true;
  }

  // 404 unless `model` is empty or a served name.
  bool KnownModel(const std::string& model, httplib::Response& res) {
    if (model.empty()) return true;
    for (const std::string& name : options.served_model_names) {
      if (model == name) return true;
    }
    ApiError e = Error(404, absl::StrCat("The model `", model, "` does not exist."), "model_not_found");
    e.param = "model";
    SendError(res, e);
    return false;
  }

  ojson ModelCard(const std::string& id) const {
    const v1::GetModelInfoResponse info = engine->GetModelInfo();
    return {{"id", id},
            {"object", "model"},
            {"created", started_unix},
            {"owned_by", "exl3serve"},
            {"root", info.model_path()},
            {"parent", nullptr},
            {"max_model_len", info.max_context_tokens()}};
  }

  void HandleCompletion(const httplib::Request& req, httplib::Response& res, bool chat);
  void Routes();
};

void HttpServer::Impl::HandleCompletion(const httplib::Request& req, httplib::Response& res, bool chat) {
  const std::string endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
  auto parsed = chat ? ParseChatCompletionRequest(req.body) : ParseCompletionRequest(req.body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return SendError(res, *e);
  const CompletionRequest& request = std::get<CompletionRequest>(parsed);
  if (!KnownModel(request.model, res) || !Serving(res)) return;

  SessionOptions so;
  so.model_name = request.model.empty() ? options.served_model_names.front() : request.model;
  so.system_fingerprint = options.system_fingerprint;
  so.tool_format = tool_format;
  so.reasoning = reasoning;
  auto started = CompletionSession::Start(*engine, request, so);
  if (auto* e = std::get_if<ApiError>(&started)) return SendError(res, *e);
  Enter();  // left when the response is complete (below, or the stream's releaser)
  std::shared_ptr<CompletionSession> session = std::move(std::get<std::unique_ptr<CompletionSession>>(started));
  const int fd = FindConnectionSocket(req);

  if (!request.stream) {
    std::string unused;
    while (!session->Pump(kPollInterval, &unused)) {
      if (PeerClosed(fd)) {
        session->Abort("the client disconnected");
        CountDisconnect(endpoint);
        res.status = 499;  // nginx's "client closed request": nobody reads it
        Leave();
        return;
      }
      if (stopping) session->Abort("the server is shutting down");
    }
    Leave();
    auto result = session->Result();
    if (auto* e = std::get_if<ApiError>(&result)) return SendError(res, *e);
    res.status = 200;
    res.set_content(std::get<std::string>(result), "application/json");
    return;
  }

  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  if (streams_active != nullptr) streams_active->Increment();
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, session, fd, endpoint](size_t, httplib::DataSink& sink) {
        absl::Time last_write = absl::Now();
        for (;;) {
          std::string out;
          const bool done = session->Pump(kPollInterval, &out);
          if (out.empty() && absl::Now() - last_write >= options.keepalive_interval) {
            out = ": keep-alive\n\n";
          }
          const bool gone = (!out.empty() && !sink.write(out.data(), out.size())) || PeerClosed(fd);
          if (gone) {
            session->Abort("the client disconnected");
            CountDisconnect(endpoint);
            return false;
          }
          if (!out.empty()) last_write = absl::Now();
          if (done) {
            sink.done();
            return true;
          }
          if (stopping) session->Abort("the server is shutting down");
        }
      },
      [this](bool) {
        if (streams_active != nullptr) streams_active->Decrement();
        Leave();
      });
}

void HttpServer::Impl::Routes() {
  httplib::Server& s = *server;
  s.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
    std::string endpoint = req.path;
    if (absl::StartsWith(endpoint, "/v1/models/")) endpoint = "/v1/models/{id}";
    static const char* const kKnown[] = {"/v1/models", "/v1/models/{id}", "/v1/chat/completions",
                                         "/v1/completions", "/tokenize", "/detokenize",
                                         "/v1/embeddings", "/health", "/metrics"};
    if (std::find(std::begin(kKnown), std::end(kKnown), endpoint) == std::end(kKnown)) endpoint = "other";
    CountRequest(endpoint, res.status);
  });
  // Statuses httplib sets itself (404 route, 413 body, 400 parse) get an
  // OpenAI body too.
  s.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req,
                             httplib::Response& res) -> httplib::Server::HandlerResponse {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    std::string message;
    if (res.status == 404) message = absl::StrCat("no such endpoint: ", req.method, " ", req.path);
    else if (res.status == 413) message = absl::StrCat("the request body is larger than ", options.max_body_bytes, " bytes");
    else if (res.status == 405) message = absl::StrCat("method ", req.method, " is not allowed on ", req.path);
    else if (res.status == 499) return httplib::Server::HandlerResponse::Handled;
    else message = absl::StrCat("HTTP ", res.status);
    const int status = res.status;
    SendError(res, Error(status, message));
    return httplib::Server::HandlerResponse::Handled;
  }));
  s.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    EXL3_LOG(kError) << "http: handler failed: " << what;
    SendError(res, Error(500, absl::StrCat("internal error: ", what)));
  });

  s.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!Serving(res)) return;
    res.set_content("{\"status\":\"ok\"}", "application/json");
  });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    if (!options.metrics_text) return SendError(res, Error(404, "metrics are off"));
    res.set_content(options.metrics_text(), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    ojson data = ojson::array();
    for (const std::string& name : options.served_model_names) data.push_back(ModelCard(name));
    res.set_content(ojson({{"object", "list"}, {"data", data}}).dump(), "application/json");
  });
  s.Get(R"(/v1/models/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    const std::string id = req.matches[1];
    if (!KnownModel(id, res)) return;
    res.set_content(ModelCard(id).dump(), "application/json");
  });
  s.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    if (Authorized(req, res)) HandleCompletion(req, res, /*chat=*/true);
  });
  s.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    if (Authorized(req, res)) HandleCompletion(req, res, /*chat=*/false);
  });
  s.Post("/v1/embeddings", [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    SendError(res, Error(501, "embeddings are not available: the served model is a generative "
                              "(causal LM) model; use /v1/chat/completions or /v1/completions",
                         "not_supported"));
  });
  s.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    auto parsed = ParseTokenizeRequest(req.body);
    if (auto* e = std::get_if<ApiError>(&parsed)) return SendError(res, *e);
    const TokenizeRequest& t = std::get<TokenizeRequest>(parsed);
    if (!KnownModel(t.model, res)) return;
    const Tokenizer* tokenizer = engine->tokenizer();
    if (tokenizer == nullptr) return SendError(res, BadRequest("", "the model has no tokenizer.json"));
    std::string text = t.prompt;
    if (t.chat) {
      absl::StatusOr<std::string> rendered = engine->RenderChat(t.messages);
      if (!rendered.ok()) return SendError(res, BadRequest("messages", std::string(rendered.status().message())));
      text = *rendered;
    }
    const std::vector<int32_t> ids = tokenizer->Encode(text, {.add_special_tokens = t.add_special_tokens});
    ojson body = {{"count", ids.size()},
                  {"max_model_len", engine->GetModelInfo().max_context_tokens()},
                  {"tokens", ids}};
    if (t.return_token_strs) {
      ojson strs = ojson::array();
      for (int32_t id : ids) strs.push_back(tokenizer->IdToToken(id).value_or(""));
      body["token_strs"] = std::move(strs);
    }
    res.set_content(body.dump(-1, ' ', false, ojson::error_handler_t::replace), "application/json");
  });
  s.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    if (!Authorized(req, res)) return;
    auto parsed = ParseDetokenizeRequest(req.body);
    if (auto* e = std::get_if<ApiError>(&parsed)) return SendError(res, *e);
    const DetokenizeRequest& d = std::get<DetokenizeRequest>(parsed);
    if (!KnownModel(d.model, res)) return;
    const Tokenizer* tokenizer = engine->tokenizer();
    if (tokenizer == nullptr) return SendError(res, BadRequest("", "the model has no tokenizer.json"));
    absl::StatusOr<std::string> text = tokenizer->Decode(d.tokens);
    if (!text.ok()) return SendError(res, BadRequest("tokens", std::string(text.status().message())));
    res.set_content(ojson({{"prompt", *text}}).dump(), "application/json");
  });
}

HttpServer::HttpServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Shutdown(absl::Seconds(5)); }

int HttpServer::port() const { return impl_->port; }
std::string HttpServer::address() const {
  return impl_->options.host.find(':') != std::string::npos
             ? absl::StrCat("[", impl_->options.host, "]:", impl_->port)
             : absl::StrCat(impl_->options.host, ":", impl_->port);
}
int HttpServer::active_requests() const {
  absl::MutexLock lock(&impl_->active_mu);
  return impl_->active;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(Engine& engine,
                                                             const HttpServerOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->engine = &engine;
  impl->options = options;
  impl->started_unix = absl::ToUnixSeconds(absl::Now());
  if (impl->options.served_model_names.empty()) impl->options.served_model_names.push_back("model");
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("http: port must be in [0, 65535], got ", options.port));
  }
  if (options.threads < 1) return absl::InvalidArgumentError("http: threads must be >= 1");

  // Parsers: by name, or from the chat template.
  const Tokenizer* tokenizer = engine.tokenizer();
  const std::string chat_template = tokenizer != nullptr ? tokenizer->chat_template() : "";
  if (options.tool_call_parser == "auto") {
    impl->tool_format = DetectToolCallFormat(chat_template);
  } else {
    absl::StatusOr<ToolCallFormat> f = ToolCallFormatFromName(options.tool_call_parser);
    if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat("--tool-call-parser: ", f.status().message()));
    impl->tool_format = *f;
  }
  if (options.reasoning_parser == "auto") {
    impl->reasoning = absl::StrContains(chat_template, "<think>");
  } else if (options.reasoning_parser == "think") {
    impl->reasoning = true;
  } else if (options.reasoning_parser != "none") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--reasoning-parser must be auto, think or none, got \"", options.reasoning_parser, "\""));
  }

  if (!options.auth_token_file.empty()) {
    EXL3_ASSIGN_OR_RETURN(std::string token, ReadSmallFile(options.auth_token_file, "the auth token file"));
    impl->auth_token = std::string(absl::StripAsciiWhitespace(token));
    if (impl->auth_token.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the auth token file ", options.auth_token_file, " holds only whitespace"));
    }
  }
  const bool tls = !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (tls) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("http: TLS needs both a certificate and a key file");
    }
    for (const std::string& f : {options.tls_cert_file, options.tls_key_file, options.tls_client_ca_file}) {
      if (!f.empty()) EXL3_RETURN_IF_ERROR(ReadSmallFile(f, "the TLS file").status());
    }
    impl->server = std::make_unique<httplib::SSLServer>(
        options.tls_cert_file.c_str(), options.tls_key_file.c_str(),
        options.tls_client_ca_file.empty() ? nullptr : options.tls_client_ca_file.c_str());
  } else {
    impl->server = std::make_unique<httplib::Server>();
  }
  if (!impl->server->is_valid()) {
    return absl::InvalidArgumentError("http: the TLS certificate or key could not be loaded");
  }

  if (options.registry != nullptr) {
    impl->requests_family = &prometheus::BuildCounter()
                                 .Name("exl3serve:http_requests_total")
                                 .Help("HTTP API requests answered, by endpoint and status code")
                                 .Register(*options.registry);
    impl->disconnects_family = &prometheus::BuildCounter()
                                    .Name("exl3serve:http_client_disconnects_total")
                                    .Help("HTTP requests aborted because the client went away")
                                    .Register(*options.registry);
    impl->streams_active = &prometheus::BuildGauge()
                                .Name("exl3serve:http_streams_active")
                                .Help("SSE streams being served")
                                .Register(*options.registry)
                                .Add({{"model_name", options.model_name_label}});
  }

  httplib::Server& s = *impl->server;
  const int threads = options.threads;
  s.new_task_queue = [threads] { return new httplib::ThreadPool(static_cast<size_t>(threads)); };
  s.set_payload_max_length(options.max_body_bytes);
  s.set_keep_alive_max_count(100000);
  s.set_keep_alive_timeout(30);
  s.set_read_timeout(30, 0);
  s.set_write_timeout(60, 0);
  s.set_tcp_nodelay(true);
  impl->Routes();

  const int port = options.port == 0 ? s.bind_to_any_port(options.host)
                                     : (s.bind_to_port(options.host, options.port) ? options.port : -1);
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", options.host, ":", options.port,
                                               " (port in use, or not an address of this machine)"));
  }
  impl->port = port;
  Impl* raw = impl.get();
  impl->listener = std::thread([raw] { raw->server->listen_after_bind(); });
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

void HttpServer::Shutdown(absl::Duration grace) {
  absl::MutexLock lock(&impl_->shutdown_mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  impl_->draining = true;
  // Requests in flight finish on their own (bounded by `grace`); then the
  // rest are aborted and end at the next poll.
  impl_->AwaitIdle(absl::Now() + grace);
  impl_->stopping = true;  // each handler aborts at its next poll (50 ms)
  impl_->AwaitIdle(absl::Now() + absl::Seconds(5));
  impl_->server->stop();
  if (impl_->listener.joinable()) impl_->listener.join();
}

}  // namespace exl3serve::coordinator::http
