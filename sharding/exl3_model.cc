#include "sharding/exl3_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/trellis_decode.h"
#include "nlohmann/json.hpp"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

// The suffixes that belong to a quantized linear module (§2.4).
constexpr absl::string_view kLinearSuffixes[] = {kTrellisSuffix, kSuhSuffix, kSvhSuffix,
                                                kSuSuffix,      kSvSuffix,  kMcgSuffix,
                                                kMul1Suffix,    kBiasSuffix};

absl::Status Bad(const SafetensorsCheckpoint::Located& t, absl::string_view problem) {
  std::string file = t.file->path();
  if (size_t slash = file.rfind('/'); slash != std::string::npos) file = file.substr(slash + 1);
  return absl::DataLossError(absl::StrCat(file, ": tensor `", t.info->name, "`: ", problem));
}

std::string ShapeText(const std::vector<int64_t>& shape) { return ShapeToString(shape); }

bool IsFloatDType(DType dtype) {
  return dtype == DType::kF16 || dtype == DType::kBF16 || dtype == DType::kF32 ||
         dtype == DType::kF64;
}

// Converts `count` stored elements of `dtype` (a float type) at `src` —
// unaligned (§2.6), so copied element by element — to float, as
// SafetensorsFile::ReadAsFloat does for a whole tensor.
void StoredToFloat(DType dtype, const uint8_t* src, int64_t count, float* dst) {
  switch (dtype) {
    case DType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        dst[i] = kernels::HalfBitsToFloat(bits);
      }
      return;
    case DType::kBF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, 2);
        dst[i] = kernels::BitsToFloat(static_cast<uint32_t>(bits) << 16);
      }
      return;
    case DType::kF32:
      if (count > 0) std::memcpy(dst, src, static_cast<size_t>(count) * sizeof(float));
      return;
    case DType::kF64:
      for (int64_t i = 0; i < count; ++i) {
        double wide;
        std::memcpy(&wide, src + 8 * i, 8);
        dst[i] = static_cast<float>(wide);
      }
      return;
    default:
      EXL3_CHECK(false) << "StoredToFloat on " << std::string(DTypeName(dtype));
  }
}

// Elements [begin, end) of a 1-d float tensor as float.
std::vector<float> ReadFloatRange(const SafetensorsCheckpoint::Located& t, int64_t begin,
                                  int64_t end) {
  const int64_t elem = DTypeSize(t.info->dtype);
  std::vector<float> out(static_cast<size_t>(end - begin));
  StoredToFloat(t.info->dtype, t.file->Data(*t.info).data() + begin * elem, end - begin,
                out.data());
  return out;
}

// Channels [begin, end) (multiples of 16) of legacy packed signs (§5.4): bit
// b of word w is channel 16w + b, set = -1.
std::vector<float> ReadSignRange(const SafetensorsCheckpoint::Located& t, int64_t begin,
                                 int64_t end) {
  const uint8_t* words = t.file->Data(*t.info).data();
  std::vector<float> out(static_cast<size_t>(end - begin));
  for (int64_t c = begin; c < end; ++c) {
    uint16_t word;
    std::memcpy(&word, words + 2 * (c / 16), 2);
    out[c - begin] = ((word >> (c % 16)) & 1u) ? -1.0f : 1.0f;
  }
  return out;
}

absl::Status ExpectShape(const SafetensorsCheckpoint::Located& t, DType dtype,
                         const std::vector<int64_t>& shape) {
  if (t.info->dtype != dtype || t.info->shape != shape) {
    return Bad(t, absl::StrCat("is ", std::string(DTypeName(t.info->dtype)), " ", ShapeText(t.info->shape),
                               ", expected ", std::string(DTypeName(dtype)), " ", ShapeText(shape)));
  }
  return absl::OkStatus();
}

absl::Status CheckMarker(const SafetensorsCheckpoint::Located& t, int32_t expected) {
  if (t.info->dtype != DType::kI32 || !t.info->shape.empty()) {
    return Bad(t, absl::StrCat("codebook marker must be a 0-d I32, got ", std::string(DTypeName(t.info->dtype)),
                               " ", ShapeText(t.info->shape)));
  }
  EXL3_ASSIGN_OR_RETURN(int64_t value, t.file->ReadScalarInt(*t.info));
  if (value != expected) {
    return Bad(t, absl::StrCat("codebook marker holds ", value, ", expected ", expected,
                               " (other multipliers are not supported)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Exl3Model>> Exl3Model::Open(const std::string& dir) {
  std::unique_ptr<Exl3Model> model(new Exl3Model());
  model->dir_ = dir;
  EXL3_ASSIGN_OR_RETURN(nlohmann::json config, ReadJsonFile(dir + "/config.json"));
  if (!config.is_object()) {
    return absl::DataLossError(absl::StrCat(dir, "/config.json: not a JSON object"));
  }
  absl::StatusOr<ModelArch> arch = ModelArchFromConfig(config);
  if (arch.ok()) {
    model->arch_ = std::move(*arch);
  } else if (arch.status().code() != absl::StatusCode::kUnimplemented) {
    return Annotate(arch.status(), dir);
  }
  if (auto qc = config.find("quantization_config"); qc != config.end() && qc->is_object()) {
    QuantizationConfigSummary& s = model->quant_config_;
    s.present = true;
    // Advisory (§2.2): a field of another type is ignored, never trusted.
    // (json::value() throws on a type mismatch: a quant_method of 3 crashed
    // Open — found by tests/fuzz/model_folder_fuzz.cc.)
    auto text = [&](const char* key) {
      auto it = qc->find(key);
      return it != qc->end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    s.quant_method = text("quant_method");
    s.version = text("version");
    s.codebook = text("codebook");
    if (auto b = qc->find("bits"); b != qc->end() && b->is_number()) {
      const double bits = b->get<double>();
      if (std::isfinite(bits) && bits >= 0.0 && bits <= 32.0) s.bits = bits;
    }
    if (auto h = qc->find("head_bits"); h != qc->end() && h->is_number()) {
      const double head = h->get<double>();
      if (std::isfinite(head) && head >= 0.0 && head <= 32.0) s.head_bits = static_cast<int>(head);
    }
  }
  EXL3_ASSIGN_OR_RETURN(model->checkpoint_, SafetensorsCheckpoint::Open(dir));
  EXL3_RETURN_IF_ERROR(model->Describe());
  return model;
}

absl::Status Exl3Model::Describe() {
  const SafetensorsCheckpoint& ckpt = *checkpoint_;
  const std::vector<std::string> names = ckpt.TensorNames();
  std::set<std::string> modules;
  for (const std::string& name : names) {
    if (absl::EndsWith(name, kTrellisSuffix)) {
      modules.insert(name.substr(0, name.size() - kTrellisSuffix.size()));
    }
  }
  std::set<std::string> claimed;
  for (const std::string& key : modules) {
    Exl3LinearInfo info;
    info.key = key;
    const auto trellis = *ckpt.Find(key + std::string(kTrellisSuffix));
    const TensorInfo& t = *trellis.info;
    if (t.dtype != DType::kI16 || t.shape.size() != 3) {
      return Bad(trellis, absl::StrCat("trellis must be I16 [k/16, n/16, 16*K], got ",
                                       std::string(DTypeName(t.dtype)), " ", ShapeText(t.shape)));
    }
    info.k = t.shape[0] * 16;
    info.n = t.shape[1] * 16;
    if (t.shape[2] % 16 != 0 || t.shape[2] / 16 < kernels::kMinBits ||
        t.shape[2] / 16 > kernels::kMaxBits) {
      return Bad(trellis, absl::StrCat("last dimension ", t.shape[2],
                                       " is not 16*K for K in 1..8 (shape ", ShapeText(t.shape),
                                       ")"));
    }
    info.bits = static_cast<int>(t.shape[2] / 16);
    if (info.k == 0 || info.n == 0 || info.k % kChannelGroup != 0 ||
        info.n % kChannelGroup != 0) {
      return Bad(trellis, absl::StrCat("implies in x out = ", info.k, " x ", info.n,
                                       ", both must be positive multiples of 128"));
    }
    uint64_t bytes = t.ByteSize();
    auto find = [&](absl::string_view suffix) { return ckpt.Find(key + std::string(suffix)); };
    if (auto suh = find(kSuhSuffix)) {
      EXL3_RETURN_IF_ERROR(ExpectShape(*suh, DType::kF16, {info.k}));
      bytes += suh->info->ByteSize();
    } else if (auto su = find(kSuSuffix)) {
      EXL3_RETURN_IF_ERROR(ExpectShape(*su, DType::kI16, {info.k / 16}));
      info.legacy_signs = true;
      bytes += su->info->ByteSize();
    } else {
      return Bad(trellis, absl::StrCat("has no `", key, ".suh` (or legacy `.su`)"));
    }
    if (auto svh = find(kSvhSuffix)) {
      EXL3_RETURN_IF_ERROR(ExpectShape(*svh, DType::kF16, {info.n}));
      bytes += svh->info->ByteSize();
    } else if (auto sv = find(kSvSuffix)) {
      EXL3_RETURN_IF_ERROR(ExpectShape(*sv, DType::kI16, {info.n / 16}));
      info.legacy_signs = true;
      bytes += sv->info->ByteSize();
    } else {
      return Bad(trellis, absl::StrCat("has no `", key, ".svh` (or legacy `.sv`)"));
    }
    auto mcg = find(kMcgSuffix);
    auto mul1 = find(kMul1Suffix);
    if (mcg && mul1) {
      return Bad(*mcg, absl::StrCat("module `", key,
                                    "` carries both the mcg and the mul1 marker; one codebook "
                                    "per tensor"));
    }
    if (mcg) {
      EXL3_RETURN_IF_ERROR(CheckMarker(*mcg, kMcgMarkerValue));
      info.codebook = Codebook::kMcg;
      bytes += mcg->info->ByteSize();
    } else if (mul1) {
      EXL3_RETURN_IF_ERROR(CheckMarker(*mul1, kMul1MarkerValue));
      info.codebook = Codebook::kMul1;
      bytes += mul1->info->ByteSize();
    } else {
      info.codebook = Codebook::k3Inst;
    }
    if (auto bias = find(kBiasSuffix)) {
      const TensorInfo& b = *bias->info;
      if ((b.dtype != DType::kF16 && b.dtype != DType::kBF16 && b.dtype != DType::kF32) ||
          b.shape != std::vector<int64_t>{info.n}) {
        return Bad(*bias, absl::StrCat("bias must be F16 [", info.n, "], got ",
                                       std::string(DTypeName(b.dtype)), " ", ShapeText(b.shape)));
      }
      info.has_bias = true;
      bytes += b.ByteSize();
    }
    info.stored_bytes = bytes;
    for (absl::string_view suffix : kLinearSuffixes) claimed.insert(key + std::string(suffix));
    if (arch_) info.spec = arch_->FindByKey(key);
    if (info.spec != nullptr) {
      const int64_t want_k = PadToChannelGroup(info.spec->in_features);
      const int64_t want_n = PadToChannelGroup(info.spec->out_features);
      if (info.k != want_k || info.n != want_n) {
        return Bad(trellis, absl::StrCat("holds ", info.k, " x ", info.n,
                                         " (in x out, padded) but config.json implies ", want_k,
                                         " x ", want_n));
      }
    }
    linear_index_[key] = linears_.size();
    linears_.push_back(std::move(info));
  }

  for (const std::string& name : names) {
    if (claimed.count(name)) continue;
    const auto located = *ckpt.Find(name);
    for (absl::string_view suffix : {kSuhSuffix, kSvhSuffix, kSuSuffix, kSvSuffix, kMcgSuffix,
                                    kMul1Suffix}) {
      if (absl::EndsWith(name, suffix)) {
        return Bad(located, absl::StrCat("is part of an EXL3 linear but `",
                                         name.substr(0, name.size() - suffix.size()),
                                         ".trellis` is missing"));
      }
    }
    PlainTensorInfo plain;
    plain.name = name;
    plain.dtype = located.info->dtype;
    plain.shape = located.info->shape;
    plain.stored_bytes = located.info->ByteSize();
    plain_index_[name] = plain_.size();
    plain_.push_back(std::move(plain));
  }

  // Every linear the architecture defines must be there, quantized or plain.
  if (arch_) {
    for (const LinearSpec& spec : arch_->linears) {
      if (linear_index_.count(spec.key)) continue;
      const std::string weight = spec.key + std::string(kWeightSuffix);
      const PlainTensorInfo* plain = FindPlain(weight);
      if (plain == nullptr) {
        if (spec.is_head && arch_->tie_word_embeddings &&
            FindPlain(arch_->EmbedName()) != nullptr) {
          continue;  // tied head without a separate lm_head tensor
        }
        return absl::DataLossError(absl::StrCat(dir_, ": linear `", spec.key,
                                                "` is missing (neither `.trellis` nor `.weight`)"));
      }
      if (plain->shape.size() != 2 || plain->shape[1] < spec.in_features ||
          plain->shape[0] < spec.out_features) {
        return absl::DataLossError(absl::StrCat(
            dir_, ": tensor `", weight, "` has shape ", ShapeText(plain->shape),
            ", config.json implies at least [", spec.out_features, ",", spec.in_features, "]"));
      }
    }
  }
  return absl::OkStatus();
}

const Exl3LinearInfo* Exl3Model::FindLinear(std::string_view key) const {
  auto it = linear_index_.find(std::string(key));
  return it == linear_index_.end() ? nullptr : &linears_[it->second];
}

const Exl3LinearInfo* Exl3Model::FindLinear(int layer, LinearRole role, int expert) const {
  if (!arch_) return nullptr;
  const LinearSpec* spec = arch_->Find(layer, role, expert);
  return spec == nullptr ? nullptr : FindLinear(spec->key);
}

const PlainTensorInfo* Exl3Model::FindPlain(std::string_view name) const {
  auto it = plain_index_.find(std::string(name));
  return it == plain_index_.end() ? nullptr : &plain_[it->second];
}

double Exl3Model::AverageBitsPerWeight(bool include_head) const {
  double weighted = 0.0;
  double count = 0.0;
  for (const Exl3LinearInfo& l : linears_) {
    if (!include_head && l.spec != nullptr && l.spec->is_head) continue;
    if (!include_head && l.spec == nullptr && l.key == "lm_head") continue;
    const double numel = static_cast<double>(l.k) * static_cast<double>(l.n);
    weighted += numel * l.bits;
    count += numel;
  }
  return count > 0 ? weighted / count : 0.0;
}

absl::StatusOr<kernels::Exl3LinearData> Exl3Model::LoadLinear(std::string_view key_view) const {
  const absl::string_view key(key_view.data(), key_view.size());
  const Exl3LinearInfo* info = FindLinear(key_view);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(dir_, ": no quantized linear `", key, "`"));
  }
  const std::string base(key);
  auto get = [&](absl::string_view suffix) { return *checkpoint_->Find(base + std::string(suffix)); };
  kernels::Exl3LinearData data;
  data.k = info->k;
  data.n = info->n;
  data.bits = info->bits;
  data.codebook = info->codebook;
  const auto trellis = get(kTrellisSuffix);
  EXL3_ASSIGN_OR_RETURN(data.trellis, trellis.file->ReadAsUint16(*trellis.info));
  uint64_t bytes = trellis.info->ByteSize();

  // Legacy packed signs (§5.4): bit b of word w is channel 16w+b, set = -1.
  auto signs = [&](const SafetensorsCheckpoint::Located& t,
                   int64_t channels) -> absl::StatusOr<std::vector<float>> {
    EXL3_ASSIGN_OR_RETURN(std::vector<uint16_t> words, t.file->ReadAsUint16(*t.info));
    bytes += t.info->ByteSize();
    std::vector<float> out(channels);
    for (int64_t c = 0; c < channels; ++c) {
      out[c] = ((words[c / 16] >> (c % 16)) & 1u) ? -1.0f : 1.0f;
    }
    return out;
  };
  if (auto suh = checkpoint_->Find(base + std::string(kSuhSuffix))) {
    EXL3_ASSIGN_OR_RETURN(data.suh, suh->file->ReadAsFloat(*suh->info));
    bytes += suh->info->ByteSize();
  } else {
    EXL3_ASSIGN_OR_RETURN(data.suh, signs(get(kSuSuffix), info->k));
  }
  if (auto svh = checkpoint_->Find(base + std::string(kSvhSuffix))) {
    EXL3_ASSIGN_OR_RETURN(data.svh, svh->file->ReadAsFloat(*svh->info));
    bytes += svh->info->ByteSize();
  } else {
    EXL3_ASSIGN_OR_RETURN(data.svh, signs(get(kSvSuffix), info->n));
  }
  if (info->has_bias) {
    const auto bias = get(kBiasSuffix);
    EXL3_ASSIGN_OR_RETURN(data.bias, bias.file->ReadAsFloat(*bias.info));
    bytes += bias.info->ByteSize();
  }
  bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
  return data;
}

absl::StatusOr<std::vector<float>> Exl3Model::LoadTensorAsFloat(std::string_view name_view) const {
  const absl::string_view name(name_view.data(), name_view.size());
  auto located = checkpoint_->Find(name_view);
  if (!located) return absl::NotFoundError(absl::StrCat(dir_, ": no tensor `", name, "`"));
  EXL3_ASSIGN_OR_RETURN(std::vector<float> values, located->file->ReadAsFloat(*located->info));
  bytes_read_.fetch_add(located->info->ByteSize(), std::memory_order_relaxed);
  return values;
}

absl::StatusOr<kernels::Exl3LinearData> Exl3Model::LoadLinearSlice(
    std::string_view key_view, int64_t row_begin, int64_t row_end, int64_t col_begin,
    int64_t col_end, bool with_bias) const {
  const absl::string_view key(key_view.data(), key_view.size());
  const Exl3LinearInfo* info = FindLinear(key_view);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(dir_, ": no quantized linear `", key, "`"));
  }
  auto check = [&](const char* what, int64_t begin, int64_t end, int64_t limit) -> absl::Status {
    if (begin < 0 || end < begin || end > limit || begin % kChannelGroup != 0 ||
        end % kChannelGroup != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          dir_, ": linear `", key, "`: ", what, " range [", begin, ", ", end,
          ") must lie within [0, ", limit, ") with both ends multiples of ", kChannelGroup));
    }
    return absl::OkStatus();
  };
  EXL3_RETURN_IF_ERROR(check("row (input channel)", row_begin, row_end, info->k));
  EXL3_RETURN_IF_ERROR(check("column (output channel)", col_begin, col_end, info->n));

  const std::string base(key);
  auto get = [&](absl::string_view suffix) { return checkpoint_->Find(base + std::string(suffix)); };
  kernels::Exl3LinearData data;
  data.k = row_end - row_begin;
  data.n = col_end - col_begin;
  data.bits = info->bits;
  data.codebook = info->codebook;
  uint64_t bytes = 0;

  // Trellis [k/16][n/16][16K] (§3.1): a block of tile rows [tk0, tk1) and
  // tile columns [tn0, tn1) is one run of (tn1 - tn0) tiles per tile row, and
  // one run in all when the columns are complete.
  const auto trellis = *get(kTrellisSuffix);
  const uint8_t* src = trellis.file->Data(*trellis.info).data();
  const int64_t tile_words = trellis.info->shape[2];
  const int64_t tiles_n = info->n / 16;
  const int64_t tk0 = row_begin / 16, tk1 = row_end / 16;
  const int64_t tn0 = col_begin / 16;
  const int64_t run_words = (data.n / 16) * tile_words;
  data.trellis.resize(static_cast<size_t>((tk1 - tk0) * run_words));
  if (run_words > 0 && tk1 > tk0) {
    const size_t word = sizeof(uint16_t);
    if (data.n == info->n) {
      std::memcpy(data.trellis.data(), src + tk0 * tiles_n * tile_words * word,
                  data.trellis.size() * word);
    } else {
      for (int64_t tk = tk0; tk < tk1; ++tk) {
        std::memcpy(data.trellis.data() + (tk - tk0) * run_words,
                    src + (tk * tiles_n + tn0) * tile_words * word,
                    static_cast<size_t>(run_words) * word);
      }
    }
    bytes += data.trellis.size() * word;
  }

  if (auto suh = get(kSuhSuffix)) {
    data.suh = ReadFloatRange(*suh, row_begin, row_end);
    bytes += static_cast<uint64_t>(data.k) * DTypeSize(suh->info->dtype);
  } else {
    data.suh = ReadSignRange(*get(kSuSuffix), row_begin, row_end);
    bytes += static_cast<uint64_t>(data.k / 16) * sizeof(uint16_t);
  }
  if (auto svh = get(kSvhSuffix)) {
    data.svh = ReadFloatRange(*svh, col_begin, col_end);
    bytes += static_cast<uint64_t>(data.n) * DTypeSize(svh->info->dtype);
  } else {
    data.svh = ReadSignRange(*get(kSvSuffix), col_begin, col_end);
    bytes += static_cast<uint64_t>(data.n / 16) * sizeof(uint16_t);
  }
  if (with_bias && info->has_bias) {
    const auto bias = *get(kBiasSuffix);
    data.bias = ReadFloatRange(bias, col_begin, col_end);
    bytes += static_cast<uint64_t>(data.n) * DTypeSize(bias.info->dtype);
  }
  bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
  return data;
}

absl::StatusOr<std::vector<float>> Exl3Model::LoadTensorSliceAsFloat(std::string_view name_view,
                                                                     int64_t dim0_begin,
                                                                     int64_t dim0_end,
                                                                     int64_t dim1_begin,
                                                                     int64_t dim1_end) const {
  const absl::string_view name(name_view.data(), name_view.size());
  auto located = checkpoint_->Find(name_view);
  if (!located) return absl::NotFoundError(absl::StrCat(dir_, ": no tensor `", name, "`"));
  const TensorInfo& t = *located->info;
  if (t.shape.size() != 1 && t.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(dir_, ": tensor `", name, "` has shape ",
                                                   ShapeText(t.shape),
                                                   "; slices need a 1-d or 2-d tensor"));
  }
  if (!IsFloatDType(t.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(dir_, ": tensor `", name, "` is ",
                                                   std::string(DTypeName(t.dtype)),
                                                   ", expected F16, BF16, F32 or F64"));
  }
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  if (dim0_begin < 0 || dim0_end < dim0_begin || dim0_end > rows || dim1_begin < 0 ||
      dim1_end < dim1_begin || dim1_end > cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir_, ": tensor `", name, "`: block [", dim0_begin, ", ", dim0_end, ") x [", dim1_begin,
        ", ", dim1_end, ") is outside its shape ", ShapeText(t.shape),
        t.shape.size() == 1 ? " (1-d: the second range must be [0, 1))" : ""));
  }
  const int64_t elem = DTypeSize(t.dtype);
  const int64_t width = dim1_end - dim1_begin;
  std::vector<float> out(static_cast<size_t>((dim0_end - dim0_begin) * width));
  const uint8_t* src = located->file->Data(t).data();
  if (width == cols) {
    StoredToFloat(t.dtype, src + dim0_begin * cols * elem, static_cast<int64_t>(out.size()),
                  out.data());
  } else if (width > 0) {
    for (int64_t r = dim0_begin; r < dim0_end; ++r) {
      StoredToFloat(t.dtype, src + (r * cols + dim1_begin) * elem, width,
                    out.data() + (r - dim0_begin) * width);
    }
  }
  bytes_read_.fetch_add(static_cast<uint64_t>(out.size()) * elem, std::memory_order_relaxed);
  return out;
}

absl::StatusOr<std::vector<uint16_t>> Exl3Model::LoadTensorSlice16(std::string_view name_view,
                                                                   int64_t dim0_begin,
                                                                   int64_t dim0_end,
                                                                   int64_t dim1_begin,
                                                                   int64_t dim1_end) const {
  const absl::string_view name(name_view.data(), name_view.size());
  auto located = checkpoint_->Find(name_view);
  if (!located) return absl::NotFoundError(absl::StrCat(dir_, ": no tensor `", name, "`"));
  const TensorInfo& t = *located->info;
  if (t.dtype != DType::kBF16 && t.dtype != DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(dir_, ": tensor `", name, "` is ",
                                                   std::string(DTypeName(t.dtype)),
                                                   ", expected F16 or BF16"));
  }
  if (t.shape.size() != 1 && t.shape.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(dir_, ": tensor `", name, "` has shape ",
                                                   ShapeText(t.shape),
                                                   "; slices need a 1-d or 2-d tensor"));
  }
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape.size() == 2 ? t.shape[1] : 1;
  if (dim0_begin < 0 || dim0_end < dim0_begin || dim0_end > rows || dim1_begin < 0 ||
      dim1_end < dim1_begin || dim1_end > cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir_, ": tensor `", name, "`: block [", dim0_begin, ", ", dim0_end, ") x [", dim1_begin,
        ", ", dim1_end, ") is outside its shape ", ShapeText(t.shape)));
  }
  const int64_t width = dim1_end - dim1_begin;
  std::vector<uint16_t> out(static_cast<size_t>((dim0_end - dim0_begin) * width));
  const uint8_t* src = located->file->Data(t).data();
  if (width > 0) {
    for (int64_t r = dim0_begin; r < dim0_end; ++r) {
      std::memcpy(out.data() + (r - dim0_begin) * width, src + (r * cols + dim1_begin) * 2,
                  sizeof(uint16_t) * width);
    }
  }
  bytes_read_.fetch_add(static_cast<uint64_t>(out.size()) * 2, std::memory_order_relaxed);
  return out;
}

uint64_t Exl3Model::bytes_read() const { return bytes_read_.load(std::memory_order_relaxed); }

}  // namespace exl3serve::sharding
