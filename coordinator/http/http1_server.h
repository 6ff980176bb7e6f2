// coordinator/http/http1_server.h — the HTTP/1.1 connection layer under the
// OpenAI API: sockets, TLS, framing (http1_parser.h), limits and deadlines,
// handler threads. Knows nothing of the API; http_server.cc routes over it.
//
// Threads and ownership:
//   - One I/O thread owns the listening socket and every connection that is
//     not running a handler: it accepts, completes TLS handshakes, reads
//     request heads and bodies (epoll, level-triggered), parks idle
//     keep-alive connections (no polling: epoll_wait sleeps until a byte or
//     the nearest deadline), and closes every connection.
//   - A whole request goes to a handler thread (a pool grown on demand up to
//     `handler_threads`); the connection leaves epoll for that time. The
//     handler writes the response through ResponseWriter. Afterwards the
//     thread answers the next pipelined request already buffered, in order,
//     or hands the connection back to the I/O thread (a queue + eventfd).
//   So a slow or idle client costs a parked socket, never a handler thread.
//
// Limits (each refusal counted in exl3serve:http_connections_refused_total or
// answered with a status; the connection is then closed after a bounded
// lingering read so the client sees the answer, not a reset):
//   max_connections, max_connections_per_ip   503 + Retry-After at accept
//   head_timeout     request line + headers, from the request's first byte
//                    (and the TLS handshake, from accept): 408
//   request_timeout  the whole request, head and body, from its first byte: 408
//   idle_timeout     a keep-alive connection with no request: closed quietly
//   write_timeout    one write making no progress: the connection is dropped
//   framing          as http1_parser.h: 400/411/413/417/431/501/505
// Range is never honoured (responses are whole, 200).
#ifndef EXL3SERVE_COORDINATOR_HTTP_HTTP1_SERVER_H_
#define EXL3SERVE_COORDINATOR_HTTP_HTTP1_SERVER_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/http/http1_parser.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace exl3serve::coordinator::http {

// The connection limits and deadlines above; HttpServerOptions carries the
// same struct through.
struct HttpConnectionLimits {
  int listen_backlog = 4096;  // the kernel caps it at net.core.somaxconn
  size_t max_connections = 8192;
  size_t max_connections_per_ip = 1024;
  absl::Duration head_timeout = absl::Seconds(10);
  absl::Duration request_timeout = absl::Seconds(60);
  absl::Duration idle_timeout = absl::Seconds(60);
  absl::Duration write_timeout = absl::Seconds(60);
};

struct Http1ServerOptions {
  std::string host = "127.0.0.1";
  int port = 0;  // 0 = any free port
  HttpFramingLimits framing;
  HttpConnectionLimits limits;
  int handler_threads = 512;  // requests handled at once (a stream holds one)
  // TLS from PEM files; client_ca: clients must present a certificate it signed.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Connection series (open, refused by reason, timeouts by phase); null = none.
  prometheus::Registry* registry = nullptr;
  std::string model_name_label = "unknown";
};

using HttpHeaders = std::vector<std::pair<std::string, std::string>>;

// The response side of one request, used by its handler thread only.
class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;
  // A whole response (Content-Length). False when the client is gone.
  virtual bool Send(int status, std::string_view content_type, std::string_view body,
                    const HttpHeaders& headers = {}) = 0;
  // A streamed response: head now (Transfer-Encoding: chunked), then chunks,
  // then End. Each false when the client is gone.
  virtual bool BeginChunked(int status, std::string_view content_type, const HttpHeaders& headers = {}) = 0;
  virtual bool WriteChunk(std::string_view data) = 0;
  virtual bool EndChunked() = 0;
  // Answer nothing and close (the client left: nginx's 499).
  virtual void Drop(int status) = 0;
  // True when the peer closed its side (polls the socket; data it sent
  // ahead, a pipelined request, is not a close).
  virtual bool PeerClosed() = 0;
  virtual int status() const = 0;  // what was sent (0: nothing yet)
  virtual const std::string& remote_address() const = 0;
};

// Called on a handler thread for every whole request; must answer through
// `writer` (a handler that sends nothing gets a 500).
using HttpHandler = std::function<void(const HttpRequest& request, ResponseWriter& writer)>;
// Called for requests refused before a handler (framing errors, timeouts,
// limits) so the API can count them; status and a reason.
using HttpRefusalObserver = std::function<void(int status, std::string_view reason)>;

class Http1Server {
 public:
  // Binds, listens and starts the I/O thread. Errors: InvalidArgument (bad
  // options, unusable TLS files), Unavailable (cannot bind).
  static absl::StatusOr<std::unique_ptr<Http1Server>> Start(const Http1ServerOptions& options,
                                                           HttpHandler handler,
                                                           HttpRefusalObserver on_refusal = nullptr);
  ~Http1Server();  // Stop()
  Http1Server(const Http1Server&) = delete;
  Http1Server& operator=(const Http1Server&) = delete;

  int port() const;
  // Stops accepting, closes idle connections, waits for handlers to return
  // (the caller makes them return: they see no signal from here), closes
  // the rest. Idempotent.
  void Stop();

  size_t open_connections() const;

  struct Impl;

 private:
  explicit Http1Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "Not Found" for 404 etc.; "Unknown" for codes without a reason phrase here.
std::string_view HttpReasonPhrase(int status);

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_HTTP1_SERVER_H_
