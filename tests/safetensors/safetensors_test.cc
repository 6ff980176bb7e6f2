// SafetensorsFile and WriteSafetensorsFile: round trips for every dtype, both
// header layouts, the shared EXL3 test vectors, and the exact bytes written.
#include "tests/testing/shared_data.h"
#include "sharding/safetensors.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/trellis_decode.h"
#include "tests/safetensors/test_util.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::sharding::testing::FileExists;
using ::exl3serve::sharding::testing::ReadBytes;
using ::exl3serve::sharding::testing::ScratchDir;
using ::exl3serve::sharding::testing::WriteBytes;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr DType kAllDTypes[] = {DType::kBool, DType::kU8,   DType::kI8,     DType::kI16,
                                DType::kU16,  DType::kI32,  DType::kU32,    DType::kI64,
                                DType::kU64,  DType::kF16,  DType::kBF16,   DType::kF32,
                                DType::kF64,  DType::kF8E4M3, DType::kF8E5M2};

// Distinct bytes per tensor so a swapped or shifted tensor is caught.
std::vector<uint8_t> PatternBytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed * 31 + i * 7 + 1);
  return out;
}

struct Expected {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

// Every dtype as a [2,3] tensor, plus 0-d and zero-size tensors.
std::vector<Expected> AllDTypeTensors() {
  std::vector<Expected> out;
  uint8_t seed = 0;
  for (DType dtype : kAllDTypes) {
    const size_t n = 6 * static_cast<size_t>(DTypeSize(dtype));
    out.push_back({"t." + std::string(DTypeName(dtype)), dtype, {2, 3}, PatternBytes(n, ++seed)});
  }
  out.push_back({"scalar.i32", DType::kI32, {}, PatternBytes(4, ++seed)});
  out.push_back({"scalar.f64", DType::kF64, {}, PatternBytes(8, ++seed)});
  out.push_back({"empty.f16", DType::kF16, {0}, {}});
  out.push_back({"empty.i16", DType::kI16, {3, 0, 2}, {}});
  out.push_back({"u8.tail", DType::kU8, {3}, PatternBytes(3, ++seed)});  // odd size
  return out;
}

std::vector<TensorToWrite> ToWrite(const std::vector<Expected>& tensors) {
  std::vector<TensorToWrite> out;
  for (const Expected& t : tensors) out.push_back(TensorFromBytes(t.name, t.dtype, t.shape, t.bytes));
  return out;
}

void ExpectFileHolds(const SafetensorsFile& file, const std::vector<Expected>& tensors) {
  ASSERT_EQ(file.tensors().size(), tensors.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Expected& want = tensors[i];
    const TensorInfo* info = file.Find(want.name);
    ASSERT_NE(info, nullptr) << want.name;
    EXPECT_EQ(info->dtype, want.dtype) << want.name;
    EXPECT_EQ(info->shape, want.shape) << want.name;
    // Written back to back in the given order.
    EXPECT_EQ(info->begin, offset) << want.name;
    offset += want.bytes.size();
    const auto data = file.Data(*info);
    EXPECT_EQ(std::vector<uint8_t>(data.begin(), data.end()), want.bytes) << want.name;
    std::vector<uint8_t> copy(want.bytes.size());
    file.ReadTensorBytes(*info, copy.data());
    EXPECT_EQ(copy, want.bytes) << want.name;
  }
}

class RoundTripTest : public ::testing::TestWithParam<bool> {};

TEST_P(RoundTripTest, EveryDTypeScalarAndEmptyTensorReadsBackExactly) {
  const bool padded = GetParam();
  ScratchDir dir;
  const std::string path = dir.File("rt.safetensors");
  const std::vector<Expected> tensors = AllDTypeTensors();
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "é ünïcode"}};
  SafetensorsWriteOptions options;
  options.pad_header_to_8 = padded;
  ASSERT_TRUE(WriteSafetensorsFile(path, ToWrite(tensors), metadata, options).ok());
  EXPECT_FALSE(FileExists(path + ".tmp"));

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ExpectFileHolds(**file, tensors);
  EXPECT_EQ((*file)->metadata(), metadata);
  EXPECT_EQ((*file)->path(), path);
  if (padded) {
    EXPECT_EQ((*file)->data_section_offset() % 8, 0u);
  }
  uint64_t total = 0;
  for (const Expected& t : tensors) total += t.bytes.size();
  EXPECT_EQ((*file)->data_section_size(), total);
  EXPECT_EQ((*file)->file_size(), (*file)->data_section_offset() + total);
}

INSTANTIATE_TEST_SUITE_P(HeaderLayouts, RoundTripTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? "Padded" : "Unpadded"; });

TEST(WriteSafetensorsFileTest, UnpaddedHeaderCanLeaveDataSectionOddAndReadsStillWork) {
  ScratchDir dir;
  const std::string path = dir.File("odd.safetensors");
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromInt16("ww", {3}, {-1, 2, -32768}));
  tensors.push_back(TensorFromFloats("f", {2}, {1.5f, -0.25f}));
  SafetensorsWriteOptions options;
  options.pad_header_to_8 = false;
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}, options).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  // {"ww":{..."data_offsets":[0,6]},"f":{...}} is 109 bytes: 8+109 is odd.
  EXPECT_EQ((*file)->data_section_offset(), 8u + 109u);
  auto w = (*file)->ReadAsInt16(*(*file)->Find("ww"));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_THAT(*w, ElementsAre(-1, 2, -32768));
  auto f = (*file)->ReadAsFloat(*(*file)->Find("f"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(*f, ElementsAre(1.5f, -0.25f));
}

// The exact bytes, checked without our parser: the 8-byte LE length, the
// minified header with keys in the given order, then the data.
TEST(WriteSafetensorsFileTest, WritesExactMinifiedHeaderAndData) {
  ScratchDir dir;
  const std::string path = dir.File("exact.safetensors");
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromBytes("z", DType::kU8, {2}, {0xAB, 0xCD}));
  tensors.push_back(TensorScalarInt32("a.mul1", -2082680531));
  SafetensorsWriteOptions unpadded;
  unpadded.pad_header_to_8 = false;
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {{"k", "v"}}, unpadded).ok());

  const std::string header =
      R"({"__metadata__":{"k":"v"},"z":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
      R"("a.mul1":{"dtype":"I32","shape":[],"data_offsets":[2,6]}})";
  std::vector<uint8_t> want(8, 0);
  want[0] = static_cast<uint8_t>(header.size());
  want.insert(want.end(), header.begin(), header.end());
  for (uint8_t b : {0xAB, 0xCD, 0x2D, 0xD1, 0xDC, 0x83}) want.push_back(b);  // 0x83DCD12D LE
  EXPECT_EQ(ReadBytes(path), want);
}

TEST(WriteSafetensorsFileTest, PadsHeaderWithSpacesToMultipleOf8) {
  ScratchDir dir;
  const std::string path = dir.File("pad.safetensors");
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromBytes("z", DType::kU8, {1}, {7}));
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}).ok());
  const std::string header = R"({"z":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  const std::vector<uint8_t> bytes = ReadBytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ((8 + n) % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 1);
  const std::string text(bytes.begin() + 8, bytes.begin() + 8 + n);
  EXPECT_EQ(text.substr(0, header.size()), header);
  EXPECT_EQ(text.substr(header.size()), std::string(n - header.size(), ' '));
  EXPECT_EQ(bytes.back(), 7);
}

TEST(WriteSafetensorsFileTest, EmptyTensorListWritesValidFile) {
  ScratchDir dir;
  const std::string path = dir.File("empty.safetensors");
  ASSERT_TRUE(WriteSafetensorsFile(path, {}, {}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE((*file)->tensors().empty());
  EXPECT_EQ((*file)->file_size(), 8u + 8u);  // "{}" + 6 spaces
}

TEST(WriteSafetensorsFileTest, FillErrorLeavesNoFileAndKeepsThePreviousOne) {
  ScratchDir dir;
  const std::string path = dir.File("m.safetensors");
  WriteBytes(path, {1, 2, 3});
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromBytes("ok", DType::kU8, {4}, {1, 2, 3, 4}));
  TensorToWrite failing;
  failing.name = "bad";
  failing.dtype = DType::kF32;
  failing.shape = {1000};
  failing.fill = [](std::span<uint8_t> out) {
    EXPECT_EQ(out.size(), 4000u);
    return absl::UnavailableError("source shard went away");
  };
  tensors.push_back(std::move(failing));
  const absl::Status status = WriteSafetensorsFile(path, std::move(tensors), {});
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("tensor `bad`: source shard went away"));
  EXPECT_FALSE(FileExists(path + ".tmp"));
  EXPECT_EQ(ReadBytes(path), (std::vector<uint8_t>{1, 2, 3}));
}

TEST(WriteSafetensorsFileTest, FillSeesZeroedBufferOfExactSize) {
  ScratchDir dir;
  const std::string path = dir.File("f.safetensors");
  TensorToWrite t;
  t.name = "t";
  t.dtype = DType::kBF16;
  t.shape = {3, 5};
  size_t seen = 0;
  t.fill = [&seen](std::span<uint8_t> out) {
    seen = out.size();
    for (uint8_t b : out) EXPECT_EQ(b, 0);
    out[0] = 9;
    return absl::OkStatus();
  };
  std::vector<TensorToWrite> tensors;
  tensors.push_back(std::move(t));
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}).ok());
  EXPECT_EQ(seen, 30u);
}

TEST(WriteSafetensorsFileTest, RejectsBadTensorListsBeforeWriting) {
  ScratchDir dir;
  const std::string path = dir.File("x.safetensors");
  struct Case {
    std::vector<TensorToWrite> tensors;
    const char* message;
  };
  std::vector<Case> cases;
  {
    Case c{{}, "tensor `a` given twice"};
    c.tensors.push_back(TensorFromBytes("a", DType::kU8, {1}, {1}));
    c.tensors.push_back(TensorFromBytes("a", DType::kU8, {1}, {1}));
    cases.push_back(std::move(c));
  }
  {
    Case c{{}, "`__metadata__` is reserved"};
    c.tensors.push_back(TensorFromBytes("__metadata__", DType::kU8, {1}, {1}));
    cases.push_back(std::move(c));
  }
  {
    Case c{{}, "shape [2,-1] has a negative dimension"};
    c.tensors.push_back(TensorFromBytes("n", DType::kU8, {2, -1}, {}));
    cases.push_back(std::move(c));
  }
  {
    Case c{{}, "empty name"};
    c.tensors.push_back(TensorFromBytes("", DType::kU8, {1}, {1}));
    cases.push_back(std::move(c));
  }
  {
    Case c{{}, "overflows"};
    c.tensors.push_back(TensorFromBytes("big", DType::kF64, {1LL << 40, 1LL << 40}, {}));
    cases.push_back(std::move(c));
  }
  {
    Case c{{}, "has no fill function"};
    TensorToWrite t;
    t.name = "nofill";
    t.shape = {1};
    c.tensors.push_back(std::move(t));
    cases.push_back(std::move(c));
  }
  for (Case& c : cases) {
    const absl::Status status = WriteSafetensorsFile(path, std::move(c.tensors), {});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(status.message(), HasSubstr(c.message));
    EXPECT_FALSE(FileExists(path));
    EXPECT_FALSE(FileExists(path + ".tmp"));
  }
}

TEST(WriteSafetensorsFileTest, MakerWithWrongElementCountFailsTheWrite) {
  ScratchDir dir;
  const std::string path = dir.File("x.safetensors");
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromHalfBits("h", DType::kF16, {4}, {1, 2, 3}));
  const absl::Status status = WriteSafetensorsFile(path, std::move(tensors), {});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("tensor `h`: got 6 bytes of data, shape needs 8"));
  EXPECT_FALSE(FileExists(path));
}

TEST(WriteSafetensorsFileTest, MissingDirectoryIsNotFoundNamingThePath) {
  ScratchDir dir;
  const std::string path = dir.File("no/such/dir/x.safetensors");
  const absl::Status status = WriteSafetensorsFile(path, {}, {});
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr(path));
  EXPECT_THAT(status.message(), HasSubstr("No such file or directory"));
}

TEST(SafetensorsFileTest, TypedReadsConvertHalfBFloatAndDouble) {
  ScratchDir dir;
  const std::string path = dir.File("typed.safetensors");
  std::vector<TensorToWrite> tensors;
  // fp16: 1.0, -2.0, 65504, smallest subnormal; bf16: 1.0, -3.0.
  tensors.push_back(TensorFromHalfBits("h", DType::kF16, {4}, {0x3C00, 0xC000, 0x7BFF, 0x0001}));
  tensors.push_back(TensorFromHalfBits("b", DType::kBF16, {2}, {0x3F80, 0xC040}));
  std::vector<uint8_t> f64(16);
  const double d[2] = {0.1, -1e300};
  std::memcpy(f64.data(), d, 16);
  tensors.push_back(TensorFromBytes("d", DType::kF64, {2}, f64));
  tensors.push_back(TensorFromInt32("i", {2}, {7, -8}));
  tensors.push_back(TensorFromBytes("u64", DType::kU64, {}, {0, 0, 0, 0, 0, 0, 0, 0x80}));
  tensors.push_back(TensorFromBytes("i8", DType::kI8, {1}, {0xFF}));
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}).ok());
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SafetensorsFile& file = **opened;

  auto h = file.ReadAsFloat(*file.Find("h"));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(*h, ElementsAre(1.0f, -2.0f, 65504.0f, 5.9604644775390625e-8f));
  auto b = file.ReadAsFloat(*file.Find("b"));
  ASSERT_TRUE(b.ok());
  EXPECT_THAT(*b, ElementsAre(1.0f, -3.0f));
  auto dd = file.ReadAsFloat(*file.Find("d"));
  ASSERT_TRUE(dd.ok());
  EXPECT_EQ((*dd)[0], 0.1f);
  EXPECT_TRUE(std::isinf((*dd)[1]));
  auto bits = file.ReadAsUint16(*file.Find("b"));
  ASSERT_TRUE(bits.ok());
  EXPECT_THAT(*bits, ElementsAre(0x3F80, 0xC040));
  auto i = file.ReadAsInt32(*file.Find("i"));
  ASSERT_TRUE(i.ok());
  EXPECT_THAT(*i, ElementsAre(7, -8));
  auto i8 = file.ReadScalarInt(*file.Find("i8"));
  ASSERT_TRUE(i8.ok()) << i8.status();
  EXPECT_EQ(*i8, -1);

  auto wrong = file.ReadAsFloat(*file.Find("i"));
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong.status().message(), HasSubstr("tensor `i` is I32, expected F16, BF16, F32 or F64"));
  EXPECT_EQ(file.ReadAsInt16(*file.Find("h")).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(file.ReadAsUint16(*file.Find("i")).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto not_scalar = file.ReadScalarInt(*file.Find("i"));
  EXPECT_THAT(not_scalar.status().message(), HasSubstr("has shape [2], expected a single element"));
  auto too_big = file.ReadScalarInt(*file.Find("u64"));
  EXPECT_THAT(too_big.status().message(), HasSubstr("above int64 range"));
  EXPECT_EQ(file.Find("absent"), nullptr);
}

TEST(SafetensorsFileTest, OpenReportsMissingFileAsNotFound) {
  ScratchDir dir;
  auto file = SafetensorsFile::Open(dir.File("nope.safetensors"));
  EXPECT_EQ(file.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(file.status().message(), HasSubstr("nope.safetensors"));
}

TEST(SafetensorsFileTest, OpenRejectsTruncatedAndOverlongFiles) {
  ScratchDir dir;
  WriteBytes(dir.File("empty.safetensors"), {});
  WriteBytes(dir.File("short.safetensors"), {1, 0, 0, 0, 0});
  std::vector<uint8_t> overlong = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
  WriteBytes(dir.File("overlong.safetensors"), overlong);
  const std::pair<const char*, const char*> cases[] = {
      {"empty.safetensors", "file is 0 bytes, shorter than the 8-byte header length"},
      {"short.safetensors", "file is 5 bytes, shorter than the 8-byte header length"},
      {"overlong.safetensors", "header length 100 runs past the end of the file (10 bytes)"}};
  for (const auto& [name, message] : cases) {
    auto file = SafetensorsFile::Open(dir.File(name));
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << name;
    EXPECT_THAT(file.status().message(), HasSubstr(dir.File(name) + ": " + message));
  }
}

TEST(SafetensorsFileTest, TruncatedDataSectionIsDataLoss) {
  ScratchDir dir;
  const std::string path = dir.File("t.safetensors");
  std::vector<TensorToWrite> tensors;
  tensors.push_back(TensorFromInt16("w", {4}, {1, 2, 3, 4}));
  ASSERT_TRUE(WriteSafetensorsFile(path, std::move(tensors), {}).ok());
  std::vector<uint8_t> bytes = ReadBytes(path);
  bytes.pop_back();
  WriteBytes(path, bytes);
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(file.status().message(),
              HasSubstr("tensor `w`: data_offsets [0, 8] run past the data section of 7 bytes"));
}

// --- Shared EXL3 test vectors (written by the reference converter).


// Reads `count` bytes at absolute `offset` straight from the file.
std::vector<uint8_t> PreadBytes(const std::string& path, uint64_t offset, uint64_t count) {
  const std::vector<uint8_t> all = ReadBytes(path);
  EXPECT_LE(offset + count, all.size());
  return std::vector<uint8_t>(all.begin() + offset, all.begin() + offset + count);
}

TEST(SharedVectorsTest, ReadsUnpaddedHeaderWithUnalignedDataSection) {
  EXL3_REQUIRE_SHARED(path, "testdata/exl3/layout/k2_mul1_unaligned_header/model.safetensors");
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SafetensorsFile& file = **opened;
  EXPECT_EQ(file.data_section_offset(), 8u + 370u);
  EXPECT_NE(file.data_section_offset() % 8, 0u);
  const TensorInfo* trellis = file.Find("layer.proj.trellis");
  ASSERT_NE(trellis, nullptr);
  EXPECT_EQ(trellis->dtype, DType::kI16);
  EXPECT_EQ(trellis->shape, (std::vector<int64_t>{8, 8, 32}));
  auto words = file.ReadAsInt16(*trellis);
  ASSERT_TRUE(words.ok()) << words.status();
  const std::vector<uint8_t> raw =
      PreadBytes(path, file.data_section_offset() + trellis->begin, trellis->ByteSize());
  std::vector<int16_t> want(raw.size() / 2);
  std::memcpy(want.data(), raw.data(), raw.size());
  EXPECT_EQ(*words, want);

  const TensorInfo* suh = file.Find("layer.proj.suh");
  ASSERT_NE(suh, nullptr);
  auto suh_f = file.ReadAsFloat(*suh);
  ASSERT_TRUE(suh_f.ok());
  auto suh_bits = file.ReadAsUint16(*suh);
  ASSERT_TRUE(suh_bits.ok());
  ASSERT_EQ(suh_f->size(), 128u);
  for (size_t i = 0; i < suh_f->size(); ++i) {
    EXPECT_EQ((*suh_f)[i], kernels::HalfBitsToFloat((*suh_bits)[i]));
  }
  auto marker = file.ReadScalarInt(*file.Find("layer.proj.mul1"));
  ASSERT_TRUE(marker.ok());
  EXPECT_EQ(*marker, -2082680531);
}

TEST(SharedVectorsTest, ReadsPaddedK1Mul1Layer) {
  EXL3_REQUIRE_SHARED(path, "testdata/exl3/mul1_k1-8/k1_mul1/model.safetensors");
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SafetensorsFile& file = **opened;
  std::vector<std::string> names;
  for (const TensorInfo& t : file.tensors()) names.push_back(t.name);
  // Data order, not alphabetical.
  EXPECT_THAT(names, ElementsAre("layer.proj.suh", "layer.proj.svh", "layer.proj.trellis",
                                 "layer.proj.bias", "layer.proj.mul1"));
  EXPECT_EQ(file.Find("layer.proj.trellis")->shape, (std::vector<int64_t>{8, 8, 16}));
  for (const char* name : {"layer.proj.suh", "layer.proj.svh", "layer.proj.bias"}) {
    EXPECT_EQ(file.Find(name)->dtype, DType::kF16) << name;
    EXPECT_EQ(file.Find(name)->shape, (std::vector<int64_t>{128})) << name;
  }
  const TensorInfo* mul1 = file.Find("layer.proj.mul1");
  EXPECT_EQ(mul1->dtype, DType::kI32);
  EXPECT_TRUE(mul1->shape.empty());
  auto marker = file.ReadScalarInt(*mul1);
  ASSERT_TRUE(marker.ok());
  EXPECT_EQ(*marker, -2082680531);
  auto as_vector = file.ReadAsInt32(*mul1);
  ASSERT_TRUE(as_vector.ok());
  EXPECT_THAT(*as_vector, ElementsAre(-2082680531));
}

TEST(SharedVectorsTest, ReadsBF16AndF32SourceWeights) {
  EXL3_REQUIRE_SHARED(path, "testdata/exl3/mul1_k1-8/source.safetensors");
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  const SafetensorsFile& file = **opened;
  const TensorInfo* weight = file.Find("layer.proj.weight");
  ASSERT_NE(weight, nullptr);
  EXPECT_EQ(weight->dtype, DType::kBF16);
  auto w = file.ReadAsFloat(*weight);
  auto bits = file.ReadAsUint16(*weight);
  ASSERT_TRUE(w.ok() && bits.ok());
  for (size_t i = 0; i < w->size(); i += 97) {
    EXPECT_EQ(kernels::FloatBits((*w)[i]), static_cast<uint32_t>((*bits)[i]) << 16);
  }
  auto bias = file.ReadAsFloat(*file.Find("layer.proj.bias"));
  ASSERT_TRUE(bias.ok());
  EXPECT_EQ(bias->size(), 128u);
}

TEST(SharedVectorsTest, RewritingAVectorUnpaddedReproducesItsHeaderLayout) {
  // Copy every tensor of the unaligned-header file through our writer in
  // header order: the unpadded output must have the same data section.
  EXL3_REQUIRE_SHARED(path, "testdata/exl3/layout/k2_mul1_unaligned_header/model.safetensors");
  auto opened = SafetensorsFile::Open(path);
  ASSERT_TRUE(opened.ok()) << opened.status();
  std::vector<TensorToWrite> tensors;
  for (const TensorInfo& t : (*opened)->tensors()) {
    const auto data = (*opened)->Data(t);
    tensors.push_back(
        TensorFromBytes(t.name, t.dtype, t.shape, std::vector<uint8_t>(data.begin(), data.end())));
  }
  ScratchDir dir;
  SafetensorsWriteOptions unpadded;
  unpadded.pad_header_to_8 = false;
  ASSERT_TRUE(WriteSafetensorsFile(dir.File("copy.safetensors"), std::move(tensors), (*opened)->metadata(),
                                   unpadded)
                  .ok());
  const std::vector<uint8_t> original = ReadBytes(path);
  const std::vector<uint8_t> copy = ReadBytes(dir.File("copy.safetensors"));
  const uint64_t original_data = (*opened)->data_section_offset();
  auto reopened = SafetensorsFile::Open(dir.File("copy.safetensors"));
  ASSERT_TRUE(reopened.ok());
  const uint64_t copy_data = (*reopened)->data_section_offset();
  EXPECT_EQ(std::vector<uint8_t>(original.begin() + original_data, original.end()),
            std::vector<uint8_t>(copy.begin() + copy_data, copy.end()));
}

// An independent reader: python3's json + struct (no safetensors package
// needed) checks the layout rules on a file we wrote.
TEST(InteropTest, PythonJsonAndStructAcceptOurFiles) {
  if (!FileExists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 not installed";
  ScratchDir dir;
  for (bool padded : {true, false}) {
    const std::string path = dir.File(padded ? "p.safetensors" : "u.safetensors");
    SafetensorsWriteOptions options;
    options.pad_header_to_8 = padded;
    ASSERT_TRUE(WriteSafetensorsFile(path, ToWrite(AllDTypeTensors()), {{"format", "pt"}}, options)
                    .ok());
    const std::string script = dir.File("check.py");
    {
      std::FILE* f = std::fopen(script.c_str(), "w");
      ASSERT_NE(f, nullptr);
      std::fputs(R"PY(
import json, struct, sys
sizes = {"BOOL":1,"U8":1,"I8":1,"I16":2,"U16":2,"I32":4,"U32":4,"I64":8,"U64":8,
         "F16":2,"BF16":2,"F32":4,"F64":8,"F8_E4M3":1,"F8_E5M2":1}
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8+n].decode("utf-8"))
assert h.pop("__metadata__") == {"format": "pt"}
end = 0
for name, t in h.items():
    numel = 1
    for d in t["shape"]:
        numel *= d
    lo, hi = t["data_offsets"]
    assert lo == end, (name, lo, end)
    assert hi - lo == numel * sizes[t["dtype"]], name
    end = hi
assert 8 + n + end == len(b)
if sys.argv[2] == "1":
    assert (8 + n) % 8 == 0
print("ok", len(h))
)PY",
                 f);
      std::fclose(f);
    }
    const std::string command =
        "/usr/bin/python3 " + script + " " + path + " " + (padded ? "1" : "0") + " 2>&1";
    std::FILE* pipe = ::popen(command.c_str(), "r");
    ASSERT_NE(pipe, nullptr);
    char line[512] = {0};
    std::string output;
    while (std::fgets(line, sizeof line, pipe)) output += line;
    const int rc = ::pclose(pipe);
    EXPECT_EQ(rc, 0) << output;
    EXPECT_EQ(output, "ok " + std::to_string(AllDTypeTensors().size()) + "\n");
  }
}

}  // namespace
}  // namespace exl3serve::sharding
