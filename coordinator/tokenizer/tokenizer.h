// coordinator/tokenizer/tokenizer.h — text <-> token ids from a Hugging Face
// model directory (tokenizer.json + tokenizer_config.json), producing the same
// ids as Hugging Face's tokenizers library for the byte-level BPE (GPT-2,
// Llama 3, Qwen 2/3) and SentencePiece-style BPE with byte fallback (Llama 2,
// Mistral) families.
//
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, Tokenizer::Load(model_dir));
//   std::vector<int32_t> ids = tok->Encode("Hello", {.add_special_tokens = true});
//   EXL3_ASSIGN_OR_RETURN(std::string text, tok->Decode(ids));
//
// Encoding: invalid UTF-8 in the input becomes U+FFFD first; added tokens are
// cut out of the text (non-normalized ones before the normalizer runs,
// normalized ones after; leftmost, longest first; lstrip/rstrip/single_word
// honoured); the rest is normalized, pre-tokenized and run through the BPE
// model; the post-processor's template (BOS, ...) is applied on request. For
// tokenizer_class LlamaTokenizer(Fast) the template comes from
// tokenizer_config's add_bos_token/add_eos_token, as transformers does.
// Decoding runs the tokenizer.json decoder chain; for streaming see
// coordinator/tokenizer/stream_decoder.h. clean_up_tokenization_spaces is not
// applied (the tokenizers library does not apply it either).
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::coordinator {

struct EncodeOptions {
  // Apply the post-processor's template: BOS/EOS etc. (Hugging Face's
  // add_special_tokens; its default is true, ours false).
  bool add_special_tokens = false;
  // Recognise special added tokens written in the text ("<|im_start|>") as
  // those tokens, as Hugging Face does by default. Turn off for untrusted text
  // so it cannot inject control tokens; they are then tokenized as plain text.
  // Non-special added tokens are always recognised.
  bool parse_special_tokens = true;
};

struct DecodeOptions {
  // Leave out added tokens marked "special" (BOS, EOS, <|im_start|>, ...).
  bool skip_special_tokens = false;
};

// Token ids named by tokenizer_config.json (bos_token, eos_token, pad_token),
// when it names them and they exist.
struct SpecialTokenIds {
  std::optional<int32_t> bos, eos, pad;
};

class StreamDecoder;

// Limits on what a tokenizer.json may ask for; each error names its limit.
// Token ids (vocabulary, added tokens, post-processor ids) are below
// kMaxTokenId: the tables are indexed by id, so a stray id of 2^31 would
// otherwise allocate gigabytes (the largest published vocabularies hold
// ~262 k tokens).
inline constexpr int32_t kMaxTokenId = 1 << 22;
// tokenizer.json / tokenizer_config.json as read by Tokenizer::Load (real
// files are at most tens of MB).
inline constexpr size_t kMaxTokenizerFileBytes = size_t{1} << 30;

// Thread safety: immutable after loading; every const method is thread-safe.
// Ownership: owns all its tables (the vocabulary is copied out of the JSON).
class Tokenizer {
 public:
  // Loads `<model_dir>/tokenizer.json` and, if present,
  // `<model_dir>/tokenizer_config.json`.
  // Errors: NotFound (or the errno-derived code) for a missing tokenizer.json;
  // DataLoss for invalid JSON or a field of the wrong shape, naming the file
  // and the field (`model.merges[12]`); Unimplemented for a model, normalizer,
  // pre-tokenizer, decoder or regex feature this tokenizer does not support,
  // naming it. Cost: parses the whole file (a 150k-token vocabulary takes
  // about a second).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& model_dir);

  // As Load, from the files' contents; `tokenizer_config_json` may be empty.
  // `label` names the source in messages (used as "<label>/tokenizer.json").
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view tokenizer_json,
                                                            std::string_view tokenizer_config_json,
                                                            std::string_view label);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // The ids of `text` (any bytes; invalid UTF-8 is replaced by U+FFFD).
  std::vector<int32_t> Encode(std::string_view text, const EncodeOptions& options = {}) const;

  // The text of `ids` (always valid UTF-8).
  // Errors: InvalidArgument naming the first id that is negative, too large
  // or a hole in the vocabulary.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     const DecodeOptions& options = {}) const;

  // The bytes one token stands for inside a sequence (not at its start, so
  // a SentencePiece "▁" is a space): may be an incomplete UTF-8 character
  // for byte-level and byte-fallback tokens (a <0x80> byte token is the byte
  // 0x80). For logprobs' `bytes` and structured output's token bytes.
  // Errors: as Decode.
  absl::StatusOr<std::string> TokenBytes(int32_t id) const;

  // One past the largest id (vocabulary and added tokens).
  int32_t vocab_size() const;
  std::optional<int32_t> TokenToId(std::string_view token) const;
  // The token's string as stored (byte-level or "▁" form), or nullopt.
  std::optional<std::string> IdToToken(int32_t id) const;
  // True for added tokens marked "special".
  bool IsSpecial(int32_t id) const;
  const SpecialTokenIds& special_token_ids() const;
  // tokenizer_config.json's chat_template ("default" entry when it is a
  // list); empty if there is none.
  const std::string& chat_template() const;

  struct Impl;  // defined in tokenizer.cc

 private:
  friend class StreamDecoder;
  explicit Tokenizer(std::unique_ptr<Impl> impl);

  // Decodes for StreamDecoder: raw bytes (an incomplete trailing character is
  // left as bytes), and in *pieces the number of tokens that were not skipped.
  // `sequence_start`: nothing was decoded before these ids.
  // `raw_bytes`: DecodeMode::raw_byte_groups (TokenBytes).
  absl::StatusOr<std::string> DecodeForStream(std::span<const int32_t> ids,
                                              const DecodeOptions& options, bool sequence_start,
                                              bool keep_incomplete_tail, size_t* pieces,
                                              bool raw_bytes = false) const;

  std::unique_ptr<Impl> impl_;
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_TOKENIZER_H_
