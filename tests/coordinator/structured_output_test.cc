// Structured output through the serving engine (coordinator/local_engine.h
// with coordinator/constrained/): a small random Llama model whose
// tokenizer is a byte-level BPE vocabulary of 256 bytes and ~740 multi-byte
// pieces (JSON punctuation runs, words, digits, UTF-8 characters and split
// UTF-8 sequences), so a token often spans several grammar elements.
//
// Shown: every completed output of a JSON-Schema request parses and
// validates (an independent validator below, written from the JSON Schema
// spec for the keywords used); regex outputs match std::regex; choices are
// one of the choices; grammar outputs match the equivalent regex; outputs
// cut by max_tokens are valid prefixes (the matcher accepts them token by
// token); EOS comes only where the output is complete. Batched == alone
// (greedy and seeded), and with n-gram drafts drafted == undrafted.
// Malformed constraints are InvalidArgument naming the field.
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/draft_model.h"
#include "coordinator/local_engine.h"
#include "coordinator/tokenizer/byte_level.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "sharding/test_model.h"
#include "tests/testing/scratch_dir.h"
#include "worker/model/step_executor.h"
#include "worker/model/transformer.h"

namespace exl3serve::coordinator {
namespace {

using json = nlohmann::json;
constexpr absl::Duration kWait = absl::Seconds(300);
constexpr int64_t kVocab = 1000;
constexpr int32_t kEos = 999;
constexpr int32_t kBos = 998;

// ---------------------------------------------------------------- the model

// The vocabulary's multi-byte pieces (ids 256..997), deterministic.
std::vector<std::string> Pieces() {
  std::vector<std::string> pieces = {
      "{\"", "\"}", "\":", "\": ", "\", \"", "\",\"", "\":\"", "},{", "}, {", "[{", "}]", "[]",
      "{}", "\"]", "[\"", "\", ", "\",", "]}", "}}", "},", "],", ", ", ": ", " \"", "null",
      "true", "false", "tr", "ue", "fal", "se", "nu", "ll", "name", "age", "id", "type",
      "items", "email", "city", "tags", "price", "0.", "00", "10", "12", "123", "2024", "-0",
      "-1", "1e", "e+", "E-", ".5", "\\\"", "\\n", "\\u00", "\\\\", "\xC3\xA9", "\xE4\xB8\xAD",
      "\xF0\x9F\x98\x80", "\xC3", "\xA9\"", "\xE4\xB8", "\xAD\"", "a@", "@b", ".com", "http",
      "://", "\n", "\n\n", "  ", "}\n", "\"\n", " {", " [", "a-z", "ab", "abc", "xyz", "foo",
      "bar", "baz", "hello", "world", "yes", "no", "red", "green", "blue", "small", "large",
  };
  std::mt19937 rng(77);
  const std::string alphabet = "abcdefghijklmnopqrstuvwxyz0123456789{}[]\":, -._ABCXYZ";
  std::set<std::string> seen(pieces.begin(), pieces.end());
  while (pieces.size() < 742) {
    std::string p;
    const int n = 2 + static_cast<int>(rng() % 3);
    for (int i = 0; i < n; ++i) p += alphabet[rng() % alphabet.size()];
    if (seen.insert(p).second) pieces.push_back(p);
  }
  return pieces;
}

std::string ByteLevel(const std::string& bytes) { return internal::BytesToByteLevel(bytes); }

json TokenizerJson() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevel(std::string(1, static_cast<char>(b)))] = b;
  const std::vector<std::string> pieces = Pieces();
  for (size_t i = 0; i < pieces.size(); ++i) vocab[ByteLevel(pieces[i])] = 256 + i;
  return {
      {"added_tokens",
       {{{"id", kBos}, {"content", "<|bos|>"}, {"special", true}, {"normalized", false}},
        {{"id", kEos}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
  };
}

struct Model {
  testing::ScratchDir dir;
  std::string path;
  std::unique_ptr<worker::Transformer> transformer;
  std::string tokenizer_json;
};
Model* model = nullptr;

// ---------------------------------------------------------------- an independent validator

bool ValidUtf8CodepointCount(const std::string& s, int64_t* count) {
  int64_t n = 0;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    i += static_cast<size_t>(len);
    ++n;
  }
  *count = n;
  return true;
}

// JSON Schema validation for the keywords the schemas below use; `root` for
// "#/$defs/..." references. Returns an empty string or the first violation.
std::string Violation(const json& v, const json& schema, const json& root, const std::string& at) {
  if (schema.is_boolean()) return schema.get<bool>() ? "" : at + ": schema false";
  if (schema.contains("$ref")) {
    const std::string ref = schema["$ref"];
    if (ref == "#") return Violation(v, root, root, at);
    const std::string prefix = "#/$defs/";
    if (ref.rfind(prefix, 0) != 0) return at + ": unsupported $ref in the test";
    return Violation(v, root["$defs"][ref.substr(prefix.size())], root, at);
  }
  if (schema.contains("anyOf") || schema.contains("oneOf")) {
    const json& alts = schema.contains("anyOf") ? schema["anyOf"] : schema["oneOf"];
    int matched = 0;
    for (const json& s : alts) matched += Violation(v, s, root, at).empty() ? 1 : 0;
    if (matched == 0) return at + ": matches no alternative";
    if (schema.contains("oneOf") && matched != 1) return at + ": matches several oneOf alternatives";
  }
  if (schema.contains("const") && v != schema["const"]) return at + ": not the const";
  if (schema.contains("enum")) {
    bool found = false;
    for (const json& e : schema["enum"]) found = found || e == v;
    if (!found) return at + ": not in the enum";
  }
  if (schema.contains("type")) {
    std::vector<std::string> types;
    if (schema["type"].is_string()) types.push_back(schema["type"]);
    else for (const json& t : schema["type"]) types.push_back(t);
    bool ok = false;
    for (const std::string& t : types) {
      ok = ok || (t == "object" && v.is_object()) || (t == "array" && v.is_array()) ||
           (t == "string" && v.is_string()) || (t == "boolean" && v.is_boolean()) ||
           (t == "null" && v.is_null()) || (t == "number" && v.is_number()) ||
           (t == "integer" && (v.is_number_integer() ||
                               (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()))));
    }
    if (!ok) return at + ": wrong type " + v.type_name();
  }
  if (v.is_object()) {
    const json props = schema.value("properties", json::object());
    for (const json& r : schema.value("required", json::array())) {
      if (!v.contains(r.get<std::string>())) return at + ": missing " + r.get<std::string>();
    }
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (props.contains(it.key())) {
        std::string e = Violation(*it, props[it.key()], root, at + "/" + it.key());
        if (!e.empty()) return e;
      } else if (schema.contains("additionalProperties")) {
        std::string e = Violation(*it, schema["additionalProperties"], root, at + "/" + it.key());
        if (!e.empty()) return e;
      }
    }
  }
  if (v.is_array()) {
    if (schema.contains("minItems") && v.size() < schema["minItems"].get<size_t>()) return at + ": too few items";
    if (schema.contains("maxItems") && v.size() > schema["maxItems"].get<size_t>()) return at + ": too many items";
    if (schema.contains("items")) {
      for (size_t i = 0; i < v.size(); ++i) {
        std::string e = Violation(v[i], schema["items"], root, absl::StrCat(at, "/", i));
        if (!e.empty()) return e;
      }
    }
  }
  if (v.is_string()) {
    const std::string s = v;
    int64_t n = 0;
    if (!ValidUtf8CodepointCount(s, &n)) return at + ": invalid UTF-8";
    if (schema.contains("minLength") && n < schema["minLength"].get<int64_t>()) return at + ": too short";
    if (schema.contains("maxLength") && n > schema["maxLength"].get<int64_t>()) return at + ": too long";
    if (schema.contains("pattern") &&
        !std::regex_search(s, std::regex(schema["pattern"].get<std::string>()))) {
      return at + ": does not match the pattern";
    }
  }
  if (v.is_number()) {
    const double x = v.get<double>();
    if (schema.contains("minimum") && x < schema["minimum"].get<double>()) return at + ": below minimum";
    if (schema.contains("maximum") && x > schema["maximum"].get<double>()) return at + ": above maximum";
    if (schema.contains("exclusiveMinimum") && x <= schema["exclusiveMinimum"].get<double>()) return at + ": not above exclusiveMinimum";
    if (schema.contains("exclusiveMaximum") && x >= schema["exclusiveMaximum"].get<double>()) return at + ": not below exclusiveMaximum";
  }
  return "";
}

// ---------------------------------------------------------------- the engine

class Stream {
 public:
  ResponseCallback Callback() {
    return [this](const v1::GenerateResponse& r) {
      absl::MutexLock lock(&mu_);
      if (r.has_chunk()) {
        text_ += r.chunk().text();
      } else {
        final_ = r;
        done_ = true;
      }
    };
  }
  v1::GenerateResponse Wait() {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), kWait)) {
      ADD_FAILURE() << "no terminal response within " << kWait;
      return {};
    }
    return final_;
  }
  std::string text() {
    absl::MutexLock lock(&mu_);
    return text_;
  }

 private:
  absl::Mutex mu_;
  std::string text_ ABSL_GUARDED_BY(mu_);
  v1::GenerateResponse final_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

struct Outcome {
  std::vector<int32_t> ids;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  std::string error;
};

class StructuredOutputTest : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    model = new Model();
    sharding::TestModelOptions options;
    options.peaked_logits = true;
    options.seed = 5;
    options.bos_token_id = kBos;
    options.eos_token_ids = {kEos};
    model->path = model->dir.File("llama");
    ASSERT_TRUE(sharding::WriteTestModel(model->path, options).ok());
    auto loaded = worker::Transformer::Load(model->path);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    model->transformer = std::move(*loaded);
    model->tokenizer_json = TokenizerJson().dump();
  }
  static void TearDownTestSuite() {
    delete model;
    model = nullptr;
  }

 protected:
  std::unique_ptr<LocalEngine> Engine(SpeculativeMethod speculative = SpeculativeMethod::kNone,
                                      bool with_tokenizer = true) {
    EngineOptions options;
    options.model_dir = model->path;
    options.kv.dtype = worker::KvCacheDtype::kFp32;
    options.kv.num_pages = 512;
    options.kv.page_size_tokens = 16;
    options.max_running = 32;
    options.step_token_budget = 256;
    options.max_queue = 1000;
    options.speculative = speculative;
    options.draft_governor = false;  // drafts at every step
    worker::KvCacheOptions kv = options.kv;
    kv.caller_assigns_pages = true;
    auto cache = model->transformer->CreateKvCache(kv);
    EXPECT_TRUE(cache.ok());
    EngineModel m;
    m.facts = {.arch = model->transformer->config().arch,
               .eos_token_ids = model->transformer->config().eos_token_ids};
    if (with_tokenizer) {
      auto tok = Tokenizer::FromJson(model->tokenizer_json, "", "structured-test");
      EXPECT_TRUE(tok.ok()) << tok.status();
      m.tokenizer = std::move(*tok);
    }
    std::unique_ptr<DraftModel> draft;
    if (speculative == SpeculativeMethod::kDraftModel) {
      // The target as its own draft model (its own cache): greedy drafts
      // are exactly the target's greedy tokens when drawn under the mask.
      worker::KvCacheOptions draft_kv = options.kv;
      auto draft_cache = model->transformer->CreateKvCache(draft_kv);
      EXPECT_TRUE(draft_cache.ok());
      draft = std::make_unique<DraftModel>(
          std::make_unique<worker::LocalStepExecutor>(model->transformer.get(), std::move(*draft_cache)));
    }
    return std::make_unique<LocalEngine>(
        options, std::move(m),
        std::make_unique<worker::LocalStepExecutor>(model->transformer.get(), std::move(*cache)),
        std::move(draft));
  }

  static v1::GenerateRequest Request(const v1::OutputConstraint& c, int prompt_seed, bool sampled,
                                     int max_tokens) {
    v1::GenerateRequest r;
    std::mt19937 rng(static_cast<uint32_t>(prompt_seed));
    const int n = 3 + static_cast<int>(rng() % 9);
    for (int i = 0; i < n; ++i) r.mutable_tokenized()->add_input_ids(rng() % 990);
    r.mutable_sampling_params()->set_max_tokens(max_tokens);
    if (sampled) {
      r.mutable_sampling_params()->set_temperature(1.0f);
      r.mutable_sampling_params()->set_seed(1000 + prompt_seed);
    }
    *r.mutable_constraint() = c;
    return r;
  }

  // Runs `requests` all at once (batched) or one by one (alone).
  static std::vector<Outcome> Run(LocalEngine& engine, const std::vector<v1::GenerateRequest>& requests,
                                  bool batched) {
    std::vector<Outcome> out(requests.size());
    auto collect = [&](size_t i, Stream& s) {
      const v1::GenerateResponse r = s.Wait();
      if (r.has_error()) {
        out[i].error = r.error().message();
        return;
      }
      out[i].ids.assign(r.complete().output_ids().begin(), r.complete().output_ids().end());
      out[i].finish = r.complete().finish_reason();
      out[i].text = s.text();
    };
    if (batched) {
      std::vector<std::unique_ptr<Stream>> streams;
      for (size_t i = 0; i < requests.size(); ++i) {
        streams.push_back(std::make_unique<Stream>());
        absl::Status s = engine.Submit(requests[i], streams.back()->Callback());
        EXPECT_TRUE(s.ok()) << s;
        if (!s.ok()) return out;
      }
      for (size_t i = 0; i < requests.size(); ++i) collect(i, *streams[i]);
    } else {
      for (size_t i = 0; i < requests.size(); ++i) {
        Stream s;
        absl::Status st = engine.Submit(requests[i], s.Callback());
        EXPECT_TRUE(st.ok()) << st;
        if (!st.ok()) return out;
        collect(i, s);
      }
    }
    return out;
  }

  // The output is a prefix the constraint accepts token by token (an
  // independent walk of the masker's matcher: AcceptToken must take them).
  static void ExpectAcceptedPrefix(const v1::OutputConstraint& c, const Outcome& o) {
    auto tok = Tokenizer::FromJson(model->tokenizer_json, "", "structured-test");
    ASSERT_TRUE(tok.ok());
    std::vector<int32_t> eos = {kEos};
    auto vocab = constrained::TokenVocabulary::FromTokenizer(**tok, kVocab, eos);
    ASSERT_TRUE(vocab.ok()) << vocab.status();
    constrained::ConstraintSpec spec;
    if (c.has_json_schema()) {
      spec.kind = constrained::ConstraintKind::kJsonSchema;
      spec.text = c.json_schema();
    } else if (c.has_regex()) {
      spec.kind = constrained::ConstraintKind::kRegex;
      spec.text = c.regex();
    } else if (c.has_grammar()) {
      spec.kind = constrained::ConstraintKind::kGrammar;
      spec.text = c.grammar();
    } else {
      spec.kind = constrained::ConstraintKind::kChoice;
      spec.choices.assign(c.choice().choices().begin(), c.choice().choices().end());
    }
    auto compiled = constrained::CompileConstraint(spec, *vocab);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    constrained::TokenMatcher matcher(*compiled);
    for (int32_t id : o.ids) ASSERT_TRUE(matcher.AcceptToken(id).ok()) << "token " << id;
  }
};

v1::OutputConstraint Schema(const std::string& text) {
  v1::OutputConstraint c;
  c.set_json_schema(text);
  return c;
}

const std::vector<std::string>& Schemas() {
  static const auto* schemas = new std::vector<std::string>{
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer","minimum":0,"maximum":150}},"required":["name","age"],"additionalProperties":false})",
      R"({"type":"object","properties":{"color":{"enum":["red","green","blue"]},"size":{"enum":["small","large",null]},"ok":{"type":"boolean"}},"required":["color","ok"],"additionalProperties":false})",
      R"({"type":"array","items":{"type":"integer","minimum":-5,"maximum":1234},"minItems":1,"maxItems":4})",
      R"({"type":"object","properties":{"id":{"type":"string","pattern":"^[a-z]{2,4}-[0-9]{1,3}$"},"tags":{"type":"array","items":{"type":"string","maxLength":6},"maxItems":3}},"required":["id","tags"],"additionalProperties":false})",
      R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer","minimum":0,"maximum":9},"kids":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":2}},"required":["v"],"additionalProperties":false}},"$ref":"#/$defs/node"})",
      R"({"anyOf":[{"type":"object","properties":{"kind":{"const":"circle"},"r":{"type":"number","exclusiveMinimum":0,"maximum":100}},"required":["kind","r"],"additionalProperties":false},{"type":"object","properties":{"kind":{"const":"square"},"side":{"type":"integer","minimum":1,"maximum":64}},"required":["kind","side"],"additionalProperties":false}]})",
      R"({"type":"object","properties":{"city":{"type":"string","minLength":2,"maxLength":10},"zip":{"type":"string","pattern":"^[0-9]{5}$"},"note":{"type":["string","null"],"maxLength":8}},"required":["city","zip","note"],"additionalProperties":false})",
      R"({"type":"object","properties":{"price":{"type":"number","minimum":0,"maximum":1000},"qty":{"type":"integer","minimum":1,"maximum":99},"sku":{"type":"string","maxLength":8}},"required":["price","qty"],"additionalProperties":false})",
  };
  return *schemas;
}

TEST_F(StructuredOutputTest, JsonSchemaOutputsValidateAndBatchedEqualsAlone) {
  auto engine = Engine();
  std::vector<v1::GenerateRequest> requests;
  std::vector<json> schemas;
  for (size_t s = 0; s < Schemas().size(); ++s) {
    for (int k = 0; k < 4; ++k) {
      requests.push_back(Request(Schema(Schemas()[s]), static_cast<int>(s * 10 + k), k % 2 == 1, 160));
      schemas.push_back(json::parse(Schemas()[s]));
    }
  }
  const std::vector<Outcome> batched = Run(*engine, requests, true);
  const std::vector<Outcome> alone = Run(*engine, requests, false);
  int complete = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i << " schema " << i / 4 << ": "
                                      << batched[i].text);
    ASSERT_TRUE(batched[i].error.empty()) << batched[i].error;
    EXPECT_EQ(batched[i].ids, alone[i].ids) << "batched != alone";
    const v1::FinishReason f = batched[i].finish;
    ASSERT_TRUE(f == v1::FINISH_REASON_CONSTRAINT_COMPLETE || f == v1::FINISH_REASON_EOS ||
                f == v1::FINISH_REASON_LENGTH)
        << f;
    if (f == v1::FINISH_REASON_LENGTH) {
      ExpectAcceptedPrefix(requests[i].constraint(), batched[i]);
      continue;
    }
    ++complete;
    const json doc = json::parse(batched[i].text, nullptr, false);
    ASSERT_FALSE(doc.is_discarded()) << "not JSON";
    EXPECT_EQ(Violation(doc, schemas[i], schemas[i], "#"), "");
  }
  EXPECT_GE(complete, static_cast<int>(requests.size()) * 3 / 4) << "too many outputs cut by max_tokens";
  std::printf("json schema: %d of %zu complete; e.g. %s | %s | %s\n", complete, requests.size(),
              batched[0].text.c_str(), batched[17].text.c_str(), batched[21].text.c_str());
}

TEST_F(StructuredOutputTest, RegexChoiceAndGrammarOutputsMatchAnIndependentMatcher) {
  auto engine = Engine();
  struct Case {
    v1::OutputConstraint c;
    std::string check;  // ECMAScript regex the whole output must match
  };
  std::vector<Case> cases;
  auto regex = [&](const std::string& re) {
    Case c;
    c.c.set_regex(re);
    c.check = re;
    cases.push_back(c);
  };
  regex("[a-c]{3,6}-[0-9]{2}");
  regex("(yes|no|maybe)( indeed)?");
  regex("\\d{3}\\.\\d{1,2}");
  regex("(ab|cd)*e?x");
  regex("[^\"\\\\]{1,8}\\.com");
  regex("\\w+@\\w+\\.(com|org)");
  {
    Case c;
    for (const char* s : {"red", "green", "blue", "\xC3\xA9t\xC3\xA9", "x"}) c.c.mutable_choice()->add_choices(s);
    c.check = "red|green|blue|\xC3\xA9t\xC3\xA9|x";
    cases.push_back(c);
  }
  {
    Case c;
    c.c.set_grammar("root ::= item (\", \" item){0,3}\nitem ::= [a-z]+ \"=\" num\nnum ::= [1-9] [0-9]?\n");
    c.check = "[a-z]+=[1-9][0-9]?(, [a-z]+=[1-9][0-9]?){0,3}";
    cases.push_back(c);
  }
  std::vector<v1::GenerateRequest> requests;
  for (size_t i = 0; i < cases.size(); ++i) {
    for (int k = 0; k < 4; ++k) {
      requests.push_back(Request(cases[i].c, static_cast<int>(500 + i * 10 + k), k % 2 == 1, 48));
    }
  }
  const std::vector<Outcome> batched = Run(*engine, requests, true);
  const std::vector<Outcome> alone = Run(*engine, requests, false);
  int complete = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Case& c = cases[i / 4];
    SCOPED_TRACE(::testing::Message() << "request " << i << " /" << c.check << "/: " << batched[i].text);
    ASSERT_TRUE(batched[i].error.empty()) << batched[i].error;
    EXPECT_EQ(batched[i].ids, alone[i].ids);
    if (batched[i].finish == v1::FINISH_REASON_LENGTH) {
      ExpectAcceptedPrefix(c.c, batched[i]);
      continue;
    }
    ++complete;
    EXPECT_TRUE(std::regex_match(batched[i].text, std::regex(c.check)));
  }
  EXPECT_GE(complete, static_cast<int>(requests.size()) * 3 / 4);
  std::printf("regex/choice/grammar: %d of %zu complete; e.g. %s | %s | %s\n", complete,
              requests.size(), batched[1].text.c_str(), batched[13].text.c_str(),
              batched.back().text.c_str());
}

TEST_F(StructuredOutputTest, DraftedConstrainedOutputIsTheUndraftedOutput) {
  auto plain = Engine();
  auto drafted = Engine(SpeculativeMethod::kNgram);
  std::vector<v1::GenerateRequest> requests;
  for (size_t s = 0; s < Schemas().size(); ++s) {
    for (int k = 0; k < 2; ++k) {
      requests.push_back(Request(Schema(Schemas()[s]), static_cast<int>(900 + s * 10 + k), k == 1, 96));
    }
  }
  v1::OutputConstraint re;
  re.set_regex("(ab|abc|abcd){2,12}");
  for (int k = 0; k < 4; ++k) requests.push_back(Request(re, 990 + k, k % 2 == 1, 40));
  const std::vector<Outcome> a = Run(*plain, requests, true);
  const std::vector<Outcome> b = Run(*drafted, requests, true);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(a[i].error.empty()) << a[i].error;
    ASSERT_TRUE(b[i].error.empty()) << b[i].error;
    EXPECT_EQ(a[i].ids, b[i].ids) << "request " << i;
    EXPECT_EQ(a[i].finish, b[i].finish) << "request " << i;
  }
  const v1::GetServerInfoResponse info = drafted->GetServerInfo();
  EXPECT_GT(info.spec_decode_num_draft_tokens(), 0u) << "no drafts were proposed";
}

// A draft model drafts under the request's constraint: with the target as
// its own draft, every greedy draft is the token the target then draws, so
// most output tokens are accepted drafts (unconstrained drafts are cut at
// the first token the constraint refuses), and the output is the undrafted
// one — ignore_eos included (no EOS drafted, none verified past the end).
TEST_F(StructuredOutputTest, DraftModelDraftsUnderTheConstraint) {
  auto plain = Engine();
  auto drafted = Engine(SpeculativeMethod::kDraftModel);
  std::vector<v1::GenerateRequest> requests;
  for (size_t s = 0; s < Schemas().size(); ++s) {
    requests.push_back(Request(Schema(Schemas()[s]), static_cast<int>(700 + s), false, 64));
  }
  v1::GenerateRequest no_eos = Request(Schema(Schemas()[2]), 790, false, 48);
  no_eos.mutable_sampling_params()->set_ignore_eos(true);
  requests.push_back(no_eos);
  const std::vector<Outcome> a = Run(*plain, requests, true);
  const std::vector<Outcome> b = Run(*drafted, requests, true);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(a[i].error.empty()) << a[i].error;
    ASSERT_TRUE(b[i].error.empty()) << b[i].error;
    EXPECT_EQ(a[i].ids, b[i].ids) << "request " << i;
    EXPECT_EQ(a[i].finish, b[i].finish) << "request " << i;
  }
  const v1::GetServerInfoResponse info = drafted->GetServerInfo();
  ASSERT_GT(info.spec_decode_num_draft_tokens(), 0u) << "no drafts were proposed";
  EXPECT_EQ(info.spec_decode_num_accepted_tokens(), info.spec_decode_num_draft_tokens())
      << info.DebugString();
  int64_t generated = 0;
  for (const Outcome& o : b) generated += static_cast<int64_t>(o.ids.size());
  // Most tokens come from accepted drafts (measured: 151 of 200; drafts
  // drawn without the mask and cut by the engine gave 7 of 200).
  EXPECT_GT(2 * static_cast<int64_t>(info.spec_decode_num_accepted_tokens()), generated)
      << info.DebugString();
}

TEST_F(StructuredOutputTest, MalformedConstraintsAreInvalidArgumentNamingTheField) {
  auto engine = Engine();
  auto refused = [&](const v1::OutputConstraint& c, const std::string& field, const std::string& word) {
    Stream s;
    absl::Status st = engine->Submit(Request(c, 1, false, 8), s.Callback());
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(field), std::string::npos) << st;
    EXPECT_NE(st.message().find(word), std::string::npos) << st;
  };
  refused(Schema(R"({"type":"object","patternProperties":{"a":{}}})"), "constraint.json_schema",
          "patternProperties");
  refused(Schema("{not json"), "constraint.json_schema", "");
  v1::OutputConstraint bad_regex;
  bad_regex.set_regex("(ab");
  refused(bad_regex, "constraint.regex", "");
  v1::OutputConstraint bad_grammar;
  bad_grammar.set_grammar("root ::= undefined_rule\n");
  refused(bad_grammar, "constraint.grammar", "undefined_rule");
  v1::OutputConstraint empty_choice;
  empty_choice.mutable_choice();
  refused(empty_choice, "constraint.choice", "");
  refused(v1::OutputConstraint(), "constraint", "");

  auto no_tokenizer = Engine(SpeculativeMethod::kNone, /*with_tokenizer=*/false);
  Stream s;
  absl::Status st = no_tokenizer->Submit(Request(Schema("{}"), 1, false, 8), s.Callback());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(st.message().find("tokenizer"), std::string::npos) << st;
}

}  // namespace
}  // namespace exl3serve::coordinator
