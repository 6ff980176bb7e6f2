// coordinator/constrained/json_schema_oneof.cc — see json_schema_oneof.h.
#include "coordinator/constrained/json_schema_oneof.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "coordinator/constrained/json_schema_compiler.h"
#include "coordinator/constrained/json_schema_ref.h"

namespace exl3serve::coordinator::constrained::internal {
namespace {

using json = nlohmann::json;

enum class Tri { kNo, kYes, kUnknown };

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

}  // namespace

class Disjointness::Impl {
 public:
  explicit Impl(const json& root) : root_(root) {}

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

Disjointness::Disjointness(const json& root) : impl_(std::make_unique<Impl>(root)) {}
Disjointness::~Disjointness() = default;
const json* Disjointness::Resolve(const json& s, std::string* ptr) const { return impl_->Resolve(s, ptr); }
bool Disjointness::Excludes(const json& a, const Narrowing& n, const json& b) { return impl_->Excludes(a, n, b); }
bool Disjointness::Within(const json& a, const Narrowing& n, const json& b) { return impl_->Within(a, n, b); }

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

}  // namespace exl3serve::coordinator::constrained::internal
