// coordinator/constrained/utf8_ranges.h — sets of Unicode code points as the
// UTF-8 byte sequences that encode them, for the byte-level grammars (a regex
// class like [α-ω] or [^"] is one or more sequences of byte ranges).
//
//   for (const Utf8Sequence& seq : Utf8Sequences({{0x80, 0x10FFFF}})) ...
//
// Surrogates (U+D800..U+DFFF) are not characters in UTF-8 and are left out.
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_UTF8_RANGES_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_UTF8_RANGES_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace exl3serve::coordinator::constrained {

inline constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// Closed intervals [first, second] of code points.
using CodePointSet = std::vector<std::pair<uint32_t, uint32_t>>;

// Sorted, merged, clipped to [0, kMaxCodePoint].
CodePointSet NormalizeCodePoints(CodePointSet set);
// All code points not in `set` (normalized).
CodePointSet ComplementCodePoints(const CodePointSet& set);
// The code points in both (normalized).
CodePointSet IntersectCodePoints(const CodePointSet& a, const CodePointSet& b);
// `cp` is in `set`; `set` must be normalized.
bool ContainsCodePoint(const CodePointSet& set, uint32_t cp);

// One byte range per byte of a UTF-8 sequence (1-4 entries): the byte
// strings b0 b1 .. with lo_i <= b_i <= hi_i.
using Utf8Sequence = std::vector<std::pair<uint8_t, uint8_t>>;

// Byte-range sequences whose union is exactly the UTF-8 encodings of `set`.
std::vector<Utf8Sequence> Utf8Sequences(const CodePointSet& set);

// Appends the UTF-8 encoding of `cp` (< 0x110000, not a surrogate).
void AppendUtf8(uint32_t cp, std::string& out);

// The length of the UTF-8 sequence that `lead` starts: 1-4, 0 for a
// continuation byte (0x80..0xBF) or a byte no sequence starts with.
int Utf8LengthFromLead(uint8_t lead);

// Decodes one character at `text[*pos]`, advancing *pos; false (pos
// unchanged) at an invalid or truncated sequence.
bool DecodeUtf8(std::string_view text, size_t* pos, uint32_t* cp);

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_UTF8_RANGES_H_
