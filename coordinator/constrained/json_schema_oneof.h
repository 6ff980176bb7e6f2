// coordinator/constrained/json_schema_oneof.h — internal to
// json_schema_compiler: the proofs behind an exact oneOf.
//
// oneOf needs every emitted value to match exactly one branch. The compiler
// emits branch i's strings only when it can prove that none of them is valid
// against any other branch j (Disjointness::Excludes: "what the compiler
// emits for i" against "what JSON Schema accepts for j"), after narrowing i's
// objects if that helps (Narrowing). A branch every output of which is valid
// against another branch (Disjointness::Within) can never be the single
// match and is dropped. Anything else is refused.
//
// Contract: "true" from Disjointness is a proof about the schemas as this
// compiler emits them (JSON Schema semantics of the subset for the other
// branch); "false" means "not proven". Reads the document only (no grammar).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_ONEOF_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_ONEOF_H_

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace exl3serve::coordinator::constrained::internal {

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

// Conservative decisions about schemas of one document. Each answer "true"
// is a proof; "false" means "not proven" (also when the work or depth
// budget runs out, e.g. on recursive references).
class Disjointness {
 public:
  explicit Disjointness(const nlohmann::json& root);
  ~Disjointness();

  // Follows $ref and one-entry allOf (extending *ptr with the path taken):
  // the schema node a branch stands for. nullptr: a reference that does not
  // resolve, or a chain of references longer than kMaxSchemaDepth.
  const nlohmann::json* Resolve(const nlohmann::json& s, std::string* ptr = nullptr) const;
  // No value the compiler emits for `a` (narrowed by `n`) is valid against `b`.
  bool Excludes(const nlohmann::json& a, const Narrowing& n, const nlohmann::json& b);
  // Every value the compiler emits for `a` (narrowed by `n`) is valid against `b`.
  bool Within(const nlohmann::json& a, const Narrowing& n, const nlohmann::json& b);

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

// Narrows branch a's objects (`n`) so that none is valid against b, if
// one key does it: leaving out a key b requires that a need not write, or
// always writing an optional key b forbids (or whose values a writes fail
// b). False (n unchanged) when no single key does.
bool NarrowToExclude(Disjointness& d, const nlohmann::json& a, const nlohmann::json& b, Narrowing& n);

}  // namespace exl3serve::coordinator::constrained::internal

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_SCHEMA_ONEOF_H_
