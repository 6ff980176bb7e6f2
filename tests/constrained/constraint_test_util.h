// tests/constrained/constraint_test_util.h — scaffolding shared by the
// tests/constrained/*_test.cc files (header-only: tests/CMakeLists.txt builds
// one executable per *_test.cc, with no helper sources). Only test plumbing
// lives here; every oracle a test checks against (JSON Schema validators,
// format regexes, key scans, derivatives) stays in its test, so each test
// still reads on its own — where two tests' oracles look alike they differ in
// detail (e.g. the email regex of format_length_test vs oneof_test). Everything
// is in namespace exl3serve::coordinator::constrained::test_util; a test names
// what it takes with using-declarations.
//
// Vocabularies and masks. Every vocabulary built here has id kEos (0) as its
// only EOS and no bytes for it.
//   ByteVocab()                 a byte-level vocabulary: token id = byte + 1 (257 ids)
//   TokenVocab({"a", "ab"})     id 0 = EOS, then the given tokens in order (ids 1..)
//   Bit(mask, id)               whether a FillNextTokenMask bit is set
//   Accepts(c, text)            `text` accepted byte by byte (ByteVocab ids), then complete
//   NaiveMask(gc, prefix, done) the mask of a full trie walk over the replayed bytes of
//                               `prefix` (no mask cache, no key filter); EOS bit 0 iff `done`
//   CodePoints(s)               UTF-8 code points of `s` (bytes that are not continuation bytes)
//   Rng{std::mt19937(seed)}     Rand(n): uniform in [0, n)
//
// Random walks over a ByteVocab constraint (RandomByteWalks): each walk takes
// U[0, max_random_steps] random allowed tokens, then by preference EOS (if
// eos_first), the bytes of `closing` (in order, or closing[0] then the others
// rotating with the step so no single byte loops), else a random allowed
// token (or the first allowed one: EOS where allowed). `check(out)` sees every
// output at which EOS is allowed. Fatal failures (from gtest): a dead state
// (no token allowed), a refused allowed token, no EOS within max_steps; they
// end the helper, not the test (callers check HasFatalFailure()). All
// randomness comes from `g`: a seed replays the same walks. (Walks over other
// vocabularies, with drafts or mask checks, stay in their tests.)
//
// Real tokenizers. Each loader fills *out and returns true, or returns false
// after skipping the test (with a message naming what is missing) or failing
// it; the test returns on false:
//   RealTokenizer t;
//   if (!LoadLlama2cTokenizer("models/stories260K/tok512.bin", 512, &t)) return;
//   LoadLlama2cTokenizer(relative, n, out)  a llama2.c tokenizer from the shared data
//                        (tests/testing/shared_data.h: $EXL3_SHARED_DIR, else ../shared),
//                        written as tokenizer.json to a scratch dir that lives as long as
//                        *out, loaded; vocabulary of n ids, EOS id 2
//                        (stories260K: tok512.bin, 512; BabyLlama: babyllama-tok105/tok105.bin, 105)
//   LoadQwen3Tokenizer(out)  <source dir>/build/demo-tokenizer (scripts/fetch-demo-tokenizer.sh;
//                        not shared data, so $EXL3_SHARED_DIR does not move it);
//                        vocabulary of 151936 ids, EOS <|im_end|>
#ifndef EXL3SERVE_TESTS_CONSTRAINED_CONSTRAINT_TEST_UTIL_H_
#define EXL3SERVE_TESTS_CONSTRAINED_CONSTRAINT_TEST_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/mask_cache.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "sharding/llama2c_tokenizer.h"
#include "tests/testing/scratch_dir.h"
#include "tests/testing/shared_data.h"

namespace exl3serve::coordinator::constrained::test_util {

// ---- vocabularies and masks -------------------------------------------------

inline constexpr int32_t kEos = 0;

// Token id = byte + 1; 0 is EOS.
inline std::shared_ptr<const TokenVocabulary> ByteVocab() {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));
  const int32_t eos[] = {kEos};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

// Id 0: EOS; then `tokens`.
inline std::shared_ptr<const TokenVocabulary> TokenVocab(const std::vector<std::string>& tokens) {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};
  for (const std::string& t : tokens) bytes.push_back(t);
  const int32_t eos[] = {kEos};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

inline bool Bit(const std::vector<uint32_t>& m, int32_t id) { return (m[id >> 5] >> (id & 31)) & 1; }

// Accepted byte by byte (ByteVocab ids) and complete at the end.
inline bool Accepts(const std::shared_ptr<const CompiledConstraint>& c, const std::string& text) {
  TokenMatcher m(c);
  for (char ch : text) {
    if (!m.AcceptToken(static_cast<uint8_t>(ch) + 1).ok()) return false;
  }
  return m.IsComplete();
}

// The mask from a full trie walk over the replayed bytes (no cache, no key
// filter).
inline std::vector<uint32_t> NaiveMask(const GrammarConstraint& c, const std::string& prefix, bool complete) {
  NodeArena arena(false), scratch(false);
  std::vector<Stack> state, next;
  c.pda().Initial(arena, state);
  for (char ch : prefix) {
    c.pda().Advance(state, static_cast<uint8_t>(ch), arena, next);
    state.swap(next);
  }
  std::vector<uint32_t> mask(c.vocabulary().mask_words(), 0);
  TrieWalkScratch walk;
  MarkAcceptedTokens(c.pda(), c.bytes().trie(), state, scratch, walk, mask);
  if (complete) mask[0] |= 1;
  return mask;
}

// Code points of UTF-8.
inline size_t CodePoints(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

struct Rng {
  std::mt19937 g;
  int Rand(int n) { return std::uniform_int_distribution<int>(0, n - 1)(g); }
};

// ---- random walks over a ByteVocab constraint ------------------------------

struct ByteWalkOptions {
  int max_random_steps;  // random allowed tokens first: U[0, max_random_steps] of them
  int max_steps;         // a walk must take EOS within this many tokens
  std::string closing;   // then preferred bytes
  bool eos_first = true;        // EOS before the closing bytes
  bool rotate = false;          // closing[0] first, then the others rotating with the step
  bool random_fallback = true;  // none preferred allowed: a random allowed token, else the first
};

template <typename Check>
void RandomByteWalks(const std::shared_ptr<const CompiledConstraint>& c, std::mt19937& g, const ByteWalkOptions& o,
                     int walks, Check check) {
  for (int n = 0; n < walks; ++n) {
    TokenMatcher m(c);
    std::vector<uint32_t> mask(m.mask_words());
    std::string out;
    const int random_steps = std::uniform_int_distribution<int>(0, o.max_random_steps)(g);
    bool ended = false;
    for (int step = 0; step < o.max_steps && !ended; ++step) {
      m.FillNextTokenMask(mask);
      if (Bit(mask, kEos)) check(out);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id <= 256; ++id) {
        if (Bit(mask, id)) allowed.push_back(id);
      }
      ASSERT_FALSE(allowed.empty()) << "dead state after '" << out << "'";
      int32_t pick = -1;
      if (step < random_steps) {
        pick = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(g)];
      } else {
        if (o.eos_first && Bit(mask, kEos)) pick = kEos;
        for (size_t k = 0; pick < 0 && k < o.closing.size(); ++k) {
          const char ch = !o.rotate || k == 0 ? o.closing[k] : o.closing[1 + (step + k) % (o.closing.size() - 1)];
          if (Bit(mask, static_cast<uint8_t>(ch) + 1)) pick = static_cast<uint8_t>(ch) + 1;
        }
        if (pick < 0) {
          pick = o.random_fallback ? allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(g)]
                                   : allowed[0];
        }
      }
      ASSERT_TRUE(m.AcceptToken(pick).ok());
      if (pick == kEos) {
        ended = true;
      } else {
        out += static_cast<char>(pick - 1);
      }
    }
    ASSERT_TRUE(ended) << "walk did not finish: " << out;
  }
}

// ---- real tokenizers --------------------------------------------------------

struct RealTokenizer {
  std::optional<::exl3serve::testing::ScratchDir> dir;  // the written tokenizer.json (llama2.c only)
  std::unique_ptr<Tokenizer> tok;
  std::shared_ptr<const TokenVocabulary> vocab;  // set last: null when not loaded
  int32_t eos = -1;
};

namespace internal {

inline void LoadLlama2c(const std::string& relative, int32_t vocab_size, RealTokenizer* out) {
  EXL3_REQUIRE_SHARED(bin, relative);
  auto llama = sharding::ReadLlama2cTokenizer(bin, vocab_size);
  ASSERT_TRUE(llama.ok()) << llama.status();
  out->dir.emplace();
  ASSERT_TRUE(sharding::WriteHfTokenizer(*llama, out->dir->path()).ok());
  auto tok = Tokenizer::Load(out->dir->path());
  ASSERT_TRUE(tok.ok()) << tok.status();
  out->tok = std::move(*tok);
  out->eos = 2;
  auto vocab = TokenVocabulary::FromTokenizer(*out->tok, vocab_size, std::vector<int32_t>{out->eos});
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  out->vocab = *vocab;
}

inline void LoadQwen3(RealTokenizer* out) {
  const std::string dir = std::string(EXL3_SOURCE_DIR) + "/build/demo-tokenizer";
  if (!std::filesystem::exists(dir + "/tokenizer.json")) {
    GTEST_SKIP() << dir << " not found (scripts/fetch-demo-tokenizer.sh)";
  }
  auto tok = Tokenizer::Load(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  out->tok = std::move(*tok);
  out->eos = *out->tok->TokenToId("<|im_end|>");
  auto vocab = TokenVocabulary::FromTokenizer(*out->tok, 151936, std::vector<int32_t>{out->eos});
  ASSERT_TRUE(vocab.ok()) << vocab.status();
  out->vocab = *vocab;
}

}  // namespace internal

inline bool LoadLlama2cTokenizer(const std::string& relative, int32_t vocab_size, RealTokenizer* out) {
  internal::LoadLlama2c(relative, vocab_size, out);
  return out->vocab != nullptr;
}

inline bool LoadQwen3Tokenizer(RealTokenizer* out) {
  internal::LoadQwen3(out);
  return out->vocab != nullptr;
}

}  // namespace exl3serve::coordinator::constrained::test_util

#endif  // EXL3SERVE_TESTS_CONSTRAINED_CONSTRAINT_TEST_UTIL_H_
