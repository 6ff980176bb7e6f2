// coordinator/constrained/json_schema_compiler.cc — see json_schema_compiler.h
// and README.md (the supported subset and the choices made). The schema
// walker; oneOf's disjointness proofs are in json_schema_oneof, number
// bounds in json_schema_numbers, local references in json_schema_ref.
#include "coordinator/constrained/json_schema_compiler.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/constrained/json_schema_numbers.h"
#include "coordinator/constrained/json_schema_oneof.h"
#include "coordinator/constrained/json_schema_ref.h"
#include "coordinator/constrained/regex_compiler.h"
#include "coordinator/constrained/utf8_ranges.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::json;
using internal::Disjointness;
using internal::Escape;
using internal::Narrowing;
using internal::Resolved;
using internal::ResolveLocalRef;

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

std::string Dump(const json& v) { return v.dump(-1, ' ', false, json::error_handler_t::replace); }

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
          if (d.Excludes(list[i], narrow[i], list[j]) || internal::NarrowToExclude(d, list[i], list[j], narrow[i])) continue;
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
    if (integer && !has_lo && !has_hi) {
      pattern = kIntegerRegex;
    } else if (!has_lo && !has_hi) {
      return Sequence{NumberValue()};
    } else {
      std::optional<std::string> p = internal::BoundedNumberRegex(
          {.has_lo = has_lo, .lo_incl = lo_incl, .has_hi = has_hi, .hi_incl = hi_incl, .lo = lo, .hi = hi}, integer);
      if (!p) return Error(ptr, integer ? "no integer lies within the bounds" : "no number lies within the bounds");
      pattern = *std::move(p);
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
