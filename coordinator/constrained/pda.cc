// coordinator/constrained/pda.cc — see pda.h.
#include "coordinator/constrained/pda.h"

#include <algorithm>

namespace exl3serve::coordinator::constrained {

const StackNode* NodeArena::Make(uint32_t pos, const StackNode* parent) {
  if (intern_) {
    auto [it, inserted] = index_.try_emplace({pos, parent}, nullptr);
    if (!inserted) return it->second;
    nodes_.push_back({pos, parent});
    it->second = &nodes_.back();
    return it->second;
  }
  nodes_.push_back({pos, parent});
  return &nodes_.back();
}

bool Pda::Initial(NodeArena& arena, std::vector<Stack>& out) const {
  out.clear();
  for (uint32_t start : g_.alternative_starts(g_.root())) {
    if (!Closure(start, nullptr, arena, out)) return false;
  }
  return true;
}

bool Pda::Closure(uint32_t pos, const StackNode* parent, NodeArena& arena, std::vector<Stack>& out,
                  const StackNode* escape, bool* escaped) const {
  // Work items (pos, parent); no left recursion, so this ends. Items are
  // small in number for real grammars; the output is deduplicated.
  struct Item {
    uint32_t pos;
    const StackNode* parent;
  };
  Item inline_buf[32];
  std::vector<Item> heap;
  size_t n = 0;
  auto push = [&](Item it) {
    if (n < 32) {
      inline_buf[n++] = it;
    } else {
      heap.push_back(it);
    }
  };
  auto pop = [&](Item* it) {
    if (!heap.empty()) {
      *it = heap.back();
      heap.pop_back();
      return true;
    }
    if (n == 0) return false;
    *it = inline_buf[--n];
    return true;
  };
  size_t budget = 64 * kMaxStacks;
  push({pos, parent});
  Item it;
  while (pop(&it)) {
    if (--budget == 0) return false;
    const FlatGrammar::Element& e = g_.at(it.pos);
    switch (e.kind) {
      case FlatGrammar::Kind::kEnd: {
        if (it.parent == nullptr) {
          const Stack s{kAcceptPos, nullptr};
          if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
        } else if (it.parent == escape) {
          *escaped = true;
        } else {
          push({it.parent->pos, it.parent->parent});
        }
        break;
      }
      case FlatGrammar::Kind::kBytes: {
        const Stack s{it.pos, it.parent};
        if (std::find(out.begin(), out.end(), s) == out.end()) {
          if (out.size() >= kMaxStacks) return false;
          out.push_back(s);
        }
        break;
      }
      case FlatGrammar::Kind::kRule: {
        const uint32_t cont = it.pos + 1;
        const StackNode* below =
            g_.at(cont).kind == FlatGrammar::Kind::kEnd ? it.parent : arena.Make(cont, it.parent);
        const auto starts = g_.alternative_starts(e.id);
        for (size_t k = starts.size(); k-- > 0;) push({starts[k], below});
        break;
      }
    }
  }
  return true;
}

bool Pda::Advance(std::span<const Stack> in, uint8_t b, NodeArena& arena, std::vector<Stack>& out,
                  const StackNode* escape, bool* escaped) const {
  out.clear();
  for (const Stack& s : in) {
    if (s.pos == kAcceptPos || !g_.Matches(s.pos, b)) continue;
    if (!Closure(s.pos + 1, s.parent, arena, out, escape, escaped)) return false;
  }
  return true;
}

}  // namespace exl3serve::coordinator::constrained
