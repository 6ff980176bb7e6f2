// coordinator/constrained/json_key_tracker.h — unique object keys for JSON
// Schema constraints: a streaming JSON lexer over a sequence's accepted
// output that keeps, for every open object, the set of its keys (decoded:
// `"a"` and `"\u0061"` are one key), and answers whether a token appended now
// would complete a key its object already has. TokenMatcher uses it to drop
// such tokens from the mask and to refuse them in AcceptToken. Internal.
//
//   JsonKeyTracker keys;
//   keys.Append(R"({"a":1,")");                       // one step per token
//   keys.WouldRepeatKey("a\"");                       // true
//   keys.Undo(1);                                      // back to the start
//
// The lexer trusts its input to be a prefix of JSON (the grammar guarantees
// it): it reacts only to `{ [ } ] , "` outside strings and to `"` and `\`
// inside them; whitespace, numbers and literals pass through. Keys are
// compared as UTF-8 after unescaping (\uXXXX, surrogate pairs combined; a
// lone surrogate becomes its 3-byte WTF-8 form, distinct from any valid
// UTF-8 and from every other code unit).
#ifndef EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_KEY_TRACKER_H_
#define EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_KEY_TRACKER_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "coordinator/constrained/constraint.h"

namespace exl3serve::coordinator::constrained {

// The ids of a vocabulary's tokens that contain '"' (EOS ids excluded),
// grouped by how many: only they can complete a key, and completing one from
// inside a key string takes >= 1 quote, from between values >= 2, from inside
// a value string >= 3. Built once per compiled JSON Schema constraint (one
// pass over the token bytes, ~1 ms at 152k tokens).
class QuoteTokens {
 public:
  QuoteTokens() = default;
  static QuoteTokens Build(const TokenVocabulary& vocab);
  // The tokens with at least `quotes` '"' bytes (empty past the maximum).
  std::span<const int32_t> WithAtLeast(int quotes) const;
  size_t size() const { return ids_.size(); }

 private:
  std::vector<int32_t> ids_;        // by quote count, most first
  std::vector<uint32_t> at_least_;  // [k]: how many ids have >= k quotes
};

// Thread safety: thread-compatible (const methods use mutable scratch: one
// caller at a time, like TokenMatcher). Ownership: owns its state.
class JsonKeyTracker {
 public:
  JsonKeyTracker() = default;

  // Feeds one step's bytes (a token; empty for EOS). Requires: the output so
  // far plus `bytes` is a prefix of a JSON text and `WouldRepeatKey(bytes)`
  // is false (a repeated key is recorded once; the duplicate is not caught
  // later). Cost: O(bytes) plus one set insert per completed key.
  void Append(std::string_view bytes);
  // Reverts the last `steps` Append calls exactly (keys, open containers,
  // the partial key and escape state). Requires: steps <= num_steps().
  void Undo(size_t steps);
  size_t num_steps() const { return steps_.size(); }

  // Whether `bytes`, appended now, would complete a key that its object
  // already has, counting the keys `bytes` itself completes before it (so
  // `"a":1,"a"` repeats within one token). Exact for any JSON-prefix input;
  // does not change the tracker. When true and `key` is not null, stores the
  // repeated key (decoded). Cost: O(bytes) plus a set lookup per key.
  bool WouldRepeatKey(std::string_view bytes, std::string* key = nullptr) const;

  // The fewest '"' bytes a token needs to complete a repeated key now:
  // from inside a key string 1, inside a value string 3, elsewhere 2; plus
  // 2 when no open object has a key yet (the token must then complete two
  // keys of one object itself). Tokens with fewer quotes need no check.
  int MinQuotesForRepeat() const;

 private:
  // The lexer's scalar state (the partial key is beside it).
  struct Lex {
    bool in_string = false;
    bool is_key = false;      // the open string is an object key
    bool expect_key = false;  // a '"' now opens a key (after '{' or ',' in an object)
    uint8_t esc = 0;          // 0 none, 1 after '\', 2..5: hex digits of \u read + 2
    uint16_t unit = 0;        // the \u code unit being read
    uint16_t high = 0;        // a high surrogate waiting for its low half (0: none)
  };
  struct Frame {
    bool object = false;
    absl::flat_hash_set<std::string> keys;
  };
  // One mutation of the frame stack, undone in reverse order.
  struct Change {
    enum Kind : uint8_t { kPush, kPop, kKey } kind;
    std::string key;  // kKey: the key added to the top frame
  };
  struct Step {
    Lex lex;
    std::string key;       // the partial key before the step (in a key string)
    size_t changes_begin;  // into changes_
  };

  // The byte lexer, shared by Append (ApplyOps: mutate, log) and
  // WouldRepeatKey (SimOps: an overlay over the real stack). False when
  // ops.Key refuses a key.
  struct ApplyOps;
  struct SimOps;
  template <class Ops>
  static bool Feed(Lex& lex, std::string& key, uint8_t byte, Ops& ops);

  std::vector<Frame> stack_;
  Lex lex_;
  std::string key_;      // decoded bytes of the key being read
  size_t num_keys_ = 0;  // keys over all open objects
  std::vector<Change> changes_;
  std::vector<Frame> popped_;  // the frames kPop closed, in order
  std::vector<Step> steps_;
  // Scratch of WouldRepeatKey.
  mutable std::string sim_key_;
  mutable std::vector<bool> sim_local_;                            // containers the token opened: object?
  mutable std::vector<std::pair<size_t, std::string>> sim_added_;  // (depth, key) the token completed
};

}  // namespace exl3serve::coordinator::constrained

#endif  // EXL3SERVE_COORDINATOR_CONSTRAINED_JSON_KEY_TRACKER_H_
