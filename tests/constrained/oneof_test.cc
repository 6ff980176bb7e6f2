// oneOf is exact: every output the compiled grammar accepts is valid against
// exactly one branch. Checked against the test's own JSON Schema validator
// (oneOf counted exactly, pattern with std::regex, the supported formats
// with their own regexes): random walks over the allowed bytes of each
// schema's automaton validate every complete output, count which branch it
// matched (each schema lists the branches its outputs must reach), and
// hand-written texts are accepted or refused as expected. Schemas whose
// branches can overlap are refused, naming the oneOf's pointer and the two
// branches.
#include <algorithm>
#include <cmath>
#include <random>
#include <regex>
#include <set>
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

bool IsFormat(const std::string& format, const std::string& s) {
  static const std::regex kDate(R"(^(\d{4})-(\d{2})-(\d{2})$)");
  static const std::regex kTime(R"(^([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)$)");
  static const std::regex kUuid(R"(^[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}$)");
  static const std::regex kEmail(R"(^[^@\s]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}$)");
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

// A JSON Schema validator for the keywords these tests use (oneOf exact).
class Validator {
 public:
  explicit Validator(const json& root) : root_(root) {}

  bool Valid(const json& v, const json& s, int depth = 0) const {
    if (depth > 200) return false;
    if (s.is_boolean()) return s.get<bool>();
    if (s.contains("$ref")) return Valid(v, Deref(s["$ref"].get<std::string>()), depth + 1);
    if (s.contains("anyOf")) {
      bool any = false;
      for (const json& b : s["anyOf"]) any = any || Valid(v, b, depth + 1);
      if (!any) return false;
    }
    if (s.contains("oneOf") && Matches(v, s["oneOf"], depth) != 1) return false;
    if (s.contains("allOf")) {
      for (const json& b : s["allOf"]) {
        if (!Valid(v, b, depth + 1)) return false;
      }
    }
    if (s.contains("const") && !(s["const"] == v)) return false;
    if (s.contains("enum")) {
      bool found = false;
      for (const json& e : s["enum"]) found = found || e == v;
      if (!found) return false;
    }
    if (s.contains("type")) {
      const json types = s["type"].is_array() ? s["type"] : json::array({s["type"]});
      bool ok = false;
      for (const json& t : types) ok = ok || IsType(v, t.get<std::string>());
      if (!ok) return false;
    }
    if (v.is_number()) {
      const double x = v.get<double>();
      if (s.contains("minimum") && x < s["minimum"].get<double>()) return false;
      if (s.contains("maximum") && x > s["maximum"].get<double>()) return false;
      if (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) return false;
      if (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()) return false;
    }
    if (v.is_string()) {
      const std::string str = v.get<std::string>();
      if (s.contains("minLength") && CodePoints(str) < s["minLength"].get<size_t>()) return false;
      if (s.contains("maxLength") && CodePoints(str) > s["maxLength"].get<size_t>()) return false;
      if (s.contains("pattern") && !std::regex_search(str, std::regex(s["pattern"].get<std::string>()))) return false;
      if (s.contains("format") && !IsFormat(s["format"].get<std::string>(), str)) return false;
    }
    if (v.is_array()) {
      if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
      if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
      const size_t prefix = s.contains("prefixItems") ? s["prefixItems"].size() : 0;
      for (size_t i = 0; i < v.size(); ++i) {
        if (i < prefix) {
          if (!Valid(v[i], s["prefixItems"][i], depth + 1)) return false;
        } else if (s.contains("items") && !Valid(v[i], s["items"], depth + 1)) {
          return false;
        }
      }
    }
    if (v.is_object()) {
      for (const json& r : s.value("required", json::array())) {
        if (!v.contains(r.get<std::string>())) return false;
      }
      for (const auto& [k, x] : v.items()) {
        if (s.contains("properties") && s["properties"].contains(k)) {
          if (!Valid(x, s["properties"][k], depth + 1)) return false;
        } else if (s.contains("additionalProperties") && !Valid(x, s["additionalProperties"], depth + 1)) {
          return false;
        }
      }
    }
    return true;
  }

  // How many of `branches` v is valid against.
  int Matches(const json& v, const json& branches, int depth = 0) const {
    int n = 0;
    for (const json& b : branches) n += Valid(v, b, depth + 1);
    return n;
  }

 private:
  static bool IsType(const json& v, const std::string& t) {
    if (t == "null") return v.is_null();
    if (t == "boolean") return v.is_boolean();
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    if (t == "string") return v.is_string();
    if (t == "number") return v.is_number();
    if (t == "integer") return v.is_number() && std::floor(v.get<double>()) == v.get<double>();
    return false;
  }

  const json& Deref(const std::string& ref) const {
    if (ref == "#") return root_;
    const json* at = &root_;
    size_t i = 2;  // after "#/"
    while (i <= ref.size()) {
      size_t j = ref.find('/', i);
      if (j == std::string::npos) j = ref.size();
      at = &(*at)[ref.substr(i, j - i)];
      i = j + 1;
    }
    return *at;
  }

  const json& root_;
};

// Random walks: random bytes for up to 60 steps, then by preference EOS or
// closing bytes ('"' first, the others rotating), else random.
const ByteWalkOptions kWalks = {.max_random_steps = 60, .max_steps = 600, .closing = "\"}]0,:1a", .rotate = true};

struct ExactCase {
  const char* name;
  const char* schema;
  std::set<int> branches;              // root oneOf branches reached (by the walks or `accepted`), exactly
  std::vector<std::string> accepted;   // texts the constraint accepts
  std::vector<std::string> refused;    // texts it does not accept
};

const std::vector<ExactCase>& ExactCases() {
  static const auto* k = new std::vector<ExactCase>{
      {"discriminated_union",
       R"({"oneOf":[
         {"type":"object","properties":{"kind":{"const":"circle"},"radius":{"type":"number","minimum":0,"maximum":100}},
          "required":["kind","radius"],"additionalProperties":false},
         {"type":"object","properties":{"kind":{"const":"rect"},"w":{"type":"integer"},"h":{"type":"integer"}},
          "required":["kind","w","h"],"additionalProperties":false},
         {"type":"object","properties":{"kind":{"const":"tri"},"sides":{"type":"array","items":{"type":"number"},
          "minItems":3,"maxItems":3}},"required":["kind","sides"],"additionalProperties":false}]})",
       {0, 1, 2},
       {R"({"kind":"circle","radius":2.5})", R"({"kind":"rect","w":1,"h":2})"},
       {R"({"kind":"circle","w":1,"h":2})"}},
      {"type_union",
       R"({"oneOf":[{"type":"string"},{"type":"integer"},{"type":"null"},{"type":"boolean"},
                    {"type":"array","items":{"type":"integer"}}]})",
       {0, 1, 2, 3, 4},
       {"\"x\"", "-3", "null", "true", "[1,2]"},
       {"1.5", "{}"}},
      // {"page":N} matches both branches: branch 0 is dropped, branch 1 always writes per_page.
      {"pagination_oneof",
       R"({"oneOf":[
         {"type":"object","properties":{"page":{"type":"integer","minimum":1,"maximum":99}},"required":["page"],
          "additionalProperties":false},
         {"type":"object","properties":{"page":{"type":"integer","minimum":1,"maximum":99},
          "per_page":{"type":"integer","minimum":1,"maximum":50}},"required":["page"],"additionalProperties":false}]})",
       {1},
       {R"({"page":2,"per_page":10})"},
       {R"({"page":2})", R"({"per_page":10})", R"({"page":0,"per_page":10})"}},
      // {} matches both: each branch always writes its own key.
      {"optional_only_objects",
       R"({"oneOf":[{"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":false},
                    {"type":"object","properties":{"b":{"type":"string"}},"additionalProperties":false}]})",
       {0, 1},
       {R"({"a":1})", R"({"b":"x"})"},
       {"{}"}},
      // Open objects: each leaves out (also as an extra key) the key the other requires.
      {"required_vs_open",
       R"({"oneOf":[{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":true},
                    {"type":"object","properties":{"c":{"type":"integer"}},"required":["c"],
                     "additionalProperties":{"type":"integer"}}]})",
       {0, 1},
       {R"({"a":1,"b":2})", R"({"c":1,"b":2})"},
       {R"({"a":1,"c":2})", R"({"c":1,"a":2})"}},
      // An optional property of one branch that the other requires: branch 0
      // never writes it, and branch 1 ({id, name}, valid against both) is dropped.
      {"required_vs_optional",
       R"({"oneOf":[{"type":"object","properties":{"id":{"type":"integer"},"name":{"type":"string"}},"required":["id"],
                     "additionalProperties":false},
                    {"type":"object","properties":{"id":{"type":"integer"},"name":{"type":"string"}},
                     "required":["id","name"],"additionalProperties":false}]})",
       {0},
       {R"({"id":1})"},
       {R"({"id":1,"name":"x"})"}},
      {"integer_vs_number_disjoint",
       R"({"oneOf":[{"type":"integer","maximum":0},{"type":"number","exclusiveMinimum":0}]})",
       {0, 1},
       {"-4", "0", "0.5", "7"},
       {"-0.5"}},
      {"refs_with_discriminator",
       R"({"$defs":{"cat":{"type":"object","properties":{"pet":{"const":"cat"},"lives":{"type":"integer"}},
                           "required":["pet"]},
                    "dog":{"type":"object","properties":{"pet":{"const":"dog"},"good":{"type":"boolean"}},
                           "required":["pet"]}},
          "oneOf":[{"$ref":"#/$defs/cat"},{"$ref":"#/$defs/dog"},{"type":"null"}]})",
       {0, 1, 2},
       {R"({"pet":"cat","lives":9})", R"({"pet":"dog"})", "null"},
       {R"({"pet":"cow"})"}},
      // A recursive tree: the discriminator decides without following the recursion.
      {"recursive_tree",
       R"({"$defs":{"leaf":{"type":"object","properties":{"t":{"const":"leaf"},"v":{"type":"integer"}},
                            "required":["t","v"],"additionalProperties":false},
                    "node":{"type":"object","properties":{"t":{"const":"node"},
                            "kids":{"type":"array","items":{"$ref":"#"},"maxItems":2}},
                            "required":["t","kids"],"additionalProperties":false}},
          "oneOf":[{"$ref":"#/$defs/leaf"},{"$ref":"#/$defs/node"}]})",
       {0, 1},
       {R"({"t":"node","kids":[{"t":"leaf","v":1},{"t":"node","kids":[]}]})"},
       {R"({"t":"node","kids":[{"t":"leaf"}]})"}},
      // A required key whose values are disjoint (enums) decides it.
      {"enum_discriminator",
       R"({"oneOf":[{"type":"object","properties":{"op":{"enum":["add","sub"]},"x":{"type":"integer"}},
                     "required":["op"]},
                    {"type":"object","properties":{"op":{"enum":["neg"]},"x":{"type":"integer"}},"required":["op"]}]})",
       {0, 1},
       {R"({"op":"add","x":1})", R"({"op":"neg"})"},
       {R"({"op":"mul"})"}},
      {"disjoint_enums_and_ranges",
       R"({"oneOf":[{"enum":["a","b",1]},{"const":"c"},{"type":"integer","minimum":2},
                    {"type":"string","minLength":2}]})",
       {0, 1, 2, 3},
       {"\"a\"", "1", "\"c\"", "5", "\"xy\""},
       {"0", "\"x\""}},
      {"array_lengths_and_items",
       R"({"oneOf":[{"type":"array","maxItems":1},{"type":"array","minItems":2,"items":{"type":"integer"}},
                    {"type":"object","properties":{"k":{"type":"array","prefixItems":[{"const":1}],"minItems":1}},
                     "required":["k"],"additionalProperties":false},
                    {"type":"object","properties":{"k":{"type":"array","prefixItems":[{"const":2}],"minItems":1}},
                     "required":["k"],"additionalProperties":false}]})",
       {0, 1, 2, 3},
       {"[]", "[1,2]", R"({"k":[1]})", R"({"k":[2,"x"]})"},
       {R"({"k":[]})"}},
      // Branch 0 ({"a":int}) is valid against branch 1 too: dropped; branch 1 never writes "a".
      {"contained_branch_dropped",
       R"({"oneOf":[{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false},
                    {"type":"object","additionalProperties":{"type":"integer"}}]})",
       {1},
       {R"({"b":1})", "{}"},
       {R"({"a":1})"}},
      {"nested_oneof",
       R"({"type":"object","properties":{"x":{"oneOf":[{"type":"string","maxLength":3},{"type":"integer"}]},
          "y":{"oneOf":[{"type":"null"},{"type":"object","properties":{"z":{"type":"boolean"}},
                                          "required":["z"],"additionalProperties":false}]}},
          "required":["x","y"],"additionalProperties":false})",
       {},
       {R"({"x":"ab","y":null})", R"({"x":3,"y":{"z":true}})"},
       {R"({"x":"abcd","y":null})"}},
      {"formats_and_types",
       R"({"oneOf":[{"type":"string","format":"date"},{"type":"number","minimum":0,"maximum":1},{"type":"null"}]})",
       {0, 1, 2},
       {"\"2024-02-28\"", "0.25", "null"},
       {"2"}},
  };
  return *k;
}

class OneOfTest : public ::testing::Test {
 protected:
  std::shared_ptr<const TokenVocabulary> vocab_ = ByteVocab();
};

TEST_F(OneOfTest, EveryOutputMatchesExactlyOneBranch) {
  std::mt19937 g(2026);
  int schemas = 0, outputs = 0;
  for (const ExactCase& tc : ExactCases()) {
    SCOPED_TRACE(tc.name);
    const json schema = json::parse(tc.schema);
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = tc.schema}, vocab_);
    ASSERT_TRUE(c.ok()) << c.status();
    ++schemas;
    const Validator val(schema);
    std::set<int> reached;
    auto reach = [&](const json& doc) {
      if (!schema.contains("oneOf")) return;
      for (size_t i = 0; i < schema["oneOf"].size(); ++i) {
        if (val.Valid(doc, schema["oneOf"][i])) reached.insert(static_cast<int>(i));
      }
    };
    for (const std::string& text : tc.accepted) {
      EXPECT_TRUE(Accepts(*c, text)) << text;
      EXPECT_TRUE(val.Valid(json::parse(text), schema)) << "case lists an invalid text: " << text;
      reach(json::parse(text));
    }
    for (const std::string& text : tc.refused) EXPECT_FALSE(Accepts(*c, text)) << text;
    RandomByteWalks(*c, g, kWalks, 400, [&](const std::string& out) {
      const json doc = json::parse(out, nullptr, false);
      ASSERT_FALSE(doc.is_discarded()) << "EOS allowed but not JSON: " << out;
      ASSERT_TRUE(val.Valid(doc, schema)) << "EOS allowed but invalid: " << out;
      if (schema.contains("oneOf")) {
        ASSERT_EQ(val.Matches(doc, schema["oneOf"]), 1) << out;
      }
      reach(doc);
      ++outputs;
    });
    if (HasFatalFailure()) return;
    EXPECT_EQ(reached, tc.branches);
  }
  EXPECT_EQ(schemas, static_cast<int>(ExactCases().size()));
  EXPECT_GT(outputs, 2000);
  RecordProperty("outputs_validated", outputs);
}

// Random oneOf schemas: each compiles and every walk output matches exactly
// one branch, or it is refused as an overlap naming the pointer.
json RandomBranch(std::mt19937& g, int depth) {
  auto rand = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(g); };
  static const json kValues = json::array({"a", "b", 1, 2, 2.5, true, nullptr, json::object({{"a", 1}})});
  switch (rand(depth > 0 ? 11 : 8)) {
    case 0: return {{"type", rand(2) ? "null" : "boolean"}};
    case 1: {
      json s = {{"type", "string"}};
      const int lo = rand(4);
      if (rand(2)) s["minLength"] = lo;
      if (rand(2)) s["maxLength"] = lo + rand(3);
      return s;
    }
    case 2:
    case 3: {
      json s = {{"type", rand(2) ? "integer" : "number"}};
      const int lo = rand(10) - 5;
      if (rand(2)) s[rand(2) ? "minimum" : "exclusiveMinimum"] = lo;
      if (rand(2)) s[rand(2) ? "maximum" : "exclusiveMaximum"] = lo + 2 + rand(6);
      return s;
    }
    case 4: return {{"const", kValues[rand(8)]}};
    case 5: {
      json e = json::array();
      for (int i = 0, n = 1 + rand(3); i < n; ++i) {
        const json v = kValues[rand(8)];
        if (std::find(e.begin(), e.end(), v) == e.end()) e.push_back(v);
      }
      return {{"enum", e}};
    }
    case 6: return {{"type", json::array({"string", "null"})}, {"maxLength", 2}};
    case 7: return {{"type", "array"}, {"items", {{"type", "integer"}}}, {"minItems", rand(2)}, {"maxItems", 1 + rand(2)}};
    default: {
      json props = json::object(), required = json::array();
      for (const char* name : {"a", "b", "c"}) {
        if (rand(3) == 0) continue;
        props[name] = RandomBranch(g, depth - 1);
        if (rand(2)) required.push_back(name);
      }
      json s = {{"type", "object"}, {"properties", props}, {"required", required}};
      switch (rand(4)) {
        case 0: s["additionalProperties"] = false; break;
        case 1: s["additionalProperties"] = true; break;
        case 2: s["additionalProperties"] = {{"type", "integer"}}; break;
        default: break;
      }
      return s;
    }
  }
}

TEST_F(OneOfTest, RandomOneOfsAreExactOrRefused) {
  std::mt19937 g(99);
  int compiled = 0, refused = 0, outputs = 0;
  for (int iter = 0; iter < 400; ++iter) {
    json branches = json::array();
    for (int i = 0, n = 2 + static_cast<int>(g() % 2); i < n; ++i) branches.push_back(RandomBranch(g, 2));
    const json schema = {{"oneOf", branches}};
    SCOPED_TRACE(schema.dump());
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema.dump()}, vocab_);
    if (!c.ok()) {
      ASSERT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
      ASSERT_THAT(std::string(c.status().message()), HasSubstr("may both match the same value")) << c.status();
      ++refused;
      continue;
    }
    ++compiled;
    const Validator val(schema);
    RandomByteWalks(*c, g, kWalks, 25, [&](const std::string& out) {
      const json doc = json::parse(out, nullptr, false);
      ASSERT_FALSE(doc.is_discarded()) << "EOS allowed but not JSON: " << out;
      ASSERT_EQ(val.Matches(doc, branches), 1) << out;
      ++outputs;
    });
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(compiled, 100);
  EXPECT_GT(refused, 50);
  RecordProperty("compiled", compiled);
  RecordProperty("refused", refused);
  RecordProperty("outputs_validated", outputs);
}

TEST_F(OneOfTest, OverlapIsRefusedNamingPointerAndBranches) {
  struct Refusal {
    const char* schema;
    const char* part;
  };
  const Refusal cases[] = {
      {R"({"oneOf":[{"enum":["a","b"]},{"enum":["a","b"]}]})", "oneOf at /: branches 0 and 1 may both match"},
      {R"({"oneOf":[{"enum":["a","b"]},{"enum":["b","c"]}]})", "oneOf at /: branches 0 and 1"},
      {R"({"oneOf":[{"type":"integer"},{"type":"number"}]})", "oneOf at /: branches 0 and 1"},
      {R"({"oneOf":[{"type":"integer","minimum":5},{"type":"number","maximum":5}]})", "branches 0 and 1"},
      {R"({"type":"object","properties":{"x":{"oneOf":[{"type":"string"},{"type":"integer"},
          {"type":"string","minLength":1}]}}})",
       "oneOf at /properties/x: branches 0 and 2 may both match the same value"},
      {R"({"oneOf":[{"type":"string"},{"const":"a"}]})", "branches 0 and 1"},
      {R"({"oneOf":[{"type":"null"},{"type":["null","string"]}]})", "branches 0 and 1"},
      {R"({"oneOf":[{},{"type":"string"}]})", "branches 0 and 1"},
      {R"({"oneOf":[{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]},
                    {"type":"object","properties":{"a":{"type":"number"}},"required":["a"]}]})",
       "branches 0 and 1"},
      // Recursive branches without a discriminator: not provably disjoint (and the analysis ends).
      {R"({"$defs":{"l":{"type":"object","properties":{"next":{"$ref":"#/$defs/l"}}},
                    "m":{"type":"object","properties":{"next":{"$ref":"#/$defs/m"}}}},
          "oneOf":[{"$ref":"#/$defs/l"},{"$ref":"#/$defs/m"}]})",
       "branches 0 and 1"},
      {R"({"items":{"oneOf":[{"type":"boolean"},{"enum":[true,3]}]}})", "oneOf at /items: branches 0 and 1"},
  };
  for (const Refusal& r : cases) {
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = r.schema}, vocab_);
    ASSERT_FALSE(c.ok()) << r.schema;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << r.schema;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr(r.part)) << r.schema;
    EXPECT_THAT(std::string(c.status().message()), HasSubstr("or use anyOf")) << r.schema;
  }
}

TEST_F(OneOfTest, BranchErrorsWinOverOverlap) {
  auto c = CompileConstraint(
      {.kind = ConstraintKind::kJsonSchema, .text = R"({"oneOf":[{"type":"string"},{"type":"strin"}]})"}, vocab_);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("unknown type 'strin'"));
  c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = R"({"oneOf":[{"not":{}},{"type":"string"}]})"},
                        vocab_);
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("'not' at /oneOf/0"));
}

TEST_F(OneOfTest, AnyOfStillOverlaps) {
  auto c = CompileConstraint(
      {.kind = ConstraintKind::kJsonSchema, .text = R"({"anyOf":[{"type":"integer"},{"type":"number"}]})"}, vocab_);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, "3"));
  EXPECT_TRUE(Accepts(*c, "3.5"));
  c = CompileConstraint({.kind = ConstraintKind::kJsonSchema,
                         .text = R"({"anyOf":[{"type":"object","properties":{"page":{"type":"integer"}},"required":["page"],
                                     "additionalProperties":false},{"type":"object","properties":{"page":{"type":"integer"},
                                     "per_page":{"type":"integer"}},"required":["page"],"additionalProperties":false}]})"},
                        vocab_);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(Accepts(*c, R"({"page":3})"));
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
