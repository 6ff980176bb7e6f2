// coordinator/constrained/token_trie.cc — see token_trie.h.
#include "coordinator/constrained/token_trie.h"

#include <algorithm>

namespace exl3serve::coordinator::constrained {

TokenTrie TokenTrie::Build(std::vector<std::pair<std::string_view, int32_t>> entries) {
  std::erase_if(entries, [](const auto& e) { return e.first.empty(); });
  std::sort(entries.begin(), entries.end());
  TokenTrie t;
  t.byte_.push_back(0);
  t.depth_.push_back(0);
  t.end_.push_back(0);
  std::vector<uint32_t> node_of_token;  // per entry
  node_of_token.reserve(entries.size());
  std::vector<uint32_t> path = {0};  // nodes of the current prefix, by depth
  std::string_view prev;
  for (const auto& [bytes, id] : entries) {
    size_t lcp = 0;
    while (lcp < prev.size() && lcp < bytes.size() && prev[lcp] == bytes[lcp]) ++lcp;
    // Close the nodes deeper than the shared prefix.
    while (path.size() > lcp + 1) {
      t.end_[path.back()] = static_cast<uint32_t>(t.byte_.size());
      path.pop_back();
    }
    for (size_t k = lcp; k < bytes.size(); ++k) {
      path.push_back(static_cast<uint32_t>(t.byte_.size()));
      t.byte_.push_back(static_cast<uint8_t>(bytes[k]));
      t.depth_.push_back(static_cast<uint32_t>(k + 1));
      t.end_.push_back(0);
    }
    t.max_depth_ = std::max<uint32_t>(t.max_depth_, static_cast<uint32_t>(bytes.size()));
    node_of_token.push_back(path.back());
    prev = bytes;
  }
  while (!path.empty()) {
    t.end_[path.back()] = static_cast<uint32_t>(t.byte_.size());
    path.pop_back();
  }
  // Tokens by node (entries are in node order already: sorted bytes).
  t.tok_begin_.assign(t.byte_.size() + 1, 0);
  for (uint32_t node : node_of_token) ++t.tok_begin_[node + 1];
  for (size_t i = 1; i < t.tok_begin_.size(); ++i) t.tok_begin_[i] += t.tok_begin_[i - 1];
  t.ids_.resize(entries.size());
  std::vector<uint32_t> fill(t.tok_begin_.begin(), t.tok_begin_.end() - 1);
  for (size_t e = 0; e < entries.size(); ++e) t.ids_[fill[node_of_token[e]]++] = entries[e].second;
  return t;
}

}  // namespace exl3serve::coordinator::constrained
