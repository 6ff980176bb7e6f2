// libFuzzer target: raw bytes of an HTTP/1.1 connection (several requests,
// split at fuzzer-chosen points) to the request framing of the HTTP API
// (coordinator/http/http1_parser.h), the way the server feeds it: Feed what
// arrived, take a whole request, Reset, feed the rest.
//
// Contract checked: no crash, leak, hang or UB; fragmentation independence
// (the same requests, in order, and the same error, however the bytes are
// split); every accepted request is well-formed (a token method, a target
// starting with / or *, lower-case token header names without CR/LF/NUL in
// values, a body within the limit, Content-Length bodies of exactly their
// length); Feed makes progress (it consumes everything unless a request is
// complete or refused); every refusal has a status from the contract and a
// message.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "coordinator/http/http1_parser.h"

namespace {

using exl3serve::coordinator::http::HttpFramingLimits;
using exl3serve::coordinator::http::HttpRequest;
using exl3serve::coordinator::http::HttpRequestParser;

struct Result {
  std::vector<HttpRequest> requests;
  int error = 0;
};

void Check(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "contract violated: %s\n", what);
    abort();
  }
}

bool IsTokenChar(char c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         std::string("!#$%&'*+-.^_`|~").find(c) != std::string::npos;
}

Result Drive(const std::string& wire, const std::vector<size_t>& cuts, const HttpFramingLimits& limits) {
  HttpRequestParser p(limits);
  Result r;
  std::string pending;
  size_t prev = 0;
  std::vector<size_t> ends = cuts;
  ends.push_back(wire.size());
  for (size_t end : ends) {
    pending.append(wire, prev, end - prev);
    prev = end;
    for (;;) {
      const size_t used = p.Feed(pending);
      Check(used <= pending.size(), "Feed consumed more than it was given");
      const auto st = p.state();
      Check(used == pending.size() || st == HttpRequestParser::State::kComplete ||
                st == HttpRequestParser::State::kError,
            "Feed stopped early without a request or an error");
      pending.erase(0, used);
      if (st == HttpRequestParser::State::kComplete) {
        r.requests.push_back(p.TakeRequest());
        p.Reset();
        if (pending.empty()) break;
        continue;
      }
      if (st == HttpRequestParser::State::kError) {
        r.error = p.error().status;
        Check(!p.error().message.empty(), "a refusal without a message");
        return r;
      }
      break;
    }
  }
  return r;
}

void CheckRequest(const HttpRequest& q, const HttpFramingLimits& limits) {
  Check(!q.method.empty() && std::all_of(q.method.begin(), q.method.end(), IsTokenChar), "method not a token");
  Check(!q.target.empty() && (q.target[0] == '/' || q.target == "*"), "target not origin-form");
  Check(q.version_minor == 0 || q.version_minor == 1, "version");
  Check(q.body.size() <= limits.max_body_bytes, "body over the limit");
  Check(q.headers.size() <= limits.max_headers, "too many headers");
  for (const auto& [name, value] : q.headers) {
    Check(!name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return IsTokenChar(c) && !(c >= 'A' && c <= 'Z'); }),
          "header name not a lower-case token");
    Check(value.find_first_of(std::string("\r\n\0", 3)) == std::string::npos, "CR, LF or NUL in a header value");
  }
  if (const std::string* cl = q.Header("content-length")) {
    Check(std::strtoull(cl->c_str(), nullptr, 10) == q.body.size(), "body length differs from Content-Length");
  }
  const bool bodyless = q.method == "GET" || q.method == "HEAD" || q.method == "DELETE" || q.method == "OPTIONS" ||
                        q.method == "TRACE" || q.method == "CONNECT";
  Check(!bodyless || q.body.empty(), "a body on a method without one");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  HttpFramingLimits limits;
  limits.max_head_bytes = in.ConsumeIntegralInRange<size_t>(16, 4096);
  limits.max_headers = in.ConsumeIntegralInRange<size_t>(1, 64);
  limits.max_body_bytes = in.ConsumeIntegralInRange<size_t>(0, 4096);
  const size_t num_cuts = in.ConsumeIntegralInRange<size_t>(0, 8);
  std::vector<size_t> cuts;
  for (size_t i = 0; i < num_cuts; ++i) cuts.push_back(in.ConsumeIntegral<uint16_t>());
  const std::string wire = in.ConsumeRemainingBytesAsString();
  for (size_t& c : cuts) c = wire.empty() ? 0 : c % (wire.size() + 1);
  std::sort(cuts.begin(), cuts.end());

  const Result whole = Drive(wire, {}, limits);
  const Result split = Drive(wire, cuts, limits);
  Check(whole.error == split.error, "the error depends on how the bytes were split");
  Check(whole.requests.size() == split.requests.size(), "the request count depends on the split");
  for (size_t i = 0; i < whole.requests.size(); ++i) {
    const HttpRequest& a = whole.requests[i];
    const HttpRequest& b = split.requests[i];
    Check(a.method == b.method && a.target == b.target && a.headers == b.headers && a.body == b.body &&
              a.keep_alive == b.keep_alive,
          "a request depends on how the bytes were split");
    CheckRequest(a, limits);
  }
  static const int kStatuses[] = {0, 400, 411, 413, 417, 431, 501, 505};
  Check(std::find(std::begin(kStatuses), std::end(kStatuses), whole.error) != std::end(kStatuses),
        "a refusal status outside the contract");
  return 0;
}
