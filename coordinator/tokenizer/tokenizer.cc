#include "coordinator/tokenizer/tokenizer.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "coordinator/tokenizer/tokenizer_impl.h"
#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator {
namespace {

using internal::CategoryMask;
using internal::CategoryMaskForName;
using internal::DecodeUtf8;
using internal::IsWhiteSpace;

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A stretch of the input: text still to tokenize, or an added token's id.
struct Piece {
  std::string text;
  int32_t added_id = -1;
  bool at_text_start = false;
};

// The code point that ends / starts `s` (valid UTF-8, non-empty).
char32_t LastChar(std::string_view s) {
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return DecodeUtf8(s.substr(i)).front();
}
char32_t FirstChar(std::string_view s) {
  return DecodeUtf8(s.substr(0, internal::Utf8CharLength(static_cast<unsigned char>(s[0])))).front();
}

bool IsWordChar(char32_t c) {
  static const uint32_t kWord = CategoryMaskForName("L") | CategoryMaskForName("N");
  return c == '_' || (CategoryMask(c) & kWord) != 0;
}

}  // namespace

void Tokenizer::Impl::IndexAddedTokens() {
  added_by_id.clear();
  added_by_content.clear();
  for (auto& table : added_by_first_byte) {
    for (auto& bucket : table) bucket.clear();
  }
  vocab_size = model.id_end();
  for (size_t i = 0; i < added.size(); ++i) {
    const AddedToken& t = added[i];
    added_by_id[t.id] = i;
    added_by_content[t.content] = t.id;
    vocab_size = std::max(vocab_size, t.id + 1);
    if (t.content.empty()) continue;
    added_by_first_byte[t.normalized ? 1 : 0][static_cast<unsigned char>(t.content[0])].push_back(i);
  }
  for (auto& table : added_by_first_byte) {
    for (auto& bucket : table) {
      std::stable_sort(bucket.begin(), bucket.end(), [&](size_t a, size_t b) {
        return added[a].content.size() > added[b].content.size();
      });
    }
  }
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

namespace {

// Cuts the added tokens of one table out of `piece` (a text piece), leftmost
// and longest first, appending the resulting pieces to `out`.
void SplitOnAddedTokens(const Tokenizer::Impl& impl, int table, bool parse_special,
                        const Piece& piece, std::vector<Piece>* out) {
  const std::string& s = piece.text;
  const auto& buckets = impl.added_by_first_byte[table];
  size_t emitted = 0;  // end of what has been pushed to `out`
  size_t pos = 0;
  while (pos < s.size()) {
    const AddedToken* hit = nullptr;
    for (size_t index : buckets[static_cast<unsigned char>(s[pos])]) {
      const AddedToken& t = impl.added[index];
      if (s.compare(pos, t.content.size(), t.content) == 0) {
        hit = &t;
        break;
      }
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + hit->content.size();
    pos = stop;  // matches never overlap, even when one is then discarded
    if (hit->special && !parse_special) continue;
    if (hit->single_word) {
      const bool word_before = start > 0 && IsWordChar(LastChar(std::string_view(s).substr(0, start)));
      const bool word_after = stop < s.size() && IsWordChar(FirstChar(std::string_view(s).substr(stop)));
      if (word_before || word_after) continue;
    }
    if (hit->lstrip) {
      while (start > emitted) {
        size_t prev = start - 1;
        while (prev > emitted && (static_cast<unsigned char>(s[prev]) & 0xC0) == 0x80) --prev;
        if (!IsWhiteSpace(DecodeUtf8(std::string_view(s).substr(prev, start - prev)).front())) break;
        start = prev;
      }
    }
    if (hit->rstrip) {
      while (stop < s.size()) {
        const size_t len = internal::Utf8CharLength(static_cast<unsigned char>(s[stop]));
        if (!IsWhiteSpace(DecodeUtf8(std::string_view(s).substr(stop, len)).front())) break;
        stop += len;
      }
      pos = stop;
    }
    if (start > emitted) {
      out->push_back({s.substr(emitted, start - emitted), -1, piece.at_text_start && emitted == 0});
    }
    out->push_back({"", hit->id, false});
    emitted = stop;
  }
  if (emitted < s.size()) {
    out->push_back({s.substr(emitted), -1, piece.at_text_start && emitted == 0});
  }
}

}  // namespace

std::vector<int32_t> Tokenizer::Encode(std::string_view text, const EncodeOptions& options) const {
  const Impl& impl = *impl_;
  std::vector<Piece> raw_pieces;
  SplitOnAddedTokens(impl, 0, options.parse_special_tokens,
                     Piece{internal::ToValidUtf8(text), -1, true}, &raw_pieces);
  std::vector<int32_t> ids;
  for (Piece& raw : raw_pieces) {
    if (raw.added_id >= 0) {
      ids.push_back(raw.added_id);
      continue;
    }
    raw.text = internal::Normalize(impl.normalizers, std::move(raw.text));
    std::vector<Piece> pieces;
    SplitOnAddedTokens(impl, 1, options.parse_special_tokens, raw, &pieces);
    for (Piece& piece : pieces) {
      if (piece.added_id >= 0) {
        ids.push_back(piece.added_id);
        continue;
      }
      for (const std::string& word :
           internal::PreTokenize(impl.pre_tokenizers, std::move(piece.text), piece.at_text_start)) {
        impl.model.Tokenize(word, &ids);
      }
    }
  }
  if (!options.add_special_tokens || impl.single_template.empty()) return ids;
  std::vector<int32_t> with_specials;
  with_specials.reserve(ids.size() + 4);
  for (const TemplatePiece& t : impl.single_template) {
    const std::vector<int32_t>& src = t.is_sequence ? ids : t.ids;
    with_specials.insert(with_specials.end(), src.begin(), src.end());
  }
  return with_specials;
}

absl::StatusOr<std::string> Tokenizer::DecodeForStream(std::span<const int32_t> ids,
                                                       const DecodeOptions& options,
                                                       bool sequence_start,
                                                       bool keep_incomplete_tail,
                                                       size_t* pieces_out, bool raw_bytes) const {
  const Impl& impl = *impl_;
  std::vector<std::string> pieces;
  pieces.reserve(ids.size());
  for (const int32_t id : ids) {
    auto added = impl.added_by_id.find(id);
    if (added != impl.added_by_id.end()) {
      const AddedToken& t = impl.added[added->second];
      if (!(options.skip_special_tokens && t.special)) pieces.push_back(t.content);
      continue;
    }
    const std::string* token = impl.model.IdToToken(id);
    if (token == nullptr) {
      return absl::InvalidArgumentError(
          id < 0 || id >= impl.vocab_size
              ? absl::StrCat("token id ", id, " is out of range [0, ", impl.vocab_size, ")")
              : absl::StrCat("token id ", id, " is not in the vocabulary"));
    }
    pieces.push_back(*token);
  }
  if (pieces_out != nullptr) *pieces_out = pieces.size();
  if (impl.decoders.empty()) {
    // No decoder: Hugging Face joins the tokens with spaces. A streamed
    // piece after the sequence's first gets its separating space too, so
    // the streamed text adds up to Decode (found by tests/fuzz/tokenizer_fuzz).
    std::string joined;
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (i > 0 || !sequence_start) joined += ' ';
      joined += pieces[i];
    }
    return joined;
  }
  return internal::DecodePieces(impl.decoders, std::move(pieces),
                                internal::DecodeMode{sequence_start, keep_incomplete_tail, raw_bytes});
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              const DecodeOptions& options) const {
  absl::StatusOr<std::string> bytes = DecodeForStream(ids, options, true, false, nullptr);
  if (!bytes.ok()) return bytes.status();
  return internal::ToValidUtf8(*bytes);
}

absl::StatusOr<std::string> Tokenizer::TokenBytes(int32_t id) const {
  const int32_t one[1] = {id};
  return DecodeForStream(one, {}, /*sequence_start=*/false, /*keep_incomplete_tail=*/true, nullptr,
                         /*raw_bytes=*/true);
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  auto it = impl_->added_by_content.find(AbslView(token));
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->model.TokenToId(token);
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) return impl_->added[it->second].content;
  const std::string* token = impl_->model.IdToToken(id);
  if (token == nullptr) return std::nullopt;
  return *token;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  auto it = impl_->added_by_id.find(id);
  return it != impl_->added_by_id.end() && impl_->added[it->second].special;
}

const SpecialTokenIds& Tokenizer::special_token_ids() const { return impl_->special_ids; }
const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

}  // namespace exl3serve::coordinator
