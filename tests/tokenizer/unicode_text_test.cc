// UTF-8 handling, Unicode categories and the GPT-2 byte table.
#include "coordinator/tokenizer/unicode_text.h"

#include "coordinator/tokenizer/byte_level.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator::internal {
namespace {

const std::string kFffd = "\xEF\xBF\xBD";

TEST(UnicodeTextTest, ReplacesEachMaximalInvalidSubpartWithOneReplacementChar) {
  EXPECT_EQ(ToValidUtf8("abc"), "abc");
  EXPECT_EQ(ToValidUtf8("\xE2\x82\x28"), kFffd + "(");     // truncated 3-byte char
  EXPECT_EQ(ToValidUtf8("\xF0\x9F\x98"), kFffd);           // truncated at the end
  EXPECT_EQ(ToValidUtf8("\xED\xA0\x80"), kFffd + kFffd + kFffd);  // surrogate: never valid
  EXPECT_EQ(ToValidUtf8("\xC0\xAF"), kFffd + kFffd);       // overlong
  EXPECT_EQ(ToValidUtf8("\xF4\x90\x80\x80"), kFffd + kFffd + kFffd + kFffd);  // above U+10FFFF
  EXPECT_EQ(ToValidUtf8("a\xFF" "b"), "a" + kFffd + "b");
  EXPECT_TRUE(IsValidUtf8("\xE4\xBD\xA0\xF0\x9F\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xE4\xBD"));
}

TEST(UnicodeTextTest, FindsOnlyTailsThatMoreBytesCouldComplete) {
  EXPECT_EQ(IncompleteUtf8TailLength("a\xE4\xBD"), 2u);
  EXPECT_EQ(IncompleteUtf8TailLength("a\xE4\xBD\xA0"), 0u);
  EXPECT_EQ(IncompleteUtf8TailLength("\xF0\x9F\x98"), 3u);
  EXPECT_EQ(IncompleteUtf8TailLength("\xF0"), 1u);
  EXPECT_EQ(IncompleteUtf8TailLength("\xFF"), 0u);
  EXPECT_EQ(IncompleteUtf8TailLength("\xED\xA0"), 0u);  // a surrogate can never complete
  EXPECT_EQ(IncompleteUtf8TailLength("\x80"), 0u);
  EXPECT_EQ(IncompleteUtf8TailLength(""), 0u);
}

TEST(UnicodeTextTest, DecodesAndEncodesCodePoints) {
  const std::vector<char32_t> cps = DecodeUtf8("a\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80");
  EXPECT_EQ(cps, (std::vector<char32_t>{'a', 0xE9, 0x4F60, 0x1F600}));
  std::string out;
  for (char32_t c : cps) AppendUtf8(c, &out);
  EXPECT_EQ(out, "a\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80");
}

TEST(UnicodeTextTest, ClassifiesLettersNumbersAndWhiteSpace) {
  const uint32_t letter = CategoryMaskForName("L"), number = CategoryMaskForName("N");
  EXPECT_NE(CategoryMask('a') & letter, 0u);
  EXPECT_NE(CategoryMask(0x4F60) & letter, 0u);   // 你
  EXPECT_NE(CategoryMask(0x663) & number, 0u);    // Arabic-Indic three
  EXPECT_NE(CategoryMask(0x216B) & number, 0u);   // Roman numeral twelve (Nl)
  EXPECT_EQ(CategoryMask(' ') & (letter | number), 0u);
  EXPECT_EQ(CategoryMaskForName("Letter"), letter);
  EXPECT_EQ(CategoryMaskForName("Nonsense"), 0u);
  EXPECT_TRUE(IsWhiteSpace(0x85));
  EXPECT_TRUE(IsWhiteSpace(0x3000));
  EXPECT_FALSE(IsWhiteSpace(0x200B));  // zero width space is not White_Space
  EXPECT_EQ(SimpleCaseFold('S'), U's');
}

TEST(UnicodeTextTest, NormalizesToNfc) {
  EXPECT_EQ(Normalize("e\xCC\x81", NormalizationForm::kNfc), "\xC3\xA9");
  EXPECT_EQ(Normalize("\xC3\xA9", NormalizationForm::kNfd), "e\xCC\x81");
  EXPECT_EQ(Normalize("\xEF\xAC\x81", NormalizationForm::kNfkc), "fi");
  EXPECT_EQ(Normalize("plain", NormalizationForm::kNfc), "plain");
}

TEST(ByteLevelTest, MapsEveryByteToADistinctCharacterAndBack) {
  EXPECT_EQ(ByteToChar(' '), char32_t{0x120});   // Ġ
  EXPECT_EQ(ByteToChar('\n'), char32_t{0x10A});  // Ċ
  EXPECT_EQ(ByteToChar('a'), char32_t{'a'});
  for (int b = 0; b < 256; ++b) EXPECT_EQ(CharToByte(ByteToChar(static_cast<unsigned char>(b))), b);
  EXPECT_EQ(CharToByte(0x4F60), -1);
  EXPECT_EQ(BytesToByteLevel(" a"), "\xC4\xA0" "a");
}

}  // namespace
}  // namespace exl3serve::coordinator::internal
