#include "sharding/llama2c_tokenizer.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

using json = nlohmann::json;

constexpr int kUnk = 0, kBos = 1, kEos = 2;
constexpr uint32_t kMaxPieceBytes = 1 << 16;
const char kMeta[] = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// "<0xNN>" -> NN, else -1.
int BytePieceValue(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>') return -1;
  int v = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = piece[i];
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// The byte length of the UTF-8 character starting with `lead` (1 for an
// invalid lead byte, which then stands alone).
size_t Utf8Length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 1;
}

bool ValidUtf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = Utf8Length(c);
    if (n == 1 && c >= 0x80) return false;
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

bool IsSpecial(int id) { return id == kUnk || id == kBos || id == kEos; }

// Byte piece ids by byte value, when the vocabulary has all 256.
std::vector<int32_t> BytePieces(const Llama2cVocab& vocab) {
  std::vector<int32_t> ids(256, -1);
  int found = 0;
  for (size_t i = 0; i < vocab.pieces.size(); ++i) {
    const int v = BytePieceValue(vocab.pieces[i]);
    if (v >= 0 && ids[v] < 0) {
      ids[v] = static_cast<int32_t>(i);
      ++found;
    }
  }
  if (found != 256) ids.clear();
  return ids;
}

}  // namespace

absl::StatusOr<Llama2cVocab> ReadLlama2cTokenizer(const std::string& path, int64_t vocab_size) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open the tokenizer"));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t off = 0;
  auto take = [&](void* out, size_t n) {
    if (off + n > data.size()) return false;
    std::memcpy(out, data.data() + off, n);
    off += n;
    return true;
  };
  Llama2cVocab vocab;
  if (!take(&vocab.max_token_length, 4)) {
    return absl::DataLossError(absl::StrCat(path, ": shorter than its 4-byte header"));
  }
  while (vocab_size > 0 ? static_cast<int64_t>(vocab.pieces.size()) < vocab_size
                        : off < data.size()) {
    const size_t id = vocab.pieces.size();
    float score = 0;
    int32_t len = 0;
    if (!take(&score, 4) || !take(&len, 4)) {
      return absl::DataLossError(absl::StrCat(path, ": truncated at piece ", id, " (",
                                              data.size(), " bytes)"));
    }
    if (len < 0 || static_cast<uint32_t>(len) > kMaxPieceBytes) {
      return absl::DataLossError(absl::StrCat(path, ": piece ", id, " has length ", len));
    }
    std::string piece(static_cast<size_t>(len), '\0');
    if (!take(piece.data(), piece.size())) {
      return absl::DataLossError(absl::StrCat(path, ": piece ", id, " is truncated"));
    }
    vocab.pieces.push_back(std::move(piece));
    vocab.scores.push_back(score);
  }
  if (off != data.size()) {
    return absl::DataLossError(absl::StrCat(path, ": ", data.size() - off,
                                            " bytes after the ", vocab.pieces.size(),
                                            " pieces the model's vocabulary has"));
  }
  return vocab;
}

absl::Status WriteHfTokenizer(const Llama2cVocab& vocab, const std::string& out_dir) {
  const size_t n = vocab.pieces.size();
  if (n < 3 || vocab.scores.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("a llama2.c vocabulary needs <unk>, BOS and EOS",
                                                   " (ids 0-2); got ", n, " pieces"));
  }
  const std::vector<int32_t> bytes = BytePieces(vocab);
  // HF names: spaces as U+2581, the control pieces as <unk> <s> </s>.
  std::vector<std::string> names(n);
  absl::flat_hash_map<std::string, int32_t> id_of;
  for (size_t i = 0; i < n; ++i) {
    names[i] = i == kUnk ? "<unk>" : i == kBos ? "<s>" : i == kEos ? "</s>"
                                   : absl::StrReplaceAll(vocab.pieces[i], {{" ", kMeta}});
    if (BytePieceValue(vocab.pieces[i]) < 0 && !ValidUtf8(vocab.pieces[i])) {
      return absl::InvalidArgumentError(absl::StrCat("piece ", i, " is not valid UTF-8"));
    }
    if (!id_of.emplace(names[i], static_cast<int32_t>(i)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("pieces ", id_of[names[i]], " and ", i, " are both \"", names[i], "\""));
    }
  }
  // Merges: every split of a mergeable piece into two mergeable pieces,
  // ranked by the piece's score (higher first), ids breaking ties.
  auto mergeable = [&](size_t i) {
    return !IsSpecial(static_cast<int>(i)) && BytePieceValue(vocab.pieces[i]) < 0;
  };
  std::vector<int32_t> order;
  for (size_t i = 0; i < n; ++i) {
    if (mergeable(i)) order.push_back(static_cast<int32_t>(i));
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return vocab.scores[a] > vocab.scores[b]; });
  json merges = json::array();
  for (int32_t id : order) {
    const std::string& name = names[id];
    for (size_t cut = 1; cut < name.size(); ++cut) {
      // Cut only between UTF-8 characters.
      if ((static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) continue;
      auto left = id_of.find(name.substr(0, cut));
      auto right = id_of.find(name.substr(cut));
      if (left == id_of.end() || right == id_of.end()) continue;
      if (!mergeable(left->second) || !mergeable(right->second)) continue;
      merges.push_back(json::array({left->first, right->first}));
    }
  }
  json vocab_json = json::object();
  for (size_t i = 0; i < n; ++i) vocab_json[names[i]] = i;
  json added = json::array();
  for (int id : {kUnk, kBos, kEos}) {
    added.push_back({{"id", id}, {"content", names[id]}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", true}});
  }
  const bool byte_fallback = !bytes.empty();
  json decoders = json::array();
  decoders.push_back({{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}});
  if (byte_fallback) decoders.push_back({{"type", "ByteFallback"}});
  decoders.push_back({{"type", "Fuse"}});
  decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  const json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         json::array({{{"type", "Prepend"}, {"prepend", kMeta}},
                      {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}})}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
        {"pair", json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                              {{"SpecialToken", {{"id", "<s>"}, {"type_id", 1}}}},
                              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", json::array({kBos})},
                                     {"tokens", json::array({"<s>"})}}}}}}},
      {"decoder", {{"type", "Sequence"}, {"decoders", decoders}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", "<unk>"},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", true},
        {"byte_fallback", byte_fallback},
        {"ignore_merges", false},
        {"vocab", vocab_json},
        {"merges", merges}}},
  };
  const json config = {
      {"tokenizer_class", "LlamaTokenizer"},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"},
      {"unk_token", "<unk>"},
      {"add_bos_token", true},
      {"add_eos_token", false},
      {"legacy", false},
      {"model_max_length", 1 << 20},
      {"clean_up_tokenization_spaces", false},
  };
  EXL3_RETURN_IF_ERROR(WriteFileAtomically(out_dir + "/tokenizer.json", tokenizer.dump(1)));
  return WriteFileAtomically(out_dir + "/tokenizer_config.json", config.dump(2));
}

std::vector<int32_t> EncodeLlama2c(const Llama2cVocab& vocab, const std::string& text) {
  absl::flat_hash_map<std::string, int32_t> id_of;
  for (size_t i = 0; i < vocab.pieces.size(); ++i) {
    if (IsSpecial(static_cast<int>(i)) || BytePieceValue(vocab.pieces[i]) >= 0) continue;
    id_of.emplace(vocab.pieces[i], static_cast<int32_t>(i));
  }
  const std::vector<int32_t> bytes = BytePieces(vocab);
  std::vector<int32_t> ids;
  if (text.empty()) return ids;
  const std::string s = " " + text;  // the dummy prefix
  for (size_t i = 0; i < s.size();) {
    const size_t len = std::min(Utf8Length(static_cast<unsigned char>(s[i])), s.size() - i);
    auto it = id_of.find(s.substr(i, len));
    if (it != id_of.end()) {
      ids.push_back(it->second);
    } else if (!bytes.empty()) {
      for (size_t k = 0; k < len; ++k) ids.push_back(bytes[static_cast<unsigned char>(s[i + k])]);
    } else {
      ids.push_back(kUnk);
    }
    i += len;
  }
  auto text_of = [&](int32_t id) -> std::string {
    return IsSpecial(id) || BytePieceValue(vocab.pieces[id]) >= 0 ? std::string("\x01<no>")
                                                                   : vocab.pieces[id];
  };
  while (true) {
    float best = -1e30f;
    int32_t best_id = -1;
    size_t best_at = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      auto it = id_of.find(text_of(ids[i]) + text_of(ids[i + 1]));
      if (it != id_of.end() && vocab.scores[it->second] > best) {
        best = vocab.scores[it->second];
        best_id = it->second;
        best_at = i;
      }
    }
    if (best_id < 0) break;
    ids[best_at] = best_id;
    ids.erase(ids.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
  }
  return ids;
}

}  // namespace exl3serve::sharding
