// coordinator/tokenizer/stream_decoder.h — incremental detokenization for
// streamed generation: feed ids one at a time, get back text that is always
// whole UTF-8 characters, and whose concatenation equals Tokenizer::Decode of
// all the ids (for any ids whose bytes form valid UTF-8).
//
//   StreamDecoder stream(*tokenizer, {.skip_special_tokens = true});
//   for (int32_t id : generated) { EXL3_ASSIGN_OR_RETURN(std::string piece, stream.Push(id)); send(piece); }
//   send(stream.Finish());
//
// How: ids are held until their bytes end on a character boundary (at most
// three tokens for a character split across byte tokens), then decoded as one
// window. The start-of-text rules (SentencePiece's leading "▁" is not a space)
// apply only while no token has been decoded yet, so later windows keep their
// spaces.
//
// Thread safety: thread-compatible (one stream per request).
// Ownership: borrows the Tokenizer, which must outlive the StreamDecoder.
#ifndef EXL3SERVE_COORDINATOR_TOKENIZER_STREAM_DECODER_H_
#define EXL3SERVE_COORDINATOR_TOKENIZER_STREAM_DECODER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace exl3serve::coordinator {

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, DecodeOptions options = {});

  // Adds one id; returns the text that became complete (possibly empty).
  // Errors: InvalidArgument for an id Decode would reject; the stream is
  // unchanged then.
  absl::StatusOr<std::string> Push(int32_t id);

  // Returns whatever is held back (an unfinished character becomes U+FFFD)
  // and resets the stream to its initial state.
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  const DecodeOptions options_;
  std::vector<int32_t> pending_;  // ids not yet turned into text
  bool started_ = false;          // some token has been decoded
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_TOKENIZER_STREAM_DECODER_H_
