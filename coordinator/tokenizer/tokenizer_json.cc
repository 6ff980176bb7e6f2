// Loading a Tokenizer from tokenizer.json / tokenizer_config.json. The only
// file of the tokenizer that sees nlohmann::json.
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "coordinator/tokenizer/tokenizer_impl.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::coordinator {
namespace {

using internal::DecoderStep;
using internal::NormalizerStep;
using internal::PrependScheme;
using internal::PreTokenizerStep;
using internal::SplitBehavior;
using json = nlohmann::json;

absl::string_view AbslView(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// Reads fields of one file; every error names the file and the field path.
class Reader {
 public:
  explicit Reader(std::string file) : file_(std::move(file)) {}

  absl::Status Bad(std::string_view path, std::string_view what) const {
    return absl::DataLossError(absl::StrCat(file_, ": `", AbslView(path), "`: ", AbslView(what)));
  }
  absl::Status Unsupported(std::string_view path, std::string_view what) const {
    return absl::UnimplementedError(
        absl::StrCat(file_, ": `", AbslView(path), "`: ", AbslView(what), " is not supported"));
  }

  // The member `key` of object `obj`, or nullptr when absent or null.
  static const json* Find(const json& obj, const char* key) {
    if (!obj.is_object()) return nullptr;
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }

  absl::StatusOr<std::string> String(const json& obj, const char* key, std::string_view path) const {
    const json* v = Find(obj, key);
    if (v == nullptr) return Bad(Sub(path, key), "missing");
    if (!v->is_string()) return Bad(Sub(path, key), absl::StrCat("expected a string, got ", v->type_name()));
    return v->get<std::string>();
  }
  absl::StatusOr<std::string> StringOr(const json& obj, const char* key, std::string_view path,
                                       std::string fallback) const {
    if (Find(obj, key) == nullptr) return fallback;
    return String(obj, key, path);
  }
  absl::StatusOr<bool> Bool(const json& obj, const char* key, std::string_view path, bool fallback) const {
    const json* v = Find(obj, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return Bad(Sub(path, key), absl::StrCat("expected true or false, got ", v->type_name()));
    return v->get<bool>();
  }
  absl::StatusOr<int64_t> Int(const json& v, std::string_view path) const {
    if (!v.is_number_integer()) return Bad(path, absl::StrCat("expected an integer, got ", v.type_name()));
    return v.get<int64_t>();
  }
  absl::StatusOr<int32_t> Id(const json& v, std::string_view path) const {
    EXL3_ASSIGN_OR_RETURN(int64_t id, Int(v, path));
    if (id < 0 || id >= kMaxTokenId) {
      return Bad(path, absl::StrCat("token id ", id, " is out of range (0 <= id < kMaxTokenId = ",
                                    kMaxTokenId, ")"));
    }
    return static_cast<int32_t>(id);
  }
  absl::StatusOr<const json*> Array(const json& obj, const char* key, std::string_view path) const {
    const json* v = Find(obj, key);
    if (v == nullptr) return Bad(Sub(path, key), "missing");
    if (!v->is_array()) return Bad(Sub(path, key), absl::StrCat("expected an array, got ", v->type_name()));
    return v;
  }

  static std::string Sub(std::string_view path, std::string_view key) {
    return path.empty() ? std::string(key) : absl::StrCat(AbslView(path), ".", AbslView(key));
  }
  static std::string Index(std::string_view path, size_t i) { return absl::StrCat(AbslView(path), "[", i, "]"); }

  // The "pattern": {"String": s} or {"Regex": r} of Split/Replace.
  struct Pattern {
    std::string text;
    bool is_regex = false;
  };
  absl::StatusOr<Pattern> GetPattern(const json& obj, std::string_view path) const {
    const json* p = Find(obj, "pattern");
    const std::string where = Sub(path, "pattern");
    if (p == nullptr || !p->is_object()) return Bad(where, "expected {\"String\": ...} or {\"Regex\": ...}");
    if (Find(*p, "String") != nullptr) {
      EXL3_ASSIGN_OR_RETURN(std::string literal, String(*p, "String", where));
      return Pattern{std::move(literal), false};
    }
    if (Find(*p, "Regex") != nullptr) {
      EXL3_ASSIGN_OR_RETURN(std::string r, String(*p, "Regex", where));
      return Pattern{std::move(r), true};
    }
    return Bad(where, "expected {\"String\": ...} or {\"Regex\": ...}");
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

absl::StatusOr<internal::BpeModel> ParseModel(const Reader& r, const json& root) {
  const json* model = Reader::Find(root, "model");
  if (model == nullptr || !model->is_object()) return r.Bad("model", "missing or not an object");
  EXL3_ASSIGN_OR_RETURN(std::string type, r.StringOr(*model, "type", "model", "BPE"));
  if (type != "BPE") return r.Unsupported("model.type", absl::StrCat("model type `", type, "` (only BPE)"));
  if (const json* dropout = Reader::Find(*model, "dropout");
      dropout != nullptr && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    return r.Unsupported("model.dropout", "BPE dropout");
  }
  const json* vocab_json = Reader::Find(*model, "vocab");
  if (vocab_json == nullptr || !vocab_json->is_object()) return r.Bad("model.vocab", "missing or not an object");
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(vocab_json->size());
  for (auto it = vocab_json->begin(); it != vocab_json->end(); ++it) {
    EXL3_ASSIGN_OR_RETURN(int32_t id, r.Id(it.value(), absl::StrCat("model.vocab[\"", it.key(), "\"]")));
    vocab.emplace_back(it.key(), id);
  }
  EXL3_ASSIGN_OR_RETURN(const json* merges_json, r.Array(*model, "merges", "model"));
  std::vector<std::pair<std::string, std::string>> merges;
  merges.reserve(merges_json->size());
  for (size_t i = 0; i < merges_json->size(); ++i) {
    const json& m = (*merges_json)[i];
    if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return r.Bad(Reader::Index("model.merges", i), absl::StrCat("expected \"left right\", got \"", s, "\""));
      }
      merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
    } else {
      return r.Bad(Reader::Index("model.merges", i), "expected a string \"left right\" or a pair of strings");
    }
  }
  internal::BpeOptions options;
  if (Reader::Find(*model, "unk_token") != nullptr) {
    EXL3_ASSIGN_OR_RETURN(options.unk_token, r.String(*model, "unk_token", "model"));
  }
  EXL3_ASSIGN_OR_RETURN(options.continuing_subword_prefix,
                        r.StringOr(*model, "continuing_subword_prefix", "model", ""));
  EXL3_ASSIGN_OR_RETURN(options.end_of_word_suffix, r.StringOr(*model, "end_of_word_suffix", "model", ""));
  EXL3_ASSIGN_OR_RETURN(options.fuse_unk, r.Bool(*model, "fuse_unk", "model", false));
  EXL3_ASSIGN_OR_RETURN(options.byte_fallback, r.Bool(*model, "byte_fallback", "model", false));
  EXL3_ASSIGN_OR_RETURN(options.ignore_merges, r.Bool(*model, "ignore_merges", "model", false));
  return internal::BpeModel::Create(std::move(vocab), merges, std::move(options), r.file());
}

absl::Status ParseNormalizer(const Reader& r, const json& n, const std::string& path,
                             std::vector<NormalizerStep>* out) {
  EXL3_ASSIGN_OR_RETURN(std::string type, r.String(n, "type", path));
  NormalizerStep step;
  if (type == "Sequence") {
    EXL3_ASSIGN_OR_RETURN(const json* list, r.Array(n, "normalizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      EXL3_RETURN_IF_ERROR(ParseNormalizer(r, (*list)[i], Reader::Index(Reader::Sub(path, "normalizers"), i), out));
    }
    return absl::OkStatus();
  } else if (type == "NFC") {
    step.kind = NormalizerStep::Kind::kNfc;
  } else if (type == "NFD") {
    step.kind = NormalizerStep::Kind::kNfd;
  } else if (type == "NFKC") {
    step.kind = NormalizerStep::Kind::kNfkc;
  } else if (type == "NFKD") {
    step.kind = NormalizerStep::Kind::kNfkd;
  } else if (type == "Prepend") {
    step.kind = NormalizerStep::Kind::kPrepend;
    EXL3_ASSIGN_OR_RETURN(step.text, r.String(n, "prepend", path));
  } else if (type == "Replace") {
    step.kind = NormalizerStep::Kind::kReplace;
    EXL3_ASSIGN_OR_RETURN(Reader::Pattern p, r.GetPattern(n, path));
    if (p.is_regex) return r.Unsupported(Reader::Sub(path, "pattern"), "a Regex pattern in a Replace normalizer");
    step.text = std::move(p.text);
    EXL3_ASSIGN_OR_RETURN(step.replacement, r.String(n, "content", path));
  } else {
    return r.Unsupported(Reader::Sub(path, "type"), absl::StrCat("normalizer `", type, "`"));
  }
  out->push_back(std::move(step));
  return absl::OkStatus();
}

absl::StatusOr<PrependScheme> ParsePrependScheme(const Reader& r, const json& n, const std::string& path) {
  if (Reader::Find(n, "prepend_scheme") != nullptr) {
    EXL3_ASSIGN_OR_RETURN(std::string scheme, r.String(n, "prepend_scheme", path));
    if (scheme == "always") return PrependScheme::kAlways;
    if (scheme == "first") return PrependScheme::kFirst;
    if (scheme == "never") return PrependScheme::kNever;
    return r.Bad(Reader::Sub(path, "prepend_scheme"),
                 absl::StrCat("expected always, first or never, got `", scheme, "`"));
  }
  // Files written before prepend_scheme existed say add_prefix_space.
  EXL3_ASSIGN_OR_RETURN(bool add_prefix_space, r.Bool(n, "add_prefix_space", path, true));
  return add_prefix_space ? PrependScheme::kAlways : PrependScheme::kNever;
}

absl::Status ParsePreTokenizer(const Reader& r, const json& n, const std::string& path,
                               std::vector<PreTokenizerStep>* out) {
  EXL3_ASSIGN_OR_RETURN(std::string type, r.String(n, "type", path));
  PreTokenizerStep step;
  if (type == "Sequence") {
    EXL3_ASSIGN_OR_RETURN(const json* list, r.Array(n, "pretokenizers", path));
    for (size_t i = 0; i < list->size(); ++i) {
      EXL3_RETURN_IF_ERROR(
          ParsePreTokenizer(r, (*list)[i], Reader::Index(Reader::Sub(path, "pretokenizers"), i), out));
    }
    return absl::OkStatus();
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    EXL3_ASSIGN_OR_RETURN(Reader::Pattern p, r.GetPattern(n, path));
    if (p.is_regex) {
      absl::StatusOr<internal::SplitRegex> re = internal::SplitRegex::Compile(p.text);
      if (!re.ok()) {
        return Annotate(re.status(), absl::StrCat(r.file(), ": `", path, ".pattern.Regex`"));
      }
      step.regex = std::move(*re);
    } else {
      step.pattern = std::move(p.text);
    }
    EXL3_ASSIGN_OR_RETURN(std::string behavior, r.String(n, "behavior", path));
    if (behavior == "Removed") step.behavior = SplitBehavior::kRemoved;
    else if (behavior == "Isolated") step.behavior = SplitBehavior::kIsolated;
    else if (behavior == "MergedWithPrevious") step.behavior = SplitBehavior::kMergedWithPrevious;
    else if (behavior == "MergedWithNext") step.behavior = SplitBehavior::kMergedWithNext;
    else if (behavior == "Contiguous") step.behavior = SplitBehavior::kContiguous;
    else return r.Bad(Reader::Sub(path, "behavior"), absl::StrCat("unknown behavior `", behavior, "`"));
    EXL3_ASSIGN_OR_RETURN(step.invert, r.Bool(n, "invert", path, false));
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    EXL3_ASSIGN_OR_RETURN(step.add_prefix_space, r.Bool(n, "add_prefix_space", path, true));
    EXL3_ASSIGN_OR_RETURN(bool use_regex, r.Bool(n, "use_regex", path, true));
    if (use_regex) {
      absl::StatusOr<internal::SplitRegex> re = internal::SplitRegex::Compile(internal::kGpt2SplitPattern);
      if (!re.ok()) return re.status();  // a bug of ours: the pattern is fixed
      step.regex = std::move(*re);
    }
  } else if (type == "Metaspace") {
    step.kind = PreTokenizerStep::Kind::kMetaspace;
    EXL3_ASSIGN_OR_RETURN(step.replacement, r.StringOr(n, "replacement", path, step.replacement));
    EXL3_ASSIGN_OR_RETURN(step.prepend_scheme, ParsePrependScheme(r, n, path));
    EXL3_ASSIGN_OR_RETURN(step.split, r.Bool(n, "split", path, true));
  } else {
    return r.Unsupported(Reader::Sub(path, "type"), absl::StrCat("pre-tokenizer `", type, "`"));
  }
  out->push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status ParseDecoder(const Reader& r, const json& n, const std::string& path,
                          std::vector<DecoderStep>* out) {
  EXL3_ASSIGN_OR_RETURN(std::string type, r.String(n, "type", path));
  DecoderStep step;
  if (type == "Sequence") {
    EXL3_ASSIGN_OR_RETURN(const json* list, r.Array(n, "decoders", path));
    for (size_t i = 0; i < list->size(); ++i) {
      EXL3_RETURN_IF_ERROR(ParseDecoder(r, (*list)[i], Reader::Index(Reader::Sub(path, "decoders"), i), out));
    }
    return absl::OkStatus();
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::kByteLevel;
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::kMetaspace;
    EXL3_ASSIGN_OR_RETURN(step.replacement, r.StringOr(n, "replacement", path, step.replacement));
    EXL3_ASSIGN_OR_RETURN(step.prepend_scheme, ParsePrependScheme(r, n, path));
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::kReplace;
    EXL3_ASSIGN_OR_RETURN(Reader::Pattern p, r.GetPattern(n, path));
    if (p.is_regex) return r.Unsupported(Reader::Sub(path, "pattern"), "a Regex pattern in a Replace decoder");
    step.pattern = std::move(p.text);
    EXL3_ASSIGN_OR_RETURN(step.content, r.String(n, "content", path));
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::kStrip;
    EXL3_ASSIGN_OR_RETURN(step.content, r.String(n, "content", path));
    for (auto [key, field] : {std::pair{"start", &step.strip_start}, std::pair{"stop", &step.strip_stop}}) {
      const json* v = Reader::Find(n, key);
      if (v == nullptr) continue;
      EXL3_ASSIGN_OR_RETURN(int64_t count, r.Int(*v, Reader::Sub(path, key)));
      if (count < 0 || count > 1024) return r.Bad(Reader::Sub(path, key), absl::StrCat("bad count ", count));
      *field = static_cast<int>(count);
    }
    // Stripping from the end of the text cannot be streamed (whether a space
    // is the last one is known only at the end), and no published tokenizer
    // uses it (SentencePiece conversions strip one leading space). Found by
    // tests/fuzz/tokenizer_fuzz.cc: streamed text differed from Decode.
    if (step.strip_stop != 0) {
      return r.Unsupported(Reader::Sub(path, "stop"),
                           "decoder `Strip` with stop > 0 (it cannot be streamed)");
    }
  } else {
    return r.Unsupported(Reader::Sub(path, "type"), absl::StrCat("decoder `", type, "`"));
  }
  out->push_back(std::move(step));
  return absl::OkStatus();
}

// Looks up an id for a template/processor token name.
absl::StatusOr<int32_t> IdOf(const Reader& r, const Tokenizer::Impl& impl, const std::string& token,
                             std::string_view path) {
  auto it = impl.added_by_content.find(token);
  if (it != impl.added_by_content.end()) return it->second;
  if (auto id = impl.model.TokenToId(token)) return *id;
  return r.Bad(path, absl::StrCat("token `", token, "` is not in the vocabulary"));
}

absl::Status ParsePostProcessor(const Reader& r, const json& n, const std::string& path,
                                Tokenizer::Impl* impl) {
  EXL3_ASSIGN_OR_RETURN(std::string type, r.String(n, "type", path));
  if (type == "ByteLevel") return absl::OkStatus();  // offsets only
  if (type == "Sequence") {
    EXL3_ASSIGN_OR_RETURN(const json* list, r.Array(n, "processors", path));
    for (size_t i = 0; i < list->size(); ++i) {
      EXL3_RETURN_IF_ERROR(
          ParsePostProcessor(r, (*list)[i], Reader::Index(Reader::Sub(path, "processors"), i), impl));
    }
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    EXL3_ASSIGN_OR_RETURN(const json* single, r.Array(n, "single", path));
    const json* specials = Reader::Find(n, "special_tokens");
    impl->single_template.clear();
    for (size_t i = 0; i < single->size(); ++i) {
      const json& item = (*single)[i];
      const std::string where = Reader::Index(Reader::Sub(path, "single"), i);
      TemplatePiece piece;
      if (Reader::Find(item, "Sequence") != nullptr) {
        piece.is_sequence = true;
      } else if (const json* special = Reader::Find(item, "SpecialToken"); special != nullptr) {
        EXL3_ASSIGN_OR_RETURN(std::string name, r.String(*special, "id", Reader::Sub(where, "SpecialToken")));
        const json* entry = specials != nullptr ? Reader::Find(*specials, name.c_str()) : nullptr;
        if (entry != nullptr) {
          const std::string entry_path = absl::StrCat(path, ".special_tokens[\"", name, "\"]");
          EXL3_ASSIGN_OR_RETURN(const json* ids, r.Array(*entry, "ids", entry_path));
          for (size_t k = 0; k < ids->size(); ++k) {
            EXL3_ASSIGN_OR_RETURN(int32_t id, r.Id((*ids)[k], Reader::Index(Reader::Sub(entry_path, "ids"), k)));
            piece.ids.push_back(id);
          }
        } else {
          EXL3_ASSIGN_OR_RETURN(int32_t id, IdOf(r, *impl, name, where));
          piece.ids.push_back(id);
        }
      } else {
        return r.Bad(where, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
      impl->single_template.push_back(std::move(piece));
    }
    return absl::OkStatus();
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    impl->single_template.clear();
    for (const char* key : {"cls", "sep"}) {
      const json* pair = Reader::Find(n, key);
      const std::string where = Reader::Sub(path, key);
      if (pair == nullptr || !pair->is_array() || pair->size() != 2) {
        return r.Bad(where, "expected [token, id]");
      }
      EXL3_ASSIGN_OR_RETURN(int32_t id, r.Id((*pair)[1], Reader::Index(where, 1)));
      if (std::string(key) == "sep") impl->single_template.push_back({true, {}});
      impl->single_template.push_back({false, {id}});
    }
    return absl::OkStatus();
  }
  return r.Unsupported(Reader::Sub(path, "type"), absl::StrCat("post-processor `", type, "`"));
}

absl::Status ParseAddedTokens(const Reader& r, const json& root, Tokenizer::Impl* impl) {
  const json* list = Reader::Find(root, "added_tokens");
  if (list == nullptr) return absl::OkStatus();
  if (!list->is_array()) return r.Bad("added_tokens", "expected an array");
  for (size_t i = 0; i < list->size(); ++i) {
    const json& t = (*list)[i];
    const std::string where = Reader::Index("added_tokens", i);
    if (!t.is_object()) return r.Bad(where, "expected an object");
    AddedToken token;
    const json* id = Reader::Find(t, "id");
    if (id == nullptr) return r.Bad(Reader::Sub(where, "id"), "missing");
    EXL3_ASSIGN_OR_RETURN(token.id, r.Id(*id, Reader::Sub(where, "id")));
    EXL3_ASSIGN_OR_RETURN(token.content, r.String(t, "content", where));
    if (token.content.empty()) return r.Bad(Reader::Sub(where, "content"), "empty");
    EXL3_ASSIGN_OR_RETURN(token.special, r.Bool(t, "special", where, false));
    EXL3_ASSIGN_OR_RETURN(token.lstrip, r.Bool(t, "lstrip", where, false));
    EXL3_ASSIGN_OR_RETURN(token.rstrip, r.Bool(t, "rstrip", where, false));
    EXL3_ASSIGN_OR_RETURN(token.single_word, r.Bool(t, "single_word", where, false));
    EXL3_ASSIGN_OR_RETURN(token.normalized, r.Bool(t, "normalized", where, !token.special));
    impl->added.push_back(std::move(token));
  }
  return absl::OkStatus();
}

// bos_token etc. are a string, {"content": ...} (AddedToken form) or null.
absl::StatusOr<std::optional<std::string>> ConfigToken(const Reader& r, const json& config, const char* key) {
  const json* v = Reader::Find(config, key);
  if (v == nullptr) return std::optional<std::string>();
  if (v->is_string()) return std::optional<std::string>(v->get<std::string>());
  if (v->is_object()) {
    EXL3_ASSIGN_OR_RETURN(std::string content, r.String(*v, "content", key));
    return std::optional<std::string>(std::move(content));
  }
  return r.Bad(key, "expected a string or an object with `content`");
}

absl::Status ParseConfig(const Reader& r, const json& config, Tokenizer::Impl* impl) {
  if (!config.is_object()) return r.Bad("", "expected an object");
  std::optional<std::string> names[3];
  std::optional<int32_t>* slots[3] = {&impl->special_ids.bos, &impl->special_ids.eos, &impl->special_ids.pad};
  const char* keys[3] = {"bos_token", "eos_token", "pad_token"};
  for (int i = 0; i < 3; ++i) {
    EXL3_ASSIGN_OR_RETURN(names[i], ConfigToken(r, config, keys[i]));
    if (names[i]) {
      auto it = impl->added_by_content.find(*names[i]);
      if (it != impl->added_by_content.end()) *slots[i] = it->second;
      else if (auto id = impl->model.TokenToId(*names[i])) *slots[i] = *id;
      else return r.Bad(keys[i], absl::StrCat("token `", *names[i], "` is not in the vocabulary"));
    }
  }
  if (const json* tmpl = Reader::Find(config, "chat_template"); tmpl != nullptr) {
    if (tmpl->is_string()) {
      impl->chat_template = tmpl->get<std::string>();
    } else if (tmpl->is_array()) {
      for (size_t i = 0; i < tmpl->size(); ++i) {
        const std::string where = Reader::Index("chat_template", i);
        EXL3_ASSIGN_OR_RETURN(std::string name, r.String((*tmpl)[i], "name", where));
        if (name == "default") {
          EXL3_ASSIGN_OR_RETURN(impl->chat_template, r.String((*tmpl)[i], "template", where));
        }
      }
    } else {
      return r.Bad("chat_template", "expected a string or a list of {name, template}");
    }
  }
  // transformers' LlamaTokenizerFast rebuilds the post-processor from these
  // two flags (defaults: BOS yes, EOS no).
  EXL3_ASSIGN_OR_RETURN(std::string cls, r.StringOr(config, "tokenizer_class", "", ""));
  if (cls == "LlamaTokenizer" || cls == "LlamaTokenizerFast") {
    EXL3_ASSIGN_OR_RETURN(bool add_bos, r.Bool(config, "add_bos_token", "", true));
    EXL3_ASSIGN_OR_RETURN(bool add_eos, r.Bool(config, "add_eos_token", "", false));
    if (add_bos && !impl->special_ids.bos) return r.Bad("add_bos_token", "true but there is no bos_token");
    if (add_eos && !impl->special_ids.eos) return r.Bad("add_eos_token", "true but there is no eos_token");
    impl->single_template.clear();
    if (add_bos) impl->single_template.push_back({false, {*impl->special_ids.bos}});
    impl->single_template.push_back({true, {}});
    if (add_eos) impl->single_template.push_back({false, {*impl->special_ids.eos}});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view tokenizer_json,
                                                               std::string_view tokenizer_config_json,
                                                               std::string_view label) {
  const std::string file = absl::StrCat(AbslView(label), "/tokenizer.json");
  const Reader r(file);
  EXL3_ASSIGN_OR_RETURN(json root, sharding::ParseJson(tokenizer_json, file));
  if (!root.is_object()) return r.Bad("", "expected an object");
  auto impl = std::make_unique<Impl>();
  EXL3_ASSIGN_OR_RETURN(impl->model, ParseModel(r, root));
  EXL3_RETURN_IF_ERROR(ParseAddedTokens(r, root, impl.get()));
  impl->IndexAddedTokens();
  if (const json* n = Reader::Find(root, "normalizer"); n != nullptr) {
    EXL3_RETURN_IF_ERROR(ParseNormalizer(r, *n, "normalizer", &impl->normalizers));
  }
  if (const json* n = Reader::Find(root, "pre_tokenizer"); n != nullptr) {
    EXL3_RETURN_IF_ERROR(ParsePreTokenizer(r, *n, "pre_tokenizer", &impl->pre_tokenizers));
  }
  if (const json* n = Reader::Find(root, "decoder"); n != nullptr) {
    EXL3_RETURN_IF_ERROR(ParseDecoder(r, *n, "decoder", &impl->decoders));
  }
  if (const json* n = Reader::Find(root, "post_processor"); n != nullptr) {
    EXL3_RETURN_IF_ERROR(ParsePostProcessor(r, *n, "post_processor", impl.get()));
  }
  if (!tokenizer_config_json.empty()) {
    const std::string config_file = absl::StrCat(AbslView(label), "/tokenizer_config.json");
    EXL3_ASSIGN_OR_RETURN(json config, sharding::ParseJson(tokenizer_config_json, config_file));
    EXL3_RETURN_IF_ERROR(ParseConfig(Reader(config_file), config, impl.get()));
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& model_dir) {
  for (const char* name : {"/tokenizer.json", "/tokenizer_config.json"}) {
    std::error_code error;
    const uintmax_t bytes = std::filesystem::file_size(model_dir + name, error);
    if (!error && bytes > kMaxTokenizerFileBytes) {
      return absl::DataLossError(absl::StrCat(model_dir, name, ": ", bytes,
                                              " bytes, over kMaxTokenizerFileBytes = ",
                                              kMaxTokenizerFileBytes));
    }
  }
  EXL3_ASSIGN_OR_RETURN(std::string tokenizer_json,
                        sharding::ReadFileToString(model_dir + "/tokenizer.json"));
  std::string config_json;
  absl::StatusOr<std::string> config = sharding::ReadFileToString(model_dir + "/tokenizer_config.json");
  if (config.ok()) {
    config_json = std::move(*config);
  } else if (!absl::IsNotFound(config.status())) {
    return config.status();
  }
  return FromJson(tokenizer_json, config_json, model_dir);
}

}  // namespace exl3serve::coordinator
