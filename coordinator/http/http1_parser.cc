#include "coordinator/http/http1_parser.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace exl3serve::coordinator::http {
namespace {

// Debian's Abseil has its own string_view (not std's).
absl::string_view AV(std::string_view s) { return absl::string_view(s.data(), s.size()); }
std::string_view SV(absl::string_view s) { return std::string_view(s.data(), s.size()); }

// RFC 9110 5.6.2 tchar.
bool IsTokenChar(char c) {
  if (absl::ascii_isalnum(static_cast<unsigned char>(c))) return true;
  switch (c) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+':
    case '-': case '.': case '^': case '_': case '`': case '|': case '~':
      return true;
    default:
      return false;
  }
}

bool IsToken(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), IsTokenChar);
}

// field-value characters: HTAB, SP, VCHAR, obs-text.
bool IsFieldValueChar(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u == '\t' || u == ' ' || (u >= 0x21 && u != 0x7f);
}

std::string_view TrimOws(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool MethodHasNoBody(std::string_view m) {
  return m == "GET" || m == "HEAD" || m == "DELETE" || m == "OPTIONS" || m == "TRACE" || m == "CONNECT";
}

// Header lines are checked as one: name token, colon, value; false + why.
bool SplitHeaderLine(std::string_view line, std::string* name, std::string* value, std::string* why) {
  if (line.front() == ' ' || line.front() == '\t') {
    *why = "a header line starts with whitespace (obsolete line folding is not accepted)";
    return false;
  }
  const size_t colon = line.find(':');
  if (colon == std::string_view::npos) {
    *why = "a header line has no colon";
    return false;
  }
  const std::string_view n = line.substr(0, colon);
  if (!IsToken(n)) {
    *why = n.empty() || n.back() == ' ' || n.back() == '\t'
               ? "whitespace or nothing before a header's colon"
               : "a header name holds a character outside RFC 9110's token";
    return false;
  }
  const std::string_view v = line.substr(colon + 1);
  if (!std::all_of(v.begin(), v.end(), IsFieldValueChar)) {
    *why = absl::StrCat("the value of header ", AV(n), " holds a control character");
    return false;
  }
  *name = absl::AsciiStrToLower(AV(n));
  *value = std::string(TrimOws(v));
  return true;
}

}  // namespace

const std::string* HttpRequest::Header(std::string_view lower_name) const {
  for (const auto& [name, value] : headers) {
    if (name == lower_name) return &value;
  }
  return nullptr;
}

HttpRequestParser::HttpRequestParser(HttpFramingLimits limits) : limits_(limits) {}

void HttpRequestParser::Reset() {
  state_ = State::kIdle;
  request_ = HttpRequest();
  error_ = HttpFramingError();
  head_.clear();
  head_scanned_ = 0;
  leading_crlf_ = 0;
  continue_pending_ = false;
  phase_ = BodyPhase::kLength;
  remaining_ = 0;
  line_.clear();
  trailer_bytes_ = 0;
  trailer_lines_ = 0;
}

void HttpRequestParser::Fail(int status, std::string message) {
  state_ = State::kError;
  error_.status = status;
  error_.message = std::move(message);
  continue_pending_ = false;
}

bool HttpRequestParser::TakeContinue() {
  const bool c = continue_pending_;
  continue_pending_ = false;
  return c;
}

size_t HttpRequestParser::Feed(std::string_view data) {
  size_t used = 0;
  while (used < data.size()) {
    switch (state_) {
      case State::kIdle:
      case State::kHead:
        used += FeedHead(data.substr(used));
        break;
      case State::kBody:
        used += FeedBody(data.substr(used));
        break;
      case State::kComplete:
      case State::kError:
        return used;
    }
  }
  return used;
}

size_t HttpRequestParser::FeedHead(std::string_view data) {
  size_t used = 0;
  if (state_ == State::kIdle) {
    // RFC 9112 2.2: empty lines before the request line are ignored (a few).
    while (used < data.size() && (data[used] == '\r' || data[used] == '\n')) {
      if (++leading_crlf_ > 8) {
        Fail(400, "more than 4 empty lines before the request line");
        return used + 1;
      }
      ++used;
    }
    if (used == data.size()) return used;
    state_ = State::kHead;
  }
  // Take bytes up to the blank line that ends the head (or the limit).
  const size_t room = limits_.max_head_bytes + 4 - head_.size();
  const std::string_view chunk = data.substr(used, room);
  const size_t before = head_.size();
  head_.append(chunk);
  const size_t from = head_scanned_ >= 3 ? head_scanned_ - 3 : 0;
  const size_t end = head_.find("\r\n\r\n", from);
  if (end == std::string::npos) {
    head_scanned_ = head_.size();
    // The head may end (blank line included) within max_head_bytes + 4;
    // refused once that is no longer possible, however the bytes came.
    if (head_.size() >= limits_.max_head_bytes + 4) {
      Fail(431, absl::StrCat("the request line and headers exceed ", limits_.max_head_bytes, " bytes"));
    }
    return used + chunk.size();
  }
  // Hand back what follows the blank line.
  const size_t head_end = end + 4;
  used += head_end - before;
  head_.resize(head_end);
  ParseHead();
  return used;
}

void HttpRequestParser::ParseHead() {
  const std::string_view head = std::string_view(head_).substr(0, head_.size() - 4);
  // Every line ends in CRLF: a bare CR or LF anywhere is refused (two
  // parsers that split lines differently are how requests get smuggled).
  for (size_t i = 0; i < head.size(); ++i) {
    if (head[i] == '\n' && (i == 0 || head[i - 1] != '\r')) return Fail(400, "a bare LF in the request head");
    if (head[i] == '\r' && (i + 1 >= head.size() || head[i + 1] != '\n')) {
      return Fail(400, "a bare CR in the request head");
    }
  }
  std::vector<std::string_view> lines;
  for (absl::string_view l : absl::StrSplit(AV(head), "\r\n")) lines.push_back(SV(l));
  // Request line: method SP request-target SP HTTP-version.
  std::vector<std::string_view> parts;
  for (absl::string_view p : absl::StrSplit(AV(lines[0]), ' ')) parts.push_back(SV(p));
  if (parts.size() != 3) return Fail(400, "the request line is not METHOD TARGET HTTP-VERSION");
  if (!IsToken(parts[0]) || parts[0].size() > 32) return Fail(400, "the method is not a token");
  const std::string_view version = parts[2];
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" || !absl::ascii_isdigit(version[5]) ||
      version[6] != '.' || !absl::ascii_isdigit(version[7])) {
    return Fail(400, "the request line does not end in HTTP/x.y");
  }
  if (version[5] != '1' || (version[7] != '0' && version[7] != '1')) {
    return Fail(505, absl::StrCat(AV(version), " is not supported (HTTP/1.1 and HTTP/1.0 are)"));
  }
  request_.method = std::string(parts[0]);
  request_.version_minor = version[7] - '0';
  std::string_view target = parts[1];
  for (char c : target) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return Fail(400, "the request target holds a character that is not visible ASCII");
  }
  if (absl::StartsWithIgnoreCase(AV(target), "http://") || absl::StartsWithIgnoreCase(AV(target), "https://")) {
    // absolute-form (RFC 9112 3.2.2): the path of the URI.
    const size_t authority = target.find("//") + 2;
    const size_t slash = target.find_first_of("/?", authority);
    target = slash == std::string_view::npos ? std::string_view("/") : target.substr(slash);
    if (target.front() == '?') return Fail(400, "an absolute-form target without a path");
  } else if (target == "*") {
    if (request_.method != "OPTIONS") return Fail(400, "the target * is for OPTIONS only");
  } else if (target.empty() || target.front() != '/') {
    return Fail(400, "the request target must be a path starting with /");
  }
  request_.target = std::string(target);
  const size_t q = target.find('?');
  request_.path = std::string(target.substr(0, q));
  request_.query = q == std::string_view::npos ? "" : std::string(target.substr(q + 1));

  if (lines.size() - 1 > limits_.max_headers) {
    return Fail(431, absl::StrCat("more than ", limits_.max_headers, " header lines"));
  }
  request_.headers.reserve(lines.size() - 1);
  for (size_t i = 1; i < lines.size(); ++i) {
    std::string name, value, why;
    if (lines[i].empty() || !SplitHeaderLine(lines[i], &name, &value, &why)) {
      return Fail(400, lines[i].empty() ? "an empty header line" : why);
    }
    request_.headers.emplace_back(std::move(name), std::move(value));
  }

  // Framing (RFC 9112 6.1-6.3), refusing every ambiguity.
  int hosts = 0, lengths = 0, codings = 0;
  std::string length_text, coding_text, connection, expect;
  for (const auto& [name, value] : request_.headers) {
    if (name == "host") {
      ++hosts;
    } else if (name == "content-length") {
      ++lengths;
      length_text = value;
    } else if (name == "transfer-encoding") {
      ++codings;
      absl::StrAppend(&coding_text, coding_text.empty() ? "" : ",", value);
    } else if (name == "connection") {
      absl::StrAppend(&connection, connection.empty() ? "" : ",", value);
    } else if (name == "expect") {
      expect = value;
    }
  }
  if (request_.version_minor == 1 && hosts != 1) {
    return Fail(400, hosts == 0 ? "an HTTP/1.1 request without Host" : "more than one Host header");
  }
  bool close = request_.version_minor == 0, keep_alive = false;
  bool close_token = false;
  for (absl::string_view t : absl::StrSplit(connection, ',')) {
    const std::string_view token = TrimOws(SV(t));
    if (absl::EqualsIgnoreCase(AV(token), "close")) close_token = true;
    if (absl::EqualsIgnoreCase(AV(token), "keep-alive")) keep_alive = true;
  }
  close = close || close_token;
  request_.keep_alive = request_.version_minor == 1 ? !close_token : (keep_alive && !close_token);

  const bool no_body_method = MethodHasNoBody(request_.method);
  if (codings > 0) {
    if (lengths > 0) return Fail(400, "both Content-Length and Transfer-Encoding (ambiguous framing)");
    if (request_.version_minor == 0) return Fail(400, "Transfer-Encoding in an HTTP/1.0 request");
    if (no_body_method) return Fail(400, absl::StrCat("a ", request_.method, " request has no body"));
    std::vector<std::string_view> list;
    for (absl::string_view t : absl::StrSplit(coding_text, ',')) {
      const std::string_view c = TrimOws(SV(t));
      if (!c.empty()) list.push_back(c);
    }
    if (list.empty() || !absl::EqualsIgnoreCase(AV(list.back()), "chunked")) {
      return Fail(400, "a request's Transfer-Encoding must end in chunked");
    }
    if (list.size() > 1) return Fail(501, absl::StrCat("transfer coding \"", coding_text, "\" is not supported (chunked only)"));
    phase_ = BodyPhase::kChunkSize;
  } else if (lengths > 0) {
    if (lengths > 1) return Fail(400, "more than one Content-Length header");
    if (length_text.empty() || length_text.size() > 19 ||
        !std::all_of(length_text.begin(), length_text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return Fail(400, absl::StrCat("Content-Length \"", length_text.substr(0, 32), "\" is not a number of bytes"));
    }
    remaining_ = std::stoull(length_text);
    if (remaining_ > 0 && no_body_method) return Fail(400, absl::StrCat("a ", request_.method, " request has no body"));
    if (remaining_ > limits_.max_body_bytes) {
      return Fail(413, absl::StrCat("the request body (", remaining_, " bytes) is larger than ",
                                    limits_.max_body_bytes, " bytes"));
    }
    phase_ = BodyPhase::kLength;
  } else if (request_.method == "POST" || request_.method == "PUT" || request_.method == "PATCH") {
    return Fail(411, absl::StrCat("a ", request_.method,
                                  " request needs Content-Length or Transfer-Encoding: chunked"));
  } else {
    remaining_ = 0;
    phase_ = BodyPhase::kLength;
  }
  const bool body_expected = phase_ != BodyPhase::kLength || remaining_ > 0;
  if (!expect.empty()) {
    if (!absl::EqualsIgnoreCase(expect, "100-continue")) {
      return Fail(417, absl::StrCat("Expect: ", expect.substr(0, 64), " is not supported (100-continue is)"));
    }
    continue_pending_ = body_expected && request_.version_minor == 1;
  }
  if (!body_expected) {
    state_ = State::kComplete;
    return;
  }
  request_.body.reserve(phase_ == BodyPhase::kLength ? remaining_ : 0);
  state_ = State::kBody;
}

size_t HttpRequestParser::FeedBody(std::string_view data) {
  continue_pending_ = false;  // the body is coming anyway
  size_t used = 0;
  while (used < data.size() && state_ == State::kBody) {
    switch (phase_) {
      case BodyPhase::kLength: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(remaining_, data.size() - used));
        request_.body.append(data.substr(used, n));
        used += n;
        remaining_ -= n;
        if (remaining_ == 0) state_ = State::kComplete;
        break;
      }
      case BodyPhase::kChunkSize:
      case BodyPhase::kTrailers: {
        // One line up to CRLF.
        const size_t eol = data.find('\n', used);
        const size_t take = (eol == std::string_view::npos ? data.size() : eol + 1) - used;
        line_.append(data.substr(used, take));
        used += take;
        // A line may hold `room` bytes before its CRLF. The same test on a
        // partial line (> room) and a whole one (> room + 1 with its CRLF:
        // its longest partial is one shorter) gives the same verdict however
        // the bytes are split.
        const size_t room = phase_ == BodyPhase::kChunkSize
                                ? 1024
                                : limits_.max_head_bytes - std::min(trailer_bytes_, limits_.max_head_bytes);
        if (line_.size() > (eol == std::string_view::npos ? room : room + 1)) {
          if (phase_ == BodyPhase::kChunkSize) {
            Fail(400, "a chunk size line longer than 1024 bytes");
          } else {
            Fail(431, "trailers exceed the header limit");
          }
          return used;
        }
        if (eol == std::string_view::npos) break;
        if (line_.size() < 2 || line_[line_.size() - 2] != '\r') {
          Fail(400, "a bare LF in the chunked body");
          return used;
        }
        line_.resize(line_.size() - 2);
        if (line_.find('\r') != std::string::npos) {
          Fail(400, "a bare CR in the chunked body");
          return used;
        }
        if (phase_ == BodyPhase::kTrailers) {
          trailer_bytes_ += line_.size() + 2;
          if (line_.empty()) {
            state_ = State::kComplete;
          } else {
            std::string name, value, why;
            if (!SplitHeaderLine(line_, &name, &value, &why)) {
              Fail(400, absl::StrCat("trailer: ", why));
              return used;
            }
            if (++trailer_lines_ > limits_.max_headers || trailer_bytes_ > limits_.max_head_bytes) {
              Fail(431, "trailers exceed the header limits");
              return used;
            }
          }
          line_.clear();
          break;
        }
        // chunk-size [ chunk-ext ]: hex digits, then nothing or ';'.
        size_t digits = 0;
        uint64_t size = 0;
        while (digits < line_.size() && absl::ascii_isxdigit(static_cast<unsigned char>(line_[digits]))) {
          if (digits == 15) {
            Fail(400, "a chunk size of more than 15 hex digits");
            return used;
          }
          const char c = absl::ascii_tolower(static_cast<unsigned char>(line_[digits]));
          size = size * 16 + static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
          ++digits;
        }
        if (digits == 0 || (digits < line_.size() && line_[digits] != ';')) {
          Fail(400, "a malformed chunk size line");
          return used;
        }
        line_.clear();
        if (size > limits_.max_body_bytes - request_.body.size()) {
          Fail(413, absl::StrCat("the chunked request body is larger than ", limits_.max_body_bytes, " bytes"));
          return used;
        }
        if (size == 0) {
          phase_ = BodyPhase::kTrailers;
        } else {
          remaining_ = size;
          phase_ = BodyPhase::kChunkData;
        }
        break;
      }
      case BodyPhase::kChunkData: {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(remaining_, data.size() - used));
        request_.body.append(data.substr(used, n));
        used += n;
        remaining_ -= n;
        if (remaining_ == 0) {
          phase_ = BodyPhase::kChunkEnd;
          line_.clear();
        }
        break;
      }
      case BodyPhase::kChunkEnd: {
        // Exactly CRLF after the chunk's data.
        const char want = line_.empty() ? '\r' : '\n';
        if (data[used] != want) {
          Fail(400, "chunk data not followed by CRLF (the chunk size and its data disagree)");
          return used;
        }
        ++used;
        if (want == '\r') {
          line_ = "\r";
        } else {
          line_.clear();
          phase_ = BodyPhase::kChunkSize;
        }
        break;
      }
    }
  }
  return used;
}

}  // namespace exl3serve::coordinator::http
