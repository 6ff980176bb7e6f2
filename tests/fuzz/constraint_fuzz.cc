// libFuzzer target: structured-output constraints from untrusted requests.
// Input: one kind byte (% 4: JSON Schema, regex, GBNF grammar, choice with
// NUL-separated entries), then the text. Contract: CompileConstraint never
// crashes, hangs or overflows the stack, and refuses with InvalidArgument or
// ResourceExhausted; a compiled constraint's matcher, walked over a small
// vocabulary (single bytes + a few multi-byte tokens), only accepts tokens
// its mask allowed, never reaches a state with no allowed token unless it is
// complete, and rolls back to identical masks.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "coordinator/constrained/constraint.h"

namespace cs = exl3serve::coordinator::constrained;

namespace {
std::shared_ptr<const cs::TokenVocabulary> Vocab() {
  std::vector<std::optional<std::string>> bytes = {std::nullopt};  // 0: EOS
  for (int b = 1; b < 256; ++b) bytes.push_back(std::string(1, static_cast<char>(b)));
  for (const char* t : {"{\"", "\": ", "\",", "true", "null", "ab", "12", "\xC3\xA9", "\xE2\x82\xAC", "]}", ", "}) {
    bytes.push_back(t);
  }
  bytes.push_back(std::string(1, '\0'));  // every byte is a token: no state is starved
  return *cs::TokenVocabulary::FromBytes(std::move(bytes), std::vector<int32_t>{0});
}
bool Bit(const std::vector<uint32_t>& m, int32_t id) { return (m[id >> 5] >> (id & 31)) & 1; }
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto vocab = Vocab();
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  cs::ConstraintSpec spec;
  spec.kind = static_cast<cs::ConstraintKind>(data[0] % 4);
  if (spec.kind == cs::ConstraintKind::kChoice) {
    for (size_t at = 0; at <= text.size();) {
      size_t end = text.find('\0', at);
      if (end == std::string::npos) end = text.size();
      spec.choices.push_back(text.substr(at, end - at));
      at = end + 1;
    }
  } else {
    spec.text = text;
  }
  auto compiled = cs::CompileConstraint(spec, vocab);
  if (!compiled.ok()) {
    const absl::StatusCode c = compiled.status().code();
    if (c != absl::StatusCode::kInvalidArgument && c != absl::StatusCode::kResourceExhausted) std::abort();
    return 0;
  }
  cs::TokenMatcher m(*compiled);
  std::vector<std::vector<uint32_t>> masks;
  uint32_t rng = static_cast<uint32_t>(size) * 2654435761u;
  for (int step = 0; step < 24; ++step) {
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenMask(mask);
    masks.push_back(mask);
    std::vector<int32_t> allowed;
    for (int32_t id = 0; id < vocab->size(); ++id) {
      if (Bit(mask, id)) allowed.push_back(id);
    }
    if (Bit(mask, 0) != m.IsComplete()) std::abort();
    if (allowed.empty()) {
      if (!m.IsComplete() && m.num_accepted() > 0) std::abort();  // dead state
      break;
    }
    rng = rng * 1664525u + 1013904223u;
    const int32_t id = allowed[(rng >> 8) % allowed.size()];
    const absl::Status st = m.AcceptToken(id);
    if (!st.ok() && st.code() != absl::StatusCode::kResourceExhausted) std::abort();
    if (!st.ok() || id == 0) break;
    // A token the mask refused is refused by AcceptToken too.
    for (int32_t other = 1; other < 256; ++other) {
      if (!Bit(mask, other)) {
        if (m.Rollback(1).ok() && m.AcceptToken(other).ok()) std::abort();
        if (!m.AcceptToken(id).ok() && m.num_accepted() < step + 1) std::abort();
        break;
      }
    }
  }
  while (m.num_accepted() > 0) {
    if (!m.Rollback(1).ok()) std::abort();
    std::vector<uint32_t> mask(m.mask_words());
    m.FillNextTokenMask(mask);
    if (mask != masks[m.num_accepted()]) std::abort();
  }
  return 0;
}
