#include "coordinator/http/http1_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <malloc.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/registry.h"

namespace exl3serve::coordinator::http {

std::string_view HttpReasonPhrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
  }
}

namespace {

absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }

constexpr size_t kReadChunk = 64 << 10;
constexpr size_t kReadBudgetPerEvent = 1 << 20;  // fairness between connections
constexpr absl::Duration kLinger = absl::Seconds(2);
constexpr size_t kLingerBytes = size_t{16} << 20;
constexpr size_t kTrimAfterBodyBytes = size_t{1} << 20;
constexpr absl::Duration kWorkerIdleExit = absl::Seconds(10);
constexpr absl::Duration kSweepInterval = absl::Milliseconds(100);
constexpr int kMinWorkers = 4;

enum class Io { kOk, kWantRead, kWantWrite, kEof, kError };

// An error body in the API's JSON shape (the layer above sends its own for
// everything it handles; these are for refusals below it).
std::string ErrorBody(int status, std::string_view message) {
  std::string escaped;
  for (char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    escaped += c;
  }
  const char* type = status == 503 ? "service_unavailable_error"
                     : status >= 500 ? "server_error"
                                     : "invalid_request_error";
  return absl::StrCat("{\"error\":{\"message\":\"", escaped, "\",\"type\":\"", type,
                      "\",\"param\":null,\"code\":null}}");
}

std::string ResponseHead(int status, int version_minor, std::string_view content_type, const HttpHeaders& headers,
                         std::string_view framing, bool keep_alive) {
  std::string head = absl::StrCat("HTTP/1.", version_minor, " ", status, " ", AV(HttpReasonPhrase(status)), "\r\n");
  if (!content_type.empty()) absl::StrAppend(&head, "Content-Type: ", AV(content_type), "\r\n");
  for (const auto& [name, value] : headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  head.append(framing);
  if (!keep_alive) {
    head += "Connection: close\r\n";
  } else if (version_minor == 0) {
    head += "Connection: keep-alive\r\n";
  }
  head += "\r\n";
  return head;
}

std::string PeerAddress(const sockaddr_storage& a) {
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a)->sin_addr, text, sizeof text);
  } else if (a.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a)->sin6_addr, text, sizeof text);
  }
  return text;
}

struct SslCtxDeleter {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};

std::string SslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    absl::StrAppend(&out, out.empty() ? "" : "; ", buf);
  }
  return out.empty() ? "unknown TLS error" : out;
}

}  // namespace

struct Connection {
  enum class Phase { kHandshake, kReading, kHandler, kLinger };
  int fd = -1;
  SSL* ssl = nullptr;
  std::string peer;
  HttpRequestParser parser;
  std::string in;  // bytes read past the end of the request being handled
  Phase phase = Phase::kReading;
  bool epoll_out = false;  // registered for EPOLLOUT (TLS handshake)
  bool in_epoll = false;
  absl::Time accepted;
  absl::Time idle_since;
  absl::Time request_started = absl::InfiniteFuture();
  absl::Time linger_until;
  size_t lingered = 0;
  size_t bytes_in = 0;       // read by the I/O thread, for the trim below
  bool close_after = false;  // set by the handler thread

  explicit Connection(HttpFramingLimits limits) : parser(limits) {}

  Io Read(char* buf, size_t cap, size_t* n) {
    *n = 0;
    if (ssl == nullptr) {
      const ssize_t r = ::recv(fd, buf, cap, MSG_DONTWAIT);
      if (r > 0) {
        *n = static_cast<size_t>(r);
        return Io::kOk;
      }
      if (r == 0) return Io::kEof;
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Io::kWantRead;
      return Io::kError;
    }
    ERR_clear_error();
    const int r = SSL_read(ssl, buf, static_cast<int>(std::min<size_t>(cap, 1 << 30)));
    if (r > 0) {
      *n = static_cast<size_t>(r);
      return Io::kOk;
    }
    switch (SSL_get_error(ssl, r)) {
      case SSL_ERROR_WANT_READ: return Io::kWantRead;
      case SSL_ERROR_WANT_WRITE: return Io::kWantWrite;
      case SSL_ERROR_ZERO_RETURN: return Io::kEof;
      default: return Io::kError;
    }
  }

  Io Write(const char* data, size_t len, size_t* n) {
    *n = 0;
    if (ssl == nullptr) {
      const ssize_t r = ::send(fd, data, len, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (r >= 0) {
        *n = static_cast<size_t>(r);
        return Io::kOk;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return Io::kWantWrite;
      return Io::kError;
    }
    ERR_clear_error();
    const int r = SSL_write(ssl, data, static_cast<int>(std::min<size_t>(len, 1 << 30)));
    if (r > 0) {
      *n = static_cast<size_t>(r);
      return Io::kOk;
    }
    switch (SSL_get_error(ssl, r)) {
      case SSL_ERROR_WANT_READ: return Io::kWantRead;
      case SSL_ERROR_WANT_WRITE: return Io::kWantWrite;
      default: return Io::kError;
    }
  }

  // Writes all of `data`, waiting (poll) while the socket is full; false when
  // the peer is gone or no byte moved for `timeout`.
  bool WriteAll(std::string_view data, absl::Duration timeout) {
    absl::Time deadline = absl::Now() + timeout;
    while (!data.empty()) {
      size_t n = 0;
      const Io io = Write(data.data(), data.size(), &n);
      if (io == Io::kOk) {
        data.remove_prefix(n);
        deadline = absl::Now() + timeout;
        continue;
      }
      if (io != Io::kWantRead && io != Io::kWantWrite) return false;
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) return false;
      pollfd p = {fd, static_cast<short>(io == Io::kWantRead ? POLLIN : POLLOUT), 0};
      const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1000)));
      if (r > 0 && (p.revents & (POLLERR | POLLNVAL))) return false;
    }
    return true;
  }

  // Sends a short response without waiting (the socket is idle, so a few
  // hundred bytes fit); best effort.
  void SendNow(std::string_view data) {
    for (int tries = 0; !data.empty() && tries < 4; ++tries) {
      size_t n = 0;
      if (Write(data.data(), data.size(), &n) != Io::kOk) return;
      data.remove_prefix(n);
    }
  }
};

struct Http1Server::Impl {
  Http1ServerOptions options;
  HttpHandler handler;
  HttpRefusalObserver on_refusal;
  std::unique_ptr<SSL_CTX, SslCtxDeleter> ssl_ctx;
  int listen_fd = -1;
  int epoll_fd = -1;
  int wake_fd = -1;
  int port = 0;
  std::thread io_thread;
  std::atomic<bool> stopping{false};
  std::atomic<size_t> open{0};

  // I/O thread only.
  std::unordered_map<int, std::unique_ptr<Connection>> connections;
  std::unordered_map<std::string, size_t> per_ip;
  std::vector<int> ready_again;  // fds of TLS connections with data buffered past a read budget
  // A connection that brought >= kTrimAfterBodyBytes closed: its buffers went
  // back to this thread's malloc arena; trimmed once the loop turn is done.
  bool trim_pending = false;

  // Handler pool and the queues between it and the I/O thread.
  std::mutex mu;
  std::condition_variable work_cv;
  std::deque<Connection*> work;      // whole requests waiting for a thread
  std::deque<Connection*> returned;  // back to the I/O thread
  int live_workers = 0;  // handler threads running (detached; Stop waits for 0)
  int idle_workers = 0;
  bool workers_exit = false;
  std::condition_variable workers_done_cv;
  int handlers_running = 0;  // connections owned by handler threads (incl. queued)
  std::condition_variable handlers_cv;
  std::mutex stop_mu;
  bool stopped = false;

  // Metrics (null without a registry).
  prometheus::Gauge* open_gauge = nullptr;
  prometheus::Family<prometheus::Counter>* refused_family = nullptr;
  prometheus::Family<prometheus::Counter>* timeouts_family = nullptr;

  void CountRefused(const std::string& reason) {
    if (refused_family != nullptr) {
      refused_family->Add({{"model_name", options.model_name_label}, {"reason", reason}}).Increment();
    }
  }
  void CountTimeout(const std::string& phase) {
    if (timeouts_family != nullptr) {
      timeouts_family->Add({{"model_name", options.model_name_label}, {"phase", phase}}).Increment();
    }
  }

  void Wake() {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(wake_fd, &one, sizeof one);
  }

  // --- I/O thread -------------------------------------------------------
  void IoLoop();
  void Accept();
  void Register(Connection* c, bool out) {
    epoll_event ev = {};
    ev.events = (out ? EPOLLOUT : EPOLLIN) | EPOLLRDHUP;
    ev.data.fd = c->fd;
    if (!c->in_epoll) {
      ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, c->fd, &ev);
    } else if (c->epoll_out != out) {
      ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c->fd, &ev);
    }
    c->in_epoll = true;
    c->epoll_out = out;
  }
  void Unregister(Connection* c) {
    if (c->in_epoll) ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c->fd, nullptr);
    c->in_epoll = false;
  }
  void Close(Connection* c) {
    Unregister(c);
    if (c->bytes_in >= kTrimAfterBodyBytes) trim_pending = true;
    if (c->ssl != nullptr) SSL_free(c->ssl);
    ::close(c->fd);
    if (auto it = per_ip.find(c->peer); it != per_ip.end() && --it->second == 0) per_ip.erase(it);
    const int fd = c->fd;
    connections.erase(fd);  // deletes c
    open.store(connections.size());
    if (open_gauge != nullptr) open_gauge->Set(static_cast<double>(connections.size()));
  }
  // Answers with `status` and closes after a bounded lingering read.
  void Refuse(Connection* c, int status, std::string_view message, int version_minor = 1) {
    if (c->ssl == nullptr || c->phase != Connection::Phase::kHandshake) {
      const std::string body = ErrorBody(status, message);
      HttpHeaders headers = {{"Content-Length", absl::StrCat(body.size())}};
      if (status == 503) headers.push_back({"Retry-After", "1"});
      c->SendNow(ResponseHead(status, version_minor, "application/json", headers, "", false) + body);
    }
    if (on_refusal) on_refusal(status, message);
    LingerClose(c);
  }
  void LingerClose(Connection* c) {
    if (c->ssl != nullptr) SSL_shutdown(c->ssl);
    ::shutdown(c->fd, SHUT_WR);
    c->phase = Connection::Phase::kLinger;
    c->linger_until = absl::Now() + kLinger;
    Register(c, false);
  }
  void OnReadable(Connection* c);
  void OnHandshake(Connection* c);
  void Dispatch(Connection* c);
  void TakeReturned();
  absl::Time Sweep(absl::Time now);

  // --- handler threads ----------------------------------------------------
  void WorkerLoop();
  void Serve(Connection* c);
};

// The writer of one request on a handler thread.
class ConnectionWriter final : public ResponseWriter {
 public:
  ConnectionWriter(Connection& c, const HttpRequest& request, const Http1Server::Impl& server)
      : c_(c), request_(request), server_(server) {
    keep_alive_ = request.keep_alive && !server.stopping.load();
    head_only_ = request.method == "HEAD";
  }

  bool Send(int status, std::string_view content_type, std::string_view body, const HttpHeaders& headers = {}) override {
    if (status_ != 0) return false;
    status_ = status;
    std::string out = ResponseHead(status, request_.version_minor, content_type, headers,
                                   absl::StrCat("Content-Length: ", body.size(), "\r\n"), keep_alive_);
    if (!head_only_) out.append(body);
    return ok_ = c_.WriteAll(out, server_.options.limits.write_timeout);
  }
  bool BeginChunked(int status, std::string_view content_type, const HttpHeaders& headers) override {
    if (status_ != 0) return false;
    status_ = status;
    streaming_ = true;
    // HTTP/1.0 has no chunked coding: the body runs to the close.
    chunked_ = request_.version_minor == 1;
    if (!chunked_) keep_alive_ = false;
    std::string out = ResponseHead(status, request_.version_minor, content_type, headers,
                                   chunked_ ? "Transfer-Encoding: chunked\r\n" : "", keep_alive_);
    return ok_ = c_.WriteAll(out, server_.options.limits.write_timeout);
  }
  bool WriteChunk(std::string_view data) override {
    if (!ok_ || status_ == 0 || ended_) return false;
    if (data.empty() || head_only_) return true;
    std::string out = chunked_ ? absl::StrCat(absl::Hex(data.size()), "\r\n", AV(data), "\r\n") : std::string(data);
    return ok_ = c_.WriteAll(out, server_.options.limits.write_timeout);
  }
  bool EndChunked() override {
    if (!ok_ || status_ == 0 || ended_) return false;
    ended_ = true;
    if (!chunked_ || head_only_) return true;
    return ok_ = c_.WriteAll("0\r\n\r\n", server_.options.limits.write_timeout);
  }
  void Drop(int status) override {
    if (status_ == 0) status_ = status;
    ok_ = false;
  }
  bool PeerClosed() override {
    pollfd p = {c_.fd, POLLIN | POLLRDHUP, 0};
    if (::poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) return true;
    if (p.revents & POLLIN) {
      char byte;
      return ::recv(c_.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
    return false;
  }
  int status() const override { return status_; }
  const std::string& remote_address() const override { return c_.peer; }

  // Whether the connection can carry another request: the response went out
  // whole (a stream ended) and both sides keep the connection.
  bool reusable() const { return ok_ && keep_alive_ && status_ != 0 && (!streaming_ || ended_); }

 private:

  Connection& c_;
  const HttpRequest& request_;
  const Http1Server::Impl& server_;
  int status_ = 0;
  bool ok_ = true;
  bool keep_alive_ = true;
  bool head_only_ = false;
  bool chunked_ = false;
  bool streaming_ = false;
  bool ended_ = false;
};

void Http1Server::Impl::Dispatch(Connection* c) {
  Unregister(c);
  c->phase = Connection::Phase::kHandler;
  std::lock_guard<std::mutex> lock(mu);
  ++handlers_running;
  work.push_back(c);
  // Idle threads may not have woken for earlier requests yet: a new thread
  // whenever the queue outgrows them, or a request would wait behind a
  // stream that holds its thread for minutes.
  if (work.size() > static_cast<size_t>(idle_workers) && live_workers < options.handler_threads) {
    ++live_workers;
    std::thread([this] { WorkerLoop(); }).detach();
  } else {
    work_cv.notify_one();
  }
}

// A handler thread idle for kWorkerIdleExit leaves (down to kMinWorkers), so
// a burst's threads do not keep their stacks and arenas for good.
void Http1Server::Impl::WorkerLoop() {
  std::unique_lock<std::mutex> lock(mu);
  for (;;) {
    ++idle_workers;
    const bool woken = work_cv.wait_for(lock, absl::ToChronoSeconds(kWorkerIdleExit),
                                        [this] { return workers_exit || !work.empty(); });
    --idle_workers;
    if (work.empty()) {
      if (!workers_exit && (woken || live_workers <= kMinWorkers)) continue;
      --live_workers;
      const bool trim = !workers_exit;
      workers_done_cv.notify_all();
      lock.unlock();
      if (trim) malloc_trim(0);  // what the leaving thread's arena holds free
      return;
    }
    Connection* c = work.front();
    work.pop_front();
    lock.unlock();
    Serve(c);
    lock.lock();
    returned.push_back(c);
    --handlers_running;
    handlers_cv.notify_all();
    Wake();
  }
}

// Answers the connection's complete request, then any further requests
// already buffered (pipelining, in order).
void Http1Server::Impl::Serve(Connection* c) {
  for (;;) {
    const HttpRequest request = c->parser.TakeRequest();
    c->parser.Reset();
    ConnectionWriter writer(*c, request, *this);
    try {
      handler(request, writer);
    } catch (const std::exception& e) {
      EXL3_LOG(kError) << "http: handler failed: " << e.what();
      if (writer.status() == 0) writer.Send(500, "application/json", ErrorBody(500, e.what()));
    }
    if (writer.status() == 0) writer.Send(500, "application/json", ErrorBody(500, "the handler sent no response"));
    // A large body (and its parsed JSON) was freed into this thread's malloc
    // arena; hand the pages back, or a burst of 8 MiB bodies over many
    // handler threads keeps its peak RSS for good.
    if (request.body.size() >= kTrimAfterBodyBytes) malloc_trim(0);
    if (!writer.reusable() || stopping.load()) {
      c->close_after = true;
      return;
    }
    c->idle_since = absl::Now();
    c->request_started = absl::InfiniteFuture();
    if (c->in.empty()) return;
    c->request_started = absl::Now();
    const size_t used = c->parser.Feed(c->in);
    c->in.erase(0, used);
    switch (c->parser.state()) {
      case HttpRequestParser::State::kComplete:
        continue;
      case HttpRequestParser::State::kError: {
        const HttpFramingError e = c->parser.error();
        if (on_refusal) on_refusal(e.status, e.message);
        const std::string body = ErrorBody(e.status, e.message);
        c->WriteAll(ResponseHead(e.status, 1, "application/json", {}, absl::StrCat("Content-Length: ", body.size(), "\r\n"),
                                 false) + body,
                    options.limits.write_timeout);
        c->close_after = true;
        return;
      }
      default:
        return;  // the rest of it comes through the I/O thread
    }
  }
}

void Http1Server::Impl::TakeReturned() {
  std::deque<Connection*> back;
  {
    std::lock_guard<std::mutex> lock(mu);
    back.swap(returned);
  }
  for (Connection* c : back) {
    if (c->close_after || stopping.load()) {
      if (c->close_after && !stopping.load()) {
        LingerClose(c);
      } else {
        Close(c);
      }
      continue;
    }
    c->phase = Connection::Phase::kReading;
    Register(c, false);
    // TLS may hold decrypted bytes epoll cannot see; a read pass finds them.
    if (c->ssl != nullptr && SSL_pending(c->ssl) > 0) ready_again.push_back(c->fd);
  }
}

void Http1Server::Impl::Accept() {
  for (;;) {
    sockaddr_storage addr = {};
    socklen_t len = sizeof addr;
    const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE) {
        EXL3_LOG(kWarning) << "http: out of file descriptors; " << connections.size() << " connections open";
        CountRefused("fds");
      }
      return;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    auto owned = std::make_unique<Connection>(options.framing);
    Connection* c = owned.get();
    c->fd = fd;
    c->peer = PeerAddress(addr);
    c->accepted = c->idle_since = absl::Now();
    connections.emplace(fd, std::move(owned));
    ++per_ip[c->peer];
    open.store(connections.size());
    if (open_gauge != nullptr) open_gauge->Set(static_cast<double>(connections.size()));
    // Over a limit: a plain connection hears 503 + Retry-After; a TLS one is
    // closed (answering would cost a handshake).
    const bool too_many = connections.size() > options.limits.max_connections;
    const bool too_many_here = per_ip[c->peer] > options.limits.max_connections_per_ip;
    if (too_many || too_many_here) {
      CountRefused(too_many ? "connections" : "per_ip");
      if (ssl_ctx != nullptr || connections.size() > 2 * options.limits.max_connections) {
        Close(c);
      } else {
        Refuse(c,
               503,
               too_many ? absl::StrCat("the server has ", options.limits.max_connections, " connections open; retry shortly")
                        : absl::StrCat("this address has ", options.limits.max_connections_per_ip,
                                       " connections open; retry shortly"));
      }
      continue;
    }
    if (ssl_ctx != nullptr) {
      c->ssl = SSL_new(ssl_ctx.get());
      SSL_set_fd(c->ssl, fd);
      SSL_set_accept_state(c->ssl);
      SSL_set_mode(c->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
      c->phase = Connection::Phase::kHandshake;
      Register(c, false);
      OnHandshake(c);
    } else {
      c->phase = Connection::Phase::kReading;
      Register(c, false);
    }
  }
}

void Http1Server::Impl::OnHandshake(Connection* c) {
  ERR_clear_error();
  const int r = SSL_do_handshake(c->ssl);
  if (r == 1) {
    c->phase = Connection::Phase::kReading;
    c->idle_since = absl::Now();
    Register(c, false);
    OnReadable(c);  // data may have come with the last handshake flight
    return;
  }
  switch (SSL_get_error(c->ssl, r)) {
    case SSL_ERROR_WANT_READ: Register(c, false); return;
    case SSL_ERROR_WANT_WRITE: Register(c, true); return;
    default:
      EXL3_LOG(kDebug) << "http: TLS handshake with " << c->peer << " failed: " << SslErrors();
      Close(c);
  }
}

void Http1Server::Impl::OnReadable(Connection* c) {
  if (c->phase == Connection::Phase::kHandshake) return OnHandshake(c);
  char buf[kReadChunk];
  if (c->phase == Connection::Phase::kLinger) {
    for (;;) {
      size_t n = 0;
      const Io io = c->Read(buf, sizeof buf, &n);
      if (io == Io::kOk) {
        c->lingered += n;
        if (c->lingered > kLingerBytes) return Close(c);
        continue;
      }
      if (io == Io::kWantRead || io == Io::kWantWrite) return;
      return Close(c);
    }
  }
  size_t budget = kReadBudgetPerEvent;
  while (c->parser.state() != HttpRequestParser::State::kComplete) {
    size_t n = 0;
    const Io io = c->Read(buf, sizeof buf, &n);
    if (io == Io::kWantRead || io == Io::kWantWrite) return;
    if (io != Io::kOk) return Close(c);  // EOF or reset: idle or mid-request, nobody to answer
    c->bytes_in += n;
    const bool was_idle = c->parser.state() == HttpRequestParser::State::kIdle;
    const size_t used = c->parser.Feed(std::string_view(buf, n));
    if (was_idle && c->parser.state() != HttpRequestParser::State::kIdle) c->request_started = absl::Now();
    if (c->parser.state() == HttpRequestParser::State::kError) {
      return Refuse(c, c->parser.error().status, c->parser.error().message, c->parser.request().version_minor);
    }
    if (c->parser.TakeContinue()) c->SendNow("HTTP/1.1 100 Continue\r\n\r\n");
    if (c->parser.state() == HttpRequestParser::State::kComplete) {
      c->in.assign(buf + used, n - used);
      break;
    }
    if (n >= budget) {
      if (c->ssl != nullptr && SSL_pending(c->ssl) > 0) ready_again.push_back(c->fd);
      return;
    }
    budget -= n;
  }
  if (stopping.load()) return Close(c);
  Dispatch(c);
}

absl::Time Http1Server::Impl::Sweep(absl::Time now) {
  absl::Time next = absl::InfiniteFuture();
  std::vector<std::pair<Connection*, int>> expired;  // 0 close, 408 answer
  for (auto& [fd, owned] : connections) {
    Connection* c = owned.get();
    absl::Time deadline = absl::InfiniteFuture();
    switch (c->phase) {
      case Connection::Phase::kHandler:
        continue;
      case Connection::Phase::kHandshake:
        deadline = c->accepted + options.limits.head_timeout;
        if (now >= deadline) {
          CountTimeout("handshake");
          expired.push_back({c, 0});
        }
        break;
      case Connection::Phase::kLinger:
        deadline = c->linger_until;
        if (now >= deadline) expired.push_back({c, 0});
        break;
      case Connection::Phase::kReading:
        switch (c->parser.state()) {
          case HttpRequestParser::State::kIdle:
            deadline = c->idle_since + options.limits.idle_timeout;
            if (now >= deadline) {
              CountTimeout("idle");
              expired.push_back({c, 0});
            }
            break;
          case HttpRequestParser::State::kHead:
            deadline = std::min(c->request_started + options.limits.head_timeout, c->request_started + options.limits.request_timeout);
            if (now >= deadline) {
              CountTimeout("head");
              expired.push_back({c, 408});
            }
            break;
          default:
            deadline = c->request_started + options.limits.request_timeout;
            if (now >= deadline) {
              CountTimeout("body");
              expired.push_back({c, 408});
            }
            break;
        }
        break;
    }
    if (now < deadline) next = std::min(next, deadline);
  }
  for (auto [c, status] : expired) {
    if (status == 0) {
      Close(c);
    } else {
      Refuse(c, status,
             c->parser.state() == HttpRequestParser::State::kHead
                 ? absl::StrCat("the request head did not arrive within ", absl::FormatDuration(options.limits.head_timeout))
                 : absl::StrCat("the request did not arrive within ", absl::FormatDuration(options.limits.request_timeout)));
      next = std::min(next, c->linger_until);
    }
  }
  return next;
}

void Http1Server::Impl::IoLoop() {
  std::vector<epoll_event> events(256);
  // The sweep walks every connection, so it runs when the earliest deadline
  // is due, or at most every kSweepInterval after events that may have set
  // new deadlines (accepts, request starts, refusals, returns) — not once
  // per event, which under load would cost O(connections) per wake-up.
  absl::Time next_sweep = absl::InfiniteFuture();
  absl::Time last_sweep = absl::InfinitePast();
  bool deadlines_changed = false;
  for (;;) {
    int timeout_ms = -1;
    const absl::Time wake = deadlines_changed ? std::min(next_sweep, last_sweep + kSweepInterval) : next_sweep;
    if (!ready_again.empty()) {
      timeout_ms = 0;
    } else if (wake != absl::InfiniteFuture()) {
      timeout_ms = static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(wake - absl::Now()) + 1, 0,
                                                        60'000));
    }
    const int n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0 && errno != EINTR) {
      EXL3_LOG(kError) << "http: epoll_wait: " << std::strerror(errno);
      return;
    }
    bool woken = false;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd) {
        uint64_t v;
        [[maybe_unused]] ssize_t r = ::read(wake_fd, &v, sizeof v);
        woken = true;
        continue;
      }
      if (fd == listen_fd) {
        if (!stopping.load()) Accept();
        continue;
      }
      auto it = connections.find(fd);
      if (it == connections.end() || !it->second->in_epoll) continue;
      OnReadable(it->second.get());
    }
    if (!ready_again.empty()) {
      std::vector<int> again;
      again.swap(ready_again);
      for (int fd : again) {
        // Still open and reading (an fd closed meanwhile may be reused: a
        // new connection then just gets a read pass that finds nothing).
        auto it = connections.find(fd);
        if (it != connections.end() && it->second->phase == Connection::Phase::kReading && it->second->in_epoll) {
          OnReadable(it->second.get());
        }
      }
    }
    if (woken) TakeReturned();
    if (trim_pending) {
      trim_pending = false;
      malloc_trim(0);
    }
    if (stopping.load()) {
      // Close what the I/O thread owns; wait for the handlers' connections.
      std::vector<Connection*> mine;
      for (auto& [fd, owned] : connections) {
        if (owned->phase != Connection::Phase::kHandler) mine.push_back(owned.get());
      }
      for (Connection* c : mine) Close(c);
      std::lock_guard<std::mutex> lock(mu);
      if (handlers_running == 0 && returned.empty()) return;
      continue;
    }
    deadlines_changed |= n > 0 || woken;
    const absl::Time now = absl::Now();
    if (now >= next_sweep || (deadlines_changed && now - last_sweep >= kSweepInterval)) {
      next_sweep = Sweep(now);
      last_sweep = now;
      deadlines_changed = false;
    }
  }
}

Http1Server::Http1Server(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Http1Server::~Http1Server() { Stop(); }

int Http1Server::port() const { return impl_->port; }

size_t Http1Server::open_connections() const { return impl_->open.load(); }

absl::StatusOr<std::unique_ptr<Http1Server>> Http1Server::Start(const Http1ServerOptions& options,
                                                               HttpHandler handler,
                                                               HttpRefusalObserver on_refusal) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("http: port must be in [0, 65535], got ", options.port));
  }
  if (options.handler_threads < 1) return absl::InvalidArgumentError("http: threads must be >= 1");
  if (options.limits.listen_backlog < 1) return absl::InvalidArgumentError("http: the listen backlog must be >= 1");
  if (options.limits.max_connections < 1 || options.limits.max_connections_per_ip < 1) {
    return absl::InvalidArgumentError("http: connection limits must be >= 1");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->handler = std::move(handler);
  impl->on_refusal = std::move(on_refusal);

  const bool tls = !options.tls_cert_file.empty() || !options.tls_key_file.empty();
  if (tls) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty()) {
      return absl::InvalidArgumentError("http: TLS needs both a certificate and a key file");
    }
    impl->ssl_ctx.reset(SSL_CTX_new(TLS_server_method()));
    SSL_CTX* ctx = impl->ssl_ctx.get();
    if (ctx == nullptr) return absl::InternalError(absl::StrCat("http: TLS: ", SslErrors()));
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    if (SSL_CTX_use_certificate_chain_file(ctx, options.tls_cert_file.c_str()) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, options.tls_key_file.c_str(), SSL_FILETYPE_PEM) != 1 ||
        SSL_CTX_check_private_key(ctx) != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("http: the TLS certificate or key could not be loaded: ", SslErrors()));
    }
    if (!options.tls_client_ca_file.empty()) {
      if (SSL_CTX_load_verify_locations(ctx, options.tls_client_ca_file.c_str(), nullptr) != 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("http: the TLS client CA could not be loaded: ", SslErrors()));
      }
      STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(options.tls_client_ca_file.c_str());
      if (names != nullptr) SSL_CTX_set_client_CA_list(ctx, names);
      SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    }
  }

  // Bind (host may be a name, an IPv4 or an IPv6 address).
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port_text = absl::StrCat(options.port);
  if (::getaddrinfo(options.host.empty() ? nullptr : options.host.c_str(), port_text.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", options.host, ":", options.port,
                                               " (not an address of this machine)"));
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, options.limits.listen_backlog) != 0) {
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("http: cannot listen on ", options.host, ":", options.port,
                                               " (port in use, or not an address of this machine)"));
  }
  impl->listen_fd = fd;
  sockaddr_storage bound = {};
  socklen_t bl = sizeof bound;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &bl);
  impl->port = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                           : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);

  impl->epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  impl->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl->epoll_fd < 0 || impl->wake_fd < 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("http: epoll/eventfd: ", std::strerror(errno)));
  }
  for (int watched : {impl->listen_fd, impl->wake_fd}) {
    epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = watched;
    ::epoll_ctl(impl->epoll_fd, EPOLL_CTL_ADD, watched, &ev);
  }

  if (options.registry != nullptr) {
    impl->open_gauge = &prometheus::BuildGauge()
                            .Name("exl3serve:http_connections_open")
                            .Help("HTTP connections open (reading, handled, idle keep-alive or closing)")
                            .Register(*options.registry)
                            .Add({{"model_name", options.model_name_label}});
    impl->refused_family = &prometheus::BuildCounter()
                                .Name("exl3serve:http_connections_refused_total")
                                .Help("HTTP connections refused at accept, by limit (connections, per_ip, fds)")
                                .Register(*options.registry);
    impl->timeouts_family = &prometheus::BuildCounter()
                                 .Name("exl3serve:http_connection_timeouts_total")
                                 .Help("HTTP connections closed by a deadline, by phase (handshake, head, body, idle)")
                                 .Register(*options.registry);
  }
  Impl* raw = impl.get();
  impl->io_thread = std::thread([raw] { raw->IoLoop(); });
  return std::unique_ptr<Http1Server>(new Http1Server(std::move(impl)));
}

void Http1Server::Stop() {
  std::lock_guard<std::mutex> stop_lock(impl_->stop_mu);
  if (impl_->stopped) return;
  impl_->stopped = true;
  impl_->stopping = true;
  impl_->Wake();
  if (impl_->io_thread.joinable()) impl_->io_thread.join();
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->workers_exit = true;
    impl_->work_cv.notify_all();
    impl_->workers_done_cv.wait(lock, [this] { return impl_->live_workers == 0; });
  }
  for (auto& [fd, owned] : impl_->connections) {
    if (owned->ssl != nullptr) SSL_free(owned->ssl);
    ::close(fd);
  }
  impl_->connections.clear();
  ::close(impl_->listen_fd);
  ::close(impl_->epoll_fd);
  ::close(impl_->wake_fd);
}

}  // namespace exl3serve::coordinator::http
