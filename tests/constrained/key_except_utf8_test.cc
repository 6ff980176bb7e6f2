// Extra object keys (additionalProperties true or a schema) next to declared
// names with non-ASCII characters (2-, 3- and 4-byte UTF-8, names that are
// prefixes of each other, one-character names, escapes, the edge code
// points of each UTF-8 length), against the test's own UTF-8 decoder:
//  - exhaustive: from every key prefix along a declared name's canonical
//    bytes, and through one more character (or escape) past it, every byte
//    the automaton allows keeps the key a valid prefix of JSON string content
//    (UTF-8 prefix, no raw control byte, escapes well formed); in particular
//    no divergence and no closing '"' inside a multi-byte character;
//  - random walks (byte-level vocabulary plus multi-byte pieces, masks from
//    TokenMatcher): every output where EOS is allowed is valid UTF-8, parses
//    with nlohmann::json, and no extra key (told apart by its value) equals a
//    declared name.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "coordinator/constrained/compiled_constraint.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/constrained/pda.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/constrained/constraint_test_util.h"

namespace exl3serve::coordinator::constrained {
namespace {

using json = nlohmann::ordered_json;
using test_util::Bit;

// ---- the test's own UTF-8 / JSON string checks (not utf8_ranges) -----------

// Bytes [lo, hi] the k-th continuation byte after `lead` may take (k = 1..);
// {1, 0}: `lead` starts no sequence.
std::pair<int, int> ContinuationRange(uint8_t lead, int k) {
  if (k > 1) return {0x80, 0xBF};
  if (lead == 0xE0) return {0xA0, 0xBF};
  if (lead == 0xED) return {0x80, 0x9F};
  if (lead == 0xF0) return {0x90, 0xBF};
  if (lead == 0xF4) return {0x80, 0x8F};
  return {0x80, 0xBF};
}
int SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

// 1: `s` is valid UTF-8; 0: a valid prefix cut inside a character; -1: invalid.
int Utf8Status(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const uint8_t lead = static_cast<uint8_t>(s[i]);
    const int len = SequenceLength(lead);
    if (len == 0) return -1;
    for (int k = 1; k < len; ++k) {
      if (i + k >= s.size()) return 0;
      const auto [lo, hi] = ContinuationRange(lead, k);
      const int b = static_cast<uint8_t>(s[i + k]);
      if (b < lo || b > hi) return -1;
    }
    i += len;
  }
  return 1;
}

// The content of a JSON string after its opening '"' (the closing '"' not
// included): kComplete (ends between characters), kInside (a valid prefix
// that ends inside a character or escape), kInvalid.
enum class Content { kComplete, kInside, kInvalid };
Content ContentStatus(std::string_view s) {
  std::string raw;  // raw bytes of the current run
  for (size_t i = 0; i < s.size();) {
    const uint8_t c = static_cast<uint8_t>(s[i]);
    if (c == '\\') {
      if (Utf8Status(raw) != 1) return Content::kInvalid;
      raw.clear();
      if (i + 1 == s.size()) return Content::kInside;
      const char e = s[i + 1];
      if (std::string_view("\"\\/bfnrt").find(e) != std::string_view::npos) {
        i += 2;
        continue;
      }
      if (e != 'u') return Content::kInvalid;
      for (size_t k = 0; k < 4; ++k) {
        if (i + 2 + k == s.size()) return Content::kInside;
        if (!std::isxdigit(static_cast<unsigned char>(s[i + 2 + k]))) return Content::kInvalid;
      }
      i += 6;
      continue;
    }
    if (c < 0x20 || c == '"') return Content::kInvalid;
    raw += static_cast<char>(c);
    ++i;
  }
  const int u = Utf8Status(raw);
  return u == 1 ? Content::kComplete : u == 0 ? Content::kInside : Content::kInvalid;
}

// Canonical key bytes (as the compiler writes names).
std::string Canonical(const std::string& name) {
  const std::string d = json(name).dump();
  return d.substr(1, d.size() - 2);
}

// ---- schemas ----------------------------------------------------------------

const std::vector<std::vector<std::string>>& NameSets() {
  static const auto* k = new std::vector<std::vector<std::string>>{
      {"Z\xC3\xBCrich", "Z\xC3\xBC", "na\xC3\xAFve"},                              // 2-byte, prefixes
      {"\xE2\x82\xAC", "\xE2\x82\xAC" "uro", "a\xE2\x82\xAC" "b"},                  // 3-byte, 1-char name
      {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80\xF0\x9F\x98\x80", "x\xF0\x9F\x98\x80"},  // 4-byte
      {"\xC3\xBC", "\xC3\xA4", "\xC3\xA9", "\"q", "a\nb", "\\", "\x01"},             // 1-char names, escapes
      {"\xE6\x97\xA5\xE6\x9C\xAC", "\xE6\x97\xA5", "\xE6\x9C\xAC\xE6\x97\xA5"},       // CJK prefixes
      {"\xC2\x80", "\xDF\xBF", "\xE0\xA0\x80", "\xEF\xBF\xBF", "\xF0\x90\x80\x80", "\xF4\x8F\xBF\xBF",
       "\xED\x9F\xBF", "\xEE\x80\x80"},  // edge code points of each length
  };
  return *k;
}

constexpr const char* kDeclaredValue = "~declared~";

// Declared names with a const value only they write; extra keys' values
// from `extra`. Some names required.
json Schema(const std::vector<std::string>& names, const json& extra, bool require_first) {
  json props = json::object();
  for (const std::string& n : names) props[n] = {{"const", kDeclaredValue}};
  json s = {{"type", "object"}, {"properties", props}, {"additionalProperties", extra}};
  if (require_first) s["required"] = json::array({names[0]});
  return s;
}

std::vector<json> Extras() { return {json(true), json{{"type", "integer"}}, json{{"type", "string"}}}; }

std::shared_ptr<const TokenVocabulary> Vocab() {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};  // id 0: EOS
  for (int b = 0; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));  // id b + 1
  std::set<std::string> pieces;
  for (const auto& names : NameSets()) {
    for (const std::string& n : names) {
      const std::string c = Canonical(n);
      pieces.insert("\"" + c + "\":");
      pieces.insert(c);
      for (size_t k = 1; k < c.size(); ++k) pieces.insert(c.substr(0, k));  // splits mid-character too
    }
  }
  for (const char* t : {"\":", "\": ", ", \"", "\\u00e9", "\\\"", "\xC3", "\xBC\"", "\x82\xAC\"", "\x80\"", "1}"}) {
    pieces.insert(t);
  }
  for (const std::string& p : pieces) {
    if (p.size() > 1) bytes.push_back(p);
  }
  const int32_t eos[] = {0};
  return *TokenVocabulary::FromBytes(std::move(bytes), eos);
}

// ---- exhaustive key prefixes ------------------------------------------------

class KeyPrefixCheck {
 public:
  KeyPrefixCheck(const Pda& pda, const std::vector<std::string>& names) : pda_(pda) {
    for (const std::string& n : names) canon_.push_back(Canonical(n));
    for (const std::string& c : canon_) {
      for (char ch : c) reps_.insert(static_cast<uint8_t>(ch));
    }
    for (uint8_t b : std::string_view("\x80\x8F\x90\x9F\xA0\xBF" "au01fn\"\\")) reps_.insert(b);
  }

  // Explores keys from the state after "{\"" (`state`). Returns the number
  // of (prefix, byte) pairs checked.
  int64_t Run(const std::vector<Stack>& state) {
    Explore("", state);
    return checked_;
  }

 private:
  bool NamePrefix(std::string_view key) const {
    for (const std::string& c : canon_) {
      if (c.compare(0, key.size(), key) == 0 && key.size() <= c.size()) return true;
    }
    return false;
  }

  // `key`: the key's bytes so far (a valid content prefix); `base`: its
  // longest prefix at a character boundary that a name starts with.
  void Explore(const std::string& key, const std::vector<Stack>& state) {
    std::vector<Stack> next;
    for (int b = 0; b < 256; ++b) {
      if (::testing::Test::HasFailure()) return;
      const size_t mark = arena_.mark();
      pda_.Advance(state, static_cast<uint8_t>(b), arena_, next);
      if (next.empty()) continue;
      ++checked_;
      const std::string ext = key + static_cast<char>(b);
      const Content st = ContentStatus(ext);
      if (b == '"' && st == Content::kInvalid) {  // not an escape's: the closing quote
        EXPECT_EQ(ContentStatus(key), Content::kComplete) << "'\"' allowed inside a character: key bytes '" << key << "'";
        continue;
      }
      ASSERT_NE(st, Content::kInvalid) << "byte 0x" << std::hex << b << " allowed after key bytes '" << key
                                       << "': not a prefix of valid JSON string content (UTF-8)";
      // Recurse along the names, and through one character past them.
      const bool on_name = NamePrefix(ext);
      const bool inside = st == Content::kInside && (NamePrefix(key) || inside_past_name_);
      if (!on_name && !inside) continue;
      if (!on_name && !reps_.contains(static_cast<uint8_t>(b))) continue;
      const bool saved = inside_past_name_;
      inside_past_name_ = !on_name;
      Explore(ext, next);
      inside_past_name_ = saved;
      arena_.Rewind(mark);
    }
  }

  const Pda& pda_;
  std::vector<std::string> canon_;
  std::set<uint8_t> reps_;
  NodeArena arena_{false};
  bool inside_past_name_ = false;
  int64_t checked_ = 0;
};

TEST(KeyExceptUtf8Test, EveryAllowedKeyByteKeepsValidUtf8) {
  int64_t checked = 0;
  for (const auto& names : NameSets()) {
    for (const json& extra : Extras()) {
      const json schema = Schema(names, extra, false);
      SCOPED_TRACE(schema.dump());
      absl::StatusOr<FlatGrammar> g =
          BuildConstraintGrammar({.kind = ConstraintKind::kJsonSchema, .text = schema.dump()});
      ASSERT_TRUE(g.ok()) << g.status();
      const Pda pda(*g);
      NodeArena arena(false);
      std::vector<Stack> state, next;
      ASSERT_TRUE(pda.Initial(arena, state));
      for (char c : std::string("{\"")) {
        pda.Advance(state, static_cast<uint8_t>(c), arena, next);
        state.swap(next);
      }
      ASSERT_FALSE(state.empty());
      KeyPrefixCheck check(pda, names);
      checked += check.Run(state);
      if (::testing::Test::HasFailure()) return;
    }
  }
  std::printf("%lld (key prefix, byte) pairs checked\n", static_cast<long long>(checked));
  EXPECT_GT(checked, 10000);
}

// Keys per object, in order, duplicates kept.
struct KeysSax : nlohmann::json_sax<json> {
  std::vector<std::vector<std::string>> open, done;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return open.emplace_back(), true; }
  bool key(string_t& k) override { return open.back().push_back(k), true; }
  bool end_object() override {
    done.push_back(open.back());
    open.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

TEST(KeyExceptUtf8Test, RandomWalksWriteValidUtf8AndNoDeclaredNameAsExtraKey) {
  const auto vocab = Vocab();
  std::mt19937 rng(7);
  auto rand = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  int outputs = 0, extra_keys = 0, non_ascii_extra = 0;
  for (const auto& names : NameSets()) {
    for (const json& extra : Extras()) {
      for (bool require_first : {false, true}) {
        const json schema = Schema(names, extra, require_first);
        SCOPED_TRACE(schema.dump());
        auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema.dump()}, vocab);
        ASSERT_TRUE(compiled.ok()) << compiled.status();
        const std::set<std::string> declared(names.begin(), names.end());
        for (int walk = 0; walk < 60; ++walk) {
          TokenMatcher m(*compiled);
          std::vector<uint32_t> mask(m.mask_words());
          std::string out;
          const int random_steps = 5 + rand(40);
          bool ended = false;
          for (int step = 0; step < 600 && !ended; ++step) {
            m.FillNextTokenMask(mask);
            std::vector<int32_t> allowed;
            for (int32_t id = 0; id < vocab->size(); ++id) {
              if (Bit(mask, id)) allowed.push_back(id);
            }
            ASSERT_FALSE(allowed.empty()) << "dead state after '" << out << "'";
            int32_t pick = -1;
            if (step < random_steps) {
              pick = allowed[rand(static_cast<int>(allowed.size()))];
              if (pick == 0 && allowed.size() > 1) pick = allowed[1 + rand(static_cast<int>(allowed.size()) - 1)];
            } else {
              for (char c : std::string("\x01\"}1:")) {
                const int32_t id = c == '\x01' ? 0 : static_cast<uint8_t>(c) + 1;
                if (Bit(mask, id)) {
                  pick = id;
                  break;
                }
              }
              if (pick < 0) pick = allowed[rand(static_cast<int>(allowed.size()))];
            }
            ASSERT_TRUE(m.AcceptToken(pick).ok());
            if (pick == 0) {
              ended = true;
            } else {
              out += *vocab->token_bytes(pick);
            }
          }
          ASSERT_TRUE(ended) << "walk did not finish: " << out;
          ++outputs;
          ASSERT_EQ(Utf8Status(out), 1) << "not valid UTF-8: " << out;
          KeysSax sax;
          ASSERT_TRUE(json::sax_parse(out, &sax)) << "not JSON: " << out;
          const json doc = json::parse(out);
          ASSERT_TRUE(doc.is_object()) << out;
          // An extra key's value is never the declared const (integers,
          // strings other than it, or any value where a const string is
          // improbable).
          for (const auto& [k, v] : doc.items()) {
            if (v == kDeclaredValue) {
              EXPECT_TRUE(declared.contains(k)) << out;
              continue;
            }
            ++extra_keys;
            non_ascii_extra += std::any_of(k.begin(), k.end(), [](char ch) { return (ch & 0x80) != 0; });
            EXPECT_FALSE(declared.contains(k)) << "extra key equals a declared name: " << out;
          }
          ASSERT_FALSE(sax.done.empty());
          EXPECT_EQ(sax.done.back().size(), doc.size()) << "repeated key: " << out;  // the outermost closes last
        }
      }
    }
  }
  std::printf("%d outputs, %d extra keys (%d non-ASCII)\n", outputs, extra_keys, non_ascii_extra);
  EXPECT_GT(outputs, 1000);
  EXPECT_GT(extra_keys, 300);
  EXPECT_GT(non_ascii_extra, 100);
}

// A vocabulary that writes ASCII only: extra keys still compile (their
// non-ASCII characters derive nothing) and walks end in ASCII JSON.
TEST(KeyExceptUtf8Test, AsciiOnlyVocabulary) {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};
  for (int c = 0x20; c < 0x7F; ++c) bytes.push_back(std::string(1, static_cast<char>(c)));
  const int32_t eos[] = {0};
  const auto vocab = *TokenVocabulary::FromBytes(std::move(bytes), eos);
  std::mt19937 rng(3);
  for (const auto& names : NameSets()) {
    const json schema = Schema(names, json(true), false);
    SCOPED_TRACE(schema.dump());
    auto compiled = CompileConstraint({.kind = ConstraintKind::kJsonSchema, .text = schema.dump()}, vocab);
    ASSERT_TRUE(compiled.ok()) << compiled.status();
    for (int walk = 0; walk < 20; ++walk) {
      TokenMatcher m(*compiled);
      std::vector<uint32_t> mask(m.mask_words());
      std::string out;
      bool ended = false;
      for (int step = 0; step < 400 && !ended; ++step) {
        m.FillNextTokenMask(mask);
        std::vector<int32_t> allowed;
        for (int32_t id = 0; id < vocab->size(); ++id) {
          if (Bit(mask, id)) allowed.push_back(id);
        }
        ASSERT_FALSE(allowed.empty()) << "dead state after '" << out << "'";
        int32_t pick = allowed[std::uniform_int_distribution<int>(0, static_cast<int>(allowed.size()) - 1)(rng)];
        if (step > 20) {
          for (char c : std::string("\x01\"}1:")) {
            const int32_t id = c == '\x01' ? 0 : c - 0x20 + 1;
            if (Bit(mask, id)) {
              pick = id;
              break;
            }
          }
        }
        ASSERT_TRUE(m.AcceptToken(pick).ok());
        if (pick == 0) {
          ended = true;
        } else {
          out += *vocab->token_bytes(pick);
        }
      }
      ASSERT_TRUE(ended) << out;
      EXPECT_TRUE(json::accept(out)) << out;
    }
  }
}

}  // namespace
}  // namespace exl3serve::coordinator::constrained
