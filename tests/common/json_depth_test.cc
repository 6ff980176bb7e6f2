// common/json_depth.h: the nesting depth of JSON text found without
// recursion, and where it first goes past the limit.
#include "common/json_depth.h"

#include <string>

#include "gtest/gtest.h"

namespace exl3serve {
namespace {

TEST(JsonDepth, CountsArraysAndObjectsOutsideStrings) {
  EXPECT_FALSE(FindJsonNestingBeyond("{}", 1));
  EXPECT_TRUE(FindJsonNestingBeyond("[[]]", 1));
  EXPECT_FALSE(FindJsonNestingBeyond(R"({"a":"[[[[{{{{\"]]]]"})", 1)) << "brackets in strings do not count";
  EXPECT_FALSE(FindJsonNestingBeyond(R"(["\\",[]])", 2)) << "an escaped backslash ends before the quote";
  EXPECT_TRUE(FindJsonNestingBeyond(R"(["\\",[[]]])", 2));
  const std::string deep = std::string(1000000, '[') + std::string(1000000, ']');
  auto e = FindJsonNestingBeyond(deep);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->depth, kMaxJsonDepth + 1);
  const std::string ok = std::string(kMaxJsonDepth, '[') + std::string(kMaxJsonDepth, ']');
  EXPECT_FALSE(FindJsonNestingBeyond(ok));
}

TEST(JsonDepth, NamesThePathWhereTheLimitIsCrossed) {
  auto e = FindJsonNestingBeyond(R"({"x":1,"messages":[{"role":"u"},{"content":[[[]]]}]})", 5);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->path, "messages[1].content[0][0]");
  e = FindJsonNestingBeyond(R"({"chat_template_kwargs":{"a":{"a":{"a":{}}}}})", 3);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->path, "chat_template_kwargs.a.a");
  e = FindJsonNestingBeyond(std::string(100, '['), 50);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->path, "[0][0][0][0][0][0][0][0]...");
  EXPECT_EQ(JoinJsonPath("guided_json", "a.b"), "guided_json.a.b");
  EXPECT_EQ(JoinJsonPath("tools", "[0]"), "tools[0]");
  EXPECT_EQ(JoinJsonPath("", "a"), "a");
  EXPECT_EQ(JoinJsonPath("f", ""), "f");
}

}  // namespace
}  // namespace exl3serve
