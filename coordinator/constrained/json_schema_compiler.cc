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
#include "coordinator/constrained/utf8_ranges.h"
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

// ---- local references -------------------------------------------------------

struct Resolved {
  const json* node;
  std::string ptr;  // the target's JSON pointer (escaped)
};

// `target` ("#", "#/$defs/a", ...) in `root`. InvalidArgument ("malformed
// reference", "does not resolve") otherwise.
absl::StatusOr<Resolved> ResolveLocalRef(const json& root, const std::string& target) {
  if (target.empty() || target[0] != '#') {
    return absl::InvalidArgumentError(absl::StrCat("reference '", target, "' is not local"));
  }
  const json* node = &root;
  const std::string path = target.substr(1);
  std::string resolved;
  size_t i = 0;
  while (i < path.size()) {
    if (path[i] != '/') return absl::InvalidArgumentError(absl::StrCat("malformed reference '", target, "'"));
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
    } else if (node->is_array() && !token.empty() && token.find_first_not_of("0123456789") == std::string::npos &&
               token.size() < 9 && std::stoul(token) < node->size()) {
      node = &(*node)[std::stoul(token)];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("reference '", target, "' does not resolve"));
    }
    absl::StrAppend(&resolved, "/", Escape(token));
    i = j;
  }
  return Resolved{node, resolved};
}

// ---- oneOf: branches that exclude each other --------------------------------
//
// oneOf needs every emitted value to match exactly one branch. The compiler
// emits branch i's strings only when it can prove that none of them is valid
// against any other branch j (Disjointness::Excludes: "what the compiler
// emits for i" against "what JSON Schema accepts for j"), after narrowing i's
// objects if that helps (Narrowing). A branch every output of which is valid
// against another branch (Disjointness::Within) can never be the single
// match and is dropped. Anything else is refused.

// Object keys a oneOf makes a branch leave out or always write, so that its
// objects fail another branch. Applies to the branch's own objects (after
// $ref and one-entry allOf), not to nested values.
struct Narrowing {
  std::vector<std::string> exclude;  // never written (neither as declared nor as extra keys)
  std::vector<std::string> require;  // declared optional properties written always
  bool empty() const { return exclude.empty() && require.empty(); }
  bool Excluded(const std::string& k) const { return std::find(exclude.begin(), exclude.end(), k) != exclude.end(); }
  bool Required(const std::string& k) const { return std::find(require.begin(), require.end(), k) != require.end(); }
};

// JSON value kinds; integer-valued numbers and the others apart (JSON Schema:
// 1.0 is an integer).
enum : uint8_t {
  kKindNull = 1,
  kKindBool = 2,
  kKindObject = 4,
  kKindArray = 8,
  kKindString = 16,
  kKindInt = 32,
  kKindFrac = 64,
  kKindAny = 127,
};

uint8_t TypeKind(const json& t) {
  if (!t.is_string()) return 0;
  const std::string name = t.get<std::string>();
  if (name == "null") return kKindNull;
  if (name == "boolean") return kKindBool;
  if (name == "object") return kKindObject;
  if (name == "array") return kKindArray;
  if (name == "string") return kKindString;
  if (name == "integer") return kKindInt;
  if (name == "number") return kKindInt | kKindFrac;
  return 0;
}

uint8_t ValueKind(const json& v) {
  if (v.is_null()) return kKindNull;
  if (v.is_boolean()) return kKindBool;
  if (v.is_object()) return kKindObject;
  if (v.is_array()) return kKindArray;
  if (v.is_string()) return kKindString;
  if (v.is_number_integer() || v.is_number_unsigned()) return kKindInt;
  const double d = v.get<double>();
  return std::isfinite(d) && std::floor(d) == d ? uint8_t{kKindInt} : uint8_t{kKindFrac};
}

bool Has(const json& s, const char* kw) { return s.is_object() && s.contains(kw); }

// Kinds of the type keyword (absent: all, as JSON Schema validates them).
uint8_t DeclaredKinds(const json& s) {
  if (!Has(s, "type")) return kKindAny;
  const json& t = s["type"];
  if (!t.is_array()) return TypeKind(t);
  uint8_t k = 0;
  for (const json& x : t) k |= TypeKind(x);
  return k;
}

// Kinds the compiler emits for a schema without const/enum/combinators (the
// type keyword, or the types its keywords imply, or any).
uint8_t EmittedKinds(const json& s) {
  if (!s.is_object()) return kKindAny;
  if (Has(s, "type")) return DeclaredKinds(s);
  uint8_t k = 0;
  auto any = [&](std::initializer_list<const char*> kws) {
    for (const char* kw : kws) {
      if (s.contains(kw)) return true;
    }
    return false;
  };
  if (any({"properties", "required", "additionalProperties"})) k |= kKindObject;
  if (any({"items", "prefixItems", "minItems", "maxItems"})) k |= kKindArray;
  if (any({"pattern", "format", "minLength", "maxLength"})) k |= kKindString;
  if (any({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})) k |= kKindInt | kKindFrac;
  return k == 0 ? uint8_t{kKindAny} : k;
}

// The numbers a schema's bounds admit (the same reading as the compiler's).
struct NumberRange {
  bool has_lo = false, lo_incl = true, has_hi = false, hi_incl = true;
  double lo = 0, hi = 0;

  explicit NumberRange(const json& s) {
    auto num = [&](const char* kw) -> std::optional<double> {
      if (!Has(s, kw) || !s[kw].is_number()) return std::nullopt;
      return s[kw].get<double>();
    };
    auto flag = [&](const char* kw) { return Has(s, kw) && s[kw].is_boolean() && s[kw].get<bool>(); };
    if (auto m = num("minimum")) has_lo = true, lo = *m, lo_incl = !flag("exclusiveMinimum");
    if (auto x = num("exclusiveMinimum"); x && (!has_lo || *x >= lo)) has_lo = true, lo = *x, lo_incl = false;
    if (auto m = num("maximum")) has_hi = true, hi = *m, hi_incl = !flag("exclusiveMaximum");
    if (auto x = num("exclusiveMaximum"); x && (!has_hi || *x <= hi)) has_hi = true, hi = *x, hi_incl = false;
  }
  double IntLo() const { return lo_incl ? std::ceil(lo) : std::floor(lo) + 1; }
  double IntHi() const { return hi_incl ? std::floor(hi) : std::ceil(hi) - 1; }
  bool In(double x) const {
    if (has_lo && (lo_incl ? x < lo : x <= lo)) return false;
    if (has_hi && (hi_incl ? x > hi : x >= hi)) return false;
    return true;
  }
};

// No number (integers: no integer) lies in both.
bool RangesDisjoint(const NumberRange& a, const NumberRange& b, bool integers) {
  if (integers) {
    if (a.has_lo && a.has_hi && a.IntLo() > a.IntHi()) return true;
    if (b.has_lo && b.has_hi && b.IntLo() > b.IntHi()) return true;
    return (a.has_hi && b.has_lo && a.IntHi() < b.IntLo()) || (b.has_hi && a.has_lo && b.IntHi() < a.IntLo());
  }
  auto below = [](const NumberRange& x, const NumberRange& y) {
    return x.has_hi && y.has_lo && (x.hi < y.lo || (x.hi == y.lo && !(x.hi_incl && y.lo_incl)));
  };
  return below(a, b) || below(b, a);
}

// Every number (integers: integer) of a lies in b.
bool RangeWithin(const NumberRange& a, const NumberRange& b, bool integers) {
  if (integers) {
    if (b.has_lo && !(a.has_lo && a.IntLo() >= b.IntLo())) return false;
    return !b.has_hi || (a.has_hi && a.IntHi() <= b.IntHi());
  }
  if (b.has_lo && !(a.has_lo && (a.lo > b.lo || (a.lo == b.lo && (b.lo_incl || !a.lo_incl))))) return false;
  return !b.has_hi || (a.has_hi && (a.hi < b.hi || (a.hi == b.hi && (b.hi_incl || !a.hi_incl))));
}

// A count interval (string length in code points, array items); hi < 0: unbounded.
struct CountRange {
  int64_t lo = 0, hi = -1;
};

CountRange Counts(const json& s, const char* min_kw, const char* max_kw) {
  CountRange c;
  if (Has(s, min_kw) && s[min_kw].is_number()) c.lo = static_cast<int64_t>(std::ceil(s[min_kw].get<double>()));
  if (Has(s, max_kw) && s[max_kw].is_number()) c.hi = static_cast<int64_t>(std::floor(s[max_kw].get<double>()));
  return c;
}

CountRange ItemCounts(const json& s) {
  CountRange c = Counts(s, "minItems", "maxItems");
  if (Has(s, "items") && s["items"].is_boolean() && !s["items"].get<bool>()) {
    const int64_t k = Has(s, "prefixItems") && s["prefixItems"].is_array() ? s["prefixItems"].size() : 0;
    c.hi = c.hi < 0 ? k : std::min(c.hi, k);
  }
  return c;
}

bool CountsDisjoint(const CountRange& a, const CountRange& b) {
  return (a.hi >= 0 && a.hi < b.lo) || (b.hi >= 0 && b.hi < a.lo) || (a.hi >= 0 && a.hi < a.lo);
}

bool CountWithin(const CountRange& a, const CountRange& b) {
  return a.lo >= b.lo && (b.hi < 0 || (a.hi >= 0 && a.hi <= b.hi));
}

size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

const json& TrueSchema() {
  static const json* t = new json(true);
  return *t;
}

// The schema of array index k (nullptr: no item may stand there).
const json* ItemSchema(const json& s, size_t k) {
  if (Has(s, "prefixItems") && s["prefixItems"].is_array() && k < s["prefixItems"].size()) {
    return &s["prefixItems"][k];
  }
  if (!Has(s, "items")) return &TrueSchema();
  const json& it = s["items"];
  if (it.is_boolean() && !it.get<bool>()) return nullptr;
  return &it;
}

// The schema a key's value must satisfy under JSON Schema (nullptr: the key
// is not allowed).
const json* ValidValue(const json& s, const std::string& key) {
  if (Has(s, "properties") && s["properties"].is_object() && s["properties"].contains(key)) {
    return &s["properties"][key];
  }
  if (!Has(s, "additionalProperties")) return &TrueSchema();
  const json& a = s["additionalProperties"];
  if (a.is_boolean() && !a.get<bool>()) return nullptr;
  return &a;
}

std::vector<std::string> RequiredNames(const json& s) {
  std::vector<std::string> out;
  if (!Has(s, "required") || !s["required"].is_array()) return out;
  for (const json& x : s["required"]) {
    if (x.is_string()) out.push_back(x.get<std::string>());
  }
  return out;
}

// The objects the compiler emits for a schema (its Object()), narrowed.
struct EmittedObject {
  std::vector<std::pair<std::string, const json*>> members;  // declared keys and their value schemas
  absl::flat_hash_set<std::string> required;                 // always written
  const json* extra = nullptr;                               // other keys' values (nullptr: none)
  absl::flat_hash_set<std::string> not_extra;                // keys no extra key equals

  EmittedObject(const json& s, const Narrowing& n) {
    for (const std::string& r : RequiredNames(s)) required.insert(r);
    for (const std::string& r : n.require) required.insert(r);
    absl::flat_hash_set<std::string> declared;
    if (Has(s, "properties") && s["properties"].is_object()) {
      for (const auto& [k, v] : s["properties"].items()) {
        declared.insert(k);
        not_extra.insert(k);
        if (!n.Excluded(k)) members.push_back({k, &v});
      }
    }
    const json* a = Has(s, "additionalProperties") ? &s["additionalProperties"] : nullptr;
    const bool closed = a != nullptr && a->is_boolean() && !a->get<bool>();
    for (const std::string& r : RequiredNames(s)) {
      if (declared.contains(r)) continue;
      declared.insert(r);
      not_extra.insert(r);
      members.push_back({r, a != nullptr && !closed ? a : &TrueSchema()});
    }
    if (a != nullptr && !closed) {
      extra = a;
    } else if (a == nullptr && !Has(s, "properties") && !Has(s, "required")) {
      extra = &TrueSchema();
    }
    for (const std::string& x : n.exclude) not_extra.insert(x);
  }
  // The value schemas key k may be written with (empty: never written).
  std::vector<const json*> Values(const std::string& k) const {
    std::vector<const json*> out;
    for (const auto& [name, v] : members) {
      if (name == k) out.push_back(v);
    }
    if (extra != nullptr && !not_extra.contains(k)) out.push_back(extra);
    return out;
  }
};

enum class Tri { kNo, kYes, kUnknown };

// Conservative decisions about schemas of one document. Each answer "true"
// is a proof; "false" means "not proven" (also when the work or depth
// budget runs out, e.g. on recursive references).
class Disjointness {
 public:
  explicit Disjointness(const json& root) : root_(root) {}

  // Follows $ref and one-entry allOf (extending *ptr with the path taken):
  // the schema node a branch stands for. nullptr: a reference that does not
  // resolve, or a chain of references longer than kMaxSchemaDepth.
  const json* Resolve(const json& s, std::string* ptr = nullptr) const {
    const json* at = &s;
    for (int hops = 0; hops <= kMaxSchemaDepth; ++hops) {
      if (Has(*at, "$ref") && (*at)["$ref"].is_string()) {
        absl::StatusOr<Resolved> r = ResolveLocalRef(root_, (*at)["$ref"].get<std::string>());
        if (!r.ok()) return nullptr;
        at = r->node;
        if (ptr != nullptr) *ptr = r->ptr;
      } else if (Has(*at, "allOf") && (*at)["allOf"].is_array() && (*at)["allOf"].size() == 1) {
        at = &(*at)["allOf"][0];
        if (ptr != nullptr) *ptr += "/allOf/0";
      } else {
        return at;
      }
    }
    return nullptr;
  }

  // No value the compiler emits for `a` (narrowed by `n`) is valid against `b`.
  bool Excludes(const json& a, const Narrowing& n, const json& b, int depth = 0) {
    if (!Spend(depth)) return false;
    const json* ra = Resolve(a);
    const json* rb = Resolve(b);
    if (ra == nullptr || rb == nullptr) return false;
    if (rb->is_boolean()) return !rb->get<bool>();
    if (ra->is_boolean()) return !ra->get<bool>();
    if (!ra->is_object() || !rb->is_object()) return false;
    // b's valid values lie in the union of its branches (oneOf: a subset).
    if (const json* list = Branches(*rb)) {
      for (const json& br : *list) {
        if (!Excludes(*ra, n, br, depth + 1)) return false;
      }
      return true;
    }
    if (const json* list = Branches(*ra)) {
      for (const json& br : *list) {
        if (!Excludes(br, Narrowing{}, *rb, depth + 1)) return false;
      }
      return true;
    }
    if (std::optional<json> values = Finite(*ra)) {
      for (const json& v : *values) {
        if (Validate(v, *rb, depth + 1) != Tri::kNo) return false;
      }
      return true;
    }
    if (std::optional<json> values = Finite(*rb)) {
      for (const json& v : *values) {
        if (Emits(*ra, n, v, depth + 1) != Tri::kNo) return false;
      }
      return true;
    }
    const uint8_t kinds = EmittedKinds(*ra) & DeclaredKinds(*rb);
    if (kinds & (kKindNull | kKindBool)) return false;
    if (kinds & (kKindInt | kKindFrac)) {
      const NumberRange x(*ra), y(*rb);
      if ((kinds & kKindInt) && !RangesDisjoint(x, y, true)) return false;
      if ((kinds & kKindFrac) && !RangesDisjoint(x, y, false)) return false;
    }
    if ((kinds & kKindString) &&
        !CountsDisjoint(Counts(*ra, "minLength", "maxLength"), Counts(*rb, "minLength", "maxLength"))) {
      return false;
    }
    if ((kinds & kKindArray) && !ArraysExclude(*ra, *rb, depth)) return false;
    if ((kinds & kKindObject) && !ObjectsExclude(*ra, n, *rb, depth)) return false;
    return true;
  }

  // Every value the compiler emits for `a` (narrowed by `n`) is valid against `b`.
  bool Within(const json& a, const Narrowing& n, const json& b, int depth = 0) {
    if (!Spend(depth)) return false;
    const json* ra = Resolve(a);
    const json* rb = Resolve(b);
    if (ra == nullptr || rb == nullptr) return false;
    if (rb->is_boolean()) return rb->get<bool>();
    if (ra->is_boolean()) return !ra->get<bool>();
    if (!ra->is_object() || !rb->is_object()) return false;
    if (const json* list = Branches(*ra)) {
      for (const json& br : *list) {
        if (!Within(br, Narrowing{}, *rb, depth + 1)) return false;
      }
      return true;
    }
    if (std::optional<json> values = Finite(*ra)) {
      for (const json& v : *values) {
        if (Validate(v, *rb, depth + 1) != Tri::kYes) return false;
      }
      return true;
    }
    if (Has(*rb, "anyOf") && (*rb)["anyOf"].is_array()) {
      for (const json& br : (*rb)["anyOf"]) {
        if (Within(*ra, n, br, depth + 1)) return true;
      }
      return false;
    }
    if (Has(*rb, "oneOf") || Finite(*rb)) return false;
    const uint8_t kinds = EmittedKinds(*ra);
    if (kinds & ~DeclaredKinds(*rb)) return false;
    if (kinds & (kKindInt | kKindFrac)) {
      const NumberRange x(*ra), y(*rb);
      if ((kinds & kKindInt) && !RangeWithin(x, y, true)) return false;
      if ((kinds & kKindFrac) && !RangeWithin(x, y, false)) return false;
    }
    if (kinds & kKindString) {
      for (const char* kw : {"pattern", "format"}) {
        if (Has(*rb, kw) && !(Has(*ra, kw) && (*ra)[kw] == (*rb)[kw])) return false;
      }
      if (!CountWithin(Counts(*ra, "minLength", "maxLength"), Counts(*rb, "minLength", "maxLength"))) return false;
    }
    if ((kinds & kKindArray) && !ArrayWithin(*ra, *rb, depth)) return false;
    if ((kinds & kKindObject) && !ObjectWithin(*ra, n, *rb, depth)) return false;
    return true;
  }

  // Whether `v` is valid against `s` (JSON Schema semantics of the subset;
  // pattern and format are not decided).
  Tri Validate(const json& v, const json& s, int depth) {
    if (!Spend(depth)) return Tri::kUnknown;
    const json* r = Resolve(s);
    if (r == nullptr) return Tri::kUnknown;
    if (r->is_boolean()) return r->get<bool>() ? Tri::kYes : Tri::kNo;
    if (!r->is_object()) return Tri::kUnknown;
    Tri acc = Tri::kYes;
    auto add = [&](Tri t) {
      if (t == Tri::kNo) acc = Tri::kNo;
      if (t == Tri::kUnknown && acc == Tri::kYes) acc = Tri::kUnknown;
      return acc == Tri::kNo;
    };
    for (const char* kw : {"anyOf", "oneOf"}) {
      if (!Has(*r, kw) || !(*r)[kw].is_array()) continue;
      int yes = 0, unknown = 0;
      for (const json& br : (*r)[kw]) {
        const Tri t = Validate(v, br, depth + 1);
        yes += t == Tri::kYes;
        unknown += t == Tri::kUnknown;
      }
      Tri t;
      if (std::string_view(kw) == "anyOf") {
        t = yes > 0 ? Tri::kYes : unknown > 0 ? Tri::kUnknown : Tri::kNo;
      } else {
        t = yes >= 2 ? Tri::kNo : yes == 1 && unknown == 0 ? Tri::kYes : yes + unknown == 0 ? Tri::kNo : Tri::kUnknown;
      }
      if (add(t)) return acc;
    }
    if (Has(*r, "allOf") && (*r)["allOf"].is_array()) {
      for (const json& br : (*r)["allOf"]) {
        if (add(Validate(v, br, depth + 1))) return acc;
      }
    }
    if (Has(*r, "const") && !((*r)["const"] == v)) return Tri::kNo;
    if (Has(*r, "enum") && (*r)["enum"].is_array()) {
      bool found = false;
      for (const json& e : (*r)["enum"]) found = found || e == v;
      if (!found) return Tri::kNo;
    }
    const uint8_t kind = ValueKind(v);
    const uint8_t declared = DeclaredKinds(*r);
    if (!(kind & declared)) return Tri::kNo;
    if (kind & (kKindInt | kKindFrac)) {
      if (!NumberRange(*r).In(v.get<double>())) return Tri::kNo;
    } else if (kind == kKindString) {
      const CountRange c = Counts(*r, "minLength", "maxLength");
      const int64_t len = static_cast<int64_t>(CodePoints(v.get<std::string>()));
      if (len < c.lo || (c.hi >= 0 && len > c.hi)) return Tri::kNo;
      if (Has(*r, "pattern") || Has(*r, "format")) add(Tri::kUnknown);
    } else if (kind == kKindArray) {
      const CountRange c = ItemCounts(*r);
      const int64_t len = static_cast<int64_t>(v.size());
      if (len < c.lo || (c.hi >= 0 && len > c.hi)) return Tri::kNo;
      for (size_t i = 0; i < v.size(); ++i) {
        const json* item = ItemSchema(*r, i);
        if (item == nullptr) return Tri::kNo;
        if (add(Validate(v[i], *item, depth + 1))) return acc;
      }
    } else if (kind == kKindObject) {
      for (const std::string& k : RequiredNames(*r)) {
        if (!v.contains(k)) return Tri::kNo;
      }
      for (const auto& [k, x] : v.items()) {
        const json* value = ValidValue(*r, k);
        if (value == nullptr) return Tri::kNo;
        if (add(Validate(x, *value, depth + 1))) return acc;
      }
    }
    return acc;
  }

 private:
  static constexpr int kMaxDepth = 24;

  bool Spend(int depth) { return depth <= kMaxDepth && --budget_ >= 0; }

  static const json* Branches(const json& s) {
    for (const char* kw : {"anyOf", "oneOf"}) {
      if (Has(s, kw) && s[kw].is_array()) return &s[kw];
    }
    return nullptr;
  }

  // const/enum: the compiler emits exactly these values.
  static std::optional<json> Finite(const json& s) {
    if (Has(s, "const")) return json::array({s["const"]});
    if (Has(s, "enum") && s["enum"].is_array()) return s["enum"];
    return std::nullopt;
  }

  // Whether the compiler may emit `v` for the resolved, non-finite `s`.
  Tri Emits(const json& s, const Narrowing& n, const json& v, int depth) {
    if (!(ValueKind(v) & EmittedKinds(s))) return Tri::kNo;
    if (v.is_object()) {
      const EmittedObject o(s, n);
      for (const std::string& k : o.required) {
        if (!v.contains(k)) return Tri::kNo;
      }
      for (const auto& [k, x] : v.items()) {
        if (o.Values(k).empty()) return Tri::kNo;
      }
    }
    return Validate(v, s, depth);
  }

  bool ArraysExclude(const json& a, const json& b, int depth) {
    const CountRange ca = ItemCounts(a), cb = ItemCounts(b);
    if (CountsDisjoint(ca, cb)) return true;
    // An item every emitted array has that b does not take there.
    for (int64_t k = 0; k < std::min<int64_t>(ca.lo, 4); ++k) {
      const json* ia = ItemSchema(a, k);
      const json* ib = ItemSchema(b, k);
      if (ia == nullptr) return true;
      if (ib == nullptr || Excludes(*ia, Narrowing{}, *ib, depth + 1)) return true;
    }
    return false;
  }

  bool ArrayWithin(const json& a, const json& b, int depth) {
    const CountRange ca = ItemCounts(a);
    if (!CountWithin(ca, ItemCounts(b))) return false;
    auto prefix = [](const json& s) -> size_t {
      return Has(s, "prefixItems") && s["prefixItems"].is_array() ? s["prefixItems"].size() : 0;
    };
    // Indexes past both prefixes all take the items schemas.
    const size_t last = std::max(prefix(a), prefix(b));
    for (size_t k = 0; k <= last; ++k) {
      if (ca.hi >= 0 && static_cast<int64_t>(k) >= ca.hi) break;
      const json* ia = ItemSchema(a, k);
      if (ia == nullptr) break;
      const json* ib = ItemSchema(b, k);
      if (ib == nullptr || !Within(*ia, Narrowing{}, *ib, depth + 1)) return false;
    }
    return true;
  }

  // A key every emitted object has (or every valid one needs) whose value
  // settles it: every value a writes for it fails b, or b forbids it.
  bool ObjectsExclude(const json& a, const Narrowing& n, const json& b, int depth) {
    const EmittedObject o(a, n);
    std::vector<std::string> keys(o.required.begin(), o.required.end());
    std::sort(keys.begin(), keys.end());
    for (const std::string& k : RequiredNames(b)) keys.push_back(k);
    for (const std::string& k : keys) {
      const json* vb = ValidValue(b, k);
      bool settles = true;
      for (const json* va : o.Values(k)) {
        if (vb != nullptr && !Excludes(*va, Narrowing{}, *vb, depth + 1)) {
          settles = false;
          break;
        }
      }
      if (settles) return true;
    }
    return false;
  }

  bool ObjectWithin(const json& a, const Narrowing& n, const json& b, int depth) {
    const EmittedObject o(a, n);
    for (const std::string& k : RequiredNames(b)) {
      if (!o.required.contains(k)) return false;
    }
    for (const auto& [k, va] : o.members) {
      const json* vb = ValidValue(b, k);
      if (vb == nullptr || !Within(*va, Narrowing{}, *vb, depth + 1)) return false;
    }
    if (o.extra != nullptr) {
      if (Has(b, "properties") && b["properties"].is_object()) {
        for (const auto& [k, vb] : b["properties"].items()) {
          if (!o.not_extra.contains(k) && !Within(*o.extra, Narrowing{}, vb, depth + 1)) return false;
        }
      }
      if (Has(b, "additionalProperties")) {
        const json& ab = b["additionalProperties"];
        if (ab.is_boolean() ? !ab.get<bool>() : !Within(*o.extra, Narrowing{}, ab, depth + 1)) return false;
      }
    }
    return true;
  }

  const json& root_;
  int64_t budget_ = 200000;  // calls per oneOf
};

// Emails with a maxLength are at most this long (see String()).
constexpr int64_t kMaxCountedEmail = 66;

class SchemaCompiler {
 public:
  SchemaCompiler(const json& root, Grammar& g) : root_(root), g_(g) {}

  // `narrow`: what a oneOf makes this schema's own objects leave out or
  // always write (only for a schema that is not a $ref, allOf or combinator).
  absl::StatusOr<Sequence> Compile(const json& s, const std::string& ptr, int depth,
                                   const Narrowing* narrow = nullptr) {
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
      if (std::string_view(kw) == "oneOf") return OneOf(list, ptr, depth);
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
        alt = Object(s, ptr, depth, narrow);
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

  // oneOf: each branch compiled only if none of its values can be valid
  // against another branch (see Disjointness), narrowed if that makes it so;
  // a branch all of whose values are valid against another one is dropped.
  absl::StatusOr<Sequence> OneOf(const json& list, const std::string& ptr, int depth) {
    const size_t n = list.size();
    Disjointness d(root_);
    std::vector<Narrowing> narrow(n);
    std::vector<bool> dropped(n, false);
    std::optional<std::pair<size_t, size_t>> overlap, last_drop;
    for (size_t i = 0; i < n && !overlap; ++i) {
      for (size_t j = 0; j < n && !overlap; ++j) {
        if (i == j) continue;
        try {
          if (d.Excludes(list[i], narrow[i], list[j]) || NarrowToExclude(d, list[i], list[j], narrow[i])) continue;
          if (d.Within(list[i], narrow[i], list[j])) {
            dropped[i] = true;
            last_drop = {std::min(i, j), std::max(i, j)};
            break;
          }
        } catch (const json::exception&) {  // a malformed branch: compiled below for its error
        }
        overlap = {std::min(i, j), std::max(i, j)};
      }
    }
    if (!overlap && std::find(dropped.begin(), dropped.end(), false) == dropped.end()) overlap = last_drop;
    std::vector<Sequence> alts;
    for (size_t i = 0; i < n; ++i) {
      if (dropped[i] && !overlap) continue;
      std::string at = absl::StrCat(ptr, "/oneOf/", i);
      absl::StatusOr<Sequence> alt;
      if (narrow[i].empty() || overlap) {
        alt = Compile(list[i], at, depth + 1);
      } else {
        const json* node = d.Resolve(list[i], &at);
        alt = Compile(*node, at, depth + 1, &narrow[i]);
      }
      if (!alt.ok()) return alt.status();
      alts.push_back(*std::move(alt));
    }
    if (overlap) {
      return absl::InvalidArgumentError(absl::StrCat(
          "oneOf at ", ptr.empty() ? "/" : ptr, ": branches ", overlap->first, " and ", overlap->second,
          " may both match the same value (give them a discriminating const/enum property, different types, "
          "or use anyOf)"));
    }
    if (alts.size() == 1) return alts[0];
    return Sequence{g_.Choice(ptr + "/oneOf", std::move(alts))};
  }

  // Narrows branch a's objects (`n`) so that none is valid against b, if
  // one key does it: leaving out a key b requires that a need not write, or
  // always writing an optional key b forbids (or whose values a writes fail
  // b). False (n unchanged) when no single key does.
  bool NarrowToExclude(Disjointness& d, const json& a, const json& b, Narrowing& n) {
    const json* ra = d.Resolve(a);
    const json* rb = d.Resolve(b);
    if (ra == nullptr || rb == nullptr || !ra->is_object() || !(EmittedKinds(*ra) & kKindObject)) return false;
    for (const char* kw : {"anyOf", "oneOf", "const", "enum"}) {
      if (ra->contains(kw)) return false;
    }
    const EmittedObject o(*ra, n);
    std::vector<Narrowing> tries;
    for (const std::string& k : RequiredNames(*rb)) {
      if (o.required.contains(k) || n.Excluded(k)) continue;
      tries.push_back(n);
      tries.back().exclude.push_back(k);
    }
    for (const auto& [k, v] : o.members) {
      if (o.required.contains(k)) continue;
      tries.push_back(n);
      tries.back().require.push_back(k);
    }
    for (Narrowing& t : tries) {
      if (d.Excludes(*ra, t, *rb)) {
        n = std::move(t);
        return true;
      }
    }
    return false;
  }

  absl::StatusOr<Sequence> Ref(const json& ref, const std::string& ptr, int depth) {
    if (!ref.is_string()) return Error(ptr, "must be a string");
    const std::string target = ref.get<std::string>();
    if (target.empty() || target[0] != '#') {
      return Error(ptr, absl::StrCat("only local references ('#...') are supported, not '", target, "'"));
    }
    if (auto it = refs_.find(target); it != refs_.end()) return Sequence{Grammar::Ref(it->second)};
    absl::StatusOr<Resolved> r = ResolveLocalRef(root_, target);
    if (!r.ok()) return Error(ptr, std::string(r.status().message()));
    const json* node = r->node;
    const std::string resolved = r->ptr;
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

  // The canonical encoding of one key character (as Dump and
  // json_string_content write it): \" \\ \b \f \n \r \t, \u00xx for the
  // other controls, raw UTF-8 otherwise.
  static std::string CanonicalChar(uint32_t cp) {
    switch (cp) {
      case '"': return "\\\"";
      case '\\': return "\\\\";
      case '\b': return "\\b";
      case '\f': return "\\f";
      case '\n': return "\\n";
      case '\r': return "\\r";
      case '\t': return "\\t";
      default: break;
    }
    if (cp < 0x20) {
      static const char kHex[] = "0123456789abcdef";
      return std::string("\\u00") + kHex[cp >> 4] + kHex[cp & 15];
    }
    std::string out;
    AppendUtf8(cp, out);
    return out;
  }

  // One canonical key character whose code point is not in `except`
  // (sorted), then any canonical rest of the key and its closing '"'. One
  // rule per distinct `except`; its escapes and non-ASCII characters are
  // rules shared by the `except`s that exclude the same ones of them.
  GrammarElement KeyDiverge(const std::vector<uint32_t>& except) {
    if (auto it = key_diverge_.find(except); it != key_diverge_.end()) return Grammar::Ref(it->second);
    if (!key_tail_) {
      absl::StatusOr<uint32_t> r = Regex("[\\s\\S]*", {.json_string_content = true}, "key_rest");
      if (!r.ok()) g_.SetError(r.status());
      const uint32_t rest = r.ok() ? *r : g_.AddRule("key_rest");
      key_tail_ = g_.AddRule("key_tail");
      g_.AddAlternative(*key_tail_, {Grammar::Ref(rest), g_.Byte('"')});
    }
    std::vector<uint32_t> escaped, non_ascii;
    ByteSet ascii;  // ASCII from ' ' but '"' and '\\': one byte
    for (uint32_t c = 0x20; c < 0x80; ++c) {
      if (c != '"' && c != '\\' && !std::binary_search(except.begin(), except.end(), c)) {
        ascii.Add(static_cast<uint8_t>(c));
      }
    }
    for (uint32_t cp : except) {
      if (cp < 0x20 || cp == '"' || cp == '\\') {
        escaped.push_back(cp);
      } else if (cp >= 0x80) {
        non_ascii.push_back(cp);
      }
    }
    const uint32_t rule = g_.AddRule("key_diverge");
    if (!ascii.empty()) g_.AddAlternative(rule, {g_.Bytes(ascii), Grammar::Ref(*key_tail_)});
    g_.AddAlternative(rule, {KeyEscapeExcept(escaped), Grammar::Ref(*key_tail_)});
    g_.AddAlternative(rule, {KeyNonAsciiExcept(non_ascii), Grammar::Ref(*key_tail_)});
    key_diverge_[except] = rule;
    return Grammar::Ref(rule);
  }

  // The canonical escapes (\" \\ \b \f \n \r \t, \u000x, \u001x) of the
  // characters not in `except` (sorted).
  GrammarElement KeyEscapeExcept(const std::vector<uint32_t>& except) {
    if (auto it = key_escapes_.find(except); it != key_escapes_.end()) return Grammar::Ref(it->second);
    auto excluded = [&](uint32_t cp) { return std::binary_search(except.begin(), except.end(), cp); };
    std::vector<Sequence> alts;
    ByteSet short_escape;
    for (uint32_t c : {uint32_t{'"'}, uint32_t{'\\'}, uint32_t{'\b'}, uint32_t{'\f'}, uint32_t{'\n'}, uint32_t{'\r'},
                       uint32_t{'\t'}}) {
      if (!excluded(c)) short_escape.Add(static_cast<uint8_t>(CanonicalChar(c)[1]));
    }
    if (!short_escape.empty()) alts.push_back({g_.Byte('\\'), g_.Bytes(short_escape)});
    for (uint32_t high = 0; high < 2; ++high) {
      ByteSet low;
      for (uint32_t c = high * 16; c < high * 16 + 16; ++c) {
        const std::string e = CanonicalChar(c);
        if (e.size() == 6 && !excluded(c)) low.Add(static_cast<uint8_t>(e[5]));
      }
      if (low.empty()) continue;
      Sequence esc = g_.Literal("\\u00");
      esc.push_back(g_.Byte(static_cast<uint8_t>('0' + high)));
      esc.push_back(g_.Bytes(low));
      alts.push_back(std::move(esc));
    }
    if (alts.empty()) alts.push_back({g_.Nothing()});  // derives nothing; Freeze drops it
    const uint32_t rule = g_.AddRule("key_escape");
    for (Sequence& a : alts) g_.AddAlternative(rule, std::move(a));
    key_escapes_[except] = rule;
    return Grammar::Ref(rule);
  }

  // The non-ASCII characters not in `except` (sorted), as whole UTF-8
  // sequences.
  GrammarElement KeyNonAsciiExcept(const std::vector<uint32_t>& except) {
    if (auto it = key_non_ascii_.find(except); it != key_non_ascii_.end()) return Grammar::Ref(it->second);
    CodePointSet taken = {{0, 0x7F}};
    for (uint32_t cp : except) taken.push_back({cp, cp});
    const uint32_t rule = g_.AddRule("key_non_ascii");
    g_.AddAlternative(rule, {g_.Nothing()});  // so the rule is defined when nothing is writable
    for (const Utf8Sequence& seq : Utf8Sequences(g_.WritableSubset(ComplementCodePoints(taken), /*note=*/false))) {
      Sequence bytes;
      for (auto [lo, hi] : seq) bytes.push_back(g_.Bytes(ByteSet::Range(lo, hi)));
      g_.AddAlternative(rule, std::move(bytes));
    }
    key_non_ascii_[except] = rule;
    return Grammar::Ref(rule);
  }

  // Any key except the given names. Keys are canonical strings (each
  // character has one encoding, CanonicalChar), written character by
  // character along a trie of the names' code points: at each node a key
  // continues with a child's character, diverges with any other character
  // (KeyDiverge), or closes where no name ends. Every choice is made
  // between whole characters, so keys are valid UTF-8.
  GrammarElement KeyExcept(const std::vector<std::string>& names) {
    if (names.empty()) return StringValue();
    struct TrieNode {
      std::vector<std::pair<uint32_t, int>> kids;  // code point, node
      bool terminal = false;
    };
    std::vector<TrieNode> trie(1);
    for (const std::string& name : names) {
      int at = 0;
      for (size_t k = 0; k < name.size();) {
        uint32_t cp;
        if (!DecodeUtf8(name, &k, &cp)) cp = 0xFFFD, ++k;  // parsed JSON is valid UTF-8; Dump's replacement
        int next = -1;
        for (auto [c, n] : trie[at].kids) {
          if (c == cp) next = n;
        }
        if (next < 0) {
          next = static_cast<int>(trie.size());
          trie[at].kids.push_back({cp, next});
          trie.emplace_back();
        }
        at = next;
      }
      trie[at].terminal = true;
    }
    std::vector<uint32_t> rules(trie.size());
    for (size_t n = 0; n < trie.size(); ++n) rules[n] = g_.AddRule("key_except");
    for (size_t n = 0; n < trie.size(); ++n) {
      std::vector<uint32_t> except;
      for (auto [cp, kid] : trie[n].kids) {
        except.push_back(cp);
        Sequence step = g_.Literal(CanonicalChar(cp));
        step.push_back(Grammar::Ref(rules[kid]));
        g_.AddAlternative(rules[n], std::move(step));
      }
      std::sort(except.begin(), except.end());
      g_.AddAlternative(rules[n], {KeyDiverge(except)});
      if (!trie[n].terminal) g_.AddAlternative(rules[n], {g_.Byte('"')});
    }
    return g_.Choice("key", {{g_.Byte('"'), Grammar::Ref(rules[0])}});
  }

  absl::StatusOr<Sequence> Object(const json& s, const std::string& ptr, int depth, const Narrowing* narrow) {
    const Narrowing none;
    const Narrowing& nw = narrow != nullptr ? *narrow : none;
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
    for (const std::string& name : nw.require) required.insert(name);
    std::vector<std::string> names;
    if (s.contains("properties")) {
      const json& props = s["properties"];
      if (!props.is_object()) return Error(ptr + "/properties", "must be an object");
      // nlohmann::json sorts keys; restore the schema's order from the text.
      for (const std::string& name : PropertyOrder(props)) {
        if (nw.Excluded(name)) continue;
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
      std::vector<std::string> not_extra = names;
      not_extra.insert(not_extra.end(), nw.exclude.begin(), nw.exclude.end());
      Sequence kv = {KeyExcept(not_extra), Sep(':', *extra)};
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
      if (s.contains("pattern") && s.contains("format")) {
        return Error(ptr, "pattern together with format is not supported (regexes are not intersected)");
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
        if (*max >= 0 && s.contains("format") && s["format"] == "email") {
          // The email DFA counts label lengths (<= 63) and the TLD's; times
          // a counter up to 254 that is far past kMaxRegexDfaStates. An
          // email of at most kMaxCountedEmail characters cannot have a
          // longer label, so below it labels go uncounted and a larger
          // maxLength is narrowed to it.
          if (*min > kMaxCountedEmail) {
            return Error(ptr, absl::StrCat("minLength/maxLength together with format 'email': minLength above ",
                                           kMaxCountedEmail, " (kMaxCountedEmail) is not supported"));
          }
          options.max_code_points = std::min(*max, kMaxCountedEmail);
          pattern =
              R"([A-Za-z0-9_+-]+(?:\.[A-Za-z0-9_+-]+)*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.[A-Za-z]{2,})";
        }
      }
      // Length: the pattern's or format's DFA times a code-point counter.
      const std::string where = s.contains("pattern") ? "/pattern" : "/format";
      absl::StatusOr<uint32_t> r = Regex(pattern, options, ptr + where);
      if (!r.ok()) {
        if (r.status().code() == absl::StatusCode::kResourceExhausted) {
          return absl::ResourceExhaustedError(absl::StrCat("at ", ptr, where, ": ", r.status().message()));
        }
        if (has_length && s.contains("format")) {
          return Error(ptr, absl::StrCat("minLength/maxLength together with format '", s["format"].get<std::string>(),
                                         "' admit no string (", r.status().message(), ")"));
        }
        return Error(ptr + where, std::string(r.status().message()));
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
  std::optional<uint32_t> string_rule_, number_rule_, any_rule_, key_tail_;
  // KeyExcept's rules by the code points they exclude.
  absl::flat_hash_map<std::vector<uint32_t>, uint32_t> key_diverge_, key_escapes_, key_non_ascii_;
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
