#include "coordinator/tokenizer/byte_level.h"

#include <array>

#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator::internal {
namespace {

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<std::string, 256> to_utf8{};
  std::array<int, 0x144> to_byte{};  // every mapped character is below U+0144
};

bool StandsForItself(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

const Tables& GetTables() {
  static const Tables* tables = [] {
    auto* t = new Tables;
    t->to_byte.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const char32_t c = StandsForItself(b) ? static_cast<char32_t>(b) : 0x100 + next++;
      t->to_char[b] = c;
      t->to_byte[c] = b;
      AppendUtf8(c, &t->to_utf8[b]);
    }
    return t;
  }();
  return *tables;
}

}  // namespace

char32_t ByteToChar(unsigned char b) { return GetTables().to_char[b]; }

int CharToByte(char32_t c) {
  const Tables& t = GetTables();
  return c < t.to_byte.size() ? t.to_byte[c] : -1;
}

std::string BytesToByteLevel(std::string_view bytes) {
  const Tables& t = GetTables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) out += t.to_utf8[static_cast<unsigned char>(c)];
  return out;
}

}  // namespace exl3serve::coordinator::internal
