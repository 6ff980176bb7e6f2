// coordinator/constrained/token_trie.h — a byte trie of token strings in
// preorder, flat: node i's subtree is [i, end(i)), so a walk skips a dead
// subtree in one step. Used for the vocabulary (TokenVocabulary) and for the
// mask cache's context-dependent token suffixes. Internal.
//
//   TokenTrie trie = TokenTrie::Build({{"ab", 7}, {"a", 3}});
//   for (uint32_t i = 1; i < trie.size(); ++i) ... trie.byte(i), trie.depth(i), trie.tokens(i)
//
// Node 0 is the root (depth 0, no byte). Thread safety: immutable.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_TOKEN_TRIE_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_TOKEN_TRIE_H_

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

namespace exl3serve::coordinator::constrained {

class TokenTrie {
 public:
  // Entries: (bytes, token id); empty byte strings are left out. Entries may
  // repeat bytes (several ids at one node).
  static TokenTrie Build(std::vector<std::pair<std::string_view, int32_t>> entries);

  uint32_t size() const { return static_cast<uint32_t>(byte_.size()); }
  bool empty() const { return byte_.size() <= 1; }
  uint8_t byte(uint32_t node) const { return byte_[node]; }
  uint32_t depth(uint32_t node) const { return depth_[node]; }
  uint32_t end(uint32_t node) const { return end_[node]; }
  uint32_t max_depth() const { return max_depth_; }
  std::span<const int32_t> tokens(uint32_t node) const {
    return {ids_.data() + tok_begin_[node], ids_.data() + tok_begin_[node + 1]};
  }
  // Tokens of the nodes [first, last) (a subtree range), in node order.
  std::span<const int32_t> tokens_in(uint32_t first, uint32_t last) const {
    return {ids_.data() + tok_begin_[first], ids_.data() + tok_begin_[last]};
  }
  size_t num_tokens() const { return ids_.size(); }
  size_t memory_bytes() const {
    return byte_.size() * 13 + ids_.size() * 4;
  }

 private:
  std::vector<uint8_t> byte_;
  std::vector<uint32_t> depth_, end_, tok_begin_;
  std::vector<int32_t> ids_;
  uint32_t max_depth_ = 0;
};

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_TOKEN_TRIE_H_
