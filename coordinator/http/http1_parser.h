// coordinator/http/http1_parser.h — HTTP/1.1 request framing (RFC 9112),
// incremental and strict: the bytes of a connection in, whole requests (or
// one framing error) out. Pure: no sockets, no clock; fuzzed by
// tests/fuzz/http1_framing_fuzz.cc.
//
// What it refuses (each an HttpFramingError; the connection must then be
// closed, since the position of the next request is no longer known):
//   400  a malformed request line or header line (bare CR or LF, whitespace
//        before a header's colon, obs-fold, control characters), a missing or
//        repeated Host in HTTP/1.1, a Content-Length that is not one run of
//        digits or is given twice, Content-Length together with
//        Transfer-Encoding, a chunked coding in HTTP/1.0, a body on a method
//        without one (GET, HEAD, DELETE, OPTIONS, TRACE, CONNECT), a malformed
//        chunk size or chunk terminator
//   411  POST/PUT/PATCH without Content-Length or chunked coding (a body
//        read to EOF is never accepted: its end cannot be told from a close)
//   413  a body over max_body_bytes, as soon as that is known: at once for a
//        Content-Length, at the chunk size line that crosses it for chunked
//   417  an Expect other than 100-continue
//   431  a head (request line + headers) over max_head_bytes, or more than
//        max_headers header lines (trailers count against the same limits)
//   501  a transfer coding other than chunked alone
//   505  an HTTP version other than 1.0 and 1.1
//
// Pipelining: Feed() stops at the end of a complete request, so bytes of the
// next one stay with the caller, who answers requests one at a time in order.
#ifndef EXL3SERVE_COORDINATOR_HTTP_HTTP1_PARSER_H_
#define EXL3SERVE_COORDINATOR_HTTP_HTTP1_PARSER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace exl3serve::coordinator::http {

struct HttpFramingLimits {
  size_t max_head_bytes = size_t{64} << 10;  // request line + headers, and trailers
  size_t max_headers = 128;
  size_t max_body_bytes = size_t{8} << 20;
};

struct HttpRequest {
  std::string method;  // as sent (case-sensitive, RFC 9110 9.1)
  std::string target;  // origin-form ("/v1/models?x=1"); absolute-form is reduced to it
  std::string path;    // target before '?'
  std::string query;   // after '?', without it
  int version_minor = 1;  // HTTP/1.<minor>: 0 or 1
  // Header lines in order; names lower-cased, values without surrounding
  // whitespace.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;  // de-chunked
  bool keep_alive = true;  // what the client asked for (Connection, version)

  // The first header named `lower_name`, or nullptr.
  const std::string* Header(std::string_view lower_name) const;
};

struct HttpFramingError {
  int status = 400;
  std::string message;
};

class HttpRequestParser {
 public:
  enum class State {
    kIdle,      // nothing of a request yet (keep-alive idle)
    kHead,      // reading the request line and headers
    kBody,      // reading the body (Content-Length or chunked)
    kComplete,  // request() is whole; Reset() before feeding more
    kError,     // error() says why; the connection must close
  };

  explicit HttpRequestParser(HttpFramingLimits limits = {});

  // Consumes bytes of `data` up to the end of the current request (or the
  // error) and returns how many; the rest belongs to the next request.
  size_t Feed(std::string_view data);

  State state() const { return state_; }
  bool in_request() const { return state_ == State::kHead || state_ == State::kBody; }
  // True once, after the head of a request that sent "Expect: 100-continue"
  // and whose body is acceptable and not yet read: the server should send
  // "HTTP/1.1 100 Continue" now. Clears itself.
  bool TakeContinue();

  const HttpRequest& request() const { return request_; }
  HttpRequest TakeRequest() { return std::move(request_); }
  const HttpFramingError& error() const { return error_; }

  // Ready for the next request on the same connection.
  void Reset();

 private:
  size_t FeedHead(std::string_view data);
  size_t FeedBody(std::string_view data);
  void ParseHead();
  void Fail(int status, std::string message);

  enum class BodyPhase { kLength, kChunkSize, kChunkData, kChunkEnd, kTrailers };

  HttpFramingLimits limits_;
  State state_ = State::kIdle;
  HttpRequest request_;
  HttpFramingError error_;
  std::string head_;        // bytes of the head so far
  size_t head_scanned_ = 0; // head_ searched for the blank line up to here
  size_t leading_crlf_ = 0; // empty lines skipped before the request line
  bool continue_pending_ = false;
  BodyPhase phase_ = BodyPhase::kLength;
  uint64_t remaining_ = 0;  // Content-Length left, or the current chunk's bytes left
  std::string line_;        // a chunk size line or trailer line being read
  size_t trailer_bytes_ = 0;
  size_t trailer_lines_ = 0;
};

}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_COORDINATOR_HTTP_HTTP1_PARSER_H_
