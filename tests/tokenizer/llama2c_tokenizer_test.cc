// The tokenizer.json written for a llama2.c tokenizer.bin
// (sharding/llama2c_tokenizer.h) against llama2.c's own encoding rule
// (EncodeLlama2c, a direct implementation of the rule in
// shared/models/stories260K/README.md) on every line of the real TinyStories
// text in ../shared, for both real vocabularies (tok512 with byte fallback,
// tok105 character-level without); decode round-trips; BOS from the
// tokenizer_config; malformed files are DataLoss.
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "sharding/llama2c_tokenizer.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/shared_data.h"

namespace exl3serve {
namespace {

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

struct Case {
  const char* name;
  const char* tokenizer;  // under shared/
  int64_t vocab;
};

class Llama2cTokenizerTest : public ::testing::TestWithParam<Case> {};

TEST_P(Llama2cTokenizerTest, IdsEqualTheLlama2cRuleOnAllTheTextAndDecodeRoundTrips) {
  EXL3_REQUIRE_SHARED(bin, GetParam().tokenizer);
  EXL3_REQUIRE_SHARED(text_dir, "testdata/text");
  absl::StatusOr<sharding::Llama2cVocab> vocab = sharding::ReadLlama2cTokenizer(bin, GetParam().vocab);
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  testing::ScratchDir dir;
  ASSERT_TRUE(sharding::WriteHfTokenizer(*vocab, dir.path()).ok());
  absl::StatusOr<std::unique_ptr<coordinator::Tokenizer>> tok = coordinator::Tokenizer::Load(dir.path());
  ASSERT_TRUE(tok.ok()) << tok.status();
  int64_t lines = 0, tokens = 0, unk = 0, mismatches = 0, bad_roundtrips = 0;
  for (const char* file : {"tinystories_train_head.txt", "tinystories_valid_first1000.txt"}) {
    for (const std::string& line : Lines(text_dir + "/" + file)) {
      if (line.empty()) continue;
      ++lines;
      const std::vector<int32_t> want = sharding::EncodeLlama2c(*vocab, line);
      const std::vector<int32_t> got = (*tok)->Encode(line);
      tokens += static_cast<int64_t>(got.size());
      int64_t line_unk = 0;
      for (int32_t id : want) line_unk += id == 0 ? 1 : 0;
      unk += line_unk;
      if (got != want) {
        if (++mismatches <= 3) ADD_FAILURE() << file << ": \"" << line.substr(0, 80) << "\"";
        continue;
      }
      absl::StatusOr<std::string> back = (*tok)->Decode(got);
      ASSERT_TRUE(back.ok()) << back.status();
      // Without byte pieces an unknown character decodes as <unk>'s text.
      if (line_unk == 0 && *back != line) {
        if (++bad_roundtrips <= 3) ADD_FAILURE() << "round trip: \"" << line.substr(0, 80) << "\"";
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << lines << " lines";
  EXPECT_EQ(bad_roundtrips, 0);
  EXPECT_GT(lines, 1000);
  std::printf("%s: %lld lines, %lld tokens, %lld <unk>: ids equal the llama2.c rule\n",
              GetParam().name, static_cast<long long>(lines), static_cast<long long>(tokens),
              static_cast<long long>(unk));
  // BOS comes from tokenizer_config's add_bos_token.
  const std::vector<int32_t> with_bos = (*tok)->Encode("Once upon a time", {.add_special_tokens = true});
  ASSERT_FALSE(with_bos.empty());
  EXPECT_EQ(with_bos[0], 1);
}

INSTANTIATE_TEST_SUITE_P(RealVocabularies, Llama2cTokenizerTest,
                         ::testing::Values(Case{"tok512", "models/stories260K/tok512.bin", 512},
                                           Case{"tok105", "models/babyllama-tok105/tok105.bin", 105}),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(Llama2cTokenizerFileTest, MalformedFilesAreDataLoss) {
  testing::ScratchDir dir;
  const std::string path = dir.path() + "/t.bin";
  auto write = [&](const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; };
  write(std::string("\x05\x00", 2));
  EXPECT_EQ(sharding::ReadLlama2cTokenizer(path, 0).status().code(), absl::StatusCode::kDataLoss);
  std::string ok(4, '\0');
  auto piece = [](const std::string& s) {
    std::string out(4, '\0');  // score 0
    const int32_t len = static_cast<int32_t>(s.size());
    out.append(reinterpret_cast<const char*>(&len), 4);
    return out + s;
  };
  write(ok + piece("<unk>") + piece("a").substr(0, 7));
  EXPECT_EQ(sharding::ReadLlama2cTokenizer(path, 0).status().code(), absl::StatusCode::kDataLoss);
  write(ok + piece("<unk>") + piece("<s>") + piece("</s>") + piece("x"));
  EXPECT_EQ(sharding::ReadLlama2cTokenizer(path, 3).status().code(), absl::StatusCode::kDataLoss)
      << "trailing piece beyond the model's vocabulary";
  std::string negative = ok + std::string(4, '\0');
  const int32_t len = -5;
  negative.append(reinterpret_cast<const char*>(&len), 4);
  write(negative);
  EXPECT_EQ(sharding::ReadLlama2cTokenizer(path, 0).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(sharding::ReadLlama2cTokenizer(dir.path() + "/missing", 0).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace exl3serve
