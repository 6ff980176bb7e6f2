// coordinator/http/http_server.h — the OpenAI-compatible HTTP API beside the
// gRPC API, in the coordinator process, over the same Engine (one admission
// queue, one set of metrics):
//
//   GET  /v1/models, /v1/models/{id}     the served model (404 for another id)
//   POST /v1/chat/completions            chat, streamed (SSE) or not; tools, reasoning
//   POST /v1/completions                 prompt as string(s) or token ids
//   POST /tokenize, /detokenize          vLLM's shapes
//   POST /v1/embeddings                  501: generative models only
//   GET  /health                         200 ready; 503 + error body otherwise
//   GET  /metrics                        the coordinator's Prometheus registry (with the HTTP series)
//
// Over our own HTTP/1.1 layer (http1_server.h, framing in http1_parser.h):
// cpp-httplib 0.11.4, which this replaced, could be crashed, smuggled past and
// held by slow clients (issue 41: a listen backlog of 5, GET bodies parsed as
// a second request, chunked bodies read unbounded, a per-byte read timeout,
// multi-range responses, busy-polled idle connections), none of it fixable
// from outside the library. Each live request holds one handler thread
// (`threads`); idle and slow connections hold none. A handler polls its
// socket for EOF between engine responses: a client that disconnects aborts
// its request within one poll interval (50 ms), streamed or not, and its KV
// blocks come back at the next step.
//
// Errors are OpenAI-shaped ({"error": {message, type, param, code}}): 400 bad
// request (named field; also any JSON value nested deeper than 256, and
// malformed framing), 401 (the gRPC bearer token), 404, 405, 408 (head or
// request deadline), 411, 413 (body over max_body_bytes, whatever its
// framing), 429 + Retry-After (queue full), 431, 503 + Retry-After (not
// ready: loading, a rank down, draining; or a connection limit), 500.
#ifndef EXL3SERVE_COORDINATOR_HTTP_HTTP_SERVER_H_
#define EXL3SERVE_COORDINATOR_HTTP_HTTP_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/engine.h"
#include "coordinator/http/http1_server.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace exl3serve::coordinator::http {

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0 = any free port (port() says which)
  // Names clients may send as `model`; the first is the id /v1/models lists.
  std::vector<std::string> served_model_names;
  // Same credentials as the gRPC API: TLS from PEM files (client_ca: mutual
  // TLS) and a bearer token file (Authorization: Bearer <token> on every
  // /v1 and /tokenize call; /health and /metrics stay open for probes).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  std::string auth_token_file;
  size_t max_body_bytes = size_t{8} << 20;  // larger bodies get 413
  int threads = 512;                         // requests handled at once (a stream holds one)
  // The connection layer's limits and deadlines (http1_server.h).
  HttpConnectionLimits limits;
  // Streams send ": keep-alive" after this long without data (long prefill).
  absl::Duration keepalive_interval = absl::Seconds(10);
  // "auto" (from the chat template), "hermes", "llama3_json", "mistral", "none".
  std::string tool_call_parser = "auto";
  // "auto" (the template mentions <think>), "think", "none".
  std::string reasoning_parser = "auto";
  std::string system_fingerprint;            // e.g. the build id; "" = none
  // The Prometheus text exposition served at /metrics; null = 404.
  std::function<std::string()> metrics_text;
  // Where the HTTP series (requests by endpoint and status, disconnects,
  // live streams) register; must outlive the server; null = none.
  prometheus::Registry* registry = nullptr;
  std::string model_name_label = "unknown";  // the model_name label of those series
};

class HttpServer {
 public:
  // Binds and starts serving. `engine` is borrowed and must outlive the
  // server. Errors: InvalidArgument for bad options (unknown parser name, a
  // TLS key without a certificate), NotFound for unreadable credential
  // files, Unavailable naming the address when it cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(Engine& engine,
                                                           const HttpServerOptions& options);
  ~HttpServer();  // Shutdown(absl::Seconds(5))
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const;
  std::string address() const;  // host:port

  // Drains: new requests get 503 (Retry-After) and /health 503, requests in
  // flight get up to `grace`, then the rest are aborted (streams end with an
  // error event) and the server stops. Idempotent.
  void Shutdown(absl::Duration grace);

  // Requests being served now (for drain and tests).
  int active_requests() const;

  struct Impl;

 private:
  explicit HttpServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_HTTP_SERVER_H_
