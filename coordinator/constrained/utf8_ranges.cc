// coordinator/constrained/utf8_ranges.cc — see utf8_ranges.h.
#include "coordinator/constrained/utf8_ranges.h"

#include <algorithm>
#include <iterator>

namespace exl3serve::coordinator::constrained {
namespace {

int EncodedLength(uint32_t cp) { return cp < 0x80 ? 1 : cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4; }

void Encode(uint32_t cp, uint8_t* out) {
  const int n = EncodedLength(cp);
  if (n == 1) {
    out[0] = static_cast<uint8_t>(cp);
    return;
  }
  static constexpr uint8_t kLead[5] = {0, 0, 0xC0, 0xE0, 0xF0};
  for (int i = n - 1; i > 0; --i) {
    out[i] = static_cast<uint8_t>(0x80 | (cp & 0x3F));
    cp >>= 6;
  }
  out[0] = static_cast<uint8_t>(kLead[n] | cp);
}

// [lo, hi] share an encoded length and no surrogate.
void Split(uint32_t lo, uint32_t hi, std::vector<Utf8Sequence>& out) {
  const int n = EncodedLength(lo);
  if (n != EncodedLength(hi)) {
    const uint32_t edge = n == 1 ? 0x7F : n == 2 ? 0x7FF : 0xFFFF;
    Split(lo, edge, out);
    Split(edge + 1, hi, out);
    return;
  }
  // Make the range a product of byte ranges: split where a lower
  // continuation byte would otherwise not span its whole 0x80..0xBF.
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (uint32_t{1} << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        Split(lo, lo | m, out);
        Split((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        Split(lo, (hi & ~m) - 1, out);
        Split(hi & ~m, hi, out);
        return;
      }
    }
  }
  uint8_t a[4], b[4];
  Encode(lo, a);
  Encode(hi, b);
  Utf8Sequence seq;
  for (int i = 0; i < n; ++i) seq.push_back({a[i], b[i]});
  out.push_back(std::move(seq));
}

}  // namespace

CodePointSet NormalizeCodePoints(CodePointSet set) {
  for (auto& [lo, hi] : set) hi = std::min(hi, kMaxCodePoint);
  std::erase_if(set, [](const auto& r) { return r.first > r.second; });
  std::sort(set.begin(), set.end());
  CodePointSet out;
  for (const auto& r : set) {
    if (!out.empty() && r.first <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, r.second);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

CodePointSet ComplementCodePoints(const CodePointSet& set) {
  CodePointSet out;
  uint32_t next = 0;
  for (const auto& [lo, hi] : NormalizeCodePoints(set)) {
    if (lo > next) out.push_back({next, lo - 1});
    next = hi + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return out;
}

CodePointSet IntersectCodePoints(const CodePointSet& a, const CodePointSet& b) {
  const CodePointSet x = NormalizeCodePoints(a), y = NormalizeCodePoints(b);
  CodePointSet out;
  for (size_t i = 0, j = 0; i < x.size() && j < y.size();) {
    const uint32_t lo = std::max(x[i].first, y[j].first), hi = std::min(x[i].second, y[j].second);
    if (lo <= hi) out.push_back({lo, hi});
    if (x[i].second < y[j].second) {
      ++i;
    } else {
      ++j;
    }
  }
  return out;
}

bool ContainsCodePoint(const CodePointSet& set, uint32_t cp) {
  auto it = std::upper_bound(set.begin(), set.end(), cp,
                             [](uint32_t v, const std::pair<uint32_t, uint32_t>& r) { return v < r.first; });
  return it != set.begin() && cp <= std::prev(it)->second;
}

int Utf8LengthFromLead(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

std::vector<Utf8Sequence> Utf8Sequences(const CodePointSet& set) {
  std::vector<Utf8Sequence> out;
  for (auto [lo, hi] : NormalizeCodePoints(set)) {
    // Leave out the surrogates.
    if (lo <= 0xDFFF && hi >= 0xD800) {
      if (lo < 0xD800) Split(lo, 0xD7FF, out);
      if (hi > 0xDFFF) Split(0xE000, hi, out);
      continue;
    }
    Split(lo, hi, out);
  }
  return out;
}

void AppendUtf8(uint32_t cp, std::string& out) {
  uint8_t b[4];
  Encode(cp, b);
  out.append(reinterpret_cast<const char*>(b), EncodedLength(cp));
}

bool DecodeUtf8(std::string_view text, size_t* pos, uint32_t* cp) {
  size_t i = *pos;
  if (i >= text.size()) return false;
  const uint8_t b0 = static_cast<uint8_t>(text[i]);
  int n;
  uint32_t c, min;
  if (b0 < 0x80) {
    n = 1, c = b0, min = 0;
  } else if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2, c = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3, c = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    return false;
  }
  if (i + n > text.size()) return false;
  for (int k = 1; k < n; ++k) {
    const uint8_t b = static_cast<uint8_t>(text[i + k]);
    if ((b & 0xC0) != 0x80) return false;
    c = (c << 6) | (b & 0x3F);
  }
  if (c < min || c > kMaxCodePoint || (c >= 0xD800 && c <= 0xDFFF)) return false;
  *pos = i + n;
  *cp = c;
  return true;
}

}  // namespace exl3serve::coordinator::constrained
