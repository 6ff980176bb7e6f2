#include "coordinator/tokenizer/unicode_text.h"

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <array>

#include "common/logging.h"

namespace exl3serve::coordinator::internal {
namespace {

// Well-formed UTF-8 (Unicode Table 3-7): the lead byte decides the length and
// the allowed range of the second byte; later bytes are always 80..BF.
struct LeadInfo {
  int length;  // 0: not a valid lead byte
  unsigned char second_lo, second_hi;
};

LeadInfo Lead(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

// Scans one character at `i`. Returns the number of bytes that form a
// well-formed character (> 0), or the negated length of the maximal subpart
// to replace; sets *truncated when that subpart ended only because the input
// did.
int ScanChar(std::string_view s, size_t i, bool* truncated) {
  *truncated = false;
  const auto b = static_cast<unsigned char>(s[i]);
  const LeadInfo lead = Lead(b);
  if (lead.length == 0) return -1;
  if (lead.length == 1) return 1;
  for (int k = 1; k < lead.length; ++k) {
    if (i + k >= s.size()) {
      *truncated = true;
      return -k;
    }
    const auto c = static_cast<unsigned char>(s[i + k]);
    const unsigned char lo = k == 1 ? lead.second_lo : 0x80;
    const unsigned char hi = k == 1 ? lead.second_hi : 0xBF;
    if (c < lo || c > hi) return -k;
  }
  return lead.length;
}

}  // namespace

std::string ToValidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t i = 0;
  while (i < bytes.size()) {
    bool truncated;
    const int n = ScanChar(bytes, i, &truncated);
    if (n > 0) {
      out.append(bytes.data() + i, n);
      i += n;
    } else {
      AppendUtf8(kReplacementChar, &out);
      i += -n;
    }
  }
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  size_t i = 0;
  while (i < bytes.size()) {
    bool truncated;
    const int n = ScanChar(bytes, i, &truncated);
    if (n <= 0) return false;
    i += n;
  }
  return true;
}

size_t IncompleteUtf8TailLength(std::string_view bytes) {
  // A truncated character is at most 3 bytes long; look for its lead byte.
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const size_t i = bytes.size() - back;
    const auto b = static_cast<unsigned char>(bytes[i]);
    if (b >= 0x80 && b <= 0xBF) continue;  // continuation byte: keep looking
    bool truncated;
    const int n = ScanChar(bytes, i, &truncated);
    return (n < 0 && truncated && static_cast<size_t>(-n) == back) ? back : 0;
  }
  return 0;
}

std::vector<char32_t> DecodeUtf8(std::string_view text) {
  std::vector<char32_t> cps;
  cps.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    const auto b = static_cast<unsigned char>(text[i]);
    const size_t len = Utf8CharLength(b);
    char32_t cp = len == 1 ? b : len == 2 ? (b & 0x1F) : len == 3 ? (b & 0x0F) : (b & 0x07);
    for (size_t k = 1; k < len && i + k < text.size(); ++k) {
      cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    }
    cps.push_back(cp);
    i += len;
  }
  return cps;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t Utf8CharLength(unsigned char lead) {
  if (lead >= 0xF0) return 4;
  if (lead >= 0xE0) return 3;
  if (lead >= 0xC0) return 2;
  return 1;
}

uint32_t CategoryMask(char32_t cp) { return U_MASK(u_charType(static_cast<UChar32>(cp))); }

uint32_t CategoryMaskForName(std::string_view name) {
  struct Entry {
    std::string_view short_name, long_name;
    uint32_t mask;
  };
  static constexpr std::array kEntries = {
      Entry{"L", "Letter", U_GC_L_MASK},
      Entry{"Lu", "Uppercase_Letter", U_GC_LU_MASK},
      Entry{"Ll", "Lowercase_Letter", U_GC_LL_MASK},
      Entry{"Lt", "Titlecase_Letter", U_GC_LT_MASK},
      Entry{"Lm", "Modifier_Letter", U_GC_LM_MASK},
      Entry{"Lo", "Other_Letter", U_GC_LO_MASK},
      Entry{"M", "Mark", U_GC_M_MASK},
      Entry{"Mn", "Nonspacing_Mark", U_GC_MN_MASK},
      Entry{"Mc", "Spacing_Mark", U_GC_MC_MASK},
      Entry{"Me", "Enclosing_Mark", U_GC_ME_MASK},
      Entry{"N", "Number", U_GC_N_MASK},
      Entry{"Nd", "Decimal_Number", U_GC_ND_MASK},
      Entry{"Nl", "Letter_Number", U_GC_NL_MASK},
      Entry{"No", "Other_Number", U_GC_NO_MASK},
      Entry{"P", "Punctuation", U_GC_P_MASK},
      Entry{"Pc", "Connector_Punctuation", U_GC_PC_MASK},
      Entry{"Pd", "Dash_Punctuation", U_GC_PD_MASK},
      Entry{"Ps", "Open_Punctuation", U_GC_PS_MASK},
      Entry{"Pe", "Close_Punctuation", U_GC_PE_MASK},
      Entry{"Pi", "Initial_Punctuation", U_GC_PI_MASK},
      Entry{"Pf", "Final_Punctuation", U_GC_PF_MASK},
      Entry{"Po", "Other_Punctuation", U_GC_PO_MASK},
      Entry{"S", "Symbol", U_GC_S_MASK},
      Entry{"Sm", "Math_Symbol", U_GC_SM_MASK},
      Entry{"Sc", "Currency_Symbol", U_GC_SC_MASK},
      Entry{"Sk", "Modifier_Symbol", U_GC_SK_MASK},
      Entry{"So", "Other_Symbol", U_GC_SO_MASK},
      Entry{"Z", "Separator", U_GC_Z_MASK},
      Entry{"Zs", "Space_Separator", U_GC_ZS_MASK},
      Entry{"Zl", "Line_Separator", U_GC_ZL_MASK},
      Entry{"Zp", "Paragraph_Separator", U_GC_ZP_MASK},
      Entry{"C", "Other", U_GC_C_MASK},
      Entry{"Cc", "Control", U_GC_CC_MASK},
      Entry{"Cf", "Format", U_GC_CF_MASK},
      Entry{"Cs", "Surrogate", U_GC_CS_MASK},
      Entry{"Co", "Private_Use", U_GC_CO_MASK},
      Entry{"Cn", "Unassigned", U_GC_CN_MASK},
      Entry{"Any", "Any", 0xFFFFFFFFu},
  };
  for (const Entry& e : kEntries) {
    if (name == e.short_name || name == e.long_name) return e.mask;
  }
  return 0;
}

bool IsWhiteSpace(char32_t cp) {
  // The White_Space property (PropList.txt); stable since Unicode 6.3.
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

char32_t SimpleCaseFold(char32_t cp) {
  return static_cast<char32_t>(u_foldCase(static_cast<UChar32>(cp), U_FOLD_CASE_DEFAULT));
}

std::string Normalize(std::string_view text, NormalizationForm form) {
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* normalizer = nullptr;
  switch (form) {
    case NormalizationForm::kNfc: normalizer = icu::Normalizer2::getNFCInstance(err); break;
    case NormalizationForm::kNfd: normalizer = icu::Normalizer2::getNFDInstance(err); break;
    case NormalizationForm::kNfkc: normalizer = icu::Normalizer2::getNFKCInstance(err); break;
    case NormalizationForm::kNfkd: normalizer = icu::Normalizer2::getNFKDInstance(err); break;
  }
  EXL3_CHECK(U_SUCCESS(err) && normalizer != nullptr) << "ICU normalizer data is missing";
  const icu::UnicodeString in =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), static_cast<int32_t>(text.size())));
  if (normalizer->isNormalized(in, err) && U_SUCCESS(err)) return std::string(text);
  err = U_ZERO_ERROR;
  const icu::UnicodeString normalized = normalizer->normalize(in, err);
  EXL3_CHECK(U_SUCCESS(err)) << "ICU normalization failed: " << u_errorName(err);
  std::string out;
  normalized.toUTF8String(out);
  return out;
}

}  // namespace exl3serve::coordinator::internal
