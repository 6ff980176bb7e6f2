#include "coordinator/tokenizer/stream_decoder.h"

#include <utility>

#include "coordinator/tokenizer/unicode_text.h"

namespace exl3serve::coordinator {

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options)
    : tokenizer_(tokenizer), options_(options) {}

absl::StatusOr<std::string> StreamDecoder::Push(int32_t id) {
  pending_.push_back(id);
  size_t pieces = 0;
  absl::StatusOr<std::string> bytes =
      tokenizer_.DecodeForStream(pending_, options_, !started_, /*keep_incomplete_tail=*/true, &pieces);
  if (!bytes.ok()) {
    pending_.pop_back();
    return bytes.status();
  }
  if (internal::IncompleteUtf8TailLength(*bytes) > 0) return std::string();  // wait for the rest
  pending_.clear();
  if (pieces > 0) started_ = true;
  return internal::ToValidUtf8(*bytes);
}

std::string StreamDecoder::Finish() {
  std::string text;
  if (!pending_.empty()) {
    absl::StatusOr<std::string> bytes = tokenizer_.DecodeForStream(
        pending_, options_, !started_, /*keep_incomplete_tail=*/false, nullptr);
    // Every pending id was accepted by Push, so decoding cannot fail here.
    if (bytes.ok()) text = internal::ToValidUtf8(*bytes);
  }
  pending_.clear();
  started_ = false;
  return text;
}

}  // namespace exl3serve::coordinator
