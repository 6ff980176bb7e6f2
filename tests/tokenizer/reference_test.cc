// Compares the tokenizer with Hugging Face's tokenizers library on a corpus of
// 450+ strings per tokenizer (see tests/tokenizer/reference/make_reference.js).
// The reference data is produced at test time by
// tests/cli/tokenizer_reference_test.sh, which sets EXL3_TOKENIZER_REFERENCE to
// its manifest; run alone (plain ctest) these tests skip.
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/tokenizer/stream_decoder.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/tokenizer/unicode_text.h"
#include "gtest/gtest.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::coordinator {
namespace {

// Mismatches reported per check before the rest are only counted.
constexpr int kMaxReported = 8;

struct Case {
  std::string text;  // raw bytes, possibly invalid UTF-8
  std::vector<int32_t> ids, ids_special;
  std::string decoded, decoded_skip;
  bool roundtrip = false;
};

std::string FromHex(const std::string& hex) { return absl::HexStringToBytes(hex); }
std::string Show(const std::string& bytes) { return absl::StrCat("\"", absl::CHexEscape(bytes), "\""); }
std::string Show(const std::vector<int32_t>& ids) { return absl::StrCat("[", absl::StrJoin(ids, ","), "]"); }

class ReferenceTest : public testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    const char* manifest_path = std::getenv("EXL3_TOKENIZER_REFERENCE");
    if (manifest_path == nullptr) {
      GTEST_SKIP() << "EXL3_TOKENIZER_REFERENCE is not set: the reference comes from "
                      "tests/cli/tokenizer_reference_test.sh (needs node and npm)";
    }
    auto manifest = sharding::ReadJsonFile(manifest_path);
    ASSERT_TRUE(manifest.ok()) << manifest.status();
    for (const auto& entry : *manifest) {
      if (entry.at("name").get<std::string>() != GetParam()) continue;
      auto tokenizer = Tokenizer::Load(entry.at("model_dir").get<std::string>());
      ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
      tokenizer_ = std::move(*tokenizer);
      auto cases = sharding::ReadJsonFile(entry.at("cases_file").get<std::string>());
      ASSERT_TRUE(cases.ok()) << cases.status();
      for (const auto& c : cases->at("cases")) {
        Case k;
        k.text = FromHex(c.at("hex").get<std::string>());
        k.ids = c.at("ids").get<std::vector<int32_t>>();
        k.ids_special = c.at("ids_special").get<std::vector<int32_t>>();
        k.decoded = FromHex(c.at("decoded_hex").get<std::string>());
        k.decoded_skip = FromHex(c.at("decoded_skip_hex").get<std::string>());
        k.roundtrip = c.at("roundtrip").get<bool>();
        cases_.push_back(std::move(k));
      }
    }
    if (tokenizer_ == nullptr) GTEST_SKIP() << "no reference for " << GetParam() << " in the manifest";
    ASSERT_GE(cases_.size(), 300u);
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::vector<Case> cases_;
};

TEST_P(ReferenceTest, EncodesLikeHuggingFace) {
  int bad = 0;
  for (const Case& c : cases_) {
    const std::vector<int32_t> ids = tokenizer_->Encode(c.text);
    if (ids != c.ids && ++bad <= kMaxReported) {
      ADD_FAILURE() << "text " << Show(c.text) << "\n  expected " << Show(c.ids) << "\n  got      " << Show(ids);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << cases_.size() << " strings";
}

TEST_P(ReferenceTest, AddsSpecialTokensLikeHuggingFace) {
  int bad = 0;
  for (const Case& c : cases_) {
    const std::vector<int32_t> ids = tokenizer_->Encode(c.text, {.add_special_tokens = true});
    if (ids != c.ids_special && ++bad <= kMaxReported) {
      ADD_FAILURE() << "text " << Show(c.text) << "\n  expected " << Show(c.ids_special) << "\n  got      "
                    << Show(ids);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << cases_.size() << " strings";
}

TEST_P(ReferenceTest, DecodesLikeHuggingFace) {
  int bad = 0;
  for (const Case& c : cases_) {
    auto text = tokenizer_->Decode(c.ids);
    ASSERT_TRUE(text.ok()) << text.status();
    auto skipped = tokenizer_->Decode(c.ids_special, {.skip_special_tokens = true});
    ASSERT_TRUE(skipped.ok()) << skipped.status();
    if ((*text != c.decoded || *skipped != c.decoded_skip) && ++bad <= kMaxReported) {
      ADD_FAILURE() << "ids " << Show(c.ids) << "\n  expected " << Show(c.decoded) << " / skip "
                    << Show(c.decoded_skip) << "\n  got      " << Show(*text) << " / skip " << Show(*skipped);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << cases_.size() << " strings";
}

TEST_P(ReferenceTest, RoundTripsWhereTheReferenceDoes) {
  int checked = 0, bad = 0;
  for (const Case& c : cases_) {
    if (!c.roundtrip) continue;
    ++checked;
    auto text = tokenizer_->Decode(tokenizer_->Encode(c.text));
    ASSERT_TRUE(text.ok()) << text.status();
    if (*text != internal::ToValidUtf8(c.text) && ++bad <= kMaxReported) {
      ADD_FAILURE() << "text " << Show(c.text) << " came back as " << Show(*text);
    }
  }
  EXPECT_EQ(bad, 0) << "of " << checked << " round-tripping strings";
  EXPECT_GT(checked, 0);
}

TEST_P(ReferenceTest, StreamsWholeCharactersThatAddUpToDecode) {
  int bad = 0;
  for (const Case& c : cases_) {
    for (const bool skip : {false, true}) {
      const std::vector<int32_t>& ids = skip ? c.ids_special : c.ids;
      StreamDecoder stream(*tokenizer_, {.skip_special_tokens = skip});
      std::string joined;
      for (const int32_t id : ids) {
        auto piece = stream.Push(id);
        ASSERT_TRUE(piece.ok()) << piece.status();
        ASSERT_TRUE(internal::IsValidUtf8(*piece)) << "chunk " << Show(*piece) << " of " << Show(c.text);
        joined += *piece;
      }
      joined += stream.Finish();
      const std::string& expected = skip ? c.decoded_skip : c.decoded;
      if (joined != expected && ++bad <= kMaxReported) {
        ADD_FAILURE() << "ids " << Show(ids) << (skip ? " (skipping specials)" : "") << "\n  decode "
                      << Show(expected) << "\n  stream " << Show(joined);
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, ReferenceTest,
                         testing::Values("qwen3", "llama3", "llama2", "llama2-metaspace",
                                         "llama2-metaspace-split", "qwen3-gpt2-bytelevel"),
                         [](const testing::TestParamInfo<const char*>& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (ch == '-') ch = '_';
                           }
                           return name;
                         });

}  // namespace
}  // namespace exl3serve::coordinator
