// coordinator/tokenizer/text_pipeline.h — the stages around the BPE model, as
// tokenizer.json describes them: normalizers (text -> text), pre-tokenizers
// (text -> pre-tokens) and decoders (token strings -> text).
//
// Supported (everything else is rejected when the file is loaded):
//   normalizers     NFC NFD NFKC NFKD Prepend Replace(String) Sequence
//   pre_tokenizers  Split(Regex|String; Isolated Removed MergedWithPrevious
//                   MergedWithNext Contiguous; invert) ByteLevel Metaspace Sequence
//   decoders        ByteLevel Metaspace Replace(String) ByteFallback Fuse Strip Sequence
// Sequences are flattened when loaded, so each stage here is a flat list.
//
// Internal to coordinator/tokenizer. All types are immutable values after
// loading; the functions are thread-safe.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_TEXT_PIPELINE_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_TEXT_PIPELINE_H_

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/tokenizer/split_regex.h"

namespace exl3serve::coordinator::internal {

struct NormalizerStep {
  enum class Kind { kNfc, kNfd, kNfkc, kNfkd, kPrepend, kReplace };
  Kind kind = Kind::kNfc;
  std::string text;         // kPrepend: what to prepend; kReplace: the pattern
  std::string replacement;  // kReplace
};

// Applies `steps` in order. Prepend adds nothing to an empty string.
// Requires: `text` is valid UTF-8.
std::string Normalize(const std::vector<NormalizerStep>& steps, std::string text);

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace };
  Kind kind = Kind::kSplit;
  // kSplit: `regex` if set, else the literal `pattern`. kByteLevel: `regex` is
  // the GPT-2 pattern when use_regex is true.
  std::optional<SplitRegex> regex;
  std::string pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel
  bool add_prefix_space = false;
  // kMetaspace
  std::string replacement = "\xE2\x96\x81";  // U+2581
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
};

// The pre-tokens of `text` (valid UTF-8), in order, none empty.
// `at_text_start`: `text` begins at offset 0 of the caller's input (Metaspace's
// "first" scheme prepends only there).
std::vector<std::string> PreTokenize(const std::vector<PreTokenizerStep>& steps, std::string text,
                                     bool at_text_start);

// The GPT-2 pre-tokenizer pattern ByteLevel uses when use_regex is true.
inline constexpr std::string_view kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct DecoderStep {
  enum class Kind { kByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip };
  Kind kind = Kind::kByteLevel;
  std::string pattern, content;  // kReplace: pattern -> content; kStrip: content (one char)
  int strip_start = 0, strip_stop = 0;
  std::string replacement = "\xE2\x96\x81";  // kMetaspace
  PrependScheme prepend_scheme = PrependScheme::kAlways;
};

struct DecodeMode {
  // The first piece starts the decoded text (Metaspace and Strip remove a
  // leading space only there).
  bool sequence_start = true;
  // Streaming: a trailing run of <0xNN> byte tokens that is an incomplete
  // UTF-8 character is kept as raw bytes instead of becoming U+FFFD, so the
  // caller can wait for the rest.
  bool keep_incomplete_tail = false;
  // One token's bytes (Tokenizer::TokenBytes): a <0xNN> byte group is its
  // raw bytes even when it is no UTF-8 prefix (a lone continuation byte),
  // not U+FFFD.
  bool raw_byte_groups = false;
};

// Runs the decoder steps over the token strings `pieces` and returns the
// joined bytes. They are not necessarily valid UTF-8 (byte-level tokens can
// split characters); callers finish with ToValidUtf8.
std::string DecodePieces(const std::vector<DecoderStep>& steps, std::vector<std::string> pieces,
                         DecodeMode mode);

}  // namespace exl3serve::coordinator::internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_TEXT_PIPELINE_H_
