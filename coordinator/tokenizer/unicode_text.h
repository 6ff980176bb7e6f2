// coordinator/tokenizer/unicode_text.h — the Unicode facts the tokenizer needs:
// UTF-8 decoding with U+FFFD replacement, general categories, White_Space,
// simple case folding and the four normalization forms (ICU underneath; no ICU
// type appears here).
//
//   std::string text = ToValidUtf8(raw_bytes);      // invalid bytes -> U+FFFD
//   std::vector<char32_t> cps = DecodeUtf8(text);
//   if (CategoryMask(cps[0]) & CategoryMaskForName("L")) { ... }
//
// Internal to coordinator/tokenizer; Unicode version is ICU's (72: Unicode 15).
// Thread safety: every function is thread-safe.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_UNICODE_TEXT_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_UNICODE_TEXT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace exl3serve::coordinator::internal {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// Returns `bytes` with every ill-formed UTF-8 subsequence replaced by U+FFFD,
// one per maximal subpart (the Unicode "substitution of maximal subparts"
// practice, which Rust's from_utf8_lossy and WHATWG decoders follow).
std::string ToValidUtf8(std::string_view bytes);

// True if `bytes` is well-formed UTF-8.
bool IsValidUtf8(std::string_view bytes);

// Length in bytes (0..3) of a trailing sequence that is a proper prefix of a
// well-formed UTF-8 character, i.e. that more bytes could still complete.
size_t IncompleteUtf8TailLength(std::string_view bytes);

// Decodes well-formed UTF-8. Requires: IsValidUtf8(text).
std::vector<char32_t> DecodeUtf8(std::string_view text);

// Appends the UTF-8 encoding of `cp` (a scalar value) to `out`.
void AppendUtf8(char32_t cp, std::string* out);

// Byte length of the UTF-8 character starting with lead byte `lead` (1 for
// anything that is not a multi-byte lead).
size_t Utf8CharLength(unsigned char lead);

// One bit per Unicode general category (bit i = 1 << ICU's UCharCategory i).
uint32_t CategoryMask(char32_t cp);

// Mask for a property name as written in \p{...}: one- or two-letter general
// categories ("L", "Lu", "N", "Nd", "P", "S", "M", "Z", "C", ...), their long
// names ("Letter", "Number", ...) and "Any". 0 if the name is not known.
uint32_t CategoryMaskForName(std::string_view name);

// The White_Space property (what \s matches in Oniguruma's Unicode mode).
bool IsWhiteSpace(char32_t cp);

// Simple (one code point to one code point) case folding.
char32_t SimpleCaseFold(char32_t cp);

enum class NormalizationForm { kNfc, kNfd, kNfkc, kNfkd };

// Returns `text` normalized to `form`. Requires: IsValidUtf8(text).
std::string Normalize(std::string_view text, NormalizationForm form);

}  // namespace exl3serve::coordinator::internal

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_UNICODE_TEXT_H_
