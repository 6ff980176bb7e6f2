// ParseJson / ReadJsonFile / WriteFileAtomically.
#include "sharding/safetensors_json.h"

#include <string>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/safetensors/test_util.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::sharding::testing::FileExists;
using ::exl3serve::sharding::testing::ScratchDir;
using ::testing::HasSubstr;

TEST(ParseJsonTest, ReportsPositionOfSyntaxError) {
  auto parsed = ParseJson("{\n  \"a\": 1,\n  \"b\": tru }", "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("config.json: invalid json: parse error at line 3, column 11"));
  EXPECT_EQ(std::string(parsed.status().message()).find('\n'), std::string::npos);
}

TEST(ParseJsonTest, KeepsLastDuplicateByDefaultAndRejectsOnRequest) {
  auto lenient = ParseJson(R"({"a":1,"a":2})", "x");
  ASSERT_TRUE(lenient.ok());
  EXPECT_EQ((*lenient)["a"], 2);
  JsonParseOptions strict;
  strict.reject_duplicate_keys = true;
  auto rejected = ParseJson(R"({"o":{"a":1},"p":{"a":1,"b":{"a":2}},"p":0})", "x", strict);
  ASSERT_FALSE(rejected.ok());
  EXPECT_THAT(rejected.status().message(), HasSubstr("x: duplicate key `p`"));
  // Same key in sibling objects is fine.
  EXPECT_TRUE(ParseJson(R"({"o":{"a":1},"p":{"a":1,"b":[{"a":2},{"a":3}]}})", "x", strict).ok());
}

TEST(ParseJsonTest, EnforcesMaxDepth) {
  JsonParseOptions options;
  options.max_depth = 2;
  EXPECT_TRUE(ParseJson(R"({"a":[1]})", "x", options).ok());
  auto deep = ParseJson(R"({"a":[[1]]})", "x", options);
  ASSERT_FALSE(deep.ok());
  EXPECT_THAT(deep.status().message(), HasSubstr("json nests deeper than 2 levels"));
  // Far deeper than any stack would like, still just an error.
  EXPECT_FALSE(ParseJson(std::string(100000, '['), "x", options).ok());
}

TEST(ReadJsonFileTest, MissingFileIsNotFoundNamingIt) {
  ScratchDir dir;
  auto parsed = ReadJsonFile(dir.File("config.json"));
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(parsed.status().message(), HasSubstr(dir.File("config.json")));
}

TEST(ReadJsonFileTest, ParseErrorNamesTheFile) {
  ScratchDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("c.json"), "{,}").ok());
  auto parsed = ReadJsonFile(dir.File("c.json"));
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(), HasSubstr(dir.File("c.json") + ": invalid json"));
}

TEST(WriteFileAtomicallyTest, ReplacesContentsAndLeavesNoTemporary) {
  ScratchDir dir;
  const std::string path = dir.File("f.txt");
  ASSERT_TRUE(WriteFileAtomically(path, "one").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "two").ok());
  auto text = ReadFileToString(path);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "two");
  EXPECT_FALSE(FileExists(path + ".tmp"));
}

TEST(ReadFileToStringTest, DirectoryIsAnError) {
  ScratchDir dir;
  auto text = ReadFileToString(dir.path());
  EXPECT_FALSE(text.ok());
  EXPECT_THAT(text.status().message(), HasSubstr(dir.path()));
}

}  // namespace
}  // namespace exl3serve::sharding
