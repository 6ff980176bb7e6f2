// coordinator/constrained/json_schema_numbers.cc — see json_schema_numbers.h.
#include "coordinator/constrained/json_schema_numbers.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace exl3serve::coordinator::constrained::internal {
namespace {

using Int = __int128;

std::string Digits(Int v) {
  if (v == 0) return "0";
  std::string s;
  for (; v > 0; v /= 10) s.insert(s.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
  return s;
}

// Same-length digit strings lo <= hi.
std::string SameLengthRange(const std::string& lo, const std::string& hi) {
  if (lo.empty()) return "";
  if (lo.size() == 1) {
    return lo == hi ? lo : absl::StrCat("[", lo, "-", hi, "]");
  }
  if (lo[0] == hi[0]) return std::string(1, lo[0]) + SameLengthRange(lo.substr(1), hi.substr(1));
  const size_t rest = lo.size() - 1;
  std::vector<std::string> alts;
  alts.push_back(std::string(1, lo[0]) + "(?:" + SameLengthRange(lo.substr(1), std::string(rest, '9')) + ")");
  if (lo[0] + 1 <= hi[0] - 1) {
    alts.push_back(absl::StrCat("[", std::string(1, static_cast<char>(lo[0] + 1)), "-",
                                std::string(1, static_cast<char>(hi[0] - 1)), "][0-9]{", rest, "}"));
  }
  alts.push_back(std::string(1, hi[0]) + "(?:" + SameLengthRange(std::string(rest, '0'), hi.substr(1)) + ")");
  return "(?:" + absl::StrJoin(alts, "|") + ")";
}

// Canonical decimal integers in [lo, hi] (0 <= lo; hi < 0: unbounded).
std::string NonNegativeRange(Int lo, Int hi) {
  std::vector<std::string> alts;
  const std::string lo_digits = Digits(lo);
  size_t len = lo_digits.size();
  Int start = lo;
  while (hi < 0 || start <= hi) {
    Int pow = 1;
    for (size_t k = 0; k < len; ++k) pow *= 10;
    const Int top = pow - 1;
    if (hi < 0 && start == pow / 10 && len > lo_digits.size()) {
      alts.push_back(absl::StrCat("[1-9][0-9]{", len - 1, ",17}"));
      break;
    }
    if (hi < 0 && len >= 18) {
      alts.push_back(absl::StrCat("[1-9][0-9]{", len - 1, ",17}"));
      break;
    }
    const Int end = hi >= 0 && hi < top ? hi : top;
    alts.push_back(SameLengthRange(Digits(start), Digits(end)));
    if (end == hi) break;
    start = pow;
    ++len;
  }
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

// Integers in [lo, hi] (inclusive; nullopt-like flags for unbounded).
std::string IntegerRangeRegex(bool has_lo, Int lo, bool has_hi, Int hi) {
  std::vector<std::string> alts;
  // Non-negative part.
  if (!has_hi || hi >= 0) {
    alts.push_back(NonNegativeRange(has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1));
  }
  // Negative part: -m with m in [max(1, -hi), -lo].
  if (!has_lo || lo < 0) {
    const Int mlo = has_hi && hi < 0 ? -hi : 1;
    // StrCat, not "-" + string: GCC 12 warns (-Wrestrict, a false positive).
    alts.push_back(absl::StrCat("-", NonNegativeRange(mlo, has_lo ? -lo : -1)));
  }
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

// An exact non-negative decimal: integer part and fraction digits (no
// trailing zeros; may be longer than the 18 a number may have).
struct Decimal {
  Int integer = 0;
  std::string fraction;
};

// |d| as its shortest round-trip decimal.
Decimal ToDecimal(double d) {
  char buf[512];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), std::fabs(d), std::chars_format::fixed);
  const std::string text(buf, ec == std::errc() ? end : buf);
  Decimal out;
  const size_t dot = text.find('.');
  for (size_t i = 0; i < std::min(dot, text.size()); ++i) out.integer = out.integer * 10 + (text[i] - '0');
  if (dot != std::string::npos) out.fraction = text.substr(dot + 1);
  while (!out.fraction.empty() && out.fraction.back() == '0') out.fraction.pop_back();
  return out;
}

// Digit strings d of length 0..k (k: fraction digits left) with 0.d (value
// after the digits before) at least 0.lo (`lo_incl`: or equal) and, with
// `hi`, at most 0.hi (`hi_incl`: or equal); `top`: the fraction's start,
// where the digits follow a '.' and no digits is no fraction. nullopt: no
// string. Digits past the end of lo/hi compare as zeros.
std::optional<std::string> FractionRange(std::string_view lo, bool lo_incl, const std::string_view* hi, bool hi_incl,
                                         int k, bool top) {
  const bool zero_ok = lo.empty() && lo_incl && (hi == nullptr || !hi->empty() || hi_incl);
  if (zero_ok && hi == nullptr) {  // any digits
    if (k == 0) return "";
    return top ? absl::StrCat("(?:\\.[0-9]{1,", k, "})?") : absl::StrCat("[0-9]{0,", k, "}");
  }
  std::vector<std::string> alts;
  if (k > 0) {
    const int a0 = lo.empty() ? 0 : lo[0] - '0';
    const int b0 = hi == nullptr ? 10 : hi->empty() ? 0 : (*hi)[0] - '0';
    const std::string_view lo_rest = lo.empty() ? lo : lo.substr(1);
    std::string_view hi_rest;
    if (hi != nullptr && !hi->empty()) hi_rest = hi->substr(1);
    auto add = [&](int digit, std::optional<std::string> rest) {
      if (rest) alts.push_back(std::string(1, static_cast<char>('0' + digit)) + *rest);
    };
    if (a0 == b0) {
      add(a0, FractionRange(lo_rest, lo_incl, &hi_rest, hi_incl, k - 1, false));
    } else {
      add(a0, FractionRange(lo_rest, lo_incl, nullptr, false, k - 1, false));
      if (a0 + 1 <= std::min(b0 - 1, 9)) {
        alts.push_back(absl::StrCat("[", a0 + 1, "-", std::min(b0 - 1, 9), "][0-9]{0,", k - 1, "}"));
      }
      if (b0 <= 9) add(b0, FractionRange("", true, &hi_rest, hi_incl, k - 1, false));
    }
  }
  if (alts.empty()) return zero_ok ? std::optional<std::string>("") : std::nullopt;
  std::string body = alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
  if (top) body = "\\." + body;
  return zero_ok ? "(?:" + body + ")?" : body;
}

// Decimals (canonical integer part of <= 18 digits, optional fraction of
// 1..18 digits, no exponent) with magnitude from a to b (null: unbounded),
// each end inclusive or not. nullopt: none.
std::optional<std::string> MagnitudeRange(const Decimal& a, bool a_incl, const Decimal* b, bool b_incl) {
  constexpr int kFractionDigits = 18;
  const std::string_view a_frac = a.fraction;
  std::string_view b_frac;
  if (b != nullptr) b_frac = b->fraction;
  std::vector<std::string> alts;
  if (b != nullptr && b->integer < a.integer) return std::nullopt;
  if (b != nullptr && a.integer == b->integer) {
    std::optional<std::string> f = FractionRange(a_frac, a_incl, &b_frac, b_incl, kFractionDigits, true);
    if (f) alts.push_back(Digits(a.integer) + *f);
  } else {
    std::optional<std::string> f = FractionRange(a_frac, a_incl, nullptr, false, kFractionDigits, true);
    if (f) alts.push_back(Digits(a.integer) + *f);
    const std::string any_frac = R"((?:\.[0-9]{1,18})?)";
    if (b == nullptr || a.integer + 1 <= b->integer - 1) {
      alts.push_back("(?:" + NonNegativeRange(a.integer + 1, b == nullptr ? -1 : b->integer - 1) + ")" + any_frac);
    }
    if (b != nullptr) {
      std::optional<std::string> g = FractionRange("", true, &b_frac, b_incl, kFractionDigits, true);
      if (g) alts.push_back(Digits(b->integer) + *g);
    }
  }
  if (alts.empty()) return std::nullopt;
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

}  // namespace

std::optional<std::string> BoundedNumberRegex(const NumberBounds& b, bool integer) {
  bool has_lo = b.has_lo, lo_incl = b.lo_incl, has_hi = b.has_hi, hi_incl = b.hi_incl;
  double lo = b.lo, hi = b.hi;
  if (integer) {
    Int ilo = 0, ihi = 0;
    if (has_lo) ilo = static_cast<Int>(lo_incl ? std::ceil(lo) : std::floor(lo) + 1);
    if (has_hi) ihi = static_cast<Int>(hi_incl ? std::floor(hi) : std::ceil(hi) - 1);
    if (has_lo && has_hi && ilo > ihi) return std::nullopt;
    return IntegerRangeRegex(has_lo, ilo, has_hi, ihi);
  }
  if (has_lo && has_hi && (lo > hi || (lo == hi && !(lo_incl && hi_incl)))) return std::nullopt;
  // Validators compare doubles: a decimal just inside an exclusive bound
  // can round onto it (0.999999999999999999 parses as 1). An exclusive
  // bound is therefore the inclusive one at the adjacent double, so
  // every emitted number parses strictly inside.
  if (has_lo && !lo_incl) lo = std::nextafter(lo, HUGE_VAL), lo_incl = true;
  if (has_hi && !hi_incl) hi = std::nextafter(hi, -HUGE_VAL), hi_incl = true;
  // x >= 0 part and x < 0 part (as '-' and a magnitude > 0). The bounds
  // are exact decimals: the shortest representation of the doubles
  // (x <= that decimal then parses to a double <= the bound).
  std::vector<std::string> alts;
  const Decimal L = has_lo ? ToDecimal(lo) : Decimal{}, H = has_hi ? ToDecimal(hi) : Decimal{};
  if (!has_hi || hi > 0 || (hi == 0 && hi_incl)) {
    const bool from_zero = !has_lo || lo < 0;
    std::optional<std::string> m =
        MagnitudeRange(from_zero ? Decimal{} : L, from_zero || lo_incl, has_hi ? &H : nullptr, hi_incl);
    if (m) alts.push_back(*m);
  }
  if (!has_lo || lo < 0) {
    const bool from_zero = !has_hi || hi >= 0;
    std::optional<std::string> m =
        MagnitudeRange(from_zero ? Decimal{} : H, from_zero ? false : hi_incl, has_lo ? &L : nullptr, lo_incl);
    if (m) alts.push_back("-" + *m);
  }
  if (alts.empty()) return std::nullopt;
  return alts.size() == 1 ? alts[0] : "(?:" + absl::StrJoin(alts, "|") + ")";
}

}  // namespace exl3serve::coordinator::constrained::internal
