// Property test of JSON Schema constraints on random schemas, against the
// test's own validator (nlohmann::json parse + a check of the schema subset
// the generator uses) and instance generator:
//  - every valid instance (random values, the layout the masker promises:
//    schema order, optional single space after ':' and ','), cut into random
//    tokens, is allowed token by token, and EOS at its end;
//  - random walks over allowed tokens, finished by a fixed preference for
//    closing bytes, always reach EOS (no dead state) and every place EOS is
//    allowed the output parses and validates;
//  - at every step the cached mask equals the naive full trie walk.
#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/mask_cache.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::ordered_json;
using test_util::Bit;
using test_util::CodePoints;
using test_util::NaiveMask;  // the cached mask's oracle
using test_util::Rng;

json GenSchema(Rng& r, int depth) {
  switch (r.Rand(depth > 0 ? 10 : 7)) {
    case 0:
      if (r.Rand(2)) return {{"type", "string"}};
      return {{"type", "string"}, {"minLength", r.Rand(2)}, {"maxLength", 2 + r.Rand(2)}};
    case 1: {
      json s = {{"type", "integer"}};
      const int lo = r.Rand(30) - 15, hi = lo + r.Rand(20) + 2;
      if (r.Rand(2)) s[r.Rand(2) ? "minimum" : "exclusiveMinimum"] = lo;
      if (r.Rand(2)) s[r.Rand(2) ? "maximum" : "exclusiveMaximum"] = hi;
      return s;
    }
    case 2: {
      json s = {{"type", "number"}};
      // Integer or fractional (quarter, tenth), negative, exclusive bounds.
      const double scale = r.Rand(3) == 0 ? 1 : r.Rand(2) ? 4 : 10;
      const double lo = (r.Rand(30 * static_cast<int>(scale)) - 15 * scale) / scale;
      const double hi = lo + 1.25 + r.Rand(20) / scale;
      if (r.Rand(2)) s[r.Rand(2) ? "minimum" : "exclusiveMinimum"] = lo;
      if (r.Rand(2)) s[r.Rand(2) ? "maximum" : "exclusiveMaximum"] = hi;
      return s;
    }
    case 3: return {{"type", r.Rand(2) ? "boolean" : "null"}};
    case 4: return {{"enum", json::array({"cd", 7, nullptr, "a\"b"})}};
    case 5:
      if (r.Rand(2)) return {{"type", "string"}, {"pattern", "^[a-c]{1,3}$"}};
      return {{"type", "string"}, {"format", "date"}};
    case 6: return {{"type", json::array({"integer", "null"})}};
    case 7: {
      json props = json::object();
      json required = json::array();
      const char* names[] = {"a", "b", "cd", "\xC3\xA9"};
      for (int i = 0, n = 1 + r.Rand(3); i < n; ++i) {
        const std::string name = names[(i + r.Rand(2)) % 4];
        if (props.contains(name)) continue;
        props[name] = GenSchema(r, depth - 1);
        if (r.Rand(2)) required.push_back(name);
      }
      json s = {{"type", "object"}, {"properties", props}, {"required", required}};
      if (r.Rand(3) == 0) s["additionalProperties"] = false;
      return s;
    }
    case 8: {
      json s = {{"type", "array"}, {"items", GenSchema(r, depth - 1)}};
      const int min = r.Rand(2);
      s["minItems"] = min;
      if (r.Rand(2)) s["maxItems"] = min + r.Rand(3);
      return s;
    }
    default:
      return {{"anyOf", json::array({GenSchema(r, depth - 1), GenSchema(r, depth - 1)})}};
  }
}

bool IsDate(const std::string& s) {
  if (s.size() != 10 || s[4] != '-' || s[7] != '-') return false;
  const int m = std::stoi(s.substr(5, 2)), d = std::stoi(s.substr(8, 2));
  static const int kDays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  return m >= 1 && m <= 12 && d >= 1 && d <= kDays[m - 1];
}

bool Valid(const json& v, const json& s) {
  if (s.contains("anyOf")) {
    for (const json& alt : s["anyOf"]) {
      if (Valid(v, alt)) return true;
    }
    return false;
  }
  if (s.contains("enum")) {
    for (const json& e : s["enum"]) {
      if (e == v) return true;
    }
    return false;
  }
  std::vector<std::string> types;
  if (s["type"].is_array()) {
    for (const json& t : s["type"]) types.push_back(t);
  } else {
    types.push_back(s["type"]);
  }
  for (const std::string& t : types) {
    if (t == "null" && v.is_null()) return true;
    if (t == "boolean" && v.is_boolean()) return true;
    // An integer: integral value (past 64 bits nlohmann parses a double).
    if ((t == "integer" && v.is_number() && std::floor(v.get<double>()) == v.get<double>()) ||
        (t == "number" && v.is_number())) {
      const double x = v.get<double>();
      if (s.contains("minimum") && x < s["minimum"].get<double>()) continue;
      if (s.contains("maximum") && x > s["maximum"].get<double>()) continue;
      if (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) continue;
      if (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()) continue;
      return true;
    }
    if (t == "string" && v.is_string()) {
      const std::string str = v;
      if (s.contains("minLength") && CodePoints(str) < s["minLength"].get<size_t>()) continue;
      if (s.contains("maxLength") && CodePoints(str) > s["maxLength"].get<size_t>()) continue;
      if (s.contains("pattern") &&
          (str.empty() || str.size() > 3 || str.find_first_not_of("abc") != std::string::npos)) {
        continue;
      }
      if (s.contains("format") && !IsDate(str)) continue;
      return true;
    }
    if (t == "array" && v.is_array()) {
      if (v.size() < s["minItems"].get<size_t>()) continue;
      if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) continue;
      bool ok = true;
      for (const json& x : v) ok = ok && Valid(x, s["items"]);
      if (ok) return true;
    }
    if (t == "object" && v.is_object()) {
      bool ok = true;
      for (const json& req : s["required"]) ok = ok && v.contains(req.get<std::string>());
      for (const auto& [k, x] : v.items()) {
        if (s["properties"].contains(k)) {
          ok = ok && Valid(x, s["properties"][k]);
        } else {
          ok = ok && !s.contains("additionalProperties");  // only 'false' is generated
        }
      }
      if (ok) return true;
    }
  }
  return false;
}

// A random valid instance, serialized in the masker's layout.
std::string GenInstance(Rng& r, const json& s) {
  auto sep = [&](char c) { return std::string(1, c) + (r.Rand(2) ? " " : ""); };
  if (s.contains("anyOf")) return GenInstance(r, s["anyOf"][r.Rand(2)]);
  if (s.contains("enum")) return s["enum"][r.Rand(4)].dump();
  const std::string t = s["type"].is_array() ? s["type"][r.Rand(2)].get<std::string>() : s["type"].get<std::string>();
  if (t == "null") return "null";
  if (t == "boolean") return r.Rand(2) ? "true" : "false";
  if (t == "integer" || t == "number") {
    for (int tries = 0;; ++tries) {
      const int k = r.Rand(60) - 30;
      std::string text = std::to_string(k);
      if (t == "number" && r.Rand(2)) text += r.Rand(2) ? ".5" : ".25";
      if (tries > 1000) text = "0";
      if (Valid(json::parse(text), s)) return text;
    }
  }
  if (t == "string") {
    std::string str;
    if (s.contains("pattern")) {
      for (int i = 0, n = 1 + r.Rand(3); i < n; ++i) str += static_cast<char>('a' + r.Rand(3));
    } else if (s.contains("format")) {
      str = "20" + std::to_string(10 + r.Rand(90)) + "-0" + std::to_string(1 + r.Rand(9)) + "-1" + std::to_string(r.Rand(10));
    } else {
      static const char* kPieces[] = {"a", "\xC3\xA9", "\"", "\\", "\n", " ", "x", "\xE2\x82\xAC"};
      const int max = s.contains("maxLength") ? s["maxLength"].get<int>() : 5;
      const int min = s.contains("minLength") ? s["minLength"].get<int>() : 0;
      for (int i = 0, n = min + r.Rand(max - min + 1); i < n; ++i) str += kPieces[r.Rand(8)];
    }
    return json(str).dump();
  }
  if (t == "array") {
    const int min = s["minItems"], max = s.contains("maxItems") ? s["maxItems"].get<int>() : min + 2;
    std::string out = "[";
    for (int i = 0, n = min + r.Rand(max - min + 1); i < n; ++i) out += (i ? sep(',') : "") + GenInstance(r, s["items"]);
    return out + "]";
  }
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : s["properties"].items()) {
    bool required = false;
    for (const json& q : s["required"]) required = required || q == k;
    if (!required && r.Rand(2)) continue;
    out += (first ? "" : sep(',')) + json(k).dump() + sep(':') + GenInstance(r, v);
    first = false;
  }
  return out + "}";
}

std::shared_ptr<const TokenVocabulary> Vocab() {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};  // 0: EOS
  for (int c = 0x20; c < 0x7F; ++c) bytes.push_back(std::string(1, static_cast<char>(c)));
  bytes.push_back("\n");
  for (const char* t : {"\xC3", "\xA9", "\xE2", "\x82", "\xAC", "\xC3\xA9", "\xE2\x82\xAC", "{\"", "\":", "\": ",
                        ", \"", "\",", "\"}", "true", "false", "null", "\"a", "cd\"", "12", "-1", ".5", "]}", "},",
                        "[{", "\\n", "\\u00e9", "\\\"", "}\n", "\"\xC3\xA9\"", "[]", "{}", "1,", "0]", "20", "-0",
                        "a\"", "\xA9\"", "nul", "e\xC3"}) {
    bytes.push_back(t);
  }
  const int32_t eos[] = {0};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

class JsonSchemaPropertyTest : public ::testing::Test {
 protected:
  void Check(uint32_t seed) {
    Rng r{std::mt19937(seed)};
    const json schema = GenSchema(r, 3);
    SCOPED_TRACE("seed " + std::to_string(seed) + " schema " + schema.dump());
    auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema.dump()}, vocab_);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    const auto& gc = static_cast<const GrammarConstraint&>(**compiled);
    // Valid instances, token by token.
    for (int n = 0; n < 3; ++n) {
      const std::string text = GenInstance(r, schema);
      ASSERT_TRUE(Valid(json::parse(text), schema)) << "generator: " << text;
      TokenMatcher m(*compiled);
      std::vector<uint32_t> mask(m.mask_words());
      for (size_t at = 0; at < text.size();) {
        std::vector<int32_t> fits;
        for (int32_t id = 1; id < vocab_->size(); ++id) {
          auto b = vocab_->token_bytes(id);
          if (b && text.compare(at, b->size(), *b) == 0) fits.push_back(id);
        }
        ASSERT_FALSE(fits.empty());
        const int32_t id = fits[r.Rand(static_cast<int>(fits.size()))];
        m.FillNextTokenMask(mask);
        ASSERT_TRUE(Bit(mask, id)) << "'" << *vocab_->token_bytes(id) << "' after '" << text.substr(0, at) << "' of " << text;
        ASSERT_TRUE(m.AcceptToken(id).ok());
        at += vocab_->token_bytes(id)->size();
      }
      m.FillNextTokenMask(mask);
      ASSERT_TRUE(Bit(mask, 0)) << "EOS after the valid " << text;
    }
    // Random walks.
    for (int n = 0; n < 3; ++n) {
      TokenMatcher m(*compiled);
      std::string out;
      std::vector<uint32_t> mask(m.mask_words());
      const int random_steps = r.Rand(25);
      bool ended = false;
      for (int step = 0; step < 400 && !ended; ++step) {
        m.FillNextTokenMask(mask);
        ASSERT_EQ(mask, NaiveMask(gc, out, m.IsComplete())) << "cached mask vs naive walk after '" << out << "'";
        if (Bit(mask, 0)) {
          const json doc = json::parse(out, nullptr, false);
          ASSERT_FALSE(doc.is_discarded()) << "EOS allowed but not JSON: " << out;
          ASSERT_TRUE(Valid(doc, schema)) << "EOS allowed but invalid: " << out;
        }
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab_->size(); ++id) {
          if (Bit(mask, id)) allowed.push_back(id);
        }
        ASSERT_FALSE(allowed.empty()) << "dead state after '" << out << "'";
        int32_t pick = -1;
        if (step < random_steps) {
          pick = allowed[r.Rand(static_cast<int>(allowed.size()))];
        } else {
          for (char c : std::string("\x01\"}],1234567890nultrefas:{[")) {
            const int32_t id = c == '\x01' ? 0 : static_cast<int32_t>(c) - 0x20 + 1;
            if (Bit(mask, id)) {
              pick = id;
              break;
            }
          }
          if (pick < 0) pick = allowed[0];
        }
        ASSERT_TRUE(m.AcceptToken(pick).ok());
        if (pick == 0) {
          ended = true;
        } else {
          out += *vocab_->token_bytes(pick);
        }
      }
      ASSERT_TRUE(ended) << "walk did not finish: " << out;
      ASSERT_TRUE(m.IsTerminated());
    }
  }

  std::shared_ptr<const TokenVocabulary> vocab_ = Vocab();
};

TEST_F(JsonSchemaPropertyTest, RandomSchemas) {
  for (uint32_t seed = 1; seed <= 500; ++seed) {
    Check(seed);
    if (HasFatalFailure()) return;
  }
}

TEST_F(JsonSchemaPropertyTest, AnyJsonValueAcceptsWhatParsesInTheLayout) {
  auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = "{}"}, vocab_);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  for (const char* text : {R"({"a": [1, -2.5e+3, true, null, {}], "\u00e9\n": "x"})", "[]", "\"\"", "-0", "0.5E1",
                           R"([[[]], {"": {"": []}}])"}) {
    TokenMatcher m(*compiled);
    for (char c : std::string(text)) {
      ASSERT_TRUE(m.AcceptToken(static_cast<uint8_t>(c) - 0x20 + 1).ok()) << text << " at '" << c << "'";
    }
    EXPECT_TRUE(m.IsComplete()) << text;
  }
  for (const char* text : {"{ }", "[1,2 ]", "01", "1.", "\"\x01\"", "{\"a\":1,}", "tru e", "\"\\x\"", "  1"}) {
    TokenMatcher m(*compiled);
    bool refused = false;
    for (char c : std::string(text)) {
      const int32_t id = c == '\x01' ? -1 : static_cast<uint8_t>(c) - 0x20 + 1;
      if (id < 0 || !m.AcceptToken(id).ok()) {
        refused = true;
        break;
      }
    }
    EXPECT_TRUE(refused || !m.IsComplete()) << text;
  }
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
