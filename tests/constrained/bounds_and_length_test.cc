// JSON Schema numbers with fractional, negative and exclusive bounds, and
// strings with pattern plus minLength/maxLength, against independent
// decisions: numbers parsed with strtod and compared with the bounds'
// doubles (candidates with few significant digits, where that comparison is
// exact), strings matched with std::regex (ECMAScript, search) and counted
// in UTF-8 code points. Each case: enumerated candidates are accepted
// (byte by byte, then complete) iff the oracle says so, and random walks
// over allowed bytes end in EOS with every complete output valid.
#include <cmath>
#include <cstdlib>
#include <optional>
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::json;

using test_util::Accepts;
using test_util::ByteVocab;
using test_util::CodePoints;
using test_util::RandomByteWalks;

// Random walks: random allowed bytes for a while, then by preference EOS,
// closing[0], the other closing bytes in turn (so no single byte loops),
// else the first allowed token (EOS when nothing else is left); `check` sees
// every output where EOS is allowed.
template <typename Check>
void Walks(const std::shared_ptr<const CompiledConstraint>& c, std::mt19937& g, const std::string& closing, int walks,
           Check check, bool eos_first = true) {
  RandomByteWalks(c, g,
                  {.max_random_steps = 40, .max_steps = 300, .closing = closing, .eos_first = eos_first,
                   .rotate = true, .random_fallback = false},
                  walks, check);
}

struct Bounds {
  std::optional<double> lo, hi;
  bool lo_incl = true, hi_incl = true;
  bool In(double x) const {
    if (lo && (lo_incl ? x < *lo : x <= *lo)) return false;
    if (hi && (hi_incl ? x > *hi : x >= *hi)) return false;
    return true;
  }
};

// A random bound: a fraction with 1..3 decimals, negative or not.
double RandomBound(std::mt19937& g) {
  static const int kScales[] = {1, 2, 4, 8, 10, 100, 1000};
  const int scale = kScales[std::uniform_int_distribution<int>(0, 6)(g)];
  const int k = std::uniform_int_distribution<int>(-3000, 3000)(g);
  return std::strtod(std::to_string(static_cast<double>(k) / scale).c_str(), nullptr) == 0 && k != 0
             ? 0.5
             : static_cast<double>(k) / scale;
}

std::string Shortest(double d) { return json(d).dump(); }

TEST(BoundsAndLengthTest, FractionalNumberBounds) {
  auto vocab = ByteVocab();
  std::mt19937 g(20);
  int cases = 0, candidates = 0, accepted = 0;
  for (int iter = 0; iter < 300; ++iter) {
    Bounds b;
    double x = RandomBound(g), y = RandomBound(g);
    if (x > y) std::swap(x, y);
    if (iter % 7 == 0) y = x;  // a single point (or nothing, if an end is exclusive)
    const int shape = std::uniform_int_distribution<int>(0, 3)(g);
    json s = {{"type", "number"}};
    if (shape != 1) {
      b.lo = x, b.lo_incl = g() % 2;
      s[b.lo_incl ? "minimum" : "exclusiveMinimum"] = x;
    }
    if (shape != 2) {
      b.hi = y, b.hi_incl = g() % 2;
      s[b.hi_incl ? "maximum" : "exclusiveMaximum"] = y;
    }
    if (shape == 3 && g() % 2) {  // draft 4 flags
      s = {{"type", "number"}, {"minimum", x}, {"maximum", y}, {"exclusiveMinimum", g() % 2 == 0},
           {"exclusiveMaximum", g() % 2 == 0}};
      b = {x, y, !s["exclusiveMinimum"].get<bool>(), !s["exclusiveMaximum"].get<bool>()};
    }
    SCOPED_TRACE(s.dump());
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = s.dump()}, vocab);
    const bool empty = b.lo && b.hi && (*b.lo > *b.hi || (*b.lo == *b.hi && !(b.lo_incl && b.hi_incl)));
    if (empty) {
      ASSERT_FALSE(c.ok());
      EXPECT_NE(std::string(c.status().message()).find("no number lies within the bounds"), std::string::npos)
          << c.status();
      continue;
    }
    ASSERT_TRUE(c.ok()) << c.status();
    ++cases;
    // Candidates: around both bounds and zero, in several spellings.
    std::vector<std::string> texts = {"0", "-0", "0.0", "1", "-1", "0.5", "-0.5", "1e1", "1.0E-1", "2.25", "-1.5"};
    for (double base : {x, y, 0.0}) {
      for (double delta : {0.0, 0.001, -0.001, 0.01, -0.01, 0.125, -0.125, 0.5, -0.5, 1.0, -1.0, 7.0, -7.0}) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%.3f", base + delta);
        std::string t = buf;
        texts.push_back(t);
        while (t.back() == '0') t.pop_back();
        if (t.back() == '.') t.pop_back();
        texts.push_back(t);
        texts.push_back(t + "000000");
      }
      texts.push_back(Shortest(base));
    }
    for (const std::string& t : texts) {
      const json parsed = json::parse(t, nullptr, false);
      if (parsed.is_discarded()) continue;  // "-0.000" style spellings are fine, "01" is not JSON
      ++candidates;
      const bool has_exponent = t.find_first_of("eE") != std::string::npos;
      const bool expect = !has_exponent && t != "-0" && b.In(std::strtod(t.c_str(), nullptr)) &&
                          !(t[0] == '-' && std::strtod(t.c_str(), nullptr) == 0);
      ASSERT_EQ(Accepts(*c, t), expect) << t;
      accepted += expect;
    }
    auto check = [&](const std::string& out) {
      const json doc = json::parse(out, nullptr, false);
      ASSERT_TRUE(doc.is_number()) << out;
      // As validators see it (ajv: a double), even past 17 digits.
      ASSERT_TRUE(b.In(std::strtod(out.c_str(), nullptr))) << out;
    };
    Walks(*c, g, "1234567890", 4, check);
    // Up to the bounds: all the digits a number may have, nines or zeros.
    Walks(*c, g, "9.", 3, check, /*eos_first=*/false);
    Walks(*c, g, "0.1", 3, check, /*eos_first=*/false);
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("number bounds: %d schemas, %d candidates, %d accepted\n", cases, candidates, accepted);
}

TEST(BoundsAndLengthTest, BoundsAreTheShortestDecimals) {
  auto vocab = ByteVocab();
  auto compile = [&](const std::string& schema) {
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema}, vocab);
    EXPECT_TRUE(c.ok()) << schema << ": " << c.status();
    return *c;
  };
  auto c = compile(R"({"type":"number","maximum":0.1,"exclusiveMinimum":-0.1})");
  for (const char* t : {"0.1", "0.1000", "0.099999999999999999", "-0.09999999999999999", "0", "0.05"}) {
    EXPECT_TRUE(Accepts(c, t)) << t;
  }
  // -0.099999999999999999 is above -0.1 but parses as -0.1: an exclusive
  // bound ends at the adjacent double's shortest decimal.
  for (const char* t : {"0.100000000000000001", "-0.1", "-0.1000", "-0.099999999999999999", "0.11", "1", "-1"}) {
    EXPECT_FALSE(Accepts(c, t)) << t;
  }
  c = compile(R"({"type":"number","minimum":0,"exclusiveMaximum":1})");
  EXPECT_TRUE(Accepts(c, "0.9999999999999999"));
  EXPECT_FALSE(Accepts(c, "0.999999999999999999"));  // the e2e failure: ajv reads 1
  c = compile(R"({"type":"number","exclusiveMinimum":0,"maximum":2.25})");
  for (const char* t : {"0.000000000000000001", "2.25", "2.250", "1", "2"}) EXPECT_TRUE(Accepts(c, t)) << t;
  for (const char* t : {"0", "0.0", "2.251", "3", "-0.5"}) EXPECT_FALSE(Accepts(c, t)) << t;
  c = compile(R"({"type":"number","minimum":-1.5,"maximum":-0.25})");
  for (const char* t : {"-1.5", "-1", "-0.25", "-0.3"}) EXPECT_TRUE(Accepts(c, t)) << t;
  for (const char* t : {"-1.51", "-0.2", "0", "-2"}) EXPECT_FALSE(Accepts(c, t)) << t;
  // A bound with more fraction digits than a number may have.
  c = compile(R"({"type":"number","exclusiveMinimum":1e-19,"maximum":1})");
  EXPECT_TRUE(Accepts(c, "0.000000000000000001"));
  EXPECT_FALSE(Accepts(c, "0"));
  auto none = CompileConstraint(
      {.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"number","exclusiveMinimum":0,"exclusiveMaximum":1e-19})"},
      vocab);
  EXPECT_FALSE(none.ok());
}

TEST(BoundsAndLengthTest, PatternWithLength) {
  auto vocab = ByteVocab();
  // Patterns whose byte-wise std::regex reading equals the code-point one.
  const std::vector<std::string> patterns = {"^[a-z]+(-[a-z]+)*$", "a", "^(?:ab|\xC3\xA9)*$", "b$", "^[^b]*$",
                                             "^\\n?[ab\"]{1,3}", "(?:\\\\|-)", "^a*b*$"};
  const std::vector<std::string> alphabet = {"a", "b", "-", "\xC3\xA9", "\"", "\n", "\\"};
  std::mt19937 g(7);
  int cases = 0, candidates = 0, accepted = 0;
  for (int iter = 0; iter < 160; ++iter) {
    const std::string& pattern = patterns[iter % patterns.size()];
    const int min = std::uniform_int_distribution<int>(0, 4)(g);
    const int max = g() % 4 == 0 ? -1 : min + std::uniform_int_distribution<int>(0, 3)(g);
    json s = {{"type", "string"}, {"pattern", pattern}};
    if (min > 0 || g() % 2) s["minLength"] = min;
    if (max >= 0) s["maxLength"] = max;
    SCOPED_TRACE(s.dump());
    const std::regex re(pattern, std::regex::ECMAScript);
    auto valid = [&](const std::string& str) {
      const size_t n = CodePoints(str);
      return std::regex_search(str, re) && n >= static_cast<size_t>(min) && (max < 0 || n <= static_cast<size_t>(max));
    };
    // Every string over the alphabet up to 5 characters.
    std::vector<std::string> all = {""};
    bool any = false;
    for (size_t i = 0; i < all.size(); ++i) {
      any = any || valid(all[i]);
      if (CodePoints(all[i]) < 5) {
        for (const std::string& a : alphabet) all.push_back(all[i] + a);
      }
    }
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = s.dump()}, vocab);
    if (!c.ok()) {
      // Only when nothing can match (checked up to 5 characters here).
      ASSERT_FALSE(any) << c.status();
      continue;
    }
    ++cases;
    for (const std::string& str : all) {
      ++candidates;
      const bool expect = valid(str);
      ASSERT_EQ(Accepts(*c, json(str).dump()), expect) << json(str).dump();
      accepted += expect;
    }
    Walks(*c, g, "\"ab-", 4, [&](const std::string& out) {
      const json doc = json::parse(out, nullptr, false);
      ASSERT_TRUE(doc.is_string()) << out;
      ASSERT_TRUE(valid(doc.get<std::string>())) << out;
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("pattern+length: %d schemas, %d candidates, %d accepted\n", cases, candidates, accepted);
}

TEST(BoundsAndLengthTest, PatternWithLengthRespectsTheDfaLimit) {
  auto vocab = ByteVocab();
  auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema,
                              .text = R"({"type":"string","pattern":"a[ab]{10}","maxLength":1000})"},
                             vocab);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_NE(std::string(c.status().message()).find("kMaxRegexDfaStates"), std::string::npos) << c.status();
  // The log_entry schema of the e2e suite.
  c = CompileConstraint({.kind = ConstraintKind::kJsonSchema,
                         .text = R"({"type":"string","pattern":"^[a-z]+(-[a-z]+)*$","maxLength":24})"},
                        vocab);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, "\"abc-def\""));
  EXPECT_TRUE(Accepts(*c, "\"" + std::string(24, 'x') + "\""));
  EXPECT_FALSE(Accepts(*c, "\"" + std::string(25, 'x') + "\""));
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
