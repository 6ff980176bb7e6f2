// coordinator/constrained/json_key_tracker.cc — JsonKeyTracker and
// QuoteTokens (json_key_tracker.h).
#include "coordinator/constrained/json_key_tracker.h"

#include <algorithm>

namespace exl3serve::coordinator::constrained {

QuoteTokens QuoteTokens::Build(const TokenVocabulary& vocab) {
  const std::span<const int32_t> eos = vocab.eos_ids();
  std::vector<std::pair<uint32_t, int32_t>> counted;  // (quotes, id)
  for (int32_t id = 0; id < vocab.size(); ++id) {
    const std::optional<std::string_view> bytes = vocab.token_bytes(id);
    if (!bytes.has_value() || bytes->find('"') == std::string_view::npos) continue;
    if (std::find(eos.begin(), eos.end(), id) != eos.end()) continue;
    counted.emplace_back(static_cast<uint32_t>(std::count(bytes->begin(), bytes->end(), '"')), id);
  }
  std::stable_sort(counted.begin(), counted.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  QuoteTokens q;
  q.ids_.reserve(counted.size());
  for (const auto& [n, id] : counted) q.ids_.push_back(id);
  const uint32_t max_quotes = counted.empty() ? 0 : counted.front().first;
  q.at_least_.assign(max_quotes + 1, 0);
  for (const auto& [n, id] : counted) {
    for (uint32_t k = 0; k <= n; ++k) ++q.at_least_[k];
  }
  return q;
}

std::span<const int32_t> QuoteTokens::WithAtLeast(int quotes) const {
  const size_t k = static_cast<size_t>(std::max(quotes, 0));
  if (k >= at_least_.size()) return {};
  return std::span<const int32_t>(ids_.data(), at_least_[k]);
}

namespace {

void AppendUtf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {  // surrogates too (WTF-8)
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

uint16_t HexValue(uint8_t b) {
  if (b >= '0' && b <= '9') return b - '0';
  if (b >= 'a' && b <= 'f') return b - 'a' + 10;
  if (b >= 'A' && b <= 'F') return b - 'A' + 10;
  return 0;  // not JSON; the grammar never gets here
}

// The byte a two-character escape stands for (\" \\ \/ and the controls).
char Unescaped(uint8_t b) {
  switch (b) {
    case 'b': return '\b';
    case 'f': return '\f';
    case 'n': return '\n';
    case 'r': return '\r';
    case 't': return '\t';
    default: return static_cast<char>(b);
  }
}

}  // namespace

// Append: the real stack, every mutation logged for Undo.
struct JsonKeyTracker::ApplyOps {
  JsonKeyTracker& t;

  bool TopIsObject() const { return !t.stack_.empty() && t.stack_.back().object; }
  void Push(bool object) {
    t.stack_.push_back(Frame{object, {}});
    t.changes_.push_back(Change{Change::kPush, {}});
  }
  void Pop() {
    if (t.stack_.empty()) return;
    t.num_keys_ -= t.stack_.back().keys.size();
    t.popped_.push_back(std::move(t.stack_.back()));
    t.stack_.pop_back();
    t.changes_.push_back(Change{Change::kPop, {}});
  }
  bool Key(const std::string& key) {
    if (!TopIsObject()) return true;
    if (t.stack_.back().keys.insert(key).second) {
      ++t.num_keys_;
      t.changes_.push_back(Change{Change::kKey, key});
    }
    return true;
  }
};

// WouldRepeatKey: the real stack below `real` (frames the token has not
// closed) read-only; the containers the token opens and the keys it
// completes in an overlay.
struct JsonKeyTracker::SimOps {
  const JsonKeyTracker& t;
  size_t real;
  std::vector<bool>& local;
  std::vector<std::pair<size_t, std::string>>& added;  // depth non-decreasing
  std::string* repeated;

  size_t depth() const { return real + local.size(); }
  bool TopIsObject() const { return !local.empty() ? local.back() : real > 0 && t.stack_[real - 1].object; }
  void Push(bool object) { local.push_back(object); }
  void Pop() {
    if (!local.empty()) {
      local.pop_back();
    } else if (real > 0) {
      --real;
    } else {
      return;
    }
    while (!added.empty() && added.back().first >= depth()) added.pop_back();
  }
  bool Key(const std::string& key) {
    if (!TopIsObject()) return true;
    const size_t d = depth() - 1;
    bool repeat = local.empty() && t.stack_[d].keys.contains(key);
    for (size_t i = added.size(); !repeat && i > 0 && added[i - 1].first == d; --i) repeat = added[i - 1].second == key;
    if (repeat) {
      if (repeated != nullptr) *repeated = key;
      return false;
    }
    added.emplace_back(d, key);
    return true;
  }
};

template <class Ops>
bool JsonKeyTracker::Feed(Lex& lx, std::string& key, uint8_t b, Ops& ops) {
  // A high surrogate not followed by its low half stands alone.
  auto flush_high = [&] {
    if (lx.high != 0) AppendUtf8(key, lx.high);
    lx.high = 0;
  };
  if (!lx.in_string) {
    switch (b) {
      case '{':
        ops.Push(true);
        lx.expect_key = true;
        break;
      case '[':
        ops.Push(false);
        lx.expect_key = false;
        break;
      case '}':
      case ']':
        ops.Pop();
        lx.expect_key = false;
        break;
      case ',':
        lx.expect_key = ops.TopIsObject();
        break;
      case '"':
        lx = Lex{.in_string = true, .is_key = lx.expect_key};
        key.clear();
        break;
      default:
        break;
    }
    return true;
  }
  if (lx.esc == 0) {
    if (b == '"') {
      lx.in_string = false;
      if (!lx.is_key) return true;
      flush_high();
      return ops.Key(key);
    }
    if (b == '\\') {
      lx.esc = 1;
    } else if (lx.is_key) {
      flush_high();
      key.push_back(static_cast<char>(b));
    }
    return true;
  }
  if (lx.esc == 1) {
    if (b == 'u') {
      lx.esc = 2;
      lx.unit = 0;
      return true;
    }
    lx.esc = 0;
    if (lx.is_key) {
      flush_high();
      key.push_back(Unescaped(b));
    }
    return true;
  }
  lx.unit = static_cast<uint16_t>(lx.unit << 4 | HexValue(b));
  if (++lx.esc < 6) return true;
  lx.esc = 0;
  if (!lx.is_key) return true;
  const uint16_t u = lx.unit;
  if (u >= 0xDC00 && u <= 0xDFFF && lx.high != 0) {
    AppendUtf8(key, 0x10000 + ((uint32_t{lx.high} - 0xD800) << 10) + (u - 0xDC00));
    lx.high = 0;
  } else {
    flush_high();
    if (u >= 0xD800 && u <= 0xDBFF) {
      lx.high = u;
    } else {
      AppendUtf8(key, u);
    }
  }
  return true;
}

void JsonKeyTracker::Append(std::string_view bytes) {
  steps_.push_back(Step{lex_, lex_.in_string && lex_.is_key ? key_ : std::string(), changes_.size()});
  ApplyOps ops{*this};
  for (char c : bytes) Feed(lex_, key_, static_cast<uint8_t>(c), ops);
}

void JsonKeyTracker::Undo(size_t steps) {
  for (; steps > 0 && !steps_.empty(); --steps) {
    Step& step = steps_.back();
    while (changes_.size() > step.changes_begin) {
      Change& c = changes_.back();
      switch (c.kind) {
        case Change::kPush:
          stack_.pop_back();
          break;
        case Change::kPop:
          num_keys_ += popped_.back().keys.size();
          stack_.push_back(std::move(popped_.back()));
          popped_.pop_back();
          break;
        case Change::kKey:
          stack_.back().keys.erase(c.key);
          --num_keys_;
          break;
      }
      changes_.pop_back();
    }
    lex_ = step.lex;
    key_ = std::move(step.key);
    steps_.pop_back();
  }
}

bool JsonKeyTracker::WouldRepeatKey(std::string_view bytes, std::string* key) const {
  if (bytes.find('"') == std::string_view::npos) return false;
  Lex lx = lex_;
  if (lx.in_string && lx.is_key) {
    sim_key_.assign(key_);
  } else {
    sim_key_.clear();
  }
  sim_local_.clear();
  sim_added_.clear();
  SimOps ops{*this, stack_.size(), sim_local_, sim_added_, key};
  for (char c : bytes) {
    if (!Feed(lx, sim_key_, static_cast<uint8_t>(c), ops)) return true;
  }
  return false;
}

int JsonKeyTracker::MinQuotesForRepeat() const {
  const int quotes = !lex_.in_string ? 2 : lex_.is_key ? 1 : 3;
  return num_keys_ > 0 ? quotes : quotes + 2;
}

}  // namespace exl3serve::coordinator::constrained
