// sharding/llama2c_tokenizer.h — a llama2.c `tokenizer.bin` (e.g.
// shared/models/stories260K/tok512.bin) as a Hugging Face tokenizer.json +
// tokenizer_config.json, so an imported llama2.c model speaks text through
// `generate --prompt`, `serve` and every client.
//
//   EXL3_ASSIGN_OR_RETURN(Llama2cVocab vocab, ReadLlama2cTokenizer("tok512.bin", 512));
//   EXL3_RETURN_IF_ERROR(WriteHfTokenizer(vocab, out_dir));
//
// Format (little-endian): uint32 max_token_length, then per id: float32
// score, int32 byte length, the piece's bytes. Pieces use a plain space
// where SentencePiece writes U+2581; id 0 is <unk>, 1 BOS (`\n<s>\n`), 2 EOS
// (`\n</s>\n`); a vocabulary may hold the 256 byte pieces `<0x00>`..`<0xFF>`.
//
// The encoding rule of llama2.c (run.c's encode): prepend a space (the dummy
// prefix) to non-empty text, split it into UTF-8 characters, map each to its
// piece or — when none — its bytes to the byte pieces, then repeatedly merge
// the adjacent pair whose concatenation is a piece of the highest score
// (leftmost on ties). The tokenizer.json written expresses it as a BPE model:
// normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, the pieces
// with spaces as "▁", merges = every split (a, b) of a piece into two pieces,
// ranked by the merged piece's score (descending; a piece's splits left to
// right), byte_fallback when the vocabulary has all 256 byte pieces (else an
// unknown character is <unk>, as SentencePiece does without byte fallback),
// and the Llama decoder chain (Replace ▁ → space, ByteFallback, Fuse, Strip
// one leading space). tokenizer_config.json: LlamaTokenizer, add_bos_token.
#ifndef EXL3SERVE_SHARDING_LLAMA2C_TOKENIZER_H_
#define EXL3SERVE_SHARDING_LLAMA2C_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3serve::sharding {

struct Llama2cVocab {
  std::vector<std::string> pieces;  // as stored (plain spaces)
  std::vector<float> scores;
  uint32_t max_token_length = 0;
};

// Reads `path`. `vocab_size` > 0: the model's vocabulary size, which the
// file must hold exactly (DataLoss otherwise); 0: read to the end of the
// file. Errors: NotFound / PermissionDenied; DataLoss for a truncated
// file, a negative or over-long piece length, or trailing bytes.
absl::StatusOr<Llama2cVocab> ReadLlama2cTokenizer(const std::string& path, int64_t vocab_size);

// Writes tokenizer.json and tokenizer_config.json into `out_dir` (which must
// exist). Errors: InvalidArgument for fewer than 3 pieces, duplicate pieces
// or pieces that are not valid UTF-8 (besides the byte pieces); those of
// writing.
absl::Status WriteHfTokenizer(const Llama2cVocab& vocab, const std::string& out_dir);

// The llama2.c encoding rule above, directly (the reference the tests check
// tokenizer.json against; quadratic in the text length). No BOS.
std::vector<int32_t> EncodeLlama2c(const Llama2cVocab& vocab, const std::string& text);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_LLAMA2C_TOKENIZER_H_
