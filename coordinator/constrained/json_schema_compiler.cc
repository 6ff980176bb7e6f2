// coordinator/constrained/json_schema_compiler.cc — see json_schema_compiler.h
// and README.md (the supported subset and the choices made).
#include "coordinator/constrained/json_schema_compiler.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/constrained/regex_compiler.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::json;

constexpr const char* kJsonChar =
    R"((?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2})))";
// Numbers: at most 18 integer digits, 18 fraction digits and a 2-digit
// exponent, so every number is a finite double (JSON.parse("5e472") is
// Infinity, which no validator takes for a number) and a model cannot pad
// digits forever.
constexpr const char* kNumberRegex = R"(-?(?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,18})?(?:[eE][+-]?[0-9]{1,2})?)";
constexpr const char* kIntegerRegex = R"(-?(?:0|[1-9][0-9]{0,17}))";

// Keywords that only annotate (ignored).
const absl::flat_hash_set<std::string>& AnnotationKeywords() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "description", "title", "default", "examples", "$schema", "$id", "$comment", "deprecated",
      "readOnly", "writeOnly", "$defs", "definitions"};
  return *k;
}
const absl::flat_hash_set<std::string>& SupportedKeywords() {
  static const auto* k = new absl::flat_hash_set<std::string>{
      "type", "properties", "required", "additionalProperties", "enum", "const", "items",
      "prefixItems", "minItems", "maxItems", "anyOf", "oneOf", "allOf", "$ref", "pattern", "format",
      "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
  return *k;
}

std::string Escape(std::string_view token) {
  std::string out;
  for (char c : token) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

std::string Dump(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

// ---- integer and decimal ranges as regexes --------------------------------

using Int = __int128;

std::string Digits(Int v) {
  if (v == 0) return "0";
  std::string s;
  for (; v > 0; v /= 10) s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
  return s;
}

// Same-length digit strings lo <= hi.
std::string SameLengthRange(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return "";
  if (lo.size() == 1) {
    return lo == hi ? lo : absl::StrCat("[", lo, "-", hi, "]");
  }
  if (lo[0] == hi[0]) return std::string(1, lo[0]) + SameLengthRange(lo.substr(1), hi.substr(1));
  const size_t rest = lo.size() - 1;
  std::vector<std::string> alts;
  alts.push_back(std::string(1, lo[0]) + "(?:" + SameLengthRange(lo.substr(1), std::string(rest, '9')) + ")");
  if (lo[0] + 1 <= hi[0] - 1) {
    alts.push_back(absl::StrCat("[", std::string(1, static_cast<char>(lo[0] + 1)), "-",
                                std::string(1, static_cast<char>(hi[0] - 1)), "][0-9]{", rest, "}"));
  }
  alts.push_back(std::string(1, hi[0]) + "(?:" + SameLengthRange(std::string(rest, '0'), hi.substr(1)) + ")");
  return "(?:" + absl::StrJoin(alts, "|") + ")";
}

// Canonical decimal integers in [lo, hi] (0 <= lo; hi < 0: unbounded).
std::string NonNegativeRange(Int lo, Int hi) {
  std::vector<std::string> alts;
  const std::string lo_digits = Digits(lo);
  size_t len = lo_digits.size();
  Int start = lo;
  while (hi < 0 || start <= hi) {
    Int pow = 1;
    for (size_t k = 0; k < len; ++k) pow *= 10;
    const Int top = pow - 1;
    if (hi < 0 && start == pow / 10 && len > lo_digits.size()) {
      alts.push_back(absl::StrCat("[1-9][0-9]{", len - 1, ",17}"));
      break;
    }
    if (hi < 0 && len >= 18) {
      alts.push_back(absl::StrCat("[1-9][0-9]{", len - 1, ",17}"));
      break;
    }
    const Int end = hi >= 0 && hi < top ? hi : top;
    alts.push_back(SameLengthRange(Digits(start), Digits(end)));
    if (end == hi) break;
    start = pow;
    ++len;
  }
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

// Integers in [lo, hi] (inclusive; nullopt-like flags for unbounded).
std::string IntegerRangeRegex(bool has_lo, Int lo, bool has_hi, Int hi) {
  std::vector<std::string> alts;
  // Non-negative part.
  if (!has_hi || hi >= 0) {
    alts.push_back(NonNegativeRange(has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1));
  }
  // Negative part: -m with m in [max(1, -hi), -lo].
  if (!has_lo || lo < 0) {
    const Int mlo = has_hi && hi < 0 ? -hi : 1;
    alts.push_back("-" + NonNegativeRange(mlo, has_lo ? -lo : -1));
  }
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

// An exact non-negative decimal: integer part and fraction digits (no
// trailing zeros; may be longer than the 18 a number may have).
struct Decimal {
  Int integer = 0;
  std::string fraction;
};

// |d| as its shortest round-trip decimal.
Decimal ToDecimal(double d) {
  char buf[512];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), std::fabs(d), std::chars_format::fixed);
  const std::string text(buf, ec == std::errc() ? end : buf);
  Decimal out;
  const size_t dot = text.find('.');
  for (size_t i = 0; i < std::min(dot, text.size()); ++i) out.integer = out.integer * 10 + (text[i] - '0');
  if (dot != std::string::npos) out.fraction = text.substr(dot + 1);
  while (!out.fraction.empty() && out.fraction.back() == '0') out.fraction.pop_back();
  return out;
}

// Digit strings d of length 0..k (k: fraction digits left) with 0.d (value
// after the digits before) at least 0.lo (`lo_incl`: or equal) and, with
// `hi`, at most 0.hi (`hi_incl`: or equal); `top`: the fraction's start,
// where the digits follow a '.' and no digits is no fraction. nullopt: no
// string. Digits past the end of lo/hi compare as zeros.
std::optional<std::string> FractionRange(std::string_view lo, bool lo_incl, const std::string_view* hi, bool hi_incl,
                                         int k, bool top) {
  const bool zero_ok = lo.empty() && lo_incl && (hi == nullptr || !hi->empty() || hi_incl);
  if (zero_ok && hi == nullptr) {  // any digits
    if (k == 0) return "";
    return top ? absl::StrCat("(?:\\.[0-9]{1,", k, "})?") : absl::StrCat("[0-9]{0,", k, "}");
  }
  std::vector<std::string> alts;
  if (k > 0) {
    const int a0 = lo.empty() ? 0 : lo[0] - '0';
    const int b0 = hi == nullptr ? 10 : hi->empty() ? 0 : (*hi)[0] - '0';
    const std::string_view lo_rest = lo.empty() ? lo : lo.substr(1);
    std::string_view hi_rest;
    if (hi != nullptr && !hi->empty()) hi_rest = hi->substr(1);
    auto add = [&](int digit, std::optional<std::string> rest) {
      if (rest) alts.push_back(std::string(1, static_cast<char>('0' + digit)) + *rest);
    };
    if (a0 == b0) {
      add(a0, FractionRange(lo_rest, lo_incl, &hi_rest, hi_incl, k - 1, false));
    } else {
      add(a0, FractionRange(lo_rest, lo_incl, nullptr, false, k - 1, false));
      if (a0 + 1 <= std::min(b0 - 1, 9)) {
        alts.push_back(absl::StrCat("[", a0 + 1, "-", std::min(b0 - 1, 9), "][0-9]{0,", k - 1, "}"));
      }
      if (b0 <= 9) add(b0, FractionRange("", true, &hi_rest, hi_incl, k - 1, false));
    }
  }
  if (alts.empty()) return zero_ok ? std::optional<std::string>("") : std::nullopt;
  std::string body = alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
  if (top) body = "\\." + body;
  return zero_ok ? "(?:" + body + ")?" : body;
}

// Decimals (canonical integer part of <= 18 digits, optional fraction of
// 1..18 digits, no exponent) with magnitude from a to b (null: unbounded),
// each end inclusive or not. nullopt: none.
std::optional<std::string> MagnitudeRange(const Decimal& a, bool a_incl, const Decimal* b, bool b_incl) {
  constexpr int kFractionDigits = 18;
  const std::string_view a_frac = a.fraction;
  std::string_view b_frac;
  if (b != nullptr) b_frac = b->fraction;
  std::vector<std::string> alts;
  if (b != nullptr && b->integer < a.integer) return std::nullopt;
  if (b != nullptr && a.integer == b->integer) {
    std::optional<std::string> f = FractionRange(a_frac, a_incl, &b_frac, b_incl, kFractionDigits, true);
    if (f) alts.push_back(Digits(a.integer) + *f);
  } else {
    std::optional<std::string> f = FractionRange(a_frac, a_incl, nullptr, false, kFractionDigits, true);
    if (f) alts.push_back(Digits(a.integer) + *f);
    const std::string any_frac = R"((?:\.[0-9]{1,18})?)";
    if (b == nullptr || a.integer + 1 <= b->integer - 1) {
      alts.push_back("(?:" + NonNegativeRange(a.integer + 1, b == nullptr ? -1 : b->integer - 1) + ")" + any_frac);
    }
    if (b != nullptr) {
      std::optional<std::string> g = FractionRange("", true, &b_frac, b_incl, kFractionDigits, true);
      if (g) alts.push_back(Digits(b->integer) + *g);
    }
  }
  if (alts.empty()) return std::nullopt;
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

class SchemaCompiler {
 public:
  SchemaCompiler(const json& root, Grammar& g) : root_(root), g_(g) {}

  absl::StatusOr<Sequence> Compile(const json& s, const std::string& ptr, int depth) {
    if (depth > kMaxSchemaDepth) {
      return Error(ptr, absl::StrCat("schema nested deeper than ", kMaxSchemaDepth, " (kMaxSchemaDepth)"));
    }
    if (s.is_boolean()) {
      if (s.get<bool>()) return Sequence{AnyValue()};
      return Error(ptr, "schema 'false' accepts no value");
    }
    if (!s.is_object()) return Error(ptr, "a schema must be an object or a boolean");
    std::vector<std::string> keys;
    for (const auto& [k, v] : s.items()) {
      if (AnnotationKeywords().contains(k)) continue;
      if (!SupportedKeywords().contains(k)) {
        return absl::InvalidArgumentError(absl::StrCat("unsupported JSON Schema keyword '", k, "' at ",
                                                       ptr.empty() ? "/" : ptr));
      }
      keys.push_back(k);
    }
    auto only = [&](std::string_view kw) -> absl::Status {
      for (const std::string& k : keys) {
        if (k != kw) {
          return Error(ptr, absl::StrCat("'", std::string(kw), "' combined with '", k, "' is not supported"));
        }
      }
      return absl::OkStatus();
    };
    if (s.contains("$ref")) {
      if (auto st = only("$ref"); !st.ok()) return st;
      return Ref(s["$ref"], ptr + "/$ref", depth);
    }
    for (const char* kw : {"anyOf", "oneOf"}) {
      if (!s.contains(kw)) continue;
      if (auto st = only(kw); !st.ok()) return st;
      const json& list = s[kw];
      if (!list.is_array() || list.empty()) return Error(ptr + "/" + kw, "must be a non-empty array");
      std::vector<Sequence> alts;
      for (size_t i = 0; i < list.size(); ++i) {
        absl::StatusOr<Sequence> alt = Compile(list[i], absl::StrCat(ptr, "/", kw, "/", i), depth + 1);
        if (!alt.ok()) return alt.status();
        alts.push_back(*std::move(alt));
      }
      return Sequence{g_.Choice(absl::StrCat(ptr, "/", kw), std::move(alts))};
    }
    if (s.contains("allOf")) {
      if (auto st = only("allOf"); !st.ok()) return st;
      const json& list = s["allOf"];
      if (!list.is_array() || list.size() != 1) {
        return Error(ptr + "/allOf", "only an allOf with exactly one schema is supported");
      }
      return Compile(list[0], ptr + "/allOf/0", depth + 1);
    }
    if (s.contains("const")) return Sequence{Literal(Dump(s["const"]))};
    if (s.contains("enum")) {
      const json& list = s["enum"];
      if (!list.is_array() || list.empty()) return Error(ptr + "/enum", "must be a non-empty array");
      std::vector<Sequence> alts;
      for (const json& v : list) alts.push_back(g_.Literal(Dump(v)));
      return Sequence{g_.Choice(ptr + "/enum", std::move(alts))};
    }
    // Types: given, or inferred from the keywords present.
    std::vector<std::string> types;
    if (s.contains("type")) {
      const json& t = s["type"];
      if (t.is_string()) {
        types.push_back(t.get<std::string>());
      } else if (t.is_array() && !t.empty()) {
        for (const json& x : t) {
          if (!x.is_string()) return Error(ptr + "/type", "must be a string or an array of strings");
          types.push_back(x.get<std::string>());
        }
      } else {
        return Error(ptr + "/type", "must be a string or a non-empty array of strings");
      }
    } else {
      auto has = [&](std::initializer_list<const char*> kws) {
        for (const char* k : kws) {
          if (s.contains(k)) return true;
        }
        return false;
      };
      if (has({"properties", "required", "additionalProperties"})) types.push_back("object");
      if (has({"items", "prefixItems", "minItems", "maxItems"})) types.push_back("array");
      if (has({"pattern", "format", "minLength", "maxLength"})) types.push_back("string");
      if (has({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) types.push_back("number");
      if (types.empty()) return Sequence{AnyValue()};
    }
    std::vector<Sequence> alts;
    for (const std::string& type : types) {
      absl::StatusOr<Sequence> alt;
      if (type == "object") {
        alt = Object(s, ptr, depth);
      } else if (type == "array") {
        alt = Array(s, ptr, depth);
      } else if (type == "string") {
        alt = String(s, ptr);
      } else if (type == "integer" || type == "number") {
        alt = Number(s, ptr, type == "integer");
      } else if (type == "boolean") {
        alt = Sequence{g_.Choice("boolean", {g_.Literal("true"), g_.Literal("false")})};
      } else if (type == "null") {
        alt = g_.Literal("null");
      } else {
        return Error(ptr + "/type", absl::StrCat("unknown type '", type, "'"));
      }
      if (!alt.ok()) return alt.status();
      alts.push_back(*std::move(alt));
    }
    if (alts.size() == 1) return alts[0];
    return Sequence{g_.Choice(ptr + "/type", std::move(alts))};
  }

 private:
  static absl::Status Error(const std::string& ptr, std::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("at ", ptr.empty() ? "/" : ptr, ": ", std::string(what)));
  }

  GrammarElement Literal(const std::string& bytes) {
    const uint32_t r = g_.AddRule("literal");
    g_.AddAlternative(r, g_.Literal(bytes));
    return Grammar::Ref(r);
  }

  // `c` then an optional single space, then `rest`.
  GrammarElement Sep(char c, const Sequence& rest) {
    Sequence tight = {g_.Byte(static_cast<uint8_t>(c))};
    tight.insert(tight.end(), rest.begin(), rest.end());
    Sequence spaced = {g_.Byte(static_cast<uint8_t>(c)), g_.Byte(' ')};
    spaced.insert(spaced.end(), rest.begin(), rest.end());
    return g_.Choice(std::string(1, c), {std::move(tight), std::move(spaced)});
  }

  absl::StatusOr<uint32_t> Regex(const std::string& pattern, const RegexOptions& options, const std::string& name) {
    return CompileRegex(pattern, options, g_, name);
  }

  // A plain JSON string (any content, any escapes).
  GrammarElement StringValue() {
    if (!string_rule_) {
      absl::StatusOr<uint32_t> r = Regex(absl::StrCat("\"", kJsonChar, "*\""), {}, "string");
      if (!r.ok()) {
        g_.SetError(r.status());
        string_rule_ = g_.AddRule("string");
      } else {
        string_rule_ = *r;
      }
    }
    return Grammar::Ref(*string_rule_);
  }

  GrammarElement NumberValue() {
    if (!number_rule_) {
      absl::StatusOr<uint32_t> r = Regex(kNumberRegex, {}, "number");
      if (!r.ok()) g_.SetError(r.status());
      number_rule_ = r.ok() ? *r : g_.AddRule("number");
    }
    return Grammar::Ref(*number_rule_);
  }

  // Any JSON value (layout as everywhere: optional single space after ':'
  // and ',').
  GrammarElement AnyValue() {
    if (any_rule_) return Grammar::Ref(*any_rule_);
    const uint32_t value = g_.AddRule("value");
    any_rule_ = value;
    const uint32_t member = g_.AddRule("member");
    g_.AddAlternative(member, {StringValue(), Sep(':', {Grammar::Ref(value)})});
    const uint32_t members = g_.AddRule("members");  // ("," sp? member)*
    g_.AddAlternative(members, {Sep(',', {Grammar::Ref(member), Grammar::Ref(members)})});
    g_.AddAlternative(members, {});
    const uint32_t elements = g_.AddRule("elements");
    g_.AddAlternative(elements, {Sep(',', {Grammar::Ref(value), Grammar::Ref(elements)})});
    g_.AddAlternative(elements, {});
    g_.AddAlternative(value, g_.Literal("{}"));
    g_.AddAlternative(value, {g_.Byte('{'), Grammar::Ref(member), Grammar::Ref(members), g_.Byte('}')});
    g_.AddAlternative(value, g_.Literal("[]"));
    g_.AddAlternative(value, {g_.Byte('['), Grammar::Ref(value), Grammar::Ref(elements), g_.Byte(']')});
    g_.AddAlternative(value, {StringValue()});
    g_.AddAlternative(value, {NumberValue()});
    g_.AddAlternative(value, g_.Literal("true"));
    g_.AddAlternative(value, g_.Literal("false"));
    g_.AddAlternative(value, g_.Literal("null"));
    return Grammar::Ref(value);
  }

  absl::StatusOr<Sequence> Ref(const json& ref, const std::string& ptr, int depth) {
    if (!ref.is_string()) return Error(ptr, "must be a string");
    const std::string target = ref.get<std::string>();
    if (target.empty() || target[0] != '#') {
      return Error(ptr, absl::StrCat("only local references ('#...') are supported, not '", target, "'"));
    }
    if (auto it = refs_.find(target); it != refs_.end()) return Sequence{Grammar::Ref(it->second)};
    // Resolve the JSON pointer.
    const json* node = &root_;
    std::string path = target.substr(1);
    std::string resolved;
    size_t i = 0;
    while (i < path.size()) {
      if (path[i] != '/') return Error(ptr, absl::StrCat("malformed reference '", target, "'"));
      size_t j = path.find('/', i + 1);
      if (j == std::string::npos) j = path.size();
      std::string token;
      for (size_t k = i + 1; k < j; ++k) {
        if (path[k] == '~' && k + 1 < j && (path[k + 1] == '0' || path[k + 1] == '1')) {
          token += path[k + 1] == '0' ? '~' : '/';
          ++k;
        } else {
          token += path[k];
        }
      }
      if (node->is_object() && node->contains(token)) {
        node = &(*node)[token];
      } else if (node->is_array() && !token.empty() &&
                 token.find_first_not_of("0123456789") == std::string::npos && token.size() < 9 &&
                 std::stoul(token) < node->size()) {
        node = &(*node)[std::stoul(token)];
      } else {
        return Error(ptr, absl::StrCat("reference '", target, "' does not resolve"));
      }
      resolved += "/" + Escape(token);
      i = j;
    }
    const uint32_t rule = g_.AddRule("ref:" + target);
    refs_[target] = rule;
    absl::StatusOr<Sequence> body = Compile(*node, resolved, depth + 1);
    if (!body.ok()) return body.status();
    g_.AddAlternative(rule, *std::move(body));
    return Sequence{Grammar::Ref(rule)};
  }

  absl::StatusOr<int64_t> Count(const json& s, const char* kw, const std::string& ptr, int64_t fallback) {
    if (!s.contains(kw)) return fallback;
    const json& v = s[kw];
    if (!v.is_number_integer() && !(v.is_number_float() && std::floor(v.get<double>()) == v.get<double>())) {
      return Error(ptr + "/" + kw, "must be a non-negative integer");
    }
    const double d = v.get<double>();
    if (d < 0) return Error(ptr + "/" + kw, "must be a non-negative integer");
    if (d > static_cast<double>(kMaxSchemaCount)) {
      return Error(ptr + "/" + kw, absl::StrCat("above ", kMaxSchemaCount, " (kMaxSchemaCount) is not supported"));
    }
    return static_cast<int64_t>(d);
  }

  // Any key except the declared names (keys are canonical strings: JSON's
  // short escapes where it must escape; a key diverging from every declared
  // name does so at an ASCII character).
  GrammarElement KeyExcept(const std::vector<std::string>& names) {
    if (names.empty()) return StringValue();
    if (!canonical_rest_) {
      absl::StatusOr<uint32_t> r =
          Regex("[\\s\\S]*", {.json_string_content = true}, "key_rest");
      if (!r.ok()) g_.SetError(r.status());
      canonical_rest_ = r.ok() ? *r : g_.AddRule("key_rest");
    }
    struct TrieNode {
      std::vector<std::pair<uint8_t, int>> kids;
      bool terminal = false;
    };
    std::vector<TrieNode> trie(1);
    for (const std::string& name : names) {
      const std::string enc = Dump(json(name));  // "..." canonical
      int at = 0;
      for (size_t k = 1; k + 1 < enc.size(); ++k) {
        const uint8_t b = static_cast<uint8_t>(enc[k]);
        int next = -1;
        for (auto [c, n] : trie[at].kids) {
          if (c == b) next = n;
        }
        if (next < 0) {
          next = static_cast<int>(trie.size());
          trie[at].kids.push_back({b, next});
          trie.emplace_back();
        }
        at = next;
      }
      trie[at].terminal = true;
    }
    std::vector<uint32_t> rules(trie.size());
    for (size_t n = 0; n < trie.size(); ++n) rules[n] = g_.AddRule("key_except");
    for (size_t n = 0; n < trie.size(); ++n) {
      ByteSet diverge;
      diverge.AddRange(0x20, 0x7E);
      for (uint8_t c : {uint8_t{'"'}, uint8_t{'\\'}}) diverge.words[c >> 6] &= ~(uint64_t{1} << (c & 63));
      for (auto [c, kid] : trie[n].kids) {
        diverge.words[c >> 6] &= ~(uint64_t{1} << (c & 63));
        g_.AddAlternative(rules[n], {g_.Byte(c), Grammar::Ref(rules[kid])});
      }
      if (!diverge.empty()) {
        g_.AddAlternative(rules[n], {g_.Bytes(diverge), Grammar::Ref(*canonical_rest_), g_.Byte('"')});
      }
      if (!trie[n].terminal) g_.AddAlternative(rules[n], {g_.Byte('"')});
    }
    return g_.Choice("key", {{g_.Byte('"'), Grammar::Ref(rules[0])}});
  }

  absl::StatusOr<Sequence> Object(const json& s, const std::string& ptr, int depth) {
    struct Member {
      std::string name;
      bool required;
      Sequence value;
    };
    std::vector<Member> members;
    absl::flat_hash_set<std::string> required;
    if (s.contains("required")) {
      const json& r = s["required"];
      if (!r.is_array()) return Error(ptr + "/required", "must be an array of strings");
      for (const json& x : r) {
        if (!x.is_string()) return Error(ptr + "/required", "must be an array of strings");
        required.insert(x.get<std::string>());
      }
    }
    std::vector<std::string> names;
    if (s.contains("properties")) {
      const json& props = s["properties"];
      if (!props.is_object()) return Error(ptr + "/properties", "must be an object");
      // nlohmann::json sorts keys; restore the schema's order from the text.
      for (const std::string& name : PropertyOrder(props)) {
        absl::StatusOr<Sequence> v = Compile(props[name], ptr + "/properties/" + Escape(name), depth + 1);
        if (!v.ok()) return v.status();
        members.push_back({name, required.contains(name), *std::move(v)});
        names.push_back(name);
      }
    }
    for (const json& x : s.value("required", json::array())) {
      const std::string name = x.get<std::string>();
      if (std::find(names.begin(), names.end(), name) == names.end()) {
        // A required key outside `properties` is an additional property.
        Sequence value = {AnyValue()};
        if (s.contains("additionalProperties")) {
          const json& a = s["additionalProperties"];
          if (a.is_boolean() && !a.get<bool>()) {
            return Error(ptr + "/required", absl::StrCat("'", name, "' is required but not in properties, and "
                                                         "additionalProperties is false: no object "
                                                         "satisfies the schema"));
          }
          absl::StatusOr<Sequence> v = Compile(a, ptr + "/additionalProperties", depth + 1);
          if (!v.ok()) return v.status();
          value = *std::move(v);
        }
        members.push_back({name, true, std::move(value)});
        names.push_back(name);
      }
    }
    // Additional properties: absent = none when properties are declared
    // (any object otherwise); true = any value; a schema = its values.
    std::optional<Sequence> extra;
    if (s.contains("additionalProperties")) {
      const json& a = s["additionalProperties"];
      if (!(a.is_boolean() && !a.get<bool>())) {
        absl::StatusOr<Sequence> v = Compile(a, ptr + "/additionalProperties", depth + 1);
        if (!v.ok()) return v.status();
        extra = *std::move(v);
      }
    } else if (!s.contains("properties") && !s.contains("required")) {
      extra = Sequence{AnyValue()};
    }
    const size_t n = members.size();
    // F[i]: nothing emitted yet, members i.. to go; T[i]: something emitted
    // (the next member needs a comma).
    std::vector<uint32_t> first(n + 1), then(n + 1);
    for (size_t i = 0; i <= n; ++i) {
      first[i] = g_.AddRule(absl::StrCat(ptr, "/F", i));
      then[i] = g_.AddRule(absl::StrCat(ptr, "/T", i));
    }
    if (extra.has_value()) {
      Sequence kv = {KeyExcept(names), Sep(':', *extra)};
      const uint32_t rest = g_.AddRule(ptr + "/extra*");
      Sequence loop = kv;
      loop.push_back(Grammar::Ref(rest));
      g_.AddAlternative(rest, {Sep(',', loop)});
      g_.AddAlternative(rest, {});
      g_.AddAlternative(first[n], {});
      kv.push_back(Grammar::Ref(rest));
      g_.AddAlternative(first[n], kv);
      g_.AddAlternative(then[n], {Grammar::Ref(rest)});
    } else {
      g_.AddAlternative(first[n], {});
      g_.AddAlternative(then[n], {});
    }
    for (size_t i = n; i-- > 0;) {
      Sequence m = g_.Literal(Dump(json(members[i].name)));
      m.push_back(Sep(':', members[i].value));
      m.push_back(Grammar::Ref(then[i + 1]));
      g_.AddAlternative(first[i], m);
      g_.AddAlternative(then[i], {Sep(',', m)});
      if (!members[i].required) {
        g_.AddAlternative(first[i], {Grammar::Ref(first[i + 1])});
        g_.AddAlternative(then[i], {Grammar::Ref(then[i + 1])});
      }
    }
    return Sequence{g_.Byte('{'), Grammar::Ref(first[0]), g_.Byte('}')};
  }

  std::vector<std::string> PropertyOrder(const json& props) {
    std::vector<std::string> names;
    for (const auto& [k, v] : props.items()) names.push_back(k);
    auto it = order_.find(&props);
    if (it == order_.end()) return names;
    return it->second;
  }

  absl::StatusOr<Sequence> Array(const json& s, const std::string& ptr, int depth) {
    absl::StatusOr<int64_t> min = Count(s, "minItems", ptr, 0);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxItems", ptr, -1);
    if (!max.ok()) return max.status();
    std::vector<Sequence> prefix;
    if (s.contains("prefixItems")) {
      const json& p = s["prefixItems"];
      if (!p.is_array()) return Error(ptr + "/prefixItems", "must be an array of schemas");
      if (p.size() > static_cast<size_t>(kMaxSchemaCount)) return Error(ptr + "/prefixItems", "too many entries");
      for (size_t i = 0; i < p.size(); ++i) {
        absl::StatusOr<Sequence> v = Compile(p[i], absl::StrCat(ptr, "/prefixItems/", i), depth + 1);
        if (!v.ok()) return v.status();
        prefix.push_back(*std::move(v));
      }
    }
    std::optional<Sequence> items = Sequence{AnyValue()};
    if (s.contains("items")) {
      const json& it = s["items"];
      if (it.is_boolean() && !it.get<bool>()) {
        items.reset();
      } else if (it.is_array()) {
        return Error(ptr + "/items", "an array of schemas (draft 4 tuples) is not supported; use prefixItems");
      } else {
        absl::StatusOr<Sequence> v = Compile(it, ptr + "/items", depth + 1);
        if (!v.ok()) return v.status();
        items = *std::move(v);
      }
    }
    const int64_t k = static_cast<int64_t>(prefix.size());
    int64_t hi = *max;
    if (!items.has_value()) hi = hi < 0 ? k : std::min(hi, k);
    if (hi >= 0 && *min > hi) return Error(ptr, "minItems exceeds the items the array can hold");
    if (hi == 0) return g_.Literal("[]");
    auto item = [&](int64_t i) { return i < k ? prefix[i] : *items; };
    // after[i]: i items emitted (i >= 1).
    const int64_t uniform_from = std::max<int64_t>(std::max<int64_t>(k, *min), 1);
    const int64_t last = hi < 0 ? uniform_from : hi;
    std::vector<uint32_t> after(static_cast<size_t>(last + 1));
    for (int64_t i = 1; i <= last; ++i) after[i] = g_.AddRule(absl::StrCat(ptr, "/after", i));
    for (int64_t i = 1; i <= last; ++i) {
      if (i >= *min) g_.AddAlternative(after[i], {});
      if (hi >= 0 && i >= hi) continue;
      Sequence next = item(i);
      next.push_back(Grammar::Ref(hi < 0 && i == last ? after[i] : after[i + 1]));
      g_.AddAlternative(after[i], {Sep(',', next)});
    }
    std::vector<Sequence> alts;
    if (*min == 0) alts.push_back(g_.Literal("[]"));
    Sequence full = {g_.Byte('[')};
    const Sequence first = item(0);
    full.insert(full.end(), first.begin(), first.end());
    full.push_back(Grammar::Ref(after[1]));
    full.push_back(g_.Byte(']'));
    alts.push_back(std::move(full));
    return Sequence{g_.Choice(ptr + "/array", std::move(alts))};
  }

  absl::StatusOr<Sequence> String(const json& s, const std::string& ptr) {
    const bool has_length = s.contains("minLength") || s.contains("maxLength");
    if (s.contains("pattern") || s.contains("format")) {
      if (has_length && s.contains("format")) {
        return Error(ptr, "minLength/maxLength together with format is not supported");
      }
      if (s.contains("pattern") && s.contains("format")) {
        return Error(ptr, "pattern together with format is not supported");
      }
      std::string pattern;
      RegexOptions options{.json_string_content = true, .search = true};
      if (s.contains("pattern")) {
        if (!s["pattern"].is_string()) return Error(ptr + "/pattern", "must be a string");
        pattern = s["pattern"].get<std::string>();
      } else {
        if (!s["format"].is_string()) return Error(ptr + "/format", "must be a string");
        absl::StatusOr<std::string> f = FormatRegex(s["format"].get<std::string>(), ptr + "/format");
        if (!f.ok()) return f.status();
        pattern = *f;
        options.search = false;
      }
      if (has_length) {
        absl::StatusOr<int64_t> min = Count(s, "minLength", ptr, 0);
        if (!min.ok()) return min.status();
        absl::StatusOr<int64_t> max = Count(s, "maxLength", ptr, -1);
        if (!max.ok()) return max.status();
        if (*max >= 0 && *max < *min) return Error(ptr, "maxLength is below minLength");
        options.min_code_points = *min;
        options.max_code_points = *max;
      }
      absl::StatusOr<uint32_t> r = Regex(pattern, options, ptr + "/pattern");
      if (!r.ok()) {
        if (r.status().code() == absl::StatusCode::kResourceExhausted) {
          return absl::ResourceExhaustedError(absl::StrCat("at ", ptr, "/pattern: ", r.status().message()));
        }
        return Error(ptr + (s.contains("pattern") ? "/pattern" : "/format"), std::string(r.status().message()));
      }
      return Sequence{g_.Byte('"'), Grammar::Ref(*r), g_.Byte('"')};
    }
    if (!has_length) return Sequence{StringValue()};
    absl::StatusOr<int64_t> min = Count(s, "minLength", ptr, 0);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxLength", ptr, -1);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Error(ptr, "maxLength is below minLength");
    const std::string pattern = absl::StrCat("\"", kJsonChar, "{", *min, ",", *max >= 0 ? absl::StrCat(*max) : "", "}\"");
    absl::StatusOr<uint32_t> r = Regex(pattern, {}, ptr + "/string");
    if (!r.ok()) return r.status();
    return Sequence{Grammar::Ref(*r)};
  }

  absl::StatusOr<std::string> FormatRegex(const std::string& format, const std::string& ptr) {
    // Subsets of the formats' grammars (RFC 3339, RFC 4122, RFC 5321):
    // every string they allow is valid, not every valid string is allowed.
    const std::string date =
        R"([0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8])))";
    const std::string time =
        R"((?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9]))";
    if (format == "date") return date;
    if (format == "time") return time;
    if (format == "date-time") return date + "T" + time;
    if (format == "uuid") return "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}";
    if (format == "email") {
      return R"([A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.[A-Za-z]{2,24})";
    }
    if (format == "ipv4") {
      return R"((?:(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9]))";
    }
    return Error(ptr, absl::StrCat("unsupported format '", format,
                                   "' (supported: date, time, date-time, uuid, email, ipv4)"));
  }

  // A bound's value: numbers only.
  absl::StatusOr<std::optional<double>> Bound(const json& s, const char* kw, const std::string& ptr) {
    if (!s.contains(kw)) return std::optional<double>();
    const json& v = s[kw];
    if (v.is_boolean()) return std::optional<double>();  // draft 4 exclusive flags, read below
    if (!v.is_number()) return Error(ptr + "/" + kw, "must be a number");
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::fabs(d) > 1e17) {
      return Error(ptr + "/" + kw, "bounds beyond 1e17 are not supported");
    }
    return std::optional<double>(d);
  }

  absl::StatusOr<Sequence> Number(const json& s, const std::string& ptr, bool integer) {
    absl::StatusOr<std::optional<double>> minimum = Bound(s, "minimum", ptr);
    if (!minimum.ok()) return minimum.status();
    absl::StatusOr<std::optional<double>> maximum = Bound(s, "maximum", ptr);
    if (!maximum.ok()) return maximum.status();
    absl::StatusOr<std::optional<double>> xmin = Bound(s, "exclusiveMinimum", ptr);
    if (!xmin.ok()) return xmin.status();
    absl::StatusOr<std::optional<double>> xmax = Bound(s, "exclusiveMaximum", ptr);
    if (!xmax.ok()) return xmax.status();
    // Lower bound: the tighter of minimum and exclusiveMinimum (draft 4:
    // exclusiveMinimum: true makes minimum exclusive).
    bool has_lo = false, lo_incl = true, has_hi = false, hi_incl = true;
    double lo = 0, hi = 0;
    if (minimum->has_value()) has_lo = true, lo = **minimum;
    if (s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_boolean() && s["exclusiveMinimum"].get<bool>() && has_lo) {
      lo_incl = false;
    }
    if (xmin->has_value() && (!has_lo || **xmin >= lo)) has_lo = true, lo = **xmin, lo_incl = false;
    if (maximum->has_value()) has_hi = true, hi = **maximum;
    if (s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_boolean() && s["exclusiveMaximum"].get<bool>() && has_hi) {
      hi_incl = false;
    }
    if (xmax->has_value() && (!has_hi || **xmax <= hi)) has_hi = true, hi = **xmax, hi_incl = false;
    std::string pattern;
    if (integer) {
      Int ilo = 0, ihi = 0;
      if (has_lo) ilo = static_cast<Int>(lo_incl ? std::ceil(lo) : std::floor(lo) + 1);
      if (has_hi) ihi = static_cast<Int>(hi_incl ? std::floor(hi) : std::ceil(hi) - 1);
      if (has_lo && has_hi && ilo > ihi) return Error(ptr, "no integer lies within the bounds");
      pattern = has_lo || has_hi ? IntegerRangeRegex(has_lo, ilo, has_hi, ihi) : kIntegerRegex;
    } else if (!has_lo && !has_hi) {
      return Sequence{NumberValue()};
    } else {
      if (has_lo && has_hi && (lo > hi || (lo == hi && !(lo_incl && hi_incl)))) {
        return Error(ptr, "no number lies within the bounds");
      }
      // Validators compare doubles: a decimal just inside an exclusive bound
      // can round onto it (0.999999999999999999 parses as 1). An exclusive
      // bound is therefore the inclusive one at the adjacent double, so
      // every emitted number parses strictly inside.
      if (has_lo && !lo_incl) lo = std::nextafter(lo, HUGE_VAL), lo_incl = true;
      if (has_hi && !hi_incl) hi = std::nextafter(hi, -HUGE_VAL), hi_incl = true;
      // x >= 0 part and x < 0 part (as '-' and a magnitude > 0). The bounds
      // are exact decimals: the shortest representation of the doubles
      // (x <= that decimal then parses to a double <= the bound).
      std::vector<std::string> alts;
      const Decimal L = has_lo ? ToDecimal(lo) : Decimal{}, H = has_hi ? ToDecimal(hi) : Decimal{};
      if (!has_hi || hi > 0 || (hi == 0 && hi_incl)) {
        const bool from_zero = !has_lo || lo < 0;
        std::optional<std::string> m =
            MagnitudeRange(from_zero ? Decimal{} : L, from_zero || lo_incl, has_hi ? &H : nullptr, hi_incl);
        if (m) alts.push_back(*m);
      }
      if (!has_lo || lo < 0) {
        const bool from_zero = !has_hi || hi >= 0;
        std::optional<std::string> m =
            MagnitudeRange(from_zero ? Decimal{} : H, from_zero ? false : hi_incl, has_lo ? &L : nullptr, lo_incl);
        if (m) alts.push_back("-" + *m);
      }
      if (alts.empty()) return Error(ptr, "no number lies within the bounds");
      pattern = alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
    }
    absl::StatusOr<uint32_t> r = Regex(pattern, {}, ptr + (integer ? "/integer" : "/number"));
    if (!r.ok()) return r.status();
    return Sequence{Grammar::Ref(*r)};
  }

 public:
  // Key order of every object in the document, keyed by the parsed node.
  absl::flat_hash_map<const json*, std::vector<std::string>> order_;

 private:
  const json& root_;
  Grammar& g_;
  std::optional<uint32_t> string_rule_, number_rule_, any_rule_, canonical_rest_;
  absl::flat_hash_map<std::string, uint32_t> refs_;
};

}  // namespace

absl::StatusOr<uint32_t> CompileJsonSchema(std::string_view schema, Grammar& grammar) {
  if (schema.size() > kMaxSchemaBytes) {
    return absl::InvalidArgumentError(absl::StrCat("schema of ", schema.size(), " bytes exceeds ",
                                                   kMaxSchemaBytes, " (kMaxSchemaBytes)"));
  }
  // Parse twice: ordered (for the properties' order) and plain. The depth
  // of the text is bounded first so the recursive parser cannot overflow.
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < schema.size(); ++i) {
    const char c = schema[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  if (max_depth > 4 * kMaxSchemaDepth) {
    return absl::InvalidArgumentError(absl::StrCat("schema nested deeper than ", 4 * kMaxSchemaDepth, " levels"));
  }
  nlohmann::ordered_json ordered;
  try {
    ordered = nlohmann::ordered_json::parse(schema);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("schema is not valid JSON: ", e.what()));
  }
  json doc = json::parse(schema, nullptr, false);
  SchemaCompiler compiler(doc, grammar);
  // Key order: walk both trees together.
  std::vector<std::pair<const json*, const nlohmann::ordered_json*>> work = {{&doc, &ordered}};
  while (!work.empty()) {
    auto [plain, ord] = work.back();
    work.pop_back();
    if (ord->is_object()) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : ord->items()) {
        keys.push_back(k);
        work.push_back({&(*plain)[k], &v});
      }
      compiler.order_[plain] = std::move(keys);
    } else if (ord->is_array()) {
      for (size_t i = 0; i < ord->size(); ++i) work.push_back({&(*plain)[i], &(*ord)[i]});
    }
  }
  absl::StatusOr<Sequence> root = compiler.Compile(doc, "", 0);
  if (!root.ok()) return root.status();
  if (!grammar.status().ok()) return grammar.status();
  const uint32_t rule = grammar.AddRule("root");
  grammar.AddAlternative(rule, *std::move(root));
  return rule;
}

}  // namespace exl3serve::coordinator::constrained
