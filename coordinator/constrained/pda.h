// coordinator/constrained/pda.h — the byte-level pushdown automaton over a
// FlatGrammar: a state is a set of stacks; a stack is a terminal position
// (the next byte must be in its byte set) over a persistent, shared-tail
// list of return positions. Internal to coordinator/constrained/.
//
//   NodeArena arena(/*intern=*/true);
//   std::vector<Stack> state, next;
//   pda.Initial(arena, state);
//   pda.Advance(state, 'x', arena, next);   // next empty: 'x' not allowed
//
// Invariants: every stack can still be completed (FlatGrammar dropped
// unproductive alternatives), so a non-empty state is live; a stack whose
// rule instance returns to `escape` (the mask cache's stand-in for "the
// stack below, unknown") reports an escape instead of continuing. Rule calls
// in tail position push nothing, so right recursion (repetitions, regex
// DFAs) runs in constant stack depth.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_PDA_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_PDA_H_

#include <cstdint>
#include <deque>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "coordinator/constrained/grammar.h"

namespace exl3serve::coordinator::constrained {

// Most stacks one state may hold (an ambiguous grammar multiplies them).
inline constexpr size_t kMaxStacks = 2048;
static_assert(kMaxStacks == kMaxRuleAlternatives, "a rule's alternatives must fit in the stacks");

// A return position (continue at `pos` once the called rule ends) over the
// rest of the stack.
struct StackNode {
  uint32_t pos;
  const StackNode* parent;
};

// `pos` == kAcceptPos: the whole grammar is complete (nothing below).
inline constexpr uint32_t kAcceptPos = UINT32_MAX;
struct Stack {
  uint32_t pos;
  const StackNode* parent;
  bool operator==(const Stack&) const = default;
};

// Owns stack nodes. Interning (persistent states: equal stacks share nodes)
// or rewindable scratch (mask walks). Thread-compatible.
class NodeArena {
 public:
  explicit NodeArena(bool intern) : intern_(intern) {}
  const StackNode* Make(uint32_t pos, const StackNode* parent);
  size_t mark() const { return nodes_.size(); }
  // Frees the nodes made after `mark` (scratch arenas only).
  void Rewind(size_t mark) { nodes_.resize(mark); }

 private:
  bool intern_;
  std::deque<StackNode> nodes_;
  absl::flat_hash_map<std::pair<uint32_t, const StackNode*>, const StackNode*> index_;
};

class Pda {
 public:
  explicit Pda(const FlatGrammar& grammar) : g_(grammar) {}
  const FlatGrammar& grammar() const { return g_; }

  // The stacks before any byte. False when kMaxStacks was exceeded.
  bool Initial(NodeArena& arena, std::vector<Stack>& out) const;
  // Appends the stacks reachable without input from "continue at `pos` over
  // `parent`" (pos may be a kEnd). Returning into `escape` sets *escaped
  // instead. False when kMaxStacks was exceeded.
  bool Closure(uint32_t pos, const StackNode* parent, NodeArena& arena, std::vector<Stack>& out,
               const StackNode* escape = nullptr, bool* escaped = nullptr) const;
  // out = the state after byte `b` from `in` (out cleared first).
  bool Advance(std::span<const Stack> in, uint8_t b, NodeArena& arena, std::vector<Stack>& out,
               const StackNode* escape = nullptr, bool* escaped = nullptr) const;

 private:
  const FlatGrammar& g_;
};

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_PDA_H_
