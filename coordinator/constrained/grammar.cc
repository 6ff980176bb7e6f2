// coordinator/constrained/grammar.cc — see grammar.h.
#include "coordinator/constrained/grammar.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace exl3serve::coordinator::constrained {

void Grammar::RestrictCharacters(const CodePointSet* chars) {
  writable_ = chars;
  writable_ascii_ = {};
  if (chars == nullptr) return;
  for (uint32_t c = 0; c < 0x80; ++c) {
    if (ContainsCodePoint(*chars, c)) writable_ascii_.Add(static_cast<uint8_t>(c));
  }
}

CodePointSet Grammar::WritableSubset(const CodePointSet& set, bool note) {
  if (writable_ == nullptr) return set;
  CodePointSet out = IntersectCodePoints(set, *writable_);
  if (out.empty() && note) {
    const CodePointSet norm = NormalizeCodePoints(set);
    if (!norm.empty()) NoteUnwritable(norm.front().first);
  }
  return out;
}

uint32_t Grammar::AddRule(std::string name) {
  if (rules_.size() >= kMaxGrammarRules) {
    SetError(absl::ResourceExhaustedError(
        absl::StrCat("constraint grammar exceeds ", kMaxGrammarRules, " rules (kMaxGrammarRules)")));
    // Keep returning a valid id so builders need not check.
    if (!rules_.empty()) return 0;
  }
  rules_.push_back({std::move(name), {}});
  return static_cast<uint32_t>(rules_.size() - 1);
}

void Grammar::AddAlternative(uint32_t rule, Sequence sequence) {
  num_elements_ += sequence.size() + 1;
  if (num_elements_ > kMaxGrammarElements) {
    SetError(absl::ResourceExhaustedError(absl::StrCat(
        "constraint grammar exceeds ", kMaxGrammarElements, " elements (kMaxGrammarElements)")));
    return;
  }
  rules_[rule].alternatives.push_back(std::move(sequence));
}

GrammarElement Grammar::Bytes(const ByteSet& in) {
  ByteSet set = in;
  if (writable_ != nullptr) {
    // ASCII bytes are whole characters wherever they stand in UTF-8.
    set.words[0] &= writable_ascii_.words[0];
    set.words[1] &= writable_ascii_.words[1];
    if (set.empty() && !in.empty()) {
      for (int b = 0; b < 0x80; ++b) {
        if (in.Contains(static_cast<uint8_t>(b))) {
          NoteUnwritable(static_cast<uint32_t>(b));
          break;
        }
      }
    }
  }
  for (size_t i = byte_sets_.size(); i-- > 0;) {
    if (byte_sets_[i] == set) return {GrammarElement::Kind::kBytes, static_cast<uint32_t>(i)};
    if (byte_sets_.size() - i > 64) break;  // recent ones only: cheap, good enough
  }
  byte_sets_.push_back(set);
  return {GrammarElement::Kind::kBytes, static_cast<uint32_t>(byte_sets_.size() - 1)};
}

Sequence Grammar::Literal(std::string_view bytes) {
  Sequence s;
  s.reserve(bytes.size());
  if (writable_ == nullptr) {
    for (char c : bytes) s.push_back(Byte(static_cast<uint8_t>(c)));
    return s;
  }
  for (size_t at = 0; at < bytes.size();) {
    const size_t start = at;
    uint32_t cp;
    if (!DecodeUtf8(bytes, &at, &cp)) {  // no token sequence of W writes it
      s.push_back(Nothing());
      ++at;
      continue;
    }
    if (!IsWritable(cp)) {
      NoteUnwritable(cp);
      s.push_back(Nothing());
      continue;
    }
    for (size_t k = start; k < at; ++k) s.push_back(Byte(static_cast<uint8_t>(bytes[k])));
  }
  return s;
}

absl::Status Grammar::CheckAlternatives(std::string_view name, size_t count) {
  if (count <= kMaxRuleAlternatives) return absl::OkStatus();
  absl::Status s = absl::ResourceExhaustedError(absl::StrCat(
      "'", std::string(name), "' has ", count, " alternatives, more than ", kMaxRuleAlternatives,
      " (kMaxRuleAlternatives: the matcher follows at most that many parses at once)"));
  SetError(s);
  return s;
}

GrammarElement Grammar::Choice(std::string name, std::vector<Sequence> alternatives) {
  (void)CheckAlternatives(name, alternatives.size());
  const uint32_t rule = AddRule(std::move(name));
  for (Sequence& alt : alternatives) AddAlternative(rule, std::move(alt));
  return Ref(rule);
}

Sequence Grammar::Repeat(std::string_view name, const Sequence& body, int64_t min, int64_t max) {
  Sequence out;
  if (static_cast<double>(body.size()) * static_cast<double>(max < 0 ? min + 1 : max) >
      static_cast<double>(kMaxGrammarElements)) {
    SetError(absl::ResourceExhaustedError(absl::StrCat(
        "repetition {", min, ",", max, "} of '", std::string(name), "' exceeds ", kMaxGrammarElements,
        " grammar elements (kMaxGrammarElements)")));
    return out;
  }
  for (int64_t i = 0; i < min; ++i) out.insert(out.end(), body.begin(), body.end());
  if (max < 0) {
    // star ::= body star | ""
    const uint32_t star = AddRule(absl::StrCat(std::string(name), "*"));
    Sequence loop = body;
    loop.push_back(Ref(star));
    AddAlternative(star, std::move(loop));
    AddAlternative(star, {});
    out.push_back(Ref(star));
  } else if (max > min) {
    // opt_k ::= body opt_{k-1} | "" ; opt_1 ::= body | ""
    uint32_t prev = 0;
    for (int64_t k = 1; k <= max - min; ++k) {
      const uint32_t opt = AddRule(absl::StrCat(std::string(name), "{0,", k, "}"));
      Sequence seq = body;
      if (k > 1) seq.push_back(Ref(prev));
      AddAlternative(opt, std::move(seq));
      AddAlternative(opt, {});
      prev = opt;
    }
    out.push_back(Ref(prev));
  }
  return out;
}

absl::StatusOr<FlatGrammar> FlatGrammar::Freeze(const Grammar& grammar, uint32_t root) {
  if (!grammar.status().ok()) return grammar.status();
  const size_t n = grammar.num_rules();
  // Reachable rules; a reachable rule without alternatives is undefined.
  std::vector<char> reachable(n, 0);
  std::vector<uint32_t> work = {root};
  reachable[root] = 1;
  while (!work.empty()) {
    const uint32_t r = work.back();
    work.pop_back();
    if (grammar.alternatives(r).empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("grammar rule '", grammar.rule_name(r), "' is not defined"));
    }
    for (const Sequence& alt : grammar.alternatives(r)) {
      for (const GrammarElement& e : alt) {
        if (e.kind == GrammarElement::Kind::kRule && !reachable[e.id]) {
          reachable[e.id] = 1;
          work.push_back(e.id);
        }
      }
    }
  }
  auto element_ok = [&](const GrammarElement& e, const std::vector<char>& rule_flag) {
    return e.kind == GrammarElement::Kind::kRule ? rule_flag[e.id] != 0
                                                 : !grammar.byte_sets()[e.id].empty();
  };
  // Productive rules (derive some string) and nullable ones (derive "").
  std::vector<char> productive(n, 0), nullable(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (uint32_t r = 0; r < n; ++r) {
      if (!reachable[r]) continue;
      for (const Sequence& alt : grammar.alternatives(r)) {
        bool all_productive = true, all_nullable = true;
        for (const GrammarElement& e : alt) {
          all_productive = all_productive && element_ok(e, productive);
          all_nullable = all_nullable && e.kind == GrammarElement::Kind::kRule && nullable[e.id];
        }
        if (all_productive && !productive[r]) productive[r] = 1, changed = true;
        if (all_nullable && !nullable[r]) nullable[r] = 1, changed = true;
      }
    }
  }
  if (!productive[root]) {
    return absl::InvalidArgumentError(
        absl::StrCat("grammar rule '", grammar.rule_name(root), "' derives no string"));
  }
  // Left recursion: r -> s when s can start an alternative of r (after a
  // nullable prefix); a cycle is an error.
  std::vector<std::vector<uint32_t>> left(n);
  for (uint32_t r = 0; r < n; ++r) {
    if (!reachable[r]) continue;
    for (const Sequence& alt : grammar.alternatives(r)) {
      for (const GrammarElement& e : alt) {
        if (e.kind != GrammarElement::Kind::kRule) break;
        left[r].push_back(e.id);
        if (!nullable[e.id]) break;
      }
    }
  }
  std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the DFS path, 2 done
  for (uint32_t start = 0; start < n; ++start) {
    if (!reachable[start] || color[start]) continue;
    std::vector<std::pair<uint32_t, size_t>> dfs = {{start, 0}};
    color[start] = 1;
    while (!dfs.empty()) {
      auto& [r, i] = dfs.back();
      if (i == left[r].size()) {
        color[r] = 2;
        dfs.pop_back();
        continue;
      }
      const uint32_t s = left[r][i++];
      if (color[s] == 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "grammar rule '", grammar.rule_name(s),
            "' is left-recursive (it can derive itself before any byte; rewrite it with a "
            "repetition, e.g. x ::= y (\",\" y)*)"));
      }
      if (color[s] == 0) {
        color[s] = 1;
        dfs.push_back({s, 0});
      }
    }
  }
  FlatGrammar flat;
  flat.root_ = root;
  flat.byte_sets_ = grammar.byte_sets();
  flat.rule_alt_begin_.reserve(n + 1);
  flat.rule_names_.reserve(n);
  for (uint32_t r = 0; r < n; ++r) {
    flat.rule_alt_begin_.push_back(static_cast<uint32_t>(flat.alt_starts_.size()));
    flat.rule_names_.push_back(grammar.rule_name(r));
    if (!reachable[r]) continue;
    for (const Sequence& alt : grammar.alternatives(r)) {
      bool ok = true;
      for (const GrammarElement& e : alt) ok = ok && element_ok(e, productive);
      if (!ok) continue;  // can never complete: dropped, so no stack is dead
      flat.alt_starts_.push_back(static_cast<uint32_t>(flat.elements_.size()));
      for (const GrammarElement& e : alt) {
        if (e.kind == GrammarElement::Kind::kBytes) {
          flat.terminals_.push_back(static_cast<uint32_t>(flat.elements_.size()));
        }
        flat.elements_.push_back(
            {e.kind == GrammarElement::Kind::kBytes ? Kind::kBytes : Kind::kRule, e.id});
      }
      flat.elements_.push_back({Kind::kEnd, 0});
    }
  }
  flat.rule_alt_begin_.push_back(static_cast<uint32_t>(flat.alt_starts_.size()));
  return flat;
}

}  // namespace exl3serve::coordinator::constrained
