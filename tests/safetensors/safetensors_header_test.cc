// Header validation: ParseSafetensorsHeader / ParseSafetensorsBytes on
// well-formed and malformed inputs (exl3-format.md §2.6).
#include <cctype>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/safetensors.h"
#include "tests/safetensors/test_util.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::sharding::testing::MakeFileBytes;
using ::testing::HasSubstr;

TEST(DTypeTest, NamesAndSizesRoundTrip) {
  const std::vector<std::pair<std::string, int64_t>> expected = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},   {"I16", 2}, {"U16", 2},
      {"I32", 4},  {"U32", 4}, {"I64", 8},  {"U64", 8}, {"F16", 2},
      {"BF16", 2}, {"F32", 4}, {"F64", 8},  {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, size] : expected) {
    DType dtype;
    ASSERT_TRUE(ParseDTypeName(name, &dtype)) << name;
    EXPECT_EQ(DTypeName(dtype), name);
    EXPECT_EQ(DTypeSize(dtype), size) << name;
  }
}

TEST(DTypeTest, RejectsUnknownAndWrongCaseTags) {
  DType dtype = DType::kF16;
  EXPECT_FALSE(ParseDTypeName("f16", &dtype));
  EXPECT_FALSE(ParseDTypeName("F4", &dtype));
  EXPECT_FALSE(ParseDTypeName("", &dtype));
  EXPECT_EQ(dtype, DType::kF16);
}

TEST(ParseSafetensorsHeaderTest, AcceptsEmptyHeader) {
  auto parsed = ParseSafetensorsHeader("{}", 0, "x.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->tensors.empty());
  EXPECT_TRUE(parsed->metadata.empty());
}

TEST(ParseSafetensorsHeaderTest, ParsesTensorsInDataOrderWithMetadata) {
  const std::string header =
      R"({"b":{"dtype":"F16","shape":[2,3],"data_offsets":[4,16]},)"
      R"("__metadata__":{"format":"pt","k":"v"},)"
      R"("a":{"dtype":"I32","shape":[],"data_offsets":[0,4]}}   )";  // trailing padding
  auto parsed = ParseSafetensorsHeader(header, 16, "x.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->tensors.size(), 2u);
  EXPECT_EQ(parsed->tensors[0].name, "a");
  EXPECT_EQ(parsed->tensors[0].dtype, DType::kI32);
  EXPECT_TRUE(parsed->tensors[0].shape.empty());
  EXPECT_EQ(parsed->tensors[0].NumElements(), 1);
  EXPECT_EQ(parsed->tensors[0].ByteSize(), 4u);
  EXPECT_EQ(parsed->tensors[1].name, "b");
  EXPECT_EQ(parsed->tensors[1].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(parsed->tensors[1].begin, 4u);
  EXPECT_EQ(parsed->tensors[1].end, 16u);
  EXPECT_EQ(parsed->metadata.at("format"), "pt");
  EXPECT_EQ(parsed->metadata.at("k"), "v");
}

TEST(ParseSafetensorsHeaderTest, AcceptsZeroSizeTensorsAnywhereInRangeAndGaps) {
  // `z1` sits inside `a`, `z2` at the end of the data, `z3` shares `a`'s begin;
  // bytes 8..12 belong to no tensor.
  const std::string header =
      R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
      R"("z1":{"dtype":"F32","shape":[0,5],"data_offsets":[3,3]},)"
      R"("z2":{"dtype":"F16","shape":[0],"data_offsets":[16,16]},)"
      R"("z3":{"dtype":"I64","shape":[4,0],"data_offsets":[0,0]},)"
      R"("c":{"dtype":"U8","shape":[4],"data_offsets":[12,16]}})";
  auto parsed = ParseSafetensorsHeader(header, 16, "x.safetensors");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->tensors.size(), 5u);
}

struct BadHeaderCase {
  const char* label;
  std::string header;
  uint64_t data_size;
  const char* message;
};

class BadHeaderTest : public ::testing::TestWithParam<BadHeaderCase> {};

TEST_P(BadHeaderTest, IsRejectedAsDataLossWithMessage) {
  const BadHeaderCase& c = GetParam();
  auto parsed = ParseSafetensorsHeader(c.header, c.data_size, "model.safetensors");
  ASSERT_FALSE(parsed.ok()) << c.label;
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss) << parsed.status();
  const std::string message(parsed.status().message());
  EXPECT_THAT(message, HasSubstr("model.safetensors: ")) << c.label;
  EXPECT_THAT(message, HasSubstr(c.message)) << c.label;
  EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
}

const char kGood[] = R"("dtype":"U8","shape":[4],"data_offsets":[0,4])";

INSTANTIATE_TEST_SUITE_P(
    Malformed, BadHeaderTest,
    ::testing::Values(
        BadHeaderCase{"truncated json", R"({"a":)", 0, "invalid json: parse error"},
        BadHeaderCase{"trailing garbage", R"({} x)", 0, "invalid json"},
        BadHeaderCase{"empty header", "", 0, "invalid json"},
        BadHeaderCase{"invalid utf-8 name", "{\"\xff\":{}}", 0, "invalid json"},
        BadHeaderCase{"array root", R"([1,2])", 0, "header is an array, expected an object"},
        BadHeaderCase{"string root", R"("x")", 0, "header is a string"},
        BadHeaderCase{"entry not object", R"({"a":3})", 0,
                      "tensor `a`: entry is a number, expected an object"},
        BadHeaderCase{"unknown dtype",
                      R"({"a":{"dtype":"F4","shape":[4],"data_offsets":[0,4]}})", 4,
                      "tensor `a`: unknown dtype \"F4\""},
        BadHeaderCase{"dtype not string",
                      R"({"a":{"dtype":2,"shape":[4],"data_offsets":[0,4]}})", 4,
                      "tensor `a`: dtype must be a string"},
        BadHeaderCase{"negative dimension",
                      R"({"a":{"dtype":"U8","shape":[4,-1],"data_offsets":[0,4]}})", 4,
                      "tensor `a`: shape [4,-1] has -1, dimensions must be non-negative"},
        BadHeaderCase{"float dimension",
                      R"({"a":{"dtype":"U8","shape":[4.0],"data_offsets":[0,4]}})", 4,
                      "dimensions must be non-negative integers"},
        BadHeaderCase{"shape not array",
                      R"({"a":{"dtype":"U8","shape":4,"data_offsets":[0,4]}})", 4,
                      "tensor `a`: shape must be an array"},
        BadHeaderCase{"missing key", R"({"a":{"dtype":"U8","data_offsets":[0,4]}})", 4,
                      "tensor `a`: missing `shape`"},
        BadHeaderCase{"extra key", std::string(R"({"a":{)") + kGood + R"(,"foo":1}})", 4,
                      "tensor `a`: unexpected key `foo`"},
        BadHeaderCase{"offsets out of file",
                      R"({"a":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}})", 8,
                      "tensor `a`: data_offsets [0, 16] run past the data section of 8 bytes"},
        BadHeaderCase{"size mismatch",
                      R"({"a.trellis":{"dtype":"I16","shape":[8,8,64],"data_offsets":[0,100]}})",
                      100,
                      "tensor `a.trellis`: data_offsets [0, 100] hold 100 bytes, shape [8,8,64] "
                      "I16 needs 8192"},
        BadHeaderCase{"begin after end",
                      R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 8,
                      "data_offsets [4, 2] end before they begin"},
        BadHeaderCase{"three offsets",
                      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,2,4]}})", 8,
                      "data_offsets must be [begin, end]"},
        BadHeaderCase{"negative offset",
                      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[-4,0]}})", 8,
                      "data_offsets must be [begin, end]"},
        BadHeaderCase{"element count overflow",
                      R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],)"
                      R"("data_offsets":[0,0]}})",
                      8, "overflows 64-bit sizes"},
        BadHeaderCase{"byte count overflow",
                      R"({"a":{"dtype":"F64","shape":[4611686018427387904],)"
                      R"("data_offsets":[0,0]}})",
                      8, "overflows 64-bit sizes"},
        BadHeaderCase{"overlap",
                      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                      8, "tensors `a` [0, 4] and `b` [2, 6] overlap"},
        BadHeaderCase{"overlap past a contained tensor",
                      R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]},)"
                      R"("c":{"dtype":"U8","shape":[2],"data_offsets":[5,7]}})",
                      8, "tensors `a` [0, 8] and `b` [1, 3] overlap"},
        BadHeaderCase{"identical ranges",
                      R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                      R"("b":{"dtype":"I32","shape":[],"data_offsets":[0,4]}})",
                      4, "overlap"},
        BadHeaderCase{"duplicate tensor name",
                      std::string(R"({"a":{)") + kGood + R"(},"a":{)" + kGood + "}}", 4,
                      "duplicate key `a`"},
        BadHeaderCase{"duplicate key inside entry",
                      std::string(R"({"a":{"dtype":"I8",)") + kGood + "}}", 4,
                      "duplicate key `dtype`"},
        BadHeaderCase{"metadata not object", R"({"__metadata__":["x"]})", 0,
                      "`__metadata__` must be an object of strings, got an array"},
        BadHeaderCase{"metadata value not string", R"({"__metadata__":{"n":3}})", 0,
                      "`__metadata__` must map strings to strings, key `n` holds a number"},
        BadHeaderCase{"nested too deep", R"({"a":{"shape":[[1]]}})", 0,
                      "json nests deeper than 3 levels"}),
    [](const ::testing::TestParamInfo<BadHeaderCase>& info) {
      std::string name = info.param.label;
      for (char& ch : name) {
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

TEST(ParseSafetensorsBytesTest, SplitsLengthHeaderAndData) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[1,4]}})";
  const std::vector<uint8_t> file = MakeFileBytes(header, 6);
  SafetensorsLayout layout;
  auto parsed = ParseSafetensorsBytes(file, "f", &layout);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(layout.header_size, header.size());
  EXPECT_EQ(layout.data_section_offset, 8 + header.size());
  EXPECT_EQ(layout.data_section_size, 6u);
}

TEST(ParseSafetensorsBytesTest, RejectsFileShorterThanLengthPrefix) {
  const std::vector<uint8_t> file = {2, 0, 0};
  auto parsed = ParseSafetensorsBytes(file, "tiny.safetensors");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("tiny.safetensors: file is 3 bytes, shorter than the 8-byte header length"));
}

TEST(ParseSafetensorsBytesTest, RejectsHeaderLengthPastEndOfFile) {
  std::vector<uint8_t> file = MakeFileBytes("{}", 0);
  file[0] = 3;  // claims 3 header bytes, 2 present
  auto parsed = ParseSafetensorsBytes(file, "f.safetensors");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("header length 3 runs past the end of the file (10 bytes)"));
}

TEST(ParseSafetensorsBytesTest, RejectsHugeHeaderLengthBeforeLookingAtTheFile) {
  std::vector<uint8_t> file = MakeFileBytes("{}", 0);
  file[7] = 0x80;  // 2^63 + 2
  auto parsed = ParseSafetensorsBytes(file, "f.safetensors");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(parsed.status().message(), HasSubstr("exceeds the limit of 100000000 bytes"));
}

TEST(ParseSafetensorsBytesTest, DataSectionSizeBoundsOffsets) {
  const std::string header = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})";
  EXPECT_TRUE(ParseSafetensorsBytes(MakeFileBytes(header, 4), "f").ok());
  auto short_data = ParseSafetensorsBytes(MakeFileBytes(header, 3), "f");
  ASSERT_FALSE(short_data.ok());
  EXPECT_THAT(short_data.status().message(), HasSubstr("run past the data section of 3 bytes"));
}

}  // namespace
}  // namespace exl3serve::sharding
