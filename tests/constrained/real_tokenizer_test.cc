// The masker over real vocabularies: stories260K's SentencePiece-style
// tokenizer (512 tokens, byte fallback; from ../shared, skipped without it)
// and the Qwen3 byte-level BPE tokenizer (build/demo-tokenizer, fetched by
// scripts/fetch-demo-tokenizer.sh; skipped without it). The vocabulary's
// bytes follow the tokenizer (special ids and ids past it have none); JSON
// documents encoded by the tokenizer replay token by token with the cached
// mask equal to a naive trie walk at every step, ending in EOS.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/mask_cache.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using test_util::Bit;
using test_util::LoadLlama2cTokenizer;
using test_util::LoadQwen3Tokenizer;
using test_util::RealTokenizer;

// Longest-match ids of `text` over the vocabulary's bytes. (SentencePiece's
// Encode adds a dummy-prefix space at the start of a text, which an output
// continuing a prompt does not have.)
std::vector<int32_t> GreedyIds(const TokenVocabulary& vocab, std::string_view text) {
  std::vector<int32_t> ids;
  for (size_t at = 0; at < text.size();) {
    int32_t best = -1;
    size_t best_len = 0;
    for (int32_t id = 0; id < vocab.size(); ++id) {
      auto b = vocab.token_bytes(id);
      if (b && b->size() > best_len && text.substr(at).starts_with(*b)) best = id, best_len = b->size();
    }
    if (best < 0) return {};
    ids.push_back(best);
    at += best_len;
  }
  return ids;
}

// Replays `text` (plus EOS) and checks every mask against the naive walk.
void Replay(const Tokenizer& tok, std::shared_ptr<const TokenVocabulary> vocab, int32_t eos,
            const ConstraintSpec& spec, const std::string& text, bool greedy = false) {
  SCOPED_TRACE(text);
  auto compiled = CompileConstraint(spec, vocab);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  const auto& gc = static_cast<const GrammarConstraint&>(**compiled);
  std::vector<int32_t> ids = greedy ? GreedyIds(*vocab, text) : tok.Encode(text);
  ASSERT_FALSE(ids.empty());
  ids.push_back(eos);
  TokenMatcher m(*compiled);
  std::vector<uint32_t> mask(m.mask_words());
  NodeArena arena(false), scratch(false);
  std::vector<Stack> state, next;
  gc.pda().Initial(arena, state);
  for (int32_t id : ids) {
    m.FillNextTokenMask(mask);
    std::vector<uint32_t> naive(mask.size(), 0);
    TrieWalkScratch walk;
    MarkAcceptedTokens(gc.pda(), gc.bytes().trie(), state, scratch, walk, naive);
    if (m.IsComplete()) naive[eos >> 5] |= 1u << (eos & 31);
    if (mask != naive) {
      std::string diff;
      for (int32_t t = 0; t < vocab->size(); ++t) {
        if (Bit(mask, t) != Bit(naive, t)) {
          diff += absl::StrCat(" ", t, Bit(mask, t) ? "+" : "-");
        }
      }
      FAIL() << "cached mask != naive walk before token " << id << ":" << diff.substr(0, 2000);
    }
    ASSERT_TRUE(Bit(mask, id)) << "token " << id << " '" << vocab->token_bytes(id).value_or("<eos>") << "'";
    ASSERT_TRUE(m.AcceptToken(id).ok());
    if (id != eos) {
      const std::string_view bytes = *vocab->token_bytes(id);
      for (char c : bytes) {
        gc.pda().Advance(state, static_cast<uint8_t>(c), arena, next);
        state.swap(next);
      }
    }
  }
  EXPECT_TRUE(m.IsTerminated());
}

const char* kSchema =
    R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer","minimum":0},"tags":{"type":"array","items":{"enum":["a","b c"]}}},"required":["name","age"]})";

TEST(RealTokenizerTest, Stories260K) {
  RealTokenizer stories;
  if (!LoadLlama2cTokenizer("models/stories260K/tok512.bin", 512, &stories)) return;  // skipped or failed
  const auto& tok = stories.tok;
  const int32_t eos = stories.eos;  // 2
  const auto& vocab = stories.vocab;
  for (int32_t id = 0; id < 512; ++id) {
    if (tok->IsSpecial(id) || id == eos) continue;
    auto b = vocab->token_bytes(id);
    if (b.has_value()) {
      EXPECT_EQ(std::string(*b), *tok->TokenBytes(id)) << id;
    }
  }
  Replay(*tok, vocab, eos, {.kind = ConstraintKind::kJsonSchema, .text = kSchema},
         R"({"name": "Lily", "age": 3, "tags": ["b c", "a"]})", true);
  Replay(*tok, vocab, eos, {.kind = ConstraintKind::kRegex, .text = "Once upon a time, [a-z ]+\\."},
         "Once upon a time, there was a little girl.", true);
  Replay(*tok, vocab, eos, {.kind = ConstraintKind::kJsonSchema, .text = "{}"},
         R"({"story": "Tom had a big red ball.\nHe was happy!", "n": [1, 2.5, -3e2, true, null]})", true);
}

TEST(RealTokenizerTest, Qwen3ByteLevelBpe) {
  RealTokenizer qwen3;
  if (!LoadQwen3Tokenizer(&qwen3)) return;  // skipped or failed
  const auto& tok = qwen3.tok;
  const int32_t eos = qwen3.eos;  // <|im_end|>
  const auto& vocab = qwen3.vocab;
  EXPECT_EQ(vocab->size(), 151936);
  EXPECT_FALSE(vocab->token_bytes(eos).has_value());
  EXPECT_FALSE(vocab->token_bytes(151935).has_value());  // past the tokenizer
  EXPECT_FALSE(vocab->token_bytes(*tok->TokenToId("<|im_start|>")).has_value());
  EXPECT_EQ(vocab->token_bytes(*tok->TokenToId("Ġthe")), " the");
  EXPECT_FALSE(TokenVocabulary::FromTokenizer(*tok, 1000, std::vector<int32_t>{eos}).ok());
  Replay(*tok, vocab, eos, {.kind = ConstraintKind::kJsonSchema, .text = kSchema},
         R"({"name": "Zoë \"Z\" Ōtani — 東京", "age": 41, "tags": ["a"]})");
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
