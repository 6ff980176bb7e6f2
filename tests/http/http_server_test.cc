// The HTTP API end to end over a scripted engine (tests/http/scripted_engine.h):
// bytes on the wire from a raw socket client (SSE framing, chunked encoding,
// status codes and headers), tool calls and reasoning streamed and not,
// every error status, and a client that disconnects aborting its request.
#include "coordinator/http/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "tests/http/raw_http.h"
#include "tests/http/scripted_engine.h"

namespace exl3serve::coordinator::http {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServerOptions options = {}) {
    options.host = "127.0.0.1";
    options.port = 0;
    options.served_model_names = {"scripted", "scripted-alias"};
    options.tool_call_parser = "hermes";
    options.reasoning_parser = "think";
    options.registry = &registry_;
    options.model_name_label = "scripted";
    options.metrics_text = [this] { return prometheus::TextSerializer().Serialize(registry_.Collect()); };
    options.threads = 16;
    auto s = HttpServer::Start(engine_, options);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
  }
  int port() const { return server_->port(); }

  prometheus::Registry registry_;
  testing::ScriptedEngine engine_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpServerTest, ChatNotStreamedHasTheOpenAiShapeAndUsage) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                       R"({"model":"scripted","messages":[{"role":"user","content":"hi"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_THAT(r.headers["content-type"], HasSubstr("application/json"));
  json j = json::parse(r.body);
  EXPECT_TRUE(absl::StartsWith(j["id"].get<std::string>(), "chatcmpl-"));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "scripted");
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "Hello from the script.");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);  // 22 bytes in 3-byte tokens
  EXPECT_EQ(j["usage"]["total_tokens"], j["usage"]["prompt_tokens"].get<int>() + 8);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // The engine got the rendered chat as text without added special tokens.
  ASSERT_EQ(engine_.submitted().size(), 1u);
  EXPECT_EQ(engine_.submitted()[0].text(), "user: hi\nassistant: ");
  EXPECT_FALSE(engine_.submitted()[0].add_special_tokens());
}

TEST_F(HttpServerTest, ChatStreamIsFramedAsOpenAiDoes) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                       R"({"model":"scripted-alias","stream":true,"stream_options":{"include_usage":true},
                           "messages":[{"role":"user","content":"hi"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.headers["content-type"], "text/event-stream");
  EXPECT_EQ(r.headers["transfer-encoding"], "chunked");
  std::vector<std::string> events = Events(r.body);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_TRUE(absl::EndsWith(r.body, "data: [DONE]\n\n"));
  json first = json::parse(events[0]);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["model"], "scripted-alias");
  EXPECT_EQ(first["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  std::string content;
  std::string id = first["id"];
  int finishes = 0;
  for (size_t i = 1; i + 2 < events.size(); ++i) {
    json c = json::parse(events[i]);
    EXPECT_EQ(c["id"], id);
    EXPECT_EQ(c["created"], first["created"]);
    ASSERT_EQ(c["choices"].size(), 1u);
    const json& delta = c["choices"][0]["delta"];
    EXPECT_FALSE(delta.contains("role"));
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (!c["choices"][0]["finish_reason"].is_null()) {
      ++finishes;
      EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
      EXPECT_EQ(i + 3, events.size()) << "the finishing chunk is the last choice chunk";
    }
  }
  EXPECT_EQ(finishes, 1);
  EXPECT_EQ(content, "Hello from the script.");
  json usage = json::parse(events[events.size() - 2]);
  EXPECT_EQ(usage["choices"], json::array());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 8);
}

TEST_F(HttpServerTest, ToolCallsStreamedEqualNotStreamed) {
  StartServer();
  const std::string tools =
      R"("tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}])";
  const std::string messages = R"("messages":[{"role":"user","content":"weather in Paris?"}])";
  RawResponse whole = Call(port(), "POST", "/v1/chat/completions", absl::StrCat("{", tools, ",", messages, "}"));
  ASSERT_EQ(whole.status, 200) << whole.body;
  json j = json::parse(whole.body);
  const json& message = j["choices"][0]["message"];
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_EQ(message["content"], "Let me check.");
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  EXPECT_EQ(message["tool_calls"][0]["type"], "function");
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(message["tool_calls"][0]["function"]["arguments"], R"({"city": "Paris", "unit": "celsius"})");
  EXPECT_TRUE(absl::StartsWith(message["tool_calls"][0]["id"].get<std::string>(), "call_"));

  RawResponse streamed = Call(port(), "POST", "/v1/chat/completions",
                              absl::StrCat("{\"stream\":true,", tools, ",", messages, "}"));
  ASSERT_EQ(streamed.status, 200);
  std::string content, name, arguments, finish;
  int first_deltas = 0;
  for (const std::string& e : Events(streamed.body)) {
    if (e == "[DONE]") break;
    json c = json::parse(e);
    const json& choice = c["choices"][0];
    if (!choice["finish_reason"].is_null()) finish = choice["finish_reason"];
    const json& delta = choice["delta"];
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (!delta.contains("tool_calls")) continue;
    for (const json& call : delta["tool_calls"]) {
      EXPECT_EQ(call["index"], 0);
      if (call.contains("id")) {
        ++first_deltas;
        EXPECT_EQ(call["type"], "function");
        name = call["function"]["name"];
      } else {
        EXPECT_FALSE(call["function"].contains("name"));
      }
      if (call["function"].contains("arguments")) arguments += call["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(first_deltas, 1);
  EXPECT_EQ(content, "Let me check.");
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(arguments, message["tool_calls"][0]["function"]["arguments"]);
  EXPECT_EQ(finish, "tool_calls");
}

TEST_F(HttpServerTest, ToolResultGoesBackThroughTheTemplate) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/chat/completions", R"({
    "tools":[{"type":"function","function":{"name":"get_weather"}}],
    "messages":[{"role":"user","content":"weather in Paris?"},
                {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
                  "function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},
                {"role":"tool","tool_call_id":"call_1","content":"sunny, 21 C"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "It is sunny in Paris.");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls"));
  EXPECT_THAT(engine_.submitted()[0].text(), HasSubstr("tool: sunny, 21 C"));
  EXPECT_THAT(engine_.submitted()[0].text(), HasSubstr("<tool_call>get_weather {\"city\":\"Paris\"}"));
}

TEST_F(HttpServerTest, ToolChoiceRequiredAndNamedForceTheCall) {
  StartServer();
  for (const std::string choice : {R"("required")", R"({"type":"function","function":{"name":"get_weather"}})"}) {
    RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                         absl::StrCat(R"({"tools":[{"type":"function","function":{"name":"get_weather"}}],
                                         "tool_choice":)", choice,
                                      R"(,"messages":[{"role":"user","content":"hello"}]})"));
    ASSERT_EQ(r.status, 200) << r.body;
    json j = json::parse(r.body);
    const json& calls = j["choices"][0]["message"]["tool_calls"];
    ASSERT_EQ(calls.size(), 1u) << r.body;
    EXPECT_EQ(calls[0]["function"]["name"], "get_weather");
    EXPECT_EQ(calls[0]["function"]["arguments"], R"({"city": "Paris"})");
    EXPECT_TRUE(j["choices"][0]["message"]["content"].is_null());
    // vLLM's convention: "tool_calls" for required, "stop" for a named choice.
    EXPECT_EQ(j["choices"][0]["finish_reason"], choice[0] == '"' ? "tool_calls" : "stop");
    // The engine got the call object's schema as the request's constraint.
    const v1::GenerateRequest sent = engine_.submitted().back();
    ASSERT_TRUE(sent.has_constraint());
    const json schema = json::parse(sent.constraint().json_schema());
    EXPECT_EQ(schema["properties"]["name"]["const"], "get_weather") << schema.dump();
    EXPECT_TRUE(schema["properties"].contains("arguments")) << schema.dump();
    EXPECT_TRUE(absl::EndsWith(sent.text(), "<tool_call>\n")) << sent.text();
  }
}

TEST_F(HttpServerTest, StructuredOutputFieldsBecomeTheEngineConstraint) {
  StartServer();
  struct Case {
    std::string fields;
    std::function<void(const v1::OutputConstraint&)> check;
  };
  const std::vector<Case> cases = {
      {R"("response_format":{"type":"json_object"})",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(json::parse(c.json_schema()), json({{"type", "object"}})); }},
      {R"("response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"array"}}})",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(json::parse(c.json_schema()), json({{"type", "array"}})); }},
      {R"("guided_json":{"type":"integer"})",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(json::parse(c.json_schema()), json({{"type", "integer"}})); }},
      {R"("guided_json":"{\"type\":\"null\"}")",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(json::parse(c.json_schema()), json({{"type", "null"}})); }},
      {R"("guided_regex":"a+b")", [](const v1::OutputConstraint& c) { EXPECT_EQ(c.regex(), "a+b"); }},
      {R"("guided_choice":["x","y"])",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(c.choice().choices_size(), 2); }},
      {R"("guided_grammar":"root ::= \"a\"")",
       [](const v1::OutputConstraint& c) { EXPECT_EQ(c.grammar(), "root ::= \"a\""); }},
  };
  for (const Case& c : cases) {
    for (const char* path : {"/v1/chat/completions", "/v1/completions"}) {
      const std::string input = std::string(path) == "/v1/completions" ? R"("prompt":"hi")"
                                                                        : R"("messages":[{"role":"user","content":"hi"}])";
      RawResponse r = Call(port(), "POST", path, absl::StrCat("{", input, ",", c.fields, "}"));
      ASSERT_EQ(r.status, 200) << c.fields << " -> " << r.body;
      const json j = json::parse(r.body);
      EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << r.body;  // CONSTRAINT_COMPLETE
      const v1::GenerateRequest sent = engine_.submitted().back();
      ASSERT_TRUE(sent.has_constraint()) << c.fields;
      c.check(sent.constraint());
    }
  }
}

TEST_F(HttpServerTest, ReasoningIsSplitIntoBothFieldNames) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                       R"({"messages":[{"role":"user","content":"think: 2+2?"}]})");
  ASSERT_EQ(r.status, 200);
  json m = json::parse(r.body)["choices"][0]["message"];
  EXPECT_EQ(m["content"], "Four.");
  EXPECT_EQ(m["reasoning_content"], "Two and two.");
  EXPECT_EQ(m["reasoning"], "Two and two.");
  RawResponse s = Call(port(), "POST", "/v1/chat/completions",
                       R"({"stream":true,"messages":[{"role":"user","content":"think: 2+2?"}]})");
  std::string reasoning, reasoning2, content;
  for (const std::string& e : Events(s.body)) {
    if (e == "[DONE]") break;
    const json d = json::parse(e)["choices"][0]["delta"];
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("reasoning")) reasoning2 += d["reasoning"].get<std::string>();
    if (d.contains("content")) content += d["content"].get<std::string>();
  }
  EXPECT_EQ(reasoning, "Two and two.");
  EXPECT_EQ(reasoning2, "Two and two.");
  EXPECT_EQ(content, "Four.");
}

TEST_F(HttpServerTest, CompletionsFanOutPromptsAndChoicesWithSeeds) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/completions",
                       R"({"prompt":["a","b"],"n":2,"seed":7,"max_tokens":3,"logprobs":2,"echo":false})");
  ASSERT_EQ(r.status, 200) << r.body;
  json j = json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  ASSERT_EQ(j["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], "Hello fro");  // 3 tokens of 3 bytes: "Hel" "lo " "fro"
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
    const json& lp = j["choices"][i]["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 3u);
    ASSERT_EQ(lp["top_logprobs"].size(), 3u);
    EXPECT_EQ(lp["top_logprobs"][0].size(), 2u);
    EXPECT_EQ(lp["text_offset"], json({0, 3, 6}));
    EXPECT_FLOAT_EQ(lp["token_logprobs"][0].get<float>(), -0.25f);
  }
  std::vector<uint64_t> seeds;
  for (const auto& g : engine_.submitted()) seeds.push_back(g.sampling_params().seed());
  std::sort(seeds.begin(), seeds.end());
  EXPECT_EQ(seeds, (std::vector<uint64_t>{7, 7, 8, 8}));
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
}

TEST_F(HttpServerTest, CompletionsEchoAndTokenIdPrompts) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/completions", R"({"prompt":"Say: ","echo":true,"max_tokens":2})");
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], "Say: Hello ");
  RawResponse ids = Call(port(), "POST", "/v1/completions", R"({"prompt":[[1,2,3],[4]],"max_tokens":1})");
  ASSERT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(json::parse(ids.body)["choices"].size(), 2u);
  auto sub = engine_.submitted();
  ASSERT_EQ(sub.size(), 3u);
  EXPECT_EQ(sub[1].tokenized().input_ids_size() + sub[2].tokenized().input_ids_size(), 4);
}

TEST_F(HttpServerTest, ChatLogprobsCarryTokenBytesAndAlternatives) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                       R"({"logprobs":true,"top_logprobs":3,"max_tokens":2,"messages":[{"role":"user","content":"x"}]})");
  ASSERT_EQ(r.status, 200) << r.body;
  json lp = json::parse(r.body)["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(lp.size(), 2u);
  EXPECT_EQ(lp[0]["top_logprobs"].size(), 3u);
  EXPECT_FLOAT_EQ(lp[1]["logprob"].get<float>(), -0.5f);
  EXPECT_TRUE(lp[0]["bytes"].is_array());
}

TEST_F(HttpServerTest, ClientMistakesAre400NamingTheField) {
  StartServer();
  struct Case {
    std::string body;
    std::string param;
  };
  for (const Case& c : std::vector<Case>{
           {"{not json", ""},
           {"[1,2]", ""},
           {R"({"messages":"hi"})", "messages"},
           {R"({"messages":[{"role":"robot","content":"x"}]})", "messages[0].role"},
           {R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]})",
            "messages[0].content[0].type"},
           {R"({"messages":[{"role":"user","content":"x"}],"temperature":"hot"})", "temperature"},
           {R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":21,"logprobs":true})", "top_logprobs"},
           {R"({"messages":[{"role":"user","content":"x"}],"frobnicate":1})", "frobnicate"},
           {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}})",
            "response_format.type"},
           {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"},"guided_regex":"a+"})",
            "guided_regex"},
           {R"({"messages":[{"role":"user","content":"x"}],"guided_choice":[]})", "guided_choice"},
           {R"({"messages":[{"role":"user","content":"x"}],"guided_json":"{nope"})", "guided_json"},
           {R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}})",
            "response_format.json_schema"},
           {R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})", "tool_choice"},
           {R"({"messages":[{"role":"user","content":"x"}],"logit_bias":{"abc":1}})", "logit_bias.abc"},
           {R"({"messages":[{"role":"user","content":"x"}],"n":0})", "n"},
       }) {
    RawResponse r = Call(port(), "POST", "/v1/chat/completions", c.body);
    EXPECT_EQ(r.status, 400) << c.body << " -> " << r.body;
    json e = json::parse(r.body, nullptr, false);
    ASSERT_TRUE(e.contains("error")) << r.body;
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
    EXPECT_FALSE(e["error"]["message"].get<std::string>().empty());
    if (c.param.empty()) {
      EXPECT_TRUE(e["error"]["param"].is_null()) << r.body;
    } else {
      EXPECT_EQ(e["error"]["param"], c.param) << r.body;
    }
  }
  // Context overflow names its code.
  RawResponse r = Call(port(), "POST", "/v1/chat/completions", R"({"messages":[{"role":"user","content":"too long"}]})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(engine_.live(), 0);
}

TEST_F(HttpServerTest, StatusCodesForModelAuthSizeQueueAndReadiness) {
  const std::string token_file = ::testing::TempDir() + "/http_token";
  std::ofstream(token_file) << "s3cret\n";
  HttpServerOptions o;
  o.auth_token_file = token_file;
  o.max_body_bytes = 1 << 20;
  StartServer(o);
  const std::string body = R"({"model":"nope","messages":[{"role":"user","content":"x"}]})";
  EXPECT_EQ(Call(port(), "POST", "/v1/chat/completions", body).status, 401);
  EXPECT_EQ(Call(port(), "POST", "/v1/chat/completions", body, "Authorization: Bearer wrong\r\n").status, 401);
  const std::string auth = "Authorization: Bearer s3cret\r\n";
  RawResponse nf = Call(port(), "POST", "/v1/chat/completions", body, auth);
  EXPECT_EQ(nf.status, 404);
  EXPECT_EQ(json::parse(nf.body)["error"]["code"], "model_not_found");
  EXPECT_EQ(Call(port(), "GET", "/v1/models/nope", "", auth).status, 404);
  RawResponse models = Call(port(), "GET", "/v1/models", "", auth);
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(json::parse(models.body)["data"][0]["id"], "scripted");
  EXPECT_EQ(json::parse(models.body)["data"][0]["max_model_len"], 256);
  // 10 MB body.
  RawResponse big = Call(port(), "POST", "/v1/chat/completions", std::string(10 << 20, ' '), auth);
  EXPECT_EQ(big.status, 413);
  // Queue full: 429 with Retry-After.
  engine_.max_live = 0;
  RawResponse full = Call(port(), "POST", "/v1/chat/completions",
                          R"({"messages":[{"role":"user","content":"x"}]})", auth);
  EXPECT_EQ(full.status, 429);
  EXPECT_EQ(full.headers["retry-after"], "1");
  EXPECT_EQ(json::parse(full.body)["error"]["type"], "rate_limit_error");
  engine_.max_live = 1000;
  // Not ready: 503 + Retry-After, /health too (open without the token).
  EXPECT_EQ(Call(port(), "GET", "/health").status, 200);
  engine_.ready_flag = false;
  RawResponse down = Call(port(), "POST", "/v1/chat/completions",
                          R"({"messages":[{"role":"user","content":"x"}]})", auth);
  EXPECT_EQ(down.status, 503);
  EXPECT_EQ(down.headers["retry-after"], "5");
  RawResponse health = Call(port(), "GET", "/health");
  EXPECT_EQ(health.status, 503);
  EXPECT_EQ(json::parse(health.body)["error"]["type"], "service_unavailable_error");
  engine_.ready_flag = true;
  RawResponse emb = Call(port(), "POST", "/v1/embeddings", R"({"input":"x"})", auth);
  EXPECT_EQ(emb.status, 501);
  EXPECT_EQ(emb.headers["x-should-retry"], "false");
  EXPECT_EQ(Call(port(), "GET", "/v1/nothing-here", "", auth).status, 404);
  // The HTTP series count by endpoint and status.
  RawResponse metrics = Call(port(), "GET", "/metrics");
  EXPECT_THAT(metrics.body, HasSubstr("exl3serve:http_requests_total{endpoint=\"/v1/chat/completions\",model_name=\"scripted\",status=\"401\"} 2"));
  EXPECT_THAT(metrics.body, HasSubstr("status=\"429\"} 1"));
}

TEST_F(HttpServerTest, TokenizeAndDetokenizeNeedATokenizer) {
  StartServer();
  RawResponse r = Call(port(), "POST", "/tokenize", R"({"prompt":"hello"})");
  EXPECT_EQ(r.status, 400);
  EXPECT_THAT(r.body, HasSubstr("tokenizer"));
  EXPECT_EQ(Call(port(), "POST", "/detokenize", R"({"tokens":"x"})").status, 400);
}

// A long prefill: the stream sends SSE comments, which clients ignore, until
// the first token.
TEST_F(HttpServerTest, KeepAliveCommentsWhileNothingIsGenerated) {
  HttpServerOptions o;
  o.keepalive_interval = absl::Milliseconds(20);
  StartServer(o);
  RawResponse r = Call(port(), "POST", "/v1/chat/completions",
                       R"({"stream":true,"messages":[{"role":"user","content":"wait, then hello"}]})");
  ASSERT_EQ(r.status, 200);
  const size_t comment = r.body.find(": keep-alive\n\n");
  ASSERT_NE(comment, std::string::npos) << r.body;
  EXPECT_LT(comment, r.body.find("Hel")) << "the comments come while the prompt is prefilled";
  std::string content;
  for (const std::string& e : Events(r.body)) {  // comments are skipped, the rest parses
    if (e == "[DONE]") break;
    const json d = json::parse(e)["choices"][0]["delta"];
    if (d.contains("content")) content += d["content"].get<std::string>();
  }
  EXPECT_EQ(content, "Hello from the script.");
}

// A client that goes away mid-stream or mid-wait aborts its engine request.
TEST_F(HttpServerTest, DisconnectAbortsStreamedAndNotStreamedRequests) {
  StartServer();
  for (bool stream : {true, false}) {
    const int fd = Connect(port());
    SendAll(fd, RequestText("POST", "/v1/chat/completions",
                            absl::StrCat(R"({"stream":)", stream ? "true" : "false",
                                         R"(,"messages":[{"role":"user","content":"slow"}]})")));
    if (stream) {  // read until the first content arrives: the request is running
      ASSERT_TRUE(ReadUntil(fd, "tick"));
    } else {
      const absl::Time until = absl::Now() + absl::Seconds(10);
      while (engine_.live() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
      ASSERT_EQ(engine_.live(), 1);
    }
    close(fd);
    EXPECT_TRUE(engine_.WaitIdle(absl::Seconds(10))) << "stream=" << stream;
  }
  EXPECT_EQ(engine_.aborted().size(), 2u);
  RawResponse metrics = Call(port(), "GET", "/metrics");
  EXPECT_THAT(metrics.body, HasSubstr("exl3serve:http_client_disconnects_total{endpoint=\"/v1/chat/completions\",model_name=\"scripted\"} 2"));
}

TEST_F(HttpServerTest, ShutdownDrainsThenAbortsAndRefusesNewRequests) {
  StartServer();
  const int fd = Connect(port());
  SendAll(fd, RequestText("POST", "/v1/chat/completions",
                          R"({"stream":true,"messages":[{"role":"user","content":"slow"}]})"));
  std::string seen;
  char buf[4096];
  while (seen.find("tick") == std::string::npos) {
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    ASSERT_GT(n, 0);
    seen.append(buf, static_cast<size_t>(n));
  }
  server_->Shutdown(absl::Milliseconds(100));
  ssize_t n;
  while ((n = recv(fd, buf, sizeof buf, 0)) > 0) seen.append(buf, static_cast<size_t>(n));
  close(fd);
  RawResponse r = Parse(seen);
  std::vector<std::string> events = Events(r.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_THAT(events[events.size() - 2], HasSubstr("\"error\""));
  EXPECT_TRUE(engine_.WaitIdle(absl::Seconds(10)));
}

}  // namespace
}  // namespace exl3serve::coordinator::http
