#include "coordinator/tokenizer/text_pipeline.h"

#include <utility>

#include "coordinator/tokenizer/byte_level.h"
#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator::internal {
namespace {

std::string ReplaceAll(std::string_view text, std::string_view pattern, std::string_view with) {
  if (pattern.empty()) return std::string(text);
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = text.find(pattern, pos);
    if (hit == std::string_view::npos) break;
    out.append(text.substr(pos, hit - pos));
    out.append(with);
    pos = hit + pattern.size();
  }
  out.append(text.substr(pos));
  return out;
}

struct Segment {
  size_t begin, end;
  bool is_match;
};

// Byte ranges of the matches of `step` in `text`.
std::vector<std::pair<size_t, size_t>> FindDelimiters(const SplitRegex* regex,
                                                      std::string_view literal,
                                                      std::string_view text) {
  std::vector<std::pair<size_t, size_t>> found;
  if (regex != nullptr) {
    const std::vector<char32_t> cps = DecodeUtf8(text);
    std::vector<size_t> offset(cps.size() + 1, 0);  // code point index -> byte offset
    for (size_t i = 0, byte = 0; i < cps.size(); ++i) {
      offset[i] = byte;
      byte += Utf8CharLength(static_cast<unsigned char>(text[byte]));
      offset[i + 1] = byte;
    }
    for (const MatchRange& m : regex->FindAll(cps)) found.emplace_back(offset[m.begin], offset[m.end]);
  } else if (!literal.empty()) {
    for (size_t pos = text.find(literal); pos != std::string_view::npos;
         pos = text.find(literal, pos + literal.size())) {
      found.emplace_back(pos, pos + literal.size());
    }
  }
  return found;
}

// Splits [0, size) at the delimiters the way `behavior` says. Returns the
// non-empty byte ranges of the pieces, in order.
std::vector<std::pair<size_t, size_t>> ApplyBehavior(
    size_t size, const std::vector<std::pair<size_t, size_t>>& delimiters, SplitBehavior behavior,
    bool invert) {
  std::vector<Segment> segments;
  size_t prev = 0;
  for (const auto& [b, e] : delimiters) {
    if (b > prev) segments.push_back({prev, b, false});
    segments.push_back({b, e, true});
    prev = e;
  }
  if (prev < size) segments.push_back({prev, size, false});
  if (invert) {
    for (Segment& s : segments) s.is_match = !s.is_match;
  }
  std::vector<Segment> pieces;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        if (!s.is_match) pieces.push_back(s);
      }
      break;
    case SplitBehavior::kIsolated:
      pieces = segments;
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      // Mirror image of kMergedWithPrevious: walk from the right.
      bool previous_match = false;
      for (size_t i = segments.size(); i-- > 0;) {
        const Segment& s = segments[i];
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().begin = s.begin;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      std::vector<Segment> reversed(pieces.rbegin(), pieces.rend());
      pieces = std::move(reversed);
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      break;
    }
  }
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const Segment& s : pieces) {
    if (s.end > s.begin) ranges.emplace_back(s.begin, s.end);
  }
  return ranges;
}

struct Split {
  std::string text;
  bool at_text_start;
};

void SplitInto(const Split& split, const SplitRegex* regex, std::string_view literal,
               SplitBehavior behavior, bool invert, std::vector<Split>* out) {
  const auto delimiters = FindDelimiters(regex, literal, split.text);
  for (const auto& [b, e] : ApplyBehavior(split.text.size(), delimiters, behavior, invert)) {
    out->push_back({split.text.substr(b, e - b), split.at_text_start && b == 0});
  }
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

}  // namespace

std::string Normalize(const std::vector<NormalizerStep>& steps, std::string text) {
  for (const NormalizerStep& step : steps) {
    switch (step.kind) {
      case NormalizerStep::Kind::kNfc: text = Normalize(text, NormalizationForm::kNfc); break;
      case NormalizerStep::Kind::kNfd: text = Normalize(text, NormalizationForm::kNfd); break;
      case NormalizerStep::Kind::kNfkc: text = Normalize(text, NormalizationForm::kNfkc); break;
      case NormalizerStep::Kind::kNfkd: text = Normalize(text, NormalizationForm::kNfkd); break;
      case NormalizerStep::Kind::kPrepend:
        if (!text.empty()) text.insert(0, step.text);
        break;
      case NormalizerStep::Kind::kReplace:
        text = ReplaceAll(text, step.text, step.replacement);
        break;
    }
  }
  return text;
}

std::vector<std::string> PreTokenize(const std::vector<PreTokenizerStep>& steps, std::string text,
                                     bool at_text_start) {
  std::vector<Split> splits;
  if (!text.empty()) splits.push_back({std::move(text), at_text_start});
  for (const PreTokenizerStep& step : steps) {
    std::vector<Split> next;
    next.reserve(splits.size());
    for (Split& split : splits) {
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit:
          SplitInto(split, step.regex ? &*step.regex : nullptr, step.pattern, step.behavior,
                    step.invert, &next);
          break;
        case PreTokenizerStep::Kind::kByteLevel: {
          if (step.add_prefix_space && !StartsWith(split.text, " ")) split.text = " " + split.text;
          const size_t first = next.size();
          if (step.regex) {
            SplitInto(split, &*step.regex, "", SplitBehavior::kIsolated, false, &next);
          } else {
            next.push_back(std::move(split));
          }
          for (size_t i = first; i < next.size(); ++i) next[i].text = BytesToByteLevel(next[i].text);
          break;
        }
        case PreTokenizerStep::Kind::kMetaspace: {
          split.text = ReplaceAll(split.text, " ", step.replacement);
          const bool prepend =
              step.prepend_scheme == PrependScheme::kAlways ||
              (step.prepend_scheme == PrependScheme::kFirst && split.at_text_start);
          if (prepend && !StartsWith(split.text, step.replacement)) {
            split.text.insert(0, step.replacement);
          }
          if (step.split) {
            SplitInto(split, nullptr, step.replacement, SplitBehavior::kMergedWithNext, false, &next);
          } else {
            next.push_back(std::move(split));
          }
          break;
        }
      }
    }
    splits = std::move(next);
  }
  std::vector<std::string> out;
  out.reserve(splits.size());
  for (Split& s : splits) {
    if (!s.text.empty()) out.push_back(std::move(s.text));
  }
  return out;
}

namespace {

// The byte a "<0xNN>" token stands for, or -1.
int ByteTokenValue(std::string_view token) {
  if (token.size() != 6 || !StartsWith(token, "<0x") || token[5] != '>') return -1;
  int value = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = token[i];
    int digit;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    else return -1;
    value = value * 16 + digit;
  }
  return value;
}

void FlushByteGroup(std::string* group, bool at_end, DecodeMode mode, std::vector<std::string>* out) {
  if (group->empty()) return;
  if (mode.raw_byte_groups || IsValidUtf8(*group) ||
      (at_end && mode.keep_incomplete_tail &&
       IsValidUtf8(std::string_view(*group).substr(0, group->size() - IncompleteUtf8TailLength(*group))) &&
       IncompleteUtf8TailLength(*group) > 0)) {
    out->push_back(std::move(*group));
  } else {
    // Hugging Face's ByteFallback turns an invalid group into one U+FFFD per byte.
    std::string replaced;
    for (size_t i = 0; i < group->size(); ++i) AppendUtf8(kReplacementChar, &replaced);
    out->push_back(std::move(replaced));
  }
  group->clear();
}

}  // namespace

std::string DecodePieces(const std::vector<DecoderStep>& steps, std::vector<std::string> pieces,
                         DecodeMode mode) {
  for (const DecoderStep& step : steps) {
    switch (step.kind) {
      case DecoderStep::Kind::kByteLevel: {
        std::string joined;
        for (const std::string& piece : pieces) {
          // A piece with a character outside the byte table (an added token
          // such as "<|im_start|>" is inside it; other text may not be) is
          // taken as it is.
          std::string bytes;
          bool mapped = IsValidUtf8(piece);
          if (mapped) {
            for (char32_t c : DecodeUtf8(piece)) {
              const int b = CharToByte(c);
              if (b < 0) {
                mapped = false;
                break;
              }
              bytes.push_back(static_cast<char>(b));
            }
          }
          joined += mapped ? bytes : piece;
        }
        pieces.assign(1, std::move(joined));
        break;
      }
      case DecoderStep::Kind::kMetaspace:
        for (size_t i = 0; i < pieces.size(); ++i) {
          // The first token of the text loses every replacement character
          // (that is how Hugging Face tokenizers decodes it), others get spaces.
          const bool drop = i == 0 && mode.sequence_start && step.prepend_scheme != PrependScheme::kNever;
          pieces[i] = ReplaceAll(pieces[i], step.replacement, drop ? "" : " ");
        }
        break;
      case DecoderStep::Kind::kReplace:
        for (std::string& piece : pieces) piece = ReplaceAll(piece, step.pattern, step.content);
        break;
      case DecoderStep::Kind::kByteFallback: {
        std::vector<std::string> out;
        std::string group;
        for (std::string& piece : pieces) {
          const int b = ByteTokenValue(piece);
          if (b >= 0) {
            group.push_back(static_cast<char>(b));
            continue;
          }
          FlushByteGroup(&group, false, mode, &out);
          out.push_back(std::move(piece));
        }
        FlushByteGroup(&group, true, mode, &out);
        pieces = std::move(out);
        break;
      }
      case DecoderStep::Kind::kFuse: {
        std::string joined;
        for (const std::string& piece : pieces) joined += piece;
        pieces.assign(1, std::move(joined));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (size_t i = 0; i < pieces.size(); ++i) {
          std::string& piece = pieces[i];
          const std::string& c = step.content;
          if (c.empty()) continue;
          if (i > 0 || mode.sequence_start) {
            for (int k = 0; k < step.strip_start && StartsWith(piece, c); ++k) piece.erase(0, c.size());
          }
          for (int k = 0; k < step.strip_stop && piece.size() >= c.size() &&
                          piece.compare(piece.size() - c.size(), c.size(), c) == 0;
               ++k) {
            piece.erase(piece.size() - c.size());
          }
        }
        break;
    }
  }
  std::string out;
  for (const std::string& piece : pieces) out += piece;
  return out;
}

}  // namespace exl3serve::coordinator::internal
