// coordinator/tokenizer/bpe_model.h — the BPE model of a tokenizer.json
// ("model": {"type": "BPE", ...}): vocabulary, merges ranked by their order,
// byte fallback to <0xNN> tokens, the unknown token and ignore_merges.
//
//   std::vector<int32_t> ids;
//   model.Tokenize("Ġhello", &ids);   // one pre-token, already byte-mapped
//
// Semantics follow Hugging Face tokenizers: a word starts as one symbol per
// character (unknown characters become their <0xNN> byte tokens, or the unk
// token, fused when fuse_unk); then the adjacent pair with the lowest merge
// rank is merged, leftmost first on ties, until no pair has a merge. With
// ignore_merges a word that is itself in the vocabulary is one token.
//
// Internal to coordinator/tokenizer.
// Thread safety: immutable after Create; Tokenize is thread-safe.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_BPE_MODEL_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_BPE_MODEL_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"

namespace exl3serve::coordinator::internal {

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::string continuing_subword_prefix;  // "" when absent
  std::string end_of_word_suffix;         // "" when absent
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class BpeModel {
 public:
  // `vocab`: token -> id; `merges`: pairs in rank order. `label` prefixes
  // error messages (the file name).
  // Errors: DataLoss naming the merge index when a merge names a token that
  // is not in the vocabulary, or the unk token is missing; InvalidArgument
  // for negative ids.
  static absl::StatusOr<BpeModel> Create(std::vector<std::pair<std::string, int32_t>> vocab,
                                         const std::vector<std::pair<std::string, std::string>>& merges,
                                         BpeOptions options, std::string_view label);

  // Appends the ids of `word` (valid UTF-8) to `out`.
  void Tokenize(std::string_view word, std::vector<int32_t>* out) const;

  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token text of `id`, or nullptr if the vocabulary has no such id.
  const std::string* IdToToken(int32_t id) const;
  // One past the largest id in the vocabulary.
  int32_t id_end() const { return static_cast<int32_t>(id_to_token_.size()); }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  std::optional<int32_t> Find(std::string_view token) const;

  BpeOptions options_;
  absl::flat_hash_map<std::string, int32_t> token_to_id_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> has_id_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  int32_t byte_ids_[256];  // <0xNN> token ids, -1 where absent
};

}  // namespace exl3serve::coordinator::internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_BPE_MODEL_H_
