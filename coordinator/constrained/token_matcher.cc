// coordinator/constrained/token_matcher.cc — TokenMatcher (constraint.h):
// one sequence's automaton state, its next-token mask from the mask cache,
// and token-by-token history for rollback. JSON Schema constraints also keep
// a JsonKeyTracker (json_key_tracker.h): tokens that would complete a key
// their object already has are cleared from the mask and refused.
#include <algorithm>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/json_key_tracker.h"

namespace exl3serve::coordinator::constrained {

struct TokenMatcher::State {
  std::shared_ptr<const CompiledConstraint> owner;
  const GrammarConstraint* c;
  NodeArena persistent{/*intern=*/true};
  NodeArena scratch{/*intern=*/false};
  TrieWalkScratch walk;
  std::vector<Stack> closure;
  struct Step {
    std::vector<Stack> stacks;
    bool eos = false;
  };
  std::vector<Step> history;  // [0]: before any token
  // kJsonSchema: the object keys of the output; one step per history step
  // after [0] (EOS an empty one).
  std::optional<JsonKeyTracker> keys;
  std::vector<uint32_t> seen_positions;

  bool Complete(const Step& s) const {
    return s.eos || std::any_of(s.stacks.begin(), s.stacks.end(), [](const Stack& k) { return k.pos == kAcceptPos; });
  }
};

TokenMatcher::TokenMatcher(std::shared_ptr<const CompiledConstraint> constraint)
    : state_(std::make_unique<State>()) {
  state_->owner = std::move(constraint);
  state_->c = static_cast<const GrammarConstraint*>(state_->owner.get());
  State::Step first;
  if (!state_->c->pda().Initial(state_->persistent, first.stacks)) first.stacks.clear();
  state_->history.push_back(std::move(first));
  if (state_->c->spec().kind == ConstraintKind::kJsonSchema) state_->keys.emplace();
}
TokenMatcher::~TokenMatcher() = default;
TokenMatcher::TokenMatcher(TokenMatcher&&) noexcept = default;
TokenMatcher& TokenMatcher::operator=(TokenMatcher&&) noexcept = default;

int64_t TokenMatcher::mask_words() const { return state_->c->vocabulary().mask_words(); }
int64_t TokenMatcher::num_accepted() const { return static_cast<int64_t>(state_->history.size()) - 1; }
bool TokenMatcher::IsComplete() const { return state_->Complete(state_->history.back()); }
bool TokenMatcher::IsTerminated() const {
  const State::Step& s = state_->history.back();
  return s.eos || (!s.stacks.empty() && std::all_of(s.stacks.begin(), s.stacks.end(),
                                                    [](const Stack& k) { return k.pos == kAcceptPos; }));
}

void TokenMatcher::FillNextTokenMask(std::span<uint32_t> mask) {
  State& st = *state_;
  std::fill(mask.begin(), mask.end(), 0);
  const State::Step& step = st.history.back();
  if (step.eos) return;
  const GrammarConstraint& c = *st.c;
  const size_t words = std::min(mask.size(), static_cast<size_t>(c.vocabulary().mask_words()));
  st.seen_positions.clear();
  bool complete = false;
  for (const Stack& s : step.stacks) {
    if (s.pos == kAcceptPos) {
      complete = true;
      continue;
    }
    const PositionMask& pm = c.cache().at(s.pos);
    if (std::find(st.seen_positions.begin(), st.seen_positions.end(), s.pos) == st.seen_positions.end()) {
      st.seen_positions.push_back(s.pos);
      if (!pm.accepted_words.empty()) {
        const uint32_t* src = pm.accepted_words.data();
        uint32_t* dst = mask.data();
        for (size_t w = 0; w < words; ++w) dst[w] |= src[w];
      } else {
        for (int32_t id : pm.accepted_ids) mask[id >> 5] |= uint32_t{1} << (id & 31);
      }
    }
    if (!pm.uncertain.empty() && s.parent != nullptr) {
      // The frame of s.pos returns into s.parent: walk the suffixes from there.
      st.closure.clear();
      c.pda().Closure(s.parent->pos, s.parent->parent, st.scratch, st.closure);
      MarkAcceptedTokens(c.pda(), pm.uncertain, st.closure, st.scratch, st.walk, mask);
      st.scratch.Rewind(0);
    }
  }
  if (complete) {
    for (int32_t id : c.vocabulary().eos_ids()) mask[id >> 5] |= uint32_t{1} << (id & 31);
  }
  if (st.keys.has_value()) {
    // Unique keys: of the allowed tokens that could complete a key (enough
    // '"' bytes), clear those completing one their object already has.
    for (int32_t id : c.quote_tokens().WithAtLeast(st.keys->MinQuotesForRepeat())) {
      uint32_t& word = mask[id >> 5];
      const uint32_t bit = uint32_t{1} << (id & 31);
      if ((word & bit) != 0 && st.keys->WouldRepeatKey(*c.vocabulary().token_bytes(id))) word &= ~bit;
    }
  }
}

absl::Status TokenMatcher::AcceptToken(int32_t id) {
  State& st = *state_;
  const GrammarConstraint& c = *st.c;
  const State::Step& cur = st.history.back();
  if (cur.eos) {
    return absl::InvalidArgumentError(absl::StrCat("token ", id, " after EOS (the matcher is terminated)"));
  }
  const auto eos = c.vocabulary().eos_ids();
  if (std::find(eos.begin(), eos.end(), id) != eos.end()) {
    if (!st.Complete(cur)) {
      return absl::InvalidArgumentError(
          absl::StrCat("EOS token ", id, " where the output is not a complete ",
                       ConstraintKindName(c.spec().kind), " match"));
    }
    st.history.push_back({cur.stacks, true});
    if (st.keys.has_value()) st.keys->Append({});
    return absl::OkStatus();
  }
  const std::optional<std::string_view> bytes = c.vocabulary().token_bytes(id);
  if (!bytes.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("token ", id, " has no bytes (special or out of range)"));
  }
  std::vector<Stack> now = cur.stacks, next;
  for (size_t k = 0; k < bytes->size(); ++k) {
    if (!c.pda().Advance(now, static_cast<uint8_t>((*bytes)[k]), st.persistent, next)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "token ", id, ": the automaton exceeds ", kMaxStacks, " stacks (kMaxStacks; ambiguous grammar)"));
    }
    if (next.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("token ", id, " (\"", absl::CHexEscape(std::string(*bytes)),
                                                     "\") is not allowed: byte ", k, " leaves the ",
                                                     ConstraintKindName(c.spec().kind)));
    }
    std::swap(now, next);
  }
  if (st.keys.has_value()) {
    std::string key;
    if (st.keys->WouldRepeatKey(*bytes, &key)) {
      return absl::InvalidArgumentError(absl::StrCat("token ", id, " (\"", absl::CHexEscape(std::string(*bytes)),
                                                     "\") is not allowed: it repeats the key \"",
                                                     absl::CHexEscape(key), "\" in its object"));
    }
    st.keys->Append(*bytes);
  }
  st.history.push_back({std::move(now), false});
  return absl::OkStatus();
}

absl::Status TokenMatcher::Rollback(int num_tokens) {
  if (num_tokens < 0 || num_tokens > num_accepted()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rollback of ", num_tokens, " tokens with ", num_accepted(), " accepted"));
  }
  state_->history.resize(state_->history.size() - static_cast<size_t>(num_tokens));
  if (state_->keys.has_value()) state_->keys->Undo(static_cast<size_t>(num_tokens));
  return absl::OkStatus();
}

}  // namespace exl3serve::coordinator::constrained
