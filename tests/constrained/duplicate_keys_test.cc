// Unique object keys under JSON Schema constraints (TokenMatcher with
// json_key_tracker.h) over a byte-level toy vocabulary with multi-key tokens
// and escapes, against independent oracles:
//  - random walks (with drafts rolled back) on free-key schemas: at every
//    step the mask == the naive trie walk minus exactly the tokens whose
//    bytes would complete a repeated key (brute force over all tokens, keys
//    found by a recursive-descent scan and decoded by nlohmann::json); every
//    output where EOS is allowed parses with no repeated key (a SAX check);
//    rolled-back drafts leave identical masks; walks always reach EOS;
//  - keys equal after unescaping (\u0061 and a, \u00e9 and é, \/ and /)
//    are caught; AcceptToken refuses them and leaves the matcher unchanged;
//  - on declared-properties-only schemas the filter removes nothing;
//  - at the Qwen3 vocabulary (build/demo-tokenizer; skipped without it) a
//    json_object output replays with every mask == naive minus repeats;
//  - the reported case: stories260K writing {" said, ": "...", " said, ": ..}.
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/json_key_tracker.h"
#include "coordinator/constrained/mask_cache.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::json;
using test_util::Bit;
using test_util::kEos;
using test_util::LoadLlama2cTokenizer;
using test_util::LoadQwen3Tokenizer;
using test_util::NaiveMask;  // no key filter
using test_util::RealTokenizer;
using test_util::Rng;

std::shared_ptr<const TokenVocabulary> Vocab() {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};  // id 0: EOS
  // Single bytes: structure, literals, numbers, a few key letters, escapes.
  for (char c : std::string("{}[],:\" \\/0123456789abcdefABCDEFlnrstu-+.")) bytes.push_back(std::string(1, c));
  for (const char* t :
       {"é", "😀", R"(",")", R"(":")", R"("a":)", R"("a","b":)", R"("a")", R"("b")", R"({"a":)", R"({"a":1,"a":)",
        R"("a":1,"a":)", R"("a":1,"b":)", R"(, "a": )", R"(,"a":)", R"(,"b":)", R"(","a":)", R"(","b":)", R"(},"b":)",
        R"("a":1,"a":2})", R"(\u0061)", R"(\u00e9)", R"(\u00E9)", R"(\")", R"(\\)", R"("})", R"("},)", R"("}])",
        R"(":{"a":)", R"([{"a":)", R"(}, {"a":)", R"("a":{"a":)", R"("\u0061":)", R"(a")", R"(b")", R"(é":)", R"(\n)",
        R"(\u000a)", R"(\/)", R"("é")", R"(1,"a")", R"(}])", R"(},{"b":)"}) {
    bytes.push_back(t);
  }
  const int32_t eos[] = {kEos};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

int32_t Id(const TokenVocabulary& v, std::string_view t) {
  for (int32_t id = 1; id < v.size(); ++id) {
    if (v.token_bytes(id) == t) return id;
  }
  ADD_FAILURE() << "no token '" << t << "'";
  return -1;
}

// Whether a prefix of a JSON text has an object with two equal completed
// keys: recursive descent, each key's text decoded by nlohmann::json.
class PrefixKeyScan {
 public:
  explicit PrefixKeyScan(std::string_view s) : s_(s) { Value(); }
  bool repeat() const { return repeat_; }
  bool bad_key() const { return bad_key_; }

 private:
  bool End() const { return i_ >= s_.size(); }
  void Ws() {
    while (!End() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  // Each returns false when the text ends inside it.
  bool Value() {
    Ws();
    if (End()) return false;
    if (s_[i_] == '{') return Object();
    if (s_[i_] == '[') return Array();
    if (s_[i_] == '"') return String(nullptr);
    while (!End() && std::string_view("-+.0123456789eEtruefalsn").find(s_[i_]) != std::string_view::npos) ++i_;
    return !End();
  }
  bool String(std::string* decoded) {
    const size_t start = i_++;
    while (!End()) {
      const char c = s_[i_++];
      if (c == '\\') {
        if (End()) return false;
        ++i_;
      } else if (c == '"') {
        if (decoded != nullptr) {
          const json j = json::parse(s_.substr(start, i_ - start), nullptr, false);
          if (!j.is_string()) {
            bad_key_ = true;
            return false;
          }
          *decoded = j.get<std::string>();
        }
        return true;
      }
    }
    return false;
  }
  bool Object() {
    ++i_;
    std::set<std::string> keys;
    Ws();
    if (End()) return false;
    if (s_[i_] == '}') return ++i_, true;
    while (true) {
      Ws();
      if (End()) return false;
      std::string key;
      if (!String(&key)) return false;
      if (!keys.insert(key).second) repeat_ = true;
      Ws();
      if (End()) return false;
      ++i_;  // ':'
      if (!Value()) return false;
      Ws();
      if (End()) return false;
      if (s_[i_++] == '}') return true;  // else ','
    }
  }
  bool Array() {
    ++i_;
    Ws();
    if (End()) return false;
    if (s_[i_] == ']') return ++i_, true;
    while (true) {
      if (!Value()) return false;
      Ws();
      if (End()) return false;
      if (s_[i_++] == ']') return true;
    }
  }

  std::string_view s_;
  size_t i_ = 0;
  bool repeat_ = false, bad_key_ = false;
};

// A complete JSON text: parses, and no object repeats a key (SAX).
struct UniqueKeysSax : nlohmann::json_sax<json> {
  std::vector<std::set<std::string>> open;
  bool repeat = false;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open.emplace_back(), true; }
  bool key(string_t& k) override {
    if (!open.back().insert(k).second) repeat = true;
    return true;
  }
  bool end_object() override { return open.pop_back(), true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

class DuplicateKeysTest : public ::testing::Test {
 protected:
  std::shared_ptr<const CompiledConstraint> Compile(const std::string& schema) {
    auto c = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema}, vocab_);
    EXPECT_TRUE(c.ok()) << schema << ": " << c.status();
    return c.ok() ? *c : nullptr;
  }

  std::vector<uint32_t> Mask(TokenMatcher& m) {
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenMask(mask);
    return mask;
  }

  // Accepts `text` one character token at a time (the vocabulary has a
  // token for every character used).
  void AcceptText(TokenMatcher& m, std::string_view text) {
    for (size_t at = 0; at < text.size();) {
      size_t len = 1;
      while (at + len < text.size() && (static_cast<uint8_t>(text[at + len]) & 0xC0) == 0x80) ++len;
      const absl::Status s = m.AcceptToken(Id(*vocab_, text.substr(at, len)));
      ASSERT_TRUE(s.ok()) << s << " at " << at << " of " << text;
      at += len;
    }
  }

  // The expected mask: naive, minus the tokens the scan finds repeating a key.
  std::vector<uint32_t> Expected(const GrammarConstraint& gc, const std::string& out, bool complete,
                                 int* removed) {
    std::vector<uint32_t> mask = NaiveMask(gc, out, complete);
    for (int32_t id = 1; id < vocab_->size(); ++id) {
      if (!Bit(mask, id)) continue;
      const PrefixKeyScan scan(out + std::string(*vocab_->token_bytes(id)));
      EXPECT_FALSE(scan.bad_key()) << out << *vocab_->token_bytes(id);
      if (scan.repeat()) {
        mask[id >> 5] &= ~(uint32_t{1} << (id & 31));
        ++*removed;
      }
    }
    return mask;
  }

  // A random allowed token, favouring multi-byte and quote tokens (repeats).
  int32_t Pick(Rng& r, const std::vector<uint32_t>& mask) {
    std::vector<int32_t> weighted;
    for (int32_t id = 0; id < vocab_->size(); ++id) {
      if (!Bit(mask, id)) continue;
      const std::string_view b = vocab_->token_bytes(id).value_or("");
      const int w = 1 + (b.size() > 1 ? 3 : 0) + (b.find('"') != std::string_view::npos ? 3 : 0);
      weighted.insert(weighted.end(), w, id);
    }
    return weighted[r.Rand(static_cast<int>(weighted.size()))];
  }

  // Random walks on `schema`; returns how many tokens the filter removed.
  int Walks(const std::string& schema, uint32_t seed, int walks) {
    SCOPED_TRACE(schema);
    auto compiled = Compile(schema);
    if (compiled == nullptr) return 0;
    const auto& gc = static_cast<const GrammarConstraint&>(*compiled);
    Rng r{std::mt19937(seed)};
    int removed = 0;
    for (int n = 0; n < walks; ++n) {
      TokenMatcher m(compiled);
      std::string out;
      const int random_steps = r.Rand(60);
      bool ended = false;
      for (int step = 0; step < 500 && !ended; ++step) {
        const std::vector<uint32_t> mask = Mask(m);
        EXPECT_EQ(mask, Expected(gc, out, m.IsComplete(), &removed)) << "after '" << out << "'";
        if (Bit(mask, kEos)) {
          UniqueKeysSax sax;
          EXPECT_TRUE(json::sax_parse(out, &sax)) << "EOS allowed but not JSON: " << out;
          EXPECT_FALSE(sax.repeat) << "EOS allowed with a repeated key: " << out;
        }
        EXPECT_NE(mask, std::vector<uint32_t>(mask.size(), 0)) << "dead state after '" << out << "'";
        if (::testing::Test::HasFailure()) return removed;
        // A token the filter removed is refused, the state unchanged.
        const std::vector<uint32_t> naive = NaiveMask(gc, out, m.IsComplete());
        for (int32_t id = 1; id < vocab_->size(); ++id) {
          if (Bit(naive, id) && !Bit(mask, id)) {
            const absl::Status s = m.AcceptToken(id);
            EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
            EXPECT_NE(s.message().find("repeats the key"), std::string_view::npos) << s;
            EXPECT_EQ(Mask(m), mask);
            break;
          }
        }
        // A draft of 1-4 tokens, rolled back: the masks replay identically.
        if (r.Rand(4) == 0) {
          std::vector<int32_t> draft;
          std::vector<std::vector<uint32_t>> masks = {mask};
          for (int k = 1 + r.Rand(4); k > 0 && masks.back() != std::vector<uint32_t>(mask.size(), 0); --k) {
            draft.push_back(Pick(r, masks.back()));
            EXPECT_TRUE(m.AcceptToken(draft.back()).ok());
            masks.push_back(Mask(m));
          }
          EXPECT_TRUE(m.Rollback(static_cast<int>(draft.size())).ok());
          EXPECT_EQ(Mask(m), mask) << "after rolling back a draft at '" << out << "'";
          for (size_t k = 0; k < draft.size(); ++k) {
            EXPECT_TRUE(m.AcceptToken(draft[k]).ok());
            EXPECT_EQ(Mask(m), masks[k + 1]) << "replayed draft token " << k << " at '" << out << "'";
          }
          EXPECT_TRUE(m.Rollback(static_cast<int>(draft.size())).ok());
        }
        int32_t pick = -1;
        if (step < random_steps) {
          pick = Pick(r, mask);
        } else {
          // Close: EOS, then closing bytes; '"' (which ends keys) early.
          for (const char* t : {"", "\"", "}", "]", "1", "a", ",", ":", "{"}) {
            const int32_t id = *t == 0 ? kEos : Id(*vocab_, t);
            if (Bit(mask, id)) {
              pick = id;
              break;
            }
          }
          if (pick < 0) pick = Pick(r, mask);
        }
        EXPECT_TRUE(m.AcceptToken(pick).ok());
        if (pick == kEos) {
          ended = true;
        } else {
          out += *vocab_->token_bytes(pick);
        }
      }
      EXPECT_TRUE(ended) << "walk did not finish: " << out;
      EXPECT_TRUE(m.IsTerminated());
      if (::testing::Test::HasFailure()) return removed;
    }
    return removed;
  }

  // After `prefix`, the token `t` is allowed by the grammar but masked out
  // and refused, the matcher unchanged.
  void ExpectRefused(const std::string& schema, const std::string& prefix, std::string_view t) {
    SCOPED_TRACE(prefix + " + " + std::string(t));
    auto compiled = Compile(schema);
    ASSERT_NE(compiled, nullptr);
    const auto& gc = static_cast<const GrammarConstraint&>(*compiled);
    TokenMatcher m(compiled);
    AcceptText(m, prefix);
    const int32_t id = Id(*vocab_, t);
    ASSERT_TRUE(Bit(NaiveMask(gc, prefix, m.IsComplete()), id)) << "the grammar itself refuses it";
    const std::vector<uint32_t> mask = Mask(m);
    EXPECT_FALSE(Bit(mask, id));
    const absl::Status s = m.AcceptToken(id);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    int64_t chars = 0;
    for (char c : prefix) chars += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
    EXPECT_EQ(m.num_accepted(), chars);
    EXPECT_EQ(Mask(m), mask);
  }

  void ExpectAllowed(const std::string& schema, const std::string& prefix, std::string_view t) {
    SCOPED_TRACE(prefix + " + " + std::string(t));
    auto compiled = Compile(schema);
    ASSERT_NE(compiled, nullptr);
    TokenMatcher m(compiled);
    AcceptText(m, prefix);
    EXPECT_TRUE(Bit(Mask(m), Id(*vocab_, t)));
    EXPECT_TRUE(m.AcceptToken(Id(*vocab_, t)).ok());
  }

  std::shared_ptr<const TokenVocabulary> vocab_ = Vocab();
};

constexpr const char* kFreeSchemas[] = {
    "{}",
    R"({"type":"object"})",  // response_format json_object
    R"({"type":"object","properties":{"a":{"type":"integer"}},"additionalProperties":true})",
    R"({"type":"object","properties":{"a":{"type":"string"},"o":{"type":"object"}},"additionalProperties":{"type":"integer"}})",
    R"({"type":"array","items":{"type":"object","additionalProperties":{"type":"array","items":{"type":"object"}}}})",
};

TEST_F(DuplicateKeysTest, RandomWalksMaskExactlyTheRepeats) {
  uint32_t seed = 1;
  for (const char* schema : kFreeSchemas) {
    const int removed = Walks(schema, seed++, 60);
    if (HasFailure()) return;
    EXPECT_GT(removed, 0) << schema << ": the walks never met a repeat (the test lost its teeth)";
  }
}

TEST_F(DuplicateKeysTest, DeclaredPropertiesOnlyLoseNothing) {
  // The grammar already writes each declared key once: the filter is a no-op.
  EXPECT_EQ(Walks(R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"object","properties":{"a":{"type":"integer"},"é":{"type":"string"}},"required":["a"],"additionalProperties":false}},"required":["a"],"additionalProperties":false})",
                  7, 30),
            0);
}

TEST_F(DuplicateKeysTest, KeysEqualAfterUnescaping) {
  const std::string any = "{}";
  ExpectRefused(any, R"({"a":1,)", R"("a")");
  ExpectRefused(any, R"({"a":1,"\u0061)", "\"");
  ExpectRefused(any, R"({"\u0061":1,"a)", "\"");
  ExpectAllowed(any, R"({"\u0061":1,"a)", "b");
  ExpectAllowed(any, R"({"\u0061":1,"ab)", "\"");
  ExpectRefused(any, R"({"é":1,"\u00e9)", "\"");
  ExpectRefused(any, R"({"é":1,"\u00E9)", "\"");
  ExpectRefused(any, R"({"\u00e9":1,")", R"(é":)");
  ExpectAllowed(any, R"({"😀":1,")", "😀");
  ExpectRefused(any, R"({"😀":1,"😀)", "\"");
  ExpectRefused(any, R"({"\n":1,"\u000a)", "\"");
  ExpectRefused(any, R"({"\/":1,"/)", "\"");
  ExpectRefused(any, R"({"\\":1,"\u005c)", "\"");
  ExpectAllowed(any, R"({"a\\":1,"a)", "\"");
  ExpectAllowed(any, R"({"a":"\"a\"",)", R"("b")");
  ExpectRefused(any, R"({"a":"\"a\"",)", R"("a")");
}

TEST_F(DuplicateKeysTest, ScopesAndRepeatsWithinOneToken) {
  const std::string any = "{}";
  ExpectRefused(any, "{", R"("a":1,"a":)");
  ExpectAllowed(any, "{", R"("a":1,"b":)");
  ExpectRefused(any, "", R"({"a":1,"a":)");
  ExpectRefused(any, R"({"a":{"b":1},"a)", "\"");  // the outer object has a
  ExpectAllowed(any, R"({"a":{"b":1,"a)", "\"");   // the inner one does not
  ExpectAllowed(any, R"({"a":{"a":1},"b)", "\"");
  ExpectAllowed(any, R"([{"a":1},{"a)", "\"");  // sibling objects
  ExpectRefused(any, R"([{"a":1},{"a":1,"a)", "\"");
  ExpectRefused(any, R"({"b":{"a":1)", R"(},"b":)");  // closes, then repeats b outside
  ExpectAllowed(any, R"({"a":{"b":1)", R"(},"b":)");
  ExpectAllowed(any, R"({"b":[{"a":1)", R"(},{"b":)");  // a fresh object in an array
  ExpectAllowed(any, R"([{"b":1},{"a":1)", R"(},{"b":)");
  ExpectRefused(any, R"({"a":"d)", R"(","a":)");  // from inside a value string
  ExpectAllowed(any, R"({"a":"d)", R"(","b":)");
}

TEST_F(DuplicateKeysTest, RollbackRestoresKeys) {
  auto compiled = Compile("{}");
  ASSERT_NE(compiled, nullptr);
  TokenMatcher m(compiled);
  AcceptText(m, R"({"a":{"b":1},)");
  const std::vector<uint32_t> before = Mask(m);
  const int32_t a = Id(*vocab_, R"("a")"), b = Id(*vocab_, R"("b")");
  EXPECT_FALSE(Bit(before, a));
  EXPECT_TRUE(Bit(before, b));
  AcceptText(m, R"("b":{"a":1},"c":[{"d)");
  ASSERT_TRUE(m.Rollback(20).ok());
  EXPECT_EQ(Mask(m), before);
  // Back inside the inner object: b is taken there, a is not.
  ASSERT_TRUE(m.Rollback(2).ok());
  ASSERT_TRUE(m.AcceptToken(Id(*vocab_, ",")).ok());
  EXPECT_TRUE(Bit(Mask(m), a));
  EXPECT_FALSE(Bit(Mask(m), b));
  // Everything, then EOS and back.
  ASSERT_TRUE(m.Rollback(static_cast<int>(m.num_accepted())).ok());
  AcceptText(m, R"({"a":1})");
  ASSERT_TRUE(m.AcceptToken(kEos).ok());
  ASSERT_TRUE(m.Rollback(2).ok());
  AcceptText(m, ",");
  EXPECT_FALSE(Bit(Mask(m), a));
  EXPECT_TRUE(Bit(Mask(m), b));
}

TEST(DuplicateKeysQwen3Test, MaskIsNaiveMinusRepeats) {
  RealTokenizer qwen3;
  if (!LoadQwen3Tokenizer(&qwen3)) return;  // skipped or failed
  const auto& tok = qwen3.tok;
  const int32_t eos = qwen3.eos;
  const auto& vocab = qwen3.vocab;
  auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = R"({"type":"object"})"}, vocab);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  const auto& gc = static_cast<const GrammarConstraint&>(**compiled);
  // Only tokens with a '"' can complete a key: the oracle scans those.
  std::vector<int32_t> quoted;
  for (int32_t id = 0; id < vocab->size(); ++id) {
    auto b = vocab->token_bytes(id);
    if (b && b->find('"') != std::string_view::npos) quoted.push_back(id);
  }
  const std::string text =
      R"({"said": "I'm sorry, Lily.", "said_again": 1, "sa": {"said": 2, "x": [{"said": 3}]}, "é": 4, "é2": 5})";
  std::vector<int32_t> ids = tok->Encode(text);
  ids.push_back(eos);
  TokenMatcher m(*compiled);
  std::vector<uint32_t> mask(m.mask_words());
  NodeArena arena(false), scratch(false);
  std::vector<Stack> state, next;
  gc.pda().Initial(arena, state);
  std::string out;
  int removed = 0;
  for (int32_t id : ids) {
    m.FillNextTokenMask(mask);
    std::vector<uint32_t> expected(mask.size(), 0);
    TrieWalkScratch walk;
    MarkAcceptedTokens(gc.pda(), gc.bytes().trie(), state, scratch, walk, expected);
    if (m.IsComplete()) expected[eos >> 5] |= 1u << (eos & 31);
    for (int32_t q : quoted) {
      if (Bit(expected, q) && PrefixKeyScan(out + std::string(*vocab->token_bytes(q))).repeat()) {
        expected[q >> 5] &= ~(1u << (q & 31));
        ++removed;
      }
    }
    ASSERT_EQ(mask, expected) << "after '" << out << "'";
    ASSERT_TRUE(m.AcceptToken(id).ok()) << id;
    if (id == eos) break;
    const std::string_view bytes = *vocab->token_bytes(id);
    out += bytes;
    for (char c : bytes) {
      gc.pda().Advance(state, static_cast<uint8_t>(c), arena, next);
      state.swap(next);
    }
  }
  EXPECT_TRUE(m.IsTerminated());
  EXPECT_GT(removed, 0);
}

TEST(DuplicateKeysStoriesTest, SaidTwice) {
  RealTokenizer stories;
  if (!LoadLlama2cTokenizer("models/stories260K/tok512.bin", 512, &stories)) return;  // skipped or failed
  const int32_t eos = stories.eos;  // 2
  const auto& vocab = stories.vocab;
  auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = "{}"}, vocab);
  ASSERT_TRUE(compiled.ok()) << compiled.status();
  // Greedy longest-match ids, one string after another.
  auto accept = [&](TokenMatcher& m, std::string_view text) -> absl::Status {
    for (size_t at = 0; at < text.size();) {
      int32_t best = -1;
      size_t len = 0;
      for (int32_t id = 0; id < 512; ++id) {
        auto b = vocab->token_bytes(id);
        if (b && b->size() > len && text.substr(at).starts_with(*b)) best = id, len = b->size();
      }
      if (best < 0) return absl::NotFoundError("no token");
      if (absl::Status s = m.AcceptToken(best); !s.ok()) return s;
      at += len;
    }
    return absl::OkStatus();
  };
  const std::string prefix = R"({" said, ": "I'm sorry, Lily.", ")";
  TokenMatcher m(*compiled);
  ASSERT_TRUE(accept(m, prefix).ok());
  std::vector<uint32_t> mask(m.mask_words());
  m.FillNextTokenMask(mask);
  int allowed = 0;
  for (int32_t id = 0; id < 512; ++id) {
    if (!Bit(mask, id) || id == eos) continue;
    ++allowed;
    EXPECT_FALSE(PrefixKeyScan(prefix + std::string(*vocab->token_bytes(id))).repeat()) << id;
  }
  EXPECT_GT(allowed, 100);
  const absl::Status s = accept(m, R"( said, ")");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("repeats the key \" said, \""), std::string_view::npos) << s;
  EXPECT_TRUE(accept(m, R"(said, ": "I'm sorry, Lily."})").ok());
  EXPECT_TRUE(m.IsComplete());
}

TEST(JsonKeyTrackerTest, AppendUndoAndMinimumQuotes) {
  JsonKeyTracker t;
  EXPECT_EQ(t.MinQuotesForRepeat(), 4);  // no key yet, between values
  t.Append(R"({"a":1,")");
  EXPECT_EQ(t.MinQuotesForRepeat(), 1);
  std::string key;
  EXPECT_TRUE(t.WouldRepeatKey(R"(\u0061":)", &key));
  EXPECT_EQ(key, "a");
  EXPECT_FALSE(t.WouldRepeatKey(R"(b":)"));
  EXPECT_FALSE(t.WouldRepeatKey(R"(\"a":)"));  // the key is "a (an escaped quote)
  t.Append(R"(b":"x)");
  EXPECT_EQ(t.MinQuotesForRepeat(), 3);
  EXPECT_TRUE(t.WouldRepeatKey(R"(","b")"));
  t.Undo(1);
  EXPECT_FALSE(t.WouldRepeatKey(R"(b")"));
  EXPECT_EQ(t.num_steps(), 1u);
  t.Undo(1);
  EXPECT_EQ(t.num_steps(), 0u);
  EXPECT_FALSE(t.WouldRepeatKey(R"({"a":1,"b")"));
  EXPECT_TRUE(t.WouldRepeatKey(R"({"a":1,"a")"));
  // Surrogate pairs (the JSON Schema grammar writes no surrogate escapes,
  // but the lexer decodes them): the pair, the raw character and mixed case
  // are one key; lone halves are keys of their own.
  t.Append(R"({"\uD83D\uDE00":1,"\ud83d":2,"\ude00":3,)");
  EXPECT_TRUE(t.WouldRepeatKey(R"("😀")"));
  EXPECT_TRUE(t.WouldRepeatKey(R"("\ud83d\ude00")"));
  EXPECT_TRUE(t.WouldRepeatKey(R"("\uD83D")"));
  EXPECT_TRUE(t.WouldRepeatKey(R"("\uDE00")"));
  EXPECT_FALSE(t.WouldRepeatKey(R"("\ude00\ud83d")"));
  EXPECT_FALSE(t.WouldRepeatKey(R"("\ud83da")"));
  t.Append(R"("\ud83da":4,"\u00e9\n\/":5,)");
  EXPECT_TRUE(t.WouldRepeatKey(R"("\ud83d\u0061")"));
  EXPECT_TRUE(t.WouldRepeatKey(R"("é\u000a/")"));
  EXPECT_FALSE(t.WouldRepeatKey(R"("é\u000a\\")"));
}

TEST(QuoteTokensTest, GroupsByQuoteCount) {
  std::vector<std::optional<std::string>> bytes = {std::nullopt, "a", "\"", R"("a")", R"(""")", "x\"", std::nullopt};
  const int32_t eos[] = {0};
  auto v = TokenVocabulary::FromBytes(std::move(bytes), eos);
  ASSERT_TRUE(v.ok());
  const QuoteTokens q = QuoteTokens::Build(**v);
  EXPECT_EQ(q.size(), 4u);
  auto ids = [](std::span<const int32_t> s) { return std::set<int32_t>(s.begin(), s.end()); };
  EXPECT_EQ(ids(q.WithAtLeast(1)), (std::set<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(ids(q.WithAtLeast(2)), (std::set<int32_t>{3, 4}));
  EXPECT_EQ(ids(q.WithAtLeast(3)), (std::set<int32_t>{4}));
  EXPECT_TRUE(q.WithAtLeast(4).empty());
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
