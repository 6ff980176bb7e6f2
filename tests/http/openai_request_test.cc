// coordinator/http/openai_request.h on hostile bodies: regression cases of
// the request-body fuzzer (tests/fuzz/openai_request_fuzz.cc).
#include "coordinator/http/openai_request.h"

#include <string>
#include <variant>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace exl3serve::coordinator::http {
namespace {

bool ValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// Found by the fuzzer (30-minute run): an unknown field's name came back
// whole as `param` (and in the message) — megabytes for a large body.
TEST(OpenAiRequestTest, AHugeUnknownFieldNameIsCutInTheError) {
  std::string key;
  for (int i = 0; i < 3000; ++i) key += "é";  // 2 bytes each: the cut must fall between characters
  const std::string body = "{\"prompt\":\"hi\",\"x" + key + "\":1}";
  const auto parsed = ParseCompletionRequest(body);
  const ApiError* error = std::get_if<ApiError>(&parsed);
  ASSERT_NE(error, nullptr);
  EXPECT_EQ(error->status, 400);
  EXPECT_LE(error->param.size(), 259u);
  EXPECT_THAT(error->param, ::testing::StartsWith("x\xC3\xA9"));
  EXPECT_THAT(error->param, ::testing::EndsWith("..."));
  EXPECT_TRUE(ValidUtf8(error->param));
  EXPECT_LT(error->message.size(), 1024u);
  EXPECT_TRUE(ValidUtf8(ErrorJson(*error)));
}

TEST(OpenAiRequestTest, AShortUnknownFieldIsNamedWhole) {
  const auto parsed = ParseChatCompletionRequest(
      "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"frobnicate\":1}");
  const ApiError* error = std::get_if<ApiError>(&parsed);
  ASSERT_NE(error, nullptr);
  EXPECT_EQ(error->param, "frobnicate");
}

}  // namespace
}  // namespace exl3serve::coordinator::http
