// The tokenizer on small hand-made tokenizer.json files: merges by rank, byte
// fallback, added tokens, templates, decoding, streaming, and the errors for
// malformed files. No network; the Hugging Face comparison is reference_test.
#include "coordinator/tokenizer/tokenizer.h"

#include <cstdio>
#include <string>
#include <vector>

#include "coordinator/tokenizer/byte_level.h"
#include "coordinator/tokenizer/stream_decoder.h"
#include "coordinator/tokenizer/unicode_text.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3serve::coordinator {
namespace {

using json = nlohmann::json;
using testing::ElementsAre;
using testing::HasSubstr;

const std::string kSp = "\xE2\x96\x81";  // ▁
constexpr int32_t kUnk = 0, kBos = 1, kEos = 2;
int32_t Byte(int b) { return 3 + b; }  // <0xNN> ids
enum : int32_t { kSpace = 259, kH, kE, kL, kO, kLL, kSpH, kSpHe, kLLO, kSpHello, kTool = 300 };

// A SentencePiece-style BPE (Llama 2 shape): Prepend/Replace normalizer, byte
// fallback, a <s> template and the Replace/ByteFallback/Fuse/Strip decoder.
json SentencePieceJson() {
  json vocab = {{"<unk>", kUnk}, {"<s>", kBos}, {"</s>", kEos}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab[name] = Byte(b);
  }
  vocab[kSp] = kSpace;
  vocab["h"] = kH, vocab["e"] = kE, vocab["l"] = kL, vocab["o"] = kO, vocab["ll"] = kLL;
  vocab[kSp + "h"] = kSpH, vocab[kSp + "he"] = kSpHe, vocab["llo"] = kLLO, vocab[kSp + "hello"] = kSpHello;
  auto added = [](int id, const char* content, bool special) {
    return json{{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
                {"rstrip", false}, {"normalized", false}, {"special", special}};
  };
  return {
      {"version", "1.0"},
      {"added_tokens", {added(kUnk, "<unk>", true), added(kBos, "<s>", true), added(kEos, "</s>", true),
                        added(kTool, "<tool>", false)}},
      {"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", kSp}},
                       {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kSp}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor", {{"type", "TemplateProcessing"},
                          {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                      {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
                          {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {kBos}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder", {{"type", "Sequence"}, {"decoders", {
                       {{"type", "Replace"}, {"pattern", {{"String", kSp}}}, {"content", " "}},
                       {{"type", "ByteFallback"}}, {{"type", "Fuse"}},
                       {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"fuse_unk", true}, {"byte_fallback", true},
                 {"vocab", vocab},
                 // Rank order: "l l" first, so "lll" shows the leftmost tie-break.
                 {"merges", {"l l", kSp + " h", kSp + "h e", "ll o", kSp + "he llo"}}}},
  };
}

// A byte-level BPE (GPT-2 shape): ids 0..255 are the byte characters.
json ByteLevelJson() {
  json vocab;
  for (int b = 0; b < 256; ++b) {
    std::string s;
    internal::AppendUtf8(internal::ByteToChar(static_cast<unsigned char>(b)), &s);
    vocab[s] = b;
  }
  vocab["\xC4\xA0h"] = 256;   // Ġh
  vocab["\xC4\xA0hi"] = 257;  // Ġhi
  return {
      {"added_tokens", {{{"id", 258}, {"content", "<|end|>"}, {"special", true}, {"normalized", false}}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({json::array({"\xC4\xA0", "h"}), json::array({"\xC4\xA0h", "i"})})}}},
  };
}

std::unique_ptr<Tokenizer> Make(const json& tokenizer, const json& config = nullptr) {
  auto t = Tokenizer::FromJson(tokenizer.dump(), config.is_null() ? "" : config.dump(), "test");
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::string StreamAll(const Tokenizer& t, const std::vector<int32_t>& ids, std::vector<std::string>* chunks,
                      DecodeOptions options = {}) {
  StreamDecoder stream(t, options);
  std::string joined;
  for (int32_t id : ids) {
    auto piece = stream.Push(id);
    EXPECT_TRUE(piece.ok()) << piece.status();
    chunks->push_back(*piece);
    joined += *piece;
  }
  chunks->push_back(stream.Finish());
  return joined + chunks->back();
}

TEST(TokenizerTest, MergesByRankIntoOneToken) {
  auto t = Make(SentencePieceJson());
  EXPECT_THAT(t->Encode("hello"), ElementsAre(kSpHello));
  EXPECT_THAT(t->Encode("hello hello"), ElementsAre(kSpHello, kSpHello));
}

TEST(TokenizerTest, BreaksRankTiesLeftmostFirst) {
  auto t = Make(SentencePieceJson());
  EXPECT_THAT(t->Encode("lll"), ElementsAre(kSpace, kLL, kL));
}

TEST(TokenizerTest, FallsBackToByteTokensForUnknownCharacters) {
  auto t = Make(SentencePieceJson());
  EXPECT_THAT(t->Encode("hi"), ElementsAre(kSpH, Byte('i')));
  EXPECT_THAT(t->Encode("\xE4\xBD\xA0"), ElementsAre(kSpace, Byte(0xE4), Byte(0xBD), Byte(0xA0)));
}

TEST(TokenizerTest, MatchesAddedTokensBeforeTheModel) {
  auto t = Make(SentencePieceJson());
  EXPECT_THAT(t->Encode("<s>hello"), ElementsAre(kBos, kSpHello));
  EXPECT_THAT(t->Encode("hello<tool>"), ElementsAre(kSpHello, kTool));
  // With special-token parsing off, "<s>" is text; "<tool>" is not special.
  const std::vector<int32_t> ids = t->Encode("<s><tool>", {.parse_special_tokens = false});
  EXPECT_THAT(ids, ElementsAre(kSpace, Byte('<'), Byte('s'), Byte('>'), kTool));
}

TEST(TokenizerTest, AddsTheTemplateOnlyWhenAsked) {
  auto t = Make(SentencePieceJson());
  EXPECT_THAT(t->Encode("hello", {.add_special_tokens = true}), ElementsAre(kBos, kSpHello));
  EXPECT_THAT(t->Encode("", {.add_special_tokens = true}), ElementsAre(kBos));
  EXPECT_TRUE(t->Encode("").empty());
}

TEST(TokenizerTest, TakesLlamaTemplateFlagsFromTokenizerConfig) {
  const json config = {{"tokenizer_class", "LlamaTokenizer"}, {"add_bos_token", false}, {"add_eos_token", true},
                       {"bos_token", "<s>"}, {"eos_token", {{"content", "</s>"}}}, {"chat_template", "{{ x }}"}};
  auto t = Make(SentencePieceJson(), config);
  EXPECT_THAT(t->Encode("hello", {.add_special_tokens = true}), ElementsAre(kSpHello, kEos));
  EXPECT_EQ(t->special_token_ids().bos, kBos);
  EXPECT_EQ(t->special_token_ids().eos, kEos);
  EXPECT_EQ(t->chat_template(), "{{ x }}");
}

TEST(TokenizerTest, DecodesWithTheSentencePieceSpaceRule) {
  auto t = Make(SentencePieceJson());
  EXPECT_EQ(*t->Decode(t->Encode("hello hi")), "hello hi");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{kBos, kSpHello}), "<s> hello");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{kBos, kSpHello}, {.skip_special_tokens = true}), "hello");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{Byte(0xE4), Byte(0xBD), Byte(0xA0)}), "\xE4\xBD\xA0");
  // An invalid byte run becomes one U+FFFD per byte, as Hugging Face does.
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{Byte(0xE4), Byte(0xBD), kH}), "\xEF\xBF\xBD\xEF\xBF\xBDh");
}

TEST(TokenizerTest, RejectsUnknownIdsWhenDecoding) {
  auto t = Make(SentencePieceJson());
  auto bad = t->Decode(std::vector<int32_t>{kH, 5000});
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("5000"));
  EXPECT_EQ(t->Decode(std::vector<int32_t>{290}).status().code(), absl::StatusCode::kInvalidArgument);  // a hole
  EXPECT_EQ(t->Decode(std::vector<int32_t>{-1}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerTest, TokenBytesOfByteTokensAreTheRawBytes) {
  // A lone continuation or lead byte is the byte, not U+FFFD (structured
  // output walks token bytes; decoded text still replaces invalid groups).
  auto t = Make(SentencePieceJson());
  for (int b : {0x80, 0xA9, 0xBF, 0xC3, 0xE4, 0x41}) {
    absl::StatusOr<std::string> bytes = t->TokenBytes(Byte(b));
    ASSERT_TRUE(bytes.ok()) << bytes.status();
    EXPECT_EQ(*bytes, std::string(1, static_cast<char>(b))) << "byte " << b;
  }
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{Byte(0x80)}), "\xEF\xBF\xBD");
}

TEST(TokenizerTest, EncodesByteLevelTextWithTheGpt2Split) {
  auto t = Make(ByteLevelJson());
  EXPECT_THAT(t->Encode("a hi"), ElementsAre('a', 257));
  EXPECT_THAT(t->Encode("\xFF"), ElementsAre(0xEF, 0xBF, 0xBD));  // invalid input -> U+FFFD
  EXPECT_THAT(t->Encode("x<|end|>"), ElementsAre('x', 258));
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{'a', 257, 258}), "a hi<|end|>");
  EXPECT_EQ(*t->Decode(std::vector<int32_t>{0xE4, 0xBD}), "\xEF\xBF\xBD");
}

TEST(StreamDecoderTest, HoldsBytesUntilTheCharacterIsComplete) {
  auto t = Make(ByteLevelJson());
  std::vector<std::string> chunks;
  EXPECT_EQ(StreamAll(*t, {'a', 0xE4, 0xBD, 0xA0, 257}, &chunks), "a\xE4\xBD\xA0 hi");
  EXPECT_THAT(chunks, ElementsAre("a", "", "", "\xE4\xBD\xA0", " hi", ""));
}

TEST(StreamDecoderTest, FlushesAnUnfinishedCharacterAsReplacement) {
  auto t = Make(ByteLevelJson());
  std::vector<std::string> chunks;
  EXPECT_EQ(StreamAll(*t, {'a', 0xE4}, &chunks), "a\xEF\xBF\xBD");
}

TEST(StreamDecoderTest, DropsOnlyTheFirstLeadingSpaceOfTheText) {
  auto t = Make(SentencePieceJson());
  std::vector<std::string> chunks;
  EXPECT_EQ(StreamAll(*t, {kSpHello, kSpHello}, &chunks), "hello hello");
  chunks.clear();
  EXPECT_EQ(StreamAll(*t, {kSpace, kSpHello}, &chunks), *t->Decode(std::vector<int32_t>{kSpace, kSpHello}));
  chunks.clear();
  EXPECT_EQ(StreamAll(*t, {kBos, kSpHello, kSpH}, &chunks, {.skip_special_tokens = true}), "hello h");
  chunks.clear();
  EXPECT_EQ(StreamAll(*t, {kSpace, Byte(0xE4), Byte(0xBD), Byte(0xA0)}, &chunks), "\xE4\xBD\xA0");
  EXPECT_THAT(chunks, ElementsAre("", "", "", "\xE4\xBD\xA0", ""));
}

TEST(StreamDecoderTest, RejectsAnUnknownIdAndKeepsGoing) {
  auto t = Make(SentencePieceJson());
  StreamDecoder stream(*t);
  EXPECT_EQ(*stream.Push(kSpHello), "hello");
  EXPECT_EQ(stream.Push(99999).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*stream.Push(kSpH), " h");
  EXPECT_EQ(stream.Finish(), "");
}

// --- malformed files: a clear status naming the file and the field, never a crash.

absl::Status LoadError(const json& j) {
  return Tokenizer::FromJson(j.dump(), "", "dir").status();
}

TEST(TokenizerLoadTest, ReportsInvalidJsonAsDataLossNamingTheFile) {
  auto t = Tokenizer::FromJson("{\"model\": ", "", "dir");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(t.status().message(), HasSubstr("dir/tokenizer.json"));
}

TEST(TokenizerLoadTest, NamesTheBrokenField) {
  json j = SentencePieceJson();
  j.erase("model");
  EXPECT_THAT(LoadError(j).message(), HasSubstr("`model`"));

  j = SentencePieceJson();
  j["model"]["merges"][2] = 7;
  EXPECT_EQ(LoadError(j).code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(LoadError(j).message(), HasSubstr("`model.merges[2]`"));

  j = SentencePieceJson();
  j["model"]["merges"][1] = "nope x";
  EXPECT_THAT(LoadError(j).message(), HasSubstr("model.merges[1]"));
  EXPECT_THAT(LoadError(j).message(), HasSubstr("`nope`"));

  j = SentencePieceJson();
  j["model"]["vocab"]["h"] = "seven";
  EXPECT_THAT(LoadError(j).message(), HasSubstr("model.vocab[\"h\"]"));

  j = SentencePieceJson();
  j["added_tokens"][1].erase("id");
  EXPECT_THAT(LoadError(j).message(), HasSubstr("`added_tokens[1].id`"));

  j = SentencePieceJson();
  j["model"]["unk_token"] = "<missing>";
  EXPECT_THAT(LoadError(j).message(), HasSubstr("model.unk_token"));

  j = SentencePieceJson();
  j["normalizer"]["normalizers"][1]["pattern"] = 3;
  EXPECT_THAT(LoadError(j).message(), HasSubstr("normalizer.normalizers[1].pattern"));
}

TEST(TokenizerLoadTest, ReportsUnsupportedPartsAsUnimplemented) {
  json j = SentencePieceJson();
  j["model"]["type"] = "Unigram";
  EXPECT_EQ(LoadError(j).code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(LoadError(j).message(), HasSubstr("Unigram"));

  j = SentencePieceJson();
  j["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_EQ(LoadError(j).code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(LoadError(j).message(), HasSubstr("Lowercase"));

  j = SentencePieceJson();
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a*?"}}}, {"behavior", "Isolated"}};
  EXPECT_EQ(LoadError(j).code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(LoadError(j).message(), HasSubstr("pre_tokenizer.pattern.Regex"));
}

TEST(TokenizerLoadTest, ChecksTokenizerConfigTokens) {
  auto t = Tokenizer::FromJson(SentencePieceJson().dump(), R"({"eos_token": "<nope>"})", "dir");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(t.status().message(), HasSubstr("dir/tokenizer_config.json"));
  EXPECT_THAT(t.status().message(), HasSubstr("eos_token"));
}

TEST(TokenizerLoadTest, ReportsAMissingDirectoryAsNotFound) {
  auto t = Tokenizer::Load("/nonexistent/model");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json"));
}

// A tokenizer.json without a decoder joins tokens with spaces (as Hugging
// Face does); streamed one token at a time it must give the same text
// (found by tests/fuzz/tokenizer_fuzz.cc).
TEST(StreamDecoderTest, WithoutADecoderStreamsTheSameSpacesAsDecode) {
  json vocab = {{"a", 0}, {"b", 1}, {"ab", 2}};
  json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b"})}}}};
  std::unique_ptr<Tokenizer> t = Make(j);
  ASSERT_NE(t, nullptr);
  const std::vector<int32_t> ids = {2, 0, 1, 2};
  auto decoded = t->Decode(ids);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  EXPECT_EQ(*decoded, "ab a b ab");
  std::vector<std::string> chunks;
  EXPECT_EQ(StreamAll(*t, ids, &chunks), *decoded);
}

// Found by the tokenizer fuzzer (30-minute run): a vocabulary id of ~2^31
// made the id-indexed tables allocate gigabytes (out of memory). Every id of
// the file is now below kMaxTokenId, and the error names the limit.
TEST(TokenizerLoadTest, RefusesTokenIdsAtOrAboveTheLimit) {
  json j = SentencePieceJson();
  j["model"]["vocab"]["h"] = 2147480000;
  absl::Status s = LoadError(j);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(s.message(), HasSubstr("model.vocab[\"h\"]"));
  EXPECT_THAT(s.message(), HasSubstr("kMaxTokenId"));

  j = SentencePieceJson();
  j["added_tokens"][0]["id"] = kMaxTokenId;
  EXPECT_THAT(LoadError(j).message(), HasSubstr("added_tokens[0].id"));

  j = SentencePieceJson();
  j["model"]["vocab"]["h"] = kMaxTokenId - 1;  // the largest id allowed
  EXPECT_TRUE(Tokenizer::FromJson(j.dump(), "", "dir").ok());
}

// Found by the tokenizer fuzzer (second 30-minute run): a Strip decoder with
// stop 1 removed a trailing space from every streamed window, so the stream
// lost the spaces Decode kept. Such a decoder (none is published) is refused.
TEST(TokenizerLoadTest, RefusesAStripDecoderThatStripsTheEnd) {
  json j = SentencePieceJson();
  bool found = false;
  for (json& d : j["decoder"]["decoders"]) {
    if (d["type"] == "Strip") {
      d["stop"] = 1;
      found = true;
    }
  }
  ASSERT_TRUE(found) << "the test tokenizer has a Strip decoder";
  absl::Status s = LoadError(j);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
  EXPECT_THAT(s.message(), HasSubstr("stop"));
}

}  // namespace
}  // namespace exl3serve::coordinator
