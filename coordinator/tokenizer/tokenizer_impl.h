// coordinator/tokenizer/tokenizer_impl.h — the tables behind Tokenizer, shared
// by tokenizer.cc (encode/decode) and tokenizer_json.cc (loading). Internal.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_IMPL_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_IMPL_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "coordinator/tokenizer/bpe_model.h"
#include "coordinator/tokenizer/text_pipeline.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace exl3serve::coordinator {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false, rstrip = false, single_word = false;
  bool normalized = false;
};

// One element of the post-processor template for a single sequence: either
// the encoded text or fixed ids.
struct TemplatePiece {
  bool is_sequence = false;
  std::vector<int32_t> ids;
};

struct Tokenizer::Impl {
  internal::BpeModel model;
  std::vector<internal::NormalizerStep> normalizers;
  std::vector<internal::PreTokenizerStep> pre_tokenizers;
  std::vector<internal::DecoderStep> decoders;
  std::vector<TemplatePiece> single_template;  // empty: nothing is added

  std::vector<AddedToken> added;                 // in file order
  absl::flat_hash_map<int32_t, size_t> added_by_id;
  absl::flat_hash_map<std::string, int32_t> added_by_content;
  // Indices into `added` by the first byte of their content, longest first;
  // [0]: tokens matched on the raw text (normalized == false), [1]: on the
  // normalized text.
  std::array<std::array<std::vector<size_t>, 256>, 2> added_by_first_byte;

  SpecialTokenIds special_ids;
  std::string chat_template;
  int32_t vocab_size = 0;

  // Fills added_by_* and vocab_size from `added` and `model`.
  void IndexAddedTokens();
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_IMPL_H_
