// tests/http/raw_http.h — a raw-socket HTTP/1.1 client for the HTTP tests:
// the bytes on the wire are the test's, so framing, status lines, chunked
// encoding and SSE events are checked as a client sees them (no HTTP
// library between the test and the server).
#ifndef EXL3SERVE_TESTS_HTTP_RAW_HTTP_H_
#define EXL3SERVE_TESTS_HTTP_RAW_HTTP_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cctype>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator::http {
namespace {

struct RawResponse {
  int status = 0;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;                            // de-chunked
};

inline int Connect(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

inline std::string RequestText(const std::string& method, const std::string& path, const std::string& body,
                        const std::string& extra_headers = "") {
  return absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
                      extra_headers, "Content-Type: application/json\r\nContent-Length: ", body.size(),
                      "\r\n\r\n", body);
}

inline void SendAll(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    if (n <= 0) return;  // the server may refuse early (413)
    off += static_cast<size_t>(n);
  }
}

inline RawResponse Parse(const std::string& raw) {
  RawResponse r;
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return r;
  std::vector<std::string> lines = absl::StrSplit(raw.substr(0, end), "\r\n");
  std::vector<std::string> status_line = absl::StrSplit(lines[0], ' ');
  if (status_line.size() >= 2) (void)absl::SimpleAtoi(status_line[1], &r.status);
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t colon = lines[i].find(':');
    std::string name = lines[i].substr(0, colon);
    for (char& c : name) c = static_cast<char>(std::tolower(c));
    r.headers[name] = std::string(absl::StripLeadingAsciiWhitespace(lines[i].substr(colon + 1)));
  }
  std::string rest = raw.substr(end + 4);
  if (r.headers["transfer-encoding"] == "chunked") {
    size_t pos = 0;
    while (pos < rest.size()) {
      const size_t eol = rest.find("\r\n", pos);
      if (eol == std::string::npos) break;
      const size_t len = std::stoul(rest.substr(pos, eol - pos), nullptr, 16);
      if (len == 0) break;
      r.body += rest.substr(eol + 2, len);
      pos = eol + 2 + len + 2;
    }
  } else {
    r.body = rest;
  }
  return r;
}

inline RawResponse Call(int port, const std::string& method, const std::string& path, const std::string& body = "",
                 const std::string& extra_headers = "") {
  const int fd = Connect(port);
  SendAll(fd, RequestText(method, path, body, extra_headers));
  std::string raw;
  char buf[65536];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) raw.append(buf, static_cast<size_t>(n));
  close(fd);
  return Parse(raw);
}

// The data payloads of an SSE body; fails the test on any framing error.
inline std::vector<std::string> Events(const std::string& body) {
  std::vector<std::string> events;
  size_t pos = 0;
  while (pos < body.size()) {
    const size_t end = body.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event at " << pos;
    if (end == std::string::npos) break;
    const std::string event = body.substr(pos, end - pos);
    pos = end + 2;
    if (absl::StartsWith(event, ":")) continue;  // comment (keep-alive)
    EXPECT_TRUE(absl::StartsWith(event, "data: ")) << event;
    EXPECT_EQ(event.find('\n'), std::string::npos) << "one line per event: " << event;
    events.push_back(event.substr(6));
  }
  return events;
}

// Reads from `fd` until `needle` has arrived; false when the server closed
// (or failed) first. What was read goes to *seen when given.
inline bool ReadUntil(int fd, const std::string& needle, std::string* seen = nullptr) {
  std::string got;
  char buf[4096];
  while (got.find(needle) == std::string::npos) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return false;
    got.append(buf, static_cast<size_t>(n));
  }
  if (seen != nullptr) seen->append(got);
  return true;
}

// Everything the server sends until it closes or `timeout` passes; sets
// *closed when it closed.
inline std::string ReadUntilClose(int fd, absl::Duration timeout, bool* closed = nullptr) {
  std::string raw;
  const absl::Time deadline = absl::Now() + timeout;
  if (closed != nullptr) *closed = false;
  for (;;) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return raw;
    pollfd p = {fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) return raw;
    char buf[65536];
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) {
      if (closed != nullptr) *closed = true;
      return raw;
    }
    raw.append(buf, static_cast<size_t>(n));
  }
}

// The statuses of consecutive responses on one connection (each framed by
// its Content-Length); -1 for bytes that do not start a response.
inline std::vector<int> ResponseStatuses(const std::string& raw) {
  std::vector<int> statuses;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t head_end = raw.find("\r\n\r\n", pos);
    if (raw.compare(pos, 7, "HTTP/1.") != 0 || head_end == std::string::npos) {
      statuses.push_back(-1);
      break;
    }
    RawResponse r = Parse(raw.substr(pos, head_end + 4 - pos));
    statuses.push_back(r.status);
    size_t length = 0;
    if (!absl::SimpleAtoi(r.headers["content-length"], &length)) break;
    pos = head_end + 4 + length;
  }
  return statuses;
}

}  // namespace
}  // namespace exl3serve::coordinator::http

#endif  // EXL3SERVE_TESTS_HTTP_RAW_HTTP_H_
