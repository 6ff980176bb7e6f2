// SafetensorsCheckpoint: single file, sharded with an index, plain
// directories of shards, and the index consistency errors (§2.1).
#include <string>
#include <vector>

#include "tests/testing/shared_data.h"
#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"
#include "tests/safetensors/test_util.h"

namespace exl3serve::sharding {
namespace {

using ::exl3serve::sharding::testing::ScratchDir;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Writes U8 tensors of 2 bytes each, named `names`, to dir/file.
void WriteShard(const ScratchDir& dir, const std::string& file,
                const std::vector<std::string>& names) {
  std::vector<TensorToWrite> tensors;
  for (const std::string& name : names) {
    tensors.push_back(TensorFromBytes(name, DType::kU8, {2}, {uint8_t(name.size()), 1}));
  }
  ASSERT_TRUE(WriteSafetensorsFile(dir.File(file), std::move(tensors), {}).ok());
}

TEST(SafetensorsCheckpointTest, PrefersModelSafetensorsOverOtherFiles) {
  ScratchDir dir;
  WriteShard(dir, "model.safetensors", {"a", "b"});
  WriteShard(dir, "expected.safetensors", {"a", "states"});
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->TensorNames(), ElementsAre("a", "b"));
  EXPECT_EQ((*ckpt)->files().size(), 1u);
  EXPECT_FALSE((*ckpt)->Has("states"));
}

TEST(SafetensorsCheckpointTest, OpensSharedTestVectorDirectory) {
  EXL3_REQUIRE_SHARED(dir, "testdata/exl3/mul1_k1-8/k3_mul1");
  auto ckpt = SafetensorsCheckpoint::Open(dir);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->TensorNames(),
              ElementsAre("layer.proj.bias", "layer.proj.mul1", "layer.proj.suh",
                          "layer.proj.svh", "layer.proj.trellis"));
  auto trellis = (*ckpt)->Find("layer.proj.trellis");
  ASSERT_TRUE(trellis.has_value());
  EXPECT_EQ(trellis->info->shape, (std::vector<int64_t>{8, 8, 48}));
  EXPECT_THAT(trellis->file->path(), HasSubstr("k3_mul1/model.safetensors"));
}

TEST(SafetensorsCheckpointTest, FollowsIndexAcrossShards) {
  ScratchDir dir;
  WriteShard(dir, "model-00001-of-00002.safetensors", {"x.0", "x.1"});
  WriteShard(dir, "model-00002-of-00002.safetensors", {"y"});
  WriteShard(dir, "stray.safetensors", {"x.0"});  // not in the index: ignored
  ASSERT_TRUE(WriteShardIndex(dir.path(), 6,
                              {{"x.0", "model-00001-of-00002.safetensors"},
                               {"x.1", "model-00001-of-00002.safetensors"},
                               {"y", "model-00002-of-00002.safetensors"}})
                  .ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_THAT((*ckpt)->TensorNames(), ElementsAre("x.0", "x.1", "y"));
  ASSERT_EQ((*ckpt)->files().size(), 2u);
  auto y = (*ckpt)->Find("y");
  ASSERT_TRUE(y.has_value());
  EXPECT_THAT(y->file->path(), HasSubstr("model-00002-of-00002.safetensors"));
  EXPECT_EQ(y->file->Data(*y->info)[0], 1);  // name length
  EXPECT_FALSE((*ckpt)->Find("z").has_value());
  EXPECT_EQ((*ckpt)->total_tensor_bytes(), 6u);
}

TEST(SafetensorsCheckpointTest, WriteShardIndexMatchesTheHuggingFaceLayout) {
  ScratchDir dir;
  ASSERT_TRUE(WriteShardIndex(dir.path(), 1234, {{"b", "s2"}, {"a", "s1"}}).ok());
  auto json = ReadJsonFile(dir.File("model.safetensors.index.json"));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ((*json)["metadata"]["total_size"], 1234);
  EXPECT_EQ((*json)["weight_map"]["a"], "s1");
  EXPECT_EQ((*json)["weight_map"].size(), 2u);
}

TEST(SafetensorsCheckpointTest, IndexNamingMissingShardIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "model-00001-of-00002.safetensors", {"a"});
  ASSERT_TRUE(WriteShardIndex(dir.path(), 4,
                              {{"a", "model-00001-of-00002.safetensors"},
                               {"b", "model-00002-of-00002.safetensors"}})
                  .ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(),
              HasSubstr("lists `model-00002-of-00002.safetensors` (e.g. for tensor `b`), which "
                        "does not exist"));
}

TEST(SafetensorsCheckpointTest, IndexListingTensorAbsentFromItsShardIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "s1.safetensors", {"a"});
  ASSERT_TRUE(WriteShardIndex(dir.path(), 4, {{"a", "s1.safetensors"}, {"ghost", "s1.safetensors"}})
                  .ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(),
              HasSubstr("tensor `ghost` is listed in " + dir.File("model.safetensors.index.json") +
                        " for `s1.safetensors` but that file lacks it"));
}

TEST(SafetensorsCheckpointTest, ShardTensorMissingFromIndexIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "s1.safetensors", {"a", "extra"});
  ASSERT_TRUE(WriteShardIndex(dir.path(), 2, {{"a", "s1.safetensors"}}).ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("tensor `extra` in"));
  EXPECT_THAT(ckpt.status().message(), HasSubstr("is not listed in"));
}

TEST(SafetensorsCheckpointTest, TensorInTwoShardsIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "s1.safetensors", {"a"});
  WriteShard(dir, "s2.safetensors", {"a"});
  // With an index pointing `a` at s1, s2 still claims it.
  ASSERT_TRUE(WriteShardIndex(dir.path(), 2, {{"a", "s1.safetensors"}, {"b", "s2.safetensors"}})
                  .ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("index.json assigns it to `s1.safetensors`"));
}

TEST(SafetensorsCheckpointTest, IndexWithDuplicateEntryIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "s1.safetensors", {"a"});
  ASSERT_TRUE(WriteFileAtomically(dir.File("model.safetensors.index.json"),
                                  R"({"weight_map":{"a":"s1.safetensors","a":"s2.safetensors"}})")
                  .ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("duplicate key `a`"));
}

TEST(SafetensorsCheckpointTest, IndexPointingOutsideTheDirectoryIsDataLoss) {
  ScratchDir dir;
  ASSERT_TRUE(WriteShardIndex(dir.path(), 2, {{"a", "../s1.safetensors"}}).ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("expected a file name inside the directory"));
}

TEST(SafetensorsCheckpointTest, MalformedIndexIsDataLoss) {
  ScratchDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.File("model.safetensors.index.json"), R"({"metadata":{}})").ok());
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("expected an object with a `weight_map` object"));
}

TEST(SafetensorsCheckpointTest, WithoutIndexTakesAllShardsSorted) {
  ScratchDir dir;
  WriteShard(dir, "b.safetensors", {"from_b"});
  WriteShard(dir, "a.safetensors", {"from_a"});
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  ASSERT_EQ((*ckpt)->files().size(), 2u);
  EXPECT_THAT((*ckpt)->files()[0]->path(), HasSubstr("a.safetensors"));
  EXPECT_THAT((*ckpt)->TensorNames(), ElementsAre("from_a", "from_b"));
}

TEST(SafetensorsCheckpointTest, WithoutIndexSameNameInTwoFilesIsDataLoss) {
  ScratchDir dir;
  WriteShard(dir, "a.safetensors", {"t"});
  WriteShard(dir, "b.safetensors", {"t"});
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr("tensor `t` appears in both"));
}

TEST(SafetensorsCheckpointTest, EmptyOrMissingDirectoryIsNotFound) {
  ScratchDir dir;
  auto empty = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(empty.status().message(), HasSubstr(dir.path() + ": no model.safetensors"));
  auto missing = SafetensorsCheckpoint::Open(dir.File("nope"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir.File("nope")));
}

TEST(SafetensorsCheckpointTest, CorruptShardErrorNamesTheFile) {
  ScratchDir dir;
  testing::WriteBytes(dir.File("model.safetensors"), {1, 2, 3});
  auto ckpt = SafetensorsCheckpoint::Open(dir.path());
  EXPECT_EQ(ckpt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ckpt.status().message(), HasSubstr(dir.File("model.safetensors") + ": file is 3 bytes"));
}

}  // namespace
}  // namespace exl3serve::sharding
