#include "coordinator/http/http_server.h"

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
#include "coordinator/http/http1_server.h"
#include "coordinator/http/openai_request.h"
#include "coordinator/http/openai_session.h"
#include "coordinator/http/tool_call_parser.h"
#include "coordinator/tokenizer/tokenizer.h"
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

std::string_view StatusText(int status) {
  switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 405: return "invalid_request_error";
    case 408: return "invalid_request_error";
    case 411: return "invalid_request_error";
    case 413: return "invalid_request_error";
    case 417: return "invalid_request_error";
    case 431: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable_error";
    default: return "server_error";
  }
}

}  // namespace

struct HttpServer::Impl {
  Engine* engine = nullptr;
  HttpServerOptions options;
  std::unique_ptr<Http1Server> server;
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

  static void SendError(ResponseWriter& w, const ApiError& e) {
    HttpHeaders headers;
    if (e.retry_after_seconds > 0) headers.push_back({"Retry-After", absl::StrCat(e.retry_after_seconds)});
    // 501 is not worth a retry; the openai client honours x-should-retry.
    if (e.status == 501) headers.push_back({"x-should-retry", "false"});
    w.Send(e.status, "application/json", ErrorJson(e), headers);
  }
  static void SendJson(ResponseWriter& w, const std::string& body) { w.Send(200, "application/json", body); }
  static ApiError Error(int status, std::string message, std::string code = "") {
    ApiError e;
    e.status = status;
    e.type = std::string(StatusText(status));
    e.message = std::move(message);
    e.code = std::move(code);
    return e;
  }

  // 401 unless the request carries the bearer token (when one is set).
  bool Authorized(const HttpRequest& req, ResponseWriter& res) {
    if (auth_token.empty()) return true;
    const std::string* h = req.Header("authorization");
    const std::string header = h == nullptr ? "" : *h;
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
  bool Serving(ResponseWriter& res) {
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
  bool KnownModel(const std::string& model, ResponseWriter& res) {
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

  void HandleCompletion(const HttpRequest& req, ResponseWriter& res, bool chat);
  void HandleTokenize(const HttpRequest& req, ResponseWriter& res);
  void HandleDetokenize(const HttpRequest& req, ResponseWriter& res);
  // Routes one request; returns the endpoint label it counts under.
  std::string Route(const HttpRequest& req, ResponseWriter& res);
};

void HttpServer::Impl::HandleCompletion(const HttpRequest& req, ResponseWriter& res, bool chat) {
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
  Enter();
  std::unique_ptr<CompletionSession> session = std::move(std::get<std::unique_ptr<CompletionSession>>(started));

  if (!request.stream) {
    std::string unused;
    while (!session->Pump(kPollInterval, &unused)) {
      if (res.PeerClosed()) {
        session->Abort("the client disconnected");
        CountDisconnect(endpoint);
        res.Drop(499);  // nginx's "client closed request": nobody reads it
        Leave();
        return;
      }
      if (stopping) session->Abort("the server is shutting down");
    }
    Leave();
    auto result = session->Result();
    if (auto* e = std::get_if<ApiError>(&result)) return SendError(res, *e);
    SendJson(res, std::get<std::string>(result));
    return;
  }

  if (streams_active != nullptr) streams_active->Increment();
  bool gone = !res.BeginChunked(200, "text/event-stream", {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}});
  absl::Time last_write = absl::Now();
  while (!gone) {
    std::string out;
    const bool done = session->Pump(kPollInterval, &out);
    if (out.empty() && absl::Now() - last_write >= options.keepalive_interval) out = ": keep-alive\n\n";
    gone = (!out.empty() && !res.WriteChunk(out)) || res.PeerClosed();
    if (gone) break;
    if (!out.empty()) last_write = absl::Now();
    if (done) {
      res.EndChunked();
      break;
    }
    if (stopping) session->Abort("the server is shutting down");
  }
  if (gone) {
    session->Abort("the client disconnected");
    CountDisconnect(endpoint);
    res.Drop(200);
  }
  if (streams_active != nullptr) streams_active->Decrement();
  Leave();
}

void HttpServer::Impl::HandleTokenize(const HttpRequest& req, ResponseWriter& res) {
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
  SendJson(res, body.dump(-1, ' ', false, ojson::error_handler_t::replace));
}

void HttpServer::Impl::HandleDetokenize(const HttpRequest& req, ResponseWriter& res) {
  auto parsed = ParseDetokenizeRequest(req.body);
  if (auto* e = std::get_if<ApiError>(&parsed)) return SendError(res, *e);
  const DetokenizeRequest& d = std::get<DetokenizeRequest>(parsed);
  if (!KnownModel(d.model, res)) return;
  const Tokenizer* tokenizer = engine->tokenizer();
  if (tokenizer == nullptr) return SendError(res, BadRequest("", "the model has no tokenizer.json"));
  absl::StatusOr<std::string> text = tokenizer->Decode(d.tokens);
  if (!text.ok()) return SendError(res, BadRequest("tokens", std::string(text.status().message())));
  SendJson(res, ojson({{"prompt", *text}}).dump());
}

std::string HttpServer::Impl::Route(const HttpRequest& req, ResponseWriter& res) {
  const std::string& path = req.path;
  const std::string& m = req.method;
  const bool get = m == "GET" || m == "HEAD";
  const bool post = m == "POST";
  auto wrong_method = [&](const std::string& endpoint, const char* allowed) {
    ApiError e = Error(405, absl::StrCat("method ", m, " is not allowed on ", path, " (", allowed, ")"));
    HttpHeaders headers = {{"Allow", allowed}};
    res.Send(405, "application/json", ErrorJson(e), headers);
    return endpoint;
  };
  if (path == "/health") {
    if (!get) return wrong_method(path, "GET, HEAD");
    if (Serving(res)) SendJson(res, "{\"status\":\"ok\"}");
    return path;
  }
  if (path == "/metrics") {
    if (!get) return wrong_method(path, "GET, HEAD");
    if (!options.metrics_text) {
      SendError(res, Error(404, "metrics are off"));
    } else {
      // Whole, 200: Range is not honoured (no multi-range responses).
      res.Send(200, "text/plain; version=0.0.4; charset=utf-8", options.metrics_text());
    }
    return path;
  }
  if (path == "/v1/models") {
    if (!get) return wrong_method(path, "GET, HEAD");
    if (!Authorized(req, res)) return path;
    ojson data = ojson::array();
    for (const std::string& name : options.served_model_names) data.push_back(ModelCard(name));
    SendJson(res, ojson({{"object", "list"}, {"data", data}}).dump());
    return path;
  }
  if (absl::StartsWith(path, "/v1/models/") && path.size() > 11) {
    const std::string endpoint = "/v1/models/{id}";
    if (!get) return wrong_method(endpoint, "GET, HEAD");
    if (!Authorized(req, res)) return endpoint;
    const std::string id = path.substr(11);
    if (KnownModel(id, res)) SendJson(res, ModelCard(id).dump());
    return endpoint;
  }
  if (path == "/v1/chat/completions" || path == "/v1/completions") {
    if (!post) return wrong_method(path, "POST");
    if (Authorized(req, res)) HandleCompletion(req, res, /*chat=*/path == "/v1/chat/completions");
    return path;
  }
  if (path == "/v1/embeddings") {
    if (!post) return wrong_method(path, "POST");
    if (!Authorized(req, res)) return path;
    SendError(res, Error(501, "embeddings are not available: the served model is a generative "
                              "(causal LM) model; use /v1/chat/completions or /v1/completions",
                         "not_supported"));
    return path;
  }
  if (path == "/tokenize" || path == "/detokenize") {
    if (!post) return wrong_method(path, "POST");
    if (!Authorized(req, res)) return path;
    if (path == "/tokenize") {
      HandleTokenize(req, res);
    } else {
      HandleDetokenize(req, res);
    }
    return path;
  }
  SendError(res, Error(404, absl::StrCat("no such endpoint: ", m, " ", path)));
  return "other";
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

  Http1ServerOptions so;
  so.host = options.host;
  so.port = options.port;
  so.framing.max_body_bytes = options.max_body_bytes;
  so.limits = options.limits;
  so.handler_threads = options.threads;
  so.tls_cert_file = options.tls_cert_file;
  so.tls_key_file = options.tls_key_file;
  so.tls_client_ca_file = options.tls_client_ca_file;
  so.registry = options.registry;
  so.model_name_label = options.model_name_label;
  Impl* raw = impl.get();
  auto handler = [raw](const HttpRequest& req, ResponseWriter& res) {
    const std::string endpoint = raw->Route(req, res);
    raw->CountRequest(endpoint, res.status());
  };
  auto refused = [raw](int status, std::string_view) { raw->CountRequest("other", status); };
  absl::StatusOr<std::unique_ptr<Http1Server>> server = Http1Server::Start(so, handler, refused);
  if (!server.ok()) return server.status();
  impl->server = *std::move(server);
  impl->port = impl->server->port();
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
  impl_->server->Stop();
}

}  // namespace exl3serve::coordinator::http
