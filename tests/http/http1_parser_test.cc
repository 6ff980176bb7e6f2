// HTTP/1.1 request framing (coordinator/http/http1_parser.h): every framing
// the parser accepts gives the same request however the bytes are split, and
// every ambiguity a smuggling or abuse attempt relies on is refused with its
// status before the body is read.
#include "coordinator/http/http1_parser.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::coordinator::http {
namespace {

struct Outcome {
  std::vector<HttpRequest> requests;
  int error = 0;  // status of the framing error, 0 = none
  std::string message;
  size_t left = 0;  // bytes not consumed at the end (an incomplete request)
};

// Feeds `wire` split at the given cut points; answers requests as a server
// would (Reset after each).
Outcome Frame(const std::string& wire, const std::vector<size_t>& cuts = {}, HttpFramingLimits limits = {}) {
  HttpRequestParser p(limits);
  Outcome out;
  std::string pending;
  size_t prev = 0;
  std::vector<size_t> ends = cuts;
  ends.push_back(wire.size());
  for (size_t end : ends) {
    pending += wire.substr(prev, end - prev);
    prev = end;
    for (;;) {
      const size_t used = p.Feed(pending);
      pending.erase(0, used);
      if (p.state() == HttpRequestParser::State::kComplete) {
        out.requests.push_back(p.TakeRequest());
        p.Reset();
        continue;
      }
      if (p.state() == HttpRequestParser::State::kError) {
        out.error = p.error().status;
        out.message = p.error().message;
        return out;
      }
      break;
    }
  }
  out.left = pending.size() + (p.in_request() ? 1 : 0);
  return out;
}

TEST(Http1Parser, ContentLengthAndChunkedBodiesAreTheSameAtEverySplit) {
  const std::string cl = "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 11\r\n\r\nhello world";
  const std::string chunked =
      "POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
      "5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n";
  for (const std::string& wire : {cl, chunked}) {
    for (size_t cut = 0; cut <= wire.size(); ++cut) {
      Outcome o = Frame(wire, {cut});
      ASSERT_EQ(o.error, 0) << cut << ": " << o.message;
      ASSERT_EQ(o.requests.size(), 1u) << cut;
      EXPECT_EQ(o.requests[0].body, "hello world") << cut;
      EXPECT_EQ(o.requests[0].path, "/v1/completions");
      EXPECT_TRUE(o.requests[0].keep_alive);
    }
  }
  // Byte by byte.
  std::vector<size_t> every;
  for (size_t i = 1; i < chunked.size(); ++i) every.push_back(i);
  Outcome o = Frame(chunked, every);
  ASSERT_EQ(o.requests.size(), 1u) << o.message;
  EXPECT_EQ(o.requests[0].body, "hello world");
}

TEST(Http1Parser, PipelinedRequestsComeOutInOrderAndNothingIsDropped) {
  std::string wire;
  for (int i = 0; i < 7; ++i) {
    wire += "GET /r" + std::to_string(i) + "?q=" + std::to_string(i) + " HTTP/1.1\r\nHost: a\r\n\r\n";
    wire += "POST /p" + std::to_string(i) + " HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nab" +
            std::to_string(i);
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<size_t> cuts;
    for (size_t i = 1; i < wire.size(); ++i) {
      if (rng() % 9 == 0) cuts.push_back(i);
    }
    Outcome o = Frame(wire, cuts);
    ASSERT_EQ(o.error, 0) << o.message;
    ASSERT_EQ(o.requests.size(), 14u);
    for (int i = 0; i < 7; ++i) {
      EXPECT_EQ(o.requests[2 * i].method, "GET");
      EXPECT_EQ(o.requests[2 * i].path, "/r" + std::to_string(i));
      EXPECT_EQ(o.requests[2 * i].query, "q=" + std::to_string(i));
      EXPECT_EQ(o.requests[2 * i + 1].body, "ab" + std::to_string(i));
    }
    EXPECT_EQ(o.left, 0u);
  }
}

struct Refusal {
  const char* name;
  std::string wire;
  int status;
};

TEST(Http1Parser, AmbiguousOrAbusiveFramingIsRefusedWithItsStatus) {
  const std::string h = "Host: a\r\n";
  const std::vector<Refusal> cases = {
      {"GET with a body", "GET /health HTTP/1.1\r\n" + h + "Content-Length: 5\r\n\r\nhello", 400},
      {"GET chunked", "GET /health HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400},
      {"negative length", "POST / HTTP/1.1\r\n" + h + "Content-Length: -1\r\n\r\n", 400},
      {"two lengths", "POST / HTTP/1.1\r\n" + h + "Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", 400},
      {"two equal lengths", "POST / HTTP/1.1\r\n" + h + "Content-Length: 3\r\nContent-Length: 3\r\n\r\nabc", 400},
      {"length list", "POST / HTTP/1.1\r\n" + h + "Content-Length: 3, 3\r\n\r\nabc", 400},
      {"length with sign", "POST / HTTP/1.1\r\n" + h + "Content-Length: +3\r\n\r\nabc", 400},
      {"length overflow", "POST / HTTP/1.1\r\n" + h + "Content-Length: 99999999999999999999999\r\n\r\n", 400},
      {"length and chunked", "POST / HTTP/1.1\r\n" + h + "Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"gzip then chunked", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: gzip, chunked\r\n\r\n", 501},
      {"chunked not last", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked, gzip\r\n\r\n", 400},
      {"chunked in 1.0", "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400},
      {"body to EOF", "POST / HTTP/1.1\r\n" + h + "\r\nhello", 411},
      {"over the limit, declared", "POST / HTTP/1.1\r\n" + h + "Content-Length: 8388609\r\n\r\n", 413},
      {"over the limit, chunked", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n800001\r\n", 413},
      {"bad chunk size", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\nzz\r\n", 400},
      {"chunk size with space", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n", 400},
      {"chunk data too long", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n3\r\nhello\r\n", 400},
      {"bare LF in chunk line", "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n", 400},
      {"no Host", "GET / HTTP/1.1\r\n\r\n", 400},
      {"two Hosts", "GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400},
      {"space before colon", "GET / HTTP/1.1\r\n" + h + "Content-Length : 0\r\n\r\n", 400},
      {"obs-fold", "GET / HTTP/1.1\r\n" + h + "X-A: b\r\n  c\r\n\r\n", 400},
      {"bare LF", "GET / HTTP/1.1\n" + h + "\r\n", 400},
      {"bare CR", "GET / HTTP/1.1\r\nX: a\rb\r\n" + h + "\r\n", 400},
      {"NUL in a value", "GET / HTTP/1.1\r\n" + h + std::string("X: a\0b\r\n\r\n", 10), 400},
      {"HTTP/2.0", "GET / HTTP/2.0\r\n" + h + "\r\n", 505},
      {"HTTP/1.2", "GET / HTTP/1.2\r\n" + h + "\r\n", 505},
      {"not HTTP", "GET / FTP/1.1\r\n" + h + "\r\n", 400},
      {"two spaces", "GET  / HTTP/1.1\r\n" + h + "\r\n", 400},
      {"relative target", "GET health HTTP/1.1\r\n" + h + "\r\n", 400},
      {"Expect other", "POST / HTTP/1.1\r\n" + h + "Expect: 200-ok\r\nContent-Length: 1\r\n\r\nx", 417},
      {"head too large", "GET / HTTP/1.1\r\n" + h + "X: " + std::string(70000, 'a') + "\r\n\r\n", 431},
      {"head never ends", "GET / HTTP/1.1\r\n" + h + "X: " + std::string(70000, 'a'), 431},
      {"too many headers",
       [] {
         std::string w = "GET / HTTP/1.1\r\nHost: a\r\n";
         for (int i = 0; i < 200; ++i) w += "X-" + std::to_string(i) + ": v\r\n";
         return w + "\r\n";
       }(),
       431},
      {"trailers too large",
       "POST / HTTP/1.1\r\n" + h + "Transfer-Encoding: chunked\r\n\r\n0\r\nX: " + std::string(70000, 'a') + "\r\n\r\n",
       431},
  };
  for (const Refusal& c : cases) {
    for (size_t cut : {size_t{0}, c.wire.size() / 2, size_t{17}}) {
      Outcome o = Frame(c.wire, {std::min(cut, c.wire.size())});
      EXPECT_EQ(o.error, c.status) << c.name << " cut " << cut << ": " << o.message;
      EXPECT_FALSE(o.message.empty()) << c.name;
      EXPECT_TRUE(o.requests.empty()) << c.name << " let a request through";
    }
  }
}

TEST(Http1Parser, TheLimitIsKnownBeforeTheBodyIsRead) {
  // The 413 comes right after the head, with none of the body sent.
  HttpRequestParser p;
  const std::string head = "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1000000000\r\n\r\n";
  EXPECT_EQ(p.Feed(head), head.size());
  ASSERT_EQ(p.state(), HttpRequestParser::State::kError);
  EXPECT_EQ(p.error().status, 413);
  // A chunked body crossing the limit is refused at the size line that crosses it.
  HttpFramingLimits small;
  small.max_body_bytes = 10;
  Outcome o = Frame("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n5\r\n", {}, small);
  EXPECT_EQ(o.error, 413);
  o = Frame("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nabcdef\r\n4\r\nabcd\r\n0\r\n\r\n", {},
          small);
  EXPECT_EQ(o.error, 0) << o.message;
  ASSERT_EQ(o.requests.size(), 1u);
  EXPECT_EQ(o.requests[0].body, "abcdefabcd");
}

// Fuzzer finding: a trailer line without a colon that crosses the head
// limit was a 400 when it arrived whole and a 431 when split; every split
// must give the same verdict.
TEST(Http1Parser, ALineCrossingItsLimitGetsOneVerdictAtEverySplit) {
  HttpFramingLimits small;
  small.max_head_bytes = 64;
  for (size_t len : {size_t{62}, size_t{63}, size_t{64}, size_t{65}, size_t{66}, size_t{100}}) {
    const std::string wire = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" +
                             std::string(len, 'x') + "\r\n\r\n";
    const int whole = Frame(wire, {}, small).error;
    EXPECT_NE(whole, 0) << len;  // no colon, or too long
    for (size_t cut = 1; cut < wire.size(); ++cut) {
      ASSERT_EQ(Frame(wire, {cut}, small).error, whole) << "line of " << len << " cut at " << cut;
    }
  }
}

TEST(Http1Parser, KeepAliveExpectAndTargets) {
  Outcome o = Frame("GET / HTTP/1.0\r\n\r\n");
  ASSERT_EQ(o.requests.size(), 1u);
  EXPECT_FALSE(o.requests[0].keep_alive);
  o = Frame("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  ASSERT_EQ(o.requests.size(), 1u);
  EXPECT_TRUE(o.requests[0].keep_alive);
  o = Frame("GET / HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive, close\r\n\r\n");
  ASSERT_EQ(o.requests.size(), 1u);
  EXPECT_FALSE(o.requests[0].keep_alive);
  o = Frame("GET http://example/v1/models?x HTTP/1.1\r\nHost: a\r\n\r\n");
  ASSERT_EQ(o.requests.size(), 1u) << o.message;
  EXPECT_EQ(o.requests[0].path, "/v1/models");
  EXPECT_EQ(o.requests[0].query, "x");
  o = Frame("\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\nX-Empty:\r\n\r\n");
  ASSERT_EQ(o.requests.size(), 1u) << o.message;
  ASSERT_NE(o.requests[0].Header("x-empty"), nullptr);
  EXPECT_EQ(*o.requests[0].Header("x-empty"), "");

  HttpRequestParser p;
  p.Feed("POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n");
  EXPECT_EQ(p.state(), HttpRequestParser::State::kBody);
  EXPECT_TRUE(p.TakeContinue());
  EXPECT_FALSE(p.TakeContinue());
  p.Feed("ok");
  EXPECT_EQ(p.state(), HttpRequestParser::State::kComplete);
  EXPECT_EQ(p.request().body, "ok");
}

}  // namespace
}  // namespace exl3serve::coordinator::http
