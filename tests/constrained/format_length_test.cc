// JSON Schema `format` together with minLength/maxLength (the format's DFA
// times a code-point counter), against independent decisions: every output
// of random walks over the allowed bytes is a JSON string that the test's
// own regex for the format accepts and whose code points lie within the
// bounds; candidates inside the formats' conservative subsets are accepted
// exactly when their length fits; bounds no string of the format meets are
// refused, naming the combination.
#include <random>
#include <regex>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::json;
using ::testing::HasSubstr;

using test_util::Accepts;
using test_util::ByteVocab;
using test_util::ByteWalkOptions;
using test_util::CodePoints;
using test_util::RandomByteWalks;

// The formats' definitions (RFC 3339 dates with real month lengths, RFC 4122
// uuids, dotted-quad ipv4, a loose email), written apart from the compiler's.
bool IsFormat(const std::string& format, const std::string& s) {
  static const std::regex kDate(R"(^(\d{4})-(\d{2})-(\d{2})$)");
  static const std::regex kTime(R"(^([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$)");
  static const std::regex kUuid(R"(^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$)");
  static const std::regex kEmail(R"(^[^@\s"\\]+@[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?\.[A-Za-z]{2,}$)");
  static const std::regex kIpv4(R"(^((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)$)");
  auto date = [](const std::string& d) {
    std::smatch m;
    if (!std::regex_match(d, m, kDate)) return false;
    const int month = std::stoi(m[2]), day = std::stoi(m[3]);
    static const int kDays[] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    return month >= 1 && month <= 12 && day >= 1 && day <= kDays[month - 1];
  };
  if (format == "date") return date(s);
  if (format == "time") return std::regex_match(s, kTime);
  if (format == "date-time") {
    const size_t t = s.find('T');
    return t != std::string::npos && date(s.substr(0, t)) && std::regex_match(s.substr(t + 1), kTime);
  }
  if (format == "uuid") return std::regex_match(s, kUuid);
  if (format == "email") return std::regex_match(s, kEmail);
  if (format == "ipv4") return std::regex_match(s, kIpv4);
  return false;
}

struct FormatCase {
  const char* format;
  // Strings of the format (inside the compiler's conservative subsets), of various lengths.
  std::vector<std::string> members;
};

const std::vector<FormatCase>& Formats() {
  static const auto* k = new std::vector<FormatCase>{
      {"date", {"2024-01-31", "1999-12-01"}},
      {"time", {"12:30:00Z", "23:59:59.5+01:00", "00:00:00.123456789-11:30"}},
      {"date-time", {"2024-01-31T12:30:00Z", "2024-06-30T00:00:00.25+05:30"}},
      {"uuid", {"123e4567-e89b-12d3-a456-426614174000"}},
      {"email", {"a@b.co", "first.last+tag@mail.example.org", "x_y@z9.io"}},
      {"ipv4", {"1.2.3.4", "192.168.100.200", "255.255.255.255", "10.0.0.1"}},
  };
  return *k;
}

// Random walks: random bytes for up to 80 steps, then EOS or these bytes in
// order, else random.
const ByteWalkOptions kWalks = {.max_random_steps = 80, .max_steps = 400, .closing = "\"@Z.0a"};

TEST(FormatLengthTest, OutputsHaveTheFormatAndTheLength) {
  auto vocab = ByteVocab();
  std::mt19937 g(7);
  int compiled = 0, refused = 0, outputs = 0, candidates = 0;
  for (const FormatCase& fc : Formats()) {
    for (int iter = 0; iter < 14; ++iter) {
      // Bounds around the members' lengths (some empty, some one-sided).
      const int min = std::uniform_int_distribution<int>(0, 40)(g);
      const int max = min + std::uniform_int_distribution<int>(-3, 12)(g);
      json s = {{"type", "string"}, {"format", fc.format}};
      if (iter % 3 != 1) s["minLength"] = min;
      if (iter % 3 != 2 && max >= 0) s["maxLength"] = max;
      const int64_t lo = s.value("minLength", 0), hi = s.value("maxLength", -1);
      SCOPED_TRACE(s.dump());
      auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = s.dump()}, vocab);
      bool member_fits = false;
      for (const std::string& m : fc.members) {
        const int64_t n = static_cast<int64_t>(CodePoints(m));
        member_fits = member_fits || (n >= lo && (hi < 0 || n <= hi));
      }
      if (!c.ok()) {
        ASSERT_FALSE(member_fits) << c.status();  // a string of the format fits: must compile
        ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
        EXPECT_THAT(std::string(c.status().message()),
                    HasSubstr(hi >= 0 && hi < lo ? "maxLength is below minLength"
                                                 : "minLength/maxLength together with format"));
        ++refused;
        continue;
      }
      ++compiled;
      for (const std::string& m : fc.members) {
        const int64_t n = static_cast<int64_t>(CodePoints(m));
        EXPECT_EQ(Accepts(*c, json(m).dump()), n >= lo && (hi < 0 || n <= hi)) << m;
        ++candidates;
      }
      RandomByteWalks(*c, g, kWalks, 40, [&](const std::string& out) {
        const json doc = json::parse(out, nullptr, false);
        ASSERT_TRUE(doc.is_string()) << "EOS allowed but not a JSON string: " << out;
        const std::string str = doc.get<std::string>();
        ASSERT_TRUE(IsFormat(fc.format, str)) << "not a " << fc.format << ": " << out;
        const int64_t n = static_cast<int64_t>(CodePoints(str));
        ASSERT_GE(n, lo) << out;
        if (hi >= 0) {
          ASSERT_LE(n, hi) << out;
        }
        ++outputs;
      });
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(compiled, 30);
  EXPECT_GT(refused, 5);
  EXPECT_GT(outputs, 1000);
  RecordProperty("outputs_validated", outputs);
  RecordProperty("candidates", candidates);
}

TEST(FormatLengthTest, FixedLengthFormats) {
  auto vocab = ByteVocab();
  auto compile = [&](const std::string& text) {
    return CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = text}, vocab);
  };
  auto c = compile(R"({"type":"string","format":"date","minLength":10,"maxLength":10})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, "\"2024-03-01\""));
  c = compile(R"({"type":"string","format":"date","maxLength":9})");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("at /: minLength/maxLength together with format 'date'"));
  c = compile(R"({"type":"string","format":"uuid","minLength":37})");
  ASSERT_FALSE(c.ok());
  // ipv4 of at most 7 characters: 1.2.3.4 yes, 10.0.0.1 no.
  c = compile(R"({"type":"string","format":"ipv4","maxLength":7})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, "\"1.2.3.4\""));
  EXPECT_FALSE(Accepts(*c, "\"10.0.0.1\""));
  // Real-world bounds stay within the DFA limit.
  for (const char* text : {R"({"type":"string","format":"email","minLength":3,"maxLength":254})",
                           R"({"type":"string","format":"date-time","maxLength":64})",
                           R"({"type":"string","format":"uuid","maxLength":36})"}) {
    c = compile(text);
    ASSERT_TRUE(c.ok()) << text << ": " << c.status();
  }
  // An email with a maxLength is narrowed to at most 66 characters (labels then need no counting).
  c = compile(R"({"type":"string","format":"email","maxLength":254})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, "\"a@b.co\""));
  EXPECT_TRUE(Accepts(*c, json(std::string(60, 'x') + "@ab.cd").dump()));
  EXPECT_FALSE(Accepts(*c, json(std::string(61, 'x') + "@ab.cd").dump()));
  c = compile(R"({"type":"string","format":"email","minLength":67})");
  ASSERT_TRUE(c.ok()) << c.status();  // no maxLength: the format's own regex, lengths counted to 67
  EXPECT_TRUE(Accepts(*c, json(std::string(61, 'x') + "@ab.cd").dump()));
  EXPECT_FALSE(Accepts(*c, json(std::string(60, 'x') + "@ab.cd").dump()));
  // Inside a property, and in a oneOf whose branches the lengths keep apart.
  c = compile(R"({"type":"object","properties":{"ip":{"oneOf":[{"type":"string","format":"ipv4","maxLength":9},
              {"type":"string","format":"ipv4","minLength":10}]}},"required":["ip"]})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, R"({"ip":"1.2.3.4"})"));
  EXPECT_TRUE(Accepts(*c, R"({"ip":"192.168.1.1"})"));
}

TEST(FormatLengthTest, PatternWithFormatIsRefused) {
  auto vocab = ByteVocab();
  auto c = CompileConstraint(
      {.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"string","format":"date","pattern":"^2"})"}, vocab);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("pattern together with format is not supported"));
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
