#include "sharding/converter.h"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/reconstruct.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"
#include "nlohmann/json.hpp"
#include "sharding/progress_bar.h"
#include "sharding/quant/bit_allocation.h"
#include "sharding/quant/hessian.h"
#include "sharding/quant/quantize_linear.h"
#include "sharding/safetensors.h"
#include "sharding/safetensors_json.h"

namespace exl3serve::sharding {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr absl::string_view kWorkDirName = ".exl3-work";
constexpr absl::string_view kJobFileName = "job.json";
constexpr absl::string_view kReportMetadataKey = "exl3serve.report";
// Bumped when the work files' meaning changes, so a resume never mixes them.
constexpr int kWorkFormatVersion = 1;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

const char* OutScalesName(OutScalesMode mode) {
  switch (mode) {
    case OutScalesMode::kNever: return "never";
    case OutScalesMode::kAuto: return "auto";
    case OutScalesMode::kAlways:
    default: return "always";
  }
}

// Safetensors dtype tag -> the torch name quantization_config.json uses (§2.3).
const char* TorchDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF16: return "torch.float16";
    case DType::kBF16: return "torch.bfloat16";
    case DType::kF32: return "torch.float32";
    case DType::kF64: return "torch.float64";
    case DType::kI16: return "torch.int16";
    case DType::kI32: return "torch.int32";
    case DType::kI64: return "torch.int64";
    case DType::kU8: return "torch.uint8";
    case DType::kI8: return "torch.int8";
    case DType::kBool: return "torch.bool";
    default: return "other";
  }
}

// The loaded source model.
// FP8 sources: DeepSeek-V3/R1 and Kimi K2 are published with F8_E4M3
// linears, each with an fp32 `<module>.weight_scale_inv` of one scale per
// block of weight_block_size (quantization_config, [128, 128]); the weight is
// fp8 value x its block's scale (architectures.md §2.4: exllamav3 dequantizes
// them the same way before quantizing).
struct Fp8Blocks {
  int64_t out = 128;
  int64_t in = 128;
};

struct Source {
  std::unique_ptr<SafetensorsCheckpoint> ckpt;
  nlohmann::json config;
  ModelArch arch;
  Fp8Blocks fp8_blocks;
};

// A conversion unit: consecutive linears converted and resumed together.
struct ModuleGroup {
  std::string name;                       // e.g. model.layers.3.self_attn
  std::vector<const LinearSpec*> linears;
  int layer = -1;
};

absl::Status CheckFloatDType(const SafetensorsCheckpoint::Located& t) {
  const DType d = t.info->dtype;
  if (d == DType::kF16 || d == DType::kBF16 || d == DType::kF32) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(
      "tensor `", t.info->name, "` has dtype ", std::string(DTypeName(d)),
      "; the converter reads BF16, F16 and F32 weights, and F8_E4M3 linear weights with a "
      "`weight_scale_inv` (dequantize other FP8/int checkpoints first)"));
}

// An OCP E4M3 (e4m3fn) byte: bias 7, no infinities, 0x7F / 0xFF are NaN.
float E4M3ToFloat(uint8_t b) {
  const int exponent = (b >> 3) & 15, mantissa = b & 7;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa) / 8.0f, -6)
                                        : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f,
                                                     exponent - 7);
  return (b & 0x80) ? -magnitude : magnitude;
}

std::string ScaleInvName(const std::string& weight_name) {
  const std::string suffix(kWeightSuffix);
  return weight_name.substr(0, weight_name.size() - suffix.size()) + ".weight_scale_inv";
}

// A linear weight `t` (out x in) as fp32: as stored, or an F8_E4M3 weight
// times its `weight_scale_inv` block scales. Errors: Unimplemented for
// another dtype; DataLoss, naming the tensors, for a missing or misshapen
// scale or a NaN byte.
absl::StatusOr<std::vector<float>> ReadLinearWeight(const SafetensorsCheckpoint& ckpt,
                                                    const SafetensorsCheckpoint::Located& t,
                                                    int64_t out, int64_t in, Fp8Blocks blocks) {
  if (t.info->dtype != DType::kF8E4M3) {
    EXL3_RETURN_IF_ERROR(CheckFloatDType(t));
    return t.file->ReadAsFloat(*t.info);
  }
  const std::string scale_name = ScaleInvName(t.info->name);
  auto scale = ckpt.Find(scale_name);
  if (!scale) {
    return absl::DataLossError(absl::StrCat("tensor `", t.info->name, "` is F8_E4M3 but `",
                                            scale_name, "` (its block scales) is missing"));
  }
  EXL3_RETURN_IF_ERROR(CheckFloatDType(*scale));
  const int64_t rows = (out + blocks.out - 1) / blocks.out;
  const int64_t cols = (in + blocks.in - 1) / blocks.in;
  if (scale->info->shape != std::vector<int64_t>{rows, cols}) {
    return absl::DataLossError(absl::StrCat(
        "tensor `", scale_name, "` has shape ", ShapeToString(scale->info->shape), ", blocks of [",
        blocks.out, ",", blocks.in, "] (quantization_config.weight_block_size) over [", out, ",",
        in, "] imply [", rows, ",", cols, "]"));
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> scales, scale->file->ReadAsFloat(*scale->info));
  std::vector<uint8_t> bytes(static_cast<size_t>(out * in));
  t.file->ReadTensorBytes(*t.info, bytes.data());
  std::vector<float> w(bytes.size());
  for (int64_t r = 0; r < out; ++r) {
    const float* row_scales = &scales[(r / blocks.out) * cols];
    for (int64_t c = 0; c < in; ++c) {
      const uint8_t b = bytes[r * in + c];
      if ((b & 0x7F) == 0x7F) {
        return absl::DataLossError(absl::StrCat("tensor `", t.info->name, "` holds NaN at [", r,
                                                ",", c, "]"));
      }
      w[r * in + c] = E4M3ToFloat(b) * row_scales[c / blocks.in];
    }
  }
  return w;
}

// Reads HF weight `name` (out x in) into a zero-padded (out_pad x in_pad) buffer.
absl::StatusOr<std::vector<float>> LoadPaddedWeight(const SafetensorsCheckpoint& ckpt,
                                                    const std::string& name, int64_t out,
                                                    int64_t in, int64_t out_pad, int64_t in_pad,
                                                    Fp8Blocks blocks) {
  auto t = ckpt.Find(name);
  if (!t) return absl::NotFoundError(absl::StrCat("tensor `", name, "` is missing"));
  if (t->info->shape != std::vector<int64_t>{out, in}) {
    return absl::DataLossError(absl::StrCat("tensor `", name, "` has shape ",
                                            ShapeToString(t->info->shape),
                                            ", config.json implies [", out, ",", in, "]"));
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> w, ReadLinearWeight(ckpt, *t, out, in, blocks));
  if (out == out_pad && in == in_pad) return w;
  std::vector<float> padded(static_cast<size_t>(out_pad * in_pad), 0.0f);
  for (int64_t r = 0; r < out; ++r) {
    std::memcpy(&padded[r * in_pad], &w[r * in], sizeof(float) * in);
  }
  return padded;
}

// Reads bias `name` ([out]) as fp16 bits zero-padded to out_pad; nullopt if absent.
absl::StatusOr<std::optional<std::vector<uint16_t>>> LoadBiasHalf(const SafetensorsCheckpoint& ckpt,
                                                                  const std::string& name,
                                                                  int64_t out, int64_t out_pad) {
  auto t = ckpt.Find(name);
  if (!t) return std::optional<std::vector<uint16_t>>();
  EXL3_RETURN_IF_ERROR(CheckFloatDType(*t));
  if (t->info->shape != std::vector<int64_t>{out}) {
    return absl::DataLossError(absl::StrCat("tensor `", name, "` has shape ",
                                            ShapeToString(t->info->shape), ", expected [", out,
                                            "]"));
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> b, t->file->ReadAsFloat(*t->info));
  std::vector<uint16_t> bits(out_pad, 0);
  for (int64_t i = 0; i < out; ++i) bits[i] = kernels::FloatToHalfBits(b[i]);
  return std::optional<std::vector<uint16_t>>(std::move(bits));
}

std::vector<uint16_t> ToHalfBits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = kernels::FloatToHalfBits(v[i]);
  return out;
}

// The HF weight name the head reads: lm_head.weight, or the tied embedding.
absl::StatusOr<std::string> HeadSourceName(const Source& src) {
  if (src.ckpt->Has("lm_head.weight")) return std::string("lm_head.weight");
  const std::string embed = src.arch.EmbedName();
  if (src.ckpt->Has(embed)) {
    // §2.5: a tied head is cloned from the embedding and quantized separately.
    return embed;
  }
  return absl::NotFoundError(absl::StrCat("tensor `lm_head.weight` is missing and there is no `",
                                          embed, "` to tie it to"));
}

// Names of all source tensors that belong to a linear (weight/bias).
std::set<std::string> LinearTensorNames(const ModelArch& arch) {
  std::set<std::string> names;
  for (const LinearSpec& l : arch.linears) {
    names.insert(l.key + std::string(kWeightSuffix));
    names.insert(l.key + std::string(kBiasSuffix));
    names.insert(l.key + ".weight_scale_inv");  // FP8 sources: consumed with the weight
  }
  return names;
}

std::vector<ModuleGroup> MakeGroups(const ModelArch& arch) {
  std::vector<ModuleGroup> groups;
  std::map<std::string, size_t> index;
  for (const LinearSpec& l : arch.linears) {
    auto [it, inserted] = index.emplace(l.module_group, groups.size());
    if (inserted) {
      groups.push_back(ModuleGroup{l.module_group, {}, l.layer});
    }
    groups[it->second].linears.push_back(&l);
  }
  return groups;
}

nlohmann::json ReportToJson(const ConvertedLinear& r) {
  return nlohmann::json{{"key", r.key},
                        {"in", r.in_features},
                        {"out", r.out_features},
                        {"bits", r.bits},
                        {"quantized", r.quantized},
                        {"relative_error", r.relative_error},
                        {"proxy_error", r.proxy_error},
                        {"seconds", r.seconds}};
}

ConvertedLinear ReportFromJson(const nlohmann::json& j) {
  ConvertedLinear r;
  r.key = j.value("key", std::string());
  r.in_features = j.value("in", int64_t{0});
  r.out_features = j.value("out", int64_t{0});
  r.bits = j.value("bits", 0);
  r.quantized = j.value("quantized", true);
  r.relative_error = j.value("relative_error", 0.0);
  r.proxy_error = j.value("proxy_error", 0.0);
  r.seconds = j.value("seconds", 0.0);
  return r;
}

// ||W_eff - W|| / ||W|| over the unpadded (out x in) weight, W_eff rebuilt
// from what will be stored (packed trellis, fp16 suh/svh): an end-to-end check
// of quantize -> pack -> decode.
absl::StatusOr<double> StoredRelativeError(const std::vector<uint16_t>& trellis, int64_t k,
                                           int64_t n, int bits, Codebook codebook,
                                           const std::vector<uint16_t>& suh_bits,
                                           const std::vector<uint16_t>& svh_bits,
                                           const std::vector<float>& w_padded_hf, int64_t out,
                                           int64_t in) {
  std::vector<float> suh(k), svh(n);
  for (int64_t i = 0; i < k; ++i) suh[i] = kernels::HalfBitsToFloat(suh_bits[i]);
  for (int64_t i = 0; i < n; ++i) svh[i] = kernels::HalfBitsToFloat(svh_bits[i]);
  kernels::Exl3LinearView view{trellis.data(), k, n, bits, codebook, suh.data(), svh.data(),
                               nullptr};
  std::vector<float> w_eff(static_cast<size_t>(k * n));
  EXL3_RETURN_IF_ERROR(kernels::ReconstructEffectiveWeight(view, w_eff.data()));
  double err = 0.0, ref = 0.0;
  for (int64_t o = 0; o < out; ++o) {
    for (int64_t i = 0; i < in; ++i) {
      const double w = w_padded_hf[o * k + i];  // HF (out, in), row stride k = in_pad
      const double q = w_eff[i * n + o];        // EXL3 (in, out)
      err += (q - w) * (q - w);
      ref += w * w;
    }
  }
  return ref > 0 ? std::sqrt(err / ref) : std::sqrt(err);
}

class Converter {
 public:
  explicit Converter(const ConvertOptions& options) : opt_(options) {}

  absl::StatusOr<ConvertReport> Run();

 private:
  absl::Status ValidateOptions() const;
  absl::Status OpenSource();
  absl::Status PrepareOutput();
  absl::Status Allocate();
  nlohmann::json JobDescription() const;
  absl::Status ConvertGroup(const ModuleGroup& group, int group_index, ProgressBar& progress,
                            std::vector<ConvertedLinear>* reports);
  absl::StatusOr<std::vector<ConvertedLinear>> LoadGroupReport(const ModuleGroup& group) const;
  absl::Status Compile(ConvertReport* report);
  std::string GroupFile(const ModuleGroup& group) const {
    return work_dir_ + "/" + group.name + ".safetensors";
  }
  int BitsOf(const LinearSpec& l) const { return bits_.at(l.key); }

  const ConvertOptions& opt_;
  Source src_;
  std::string work_dir_;
  std::map<std::string, int> bits_;  // K per quantized linear
  int threads_ = 1;
};

absl::Status Converter::ValidateOptions() const {
  if (opt_.in_dir.empty()) return absl::InvalidArgumentError("--in must name a model directory");
  if (opt_.out_dir.empty()) return absl::InvalidArgumentError("--out must name a directory");
  if (!(opt_.bits >= 1.0 && opt_.bits <= 8.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("--bits must be in [1, 8], got %g", opt_.bits));
  }
  if (!((opt_.head_bits >= 1 && opt_.head_bits <= 8) || opt_.head_bits == 16)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--head-bits must be 1..8, or 16 to keep lm_head in fp16, got ", opt_.head_bits));
  }
  if (opt_.max_shard_bytes == 0) {
    return absl::InvalidArgumentError("--shard-size must be > 0 MiB");
  }
  if (opt_.threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--threads must be >= 0, got ", opt_.threads));
  }
  std::error_code ec;
  if (fs::weakly_canonical(opt_.in_dir, ec) == fs::weakly_canonical(opt_.out_dir, ec)) {
    return absl::InvalidArgumentError("--out must differ from --in");
  }
  return absl::OkStatus();
}

absl::Status Converter::OpenSource() {
  std::error_code ec;
  if (!fs::is_directory(opt_.in_dir, ec)) {
    return absl::NotFoundError(absl::StrCat("input model directory ", opt_.in_dir,
                                            " does not exist"));
  }
  EXL3_ASSIGN_OR_RETURN(src_.config, ReadJsonFile(opt_.in_dir + "/config.json"));
  if (auto qc = src_.config.find("quantization_config");
      qc != src_.config.end() && qc->is_object() && qc->contains("quant_method") &&
      (*qc)["quant_method"] == "exl3") {  // (value() would throw on a non-string)
    return absl::InvalidArgumentError(absl::StrCat(
        opt_.in_dir, " is already an EXL3 model; convert from the original weights"));
  }
  if (auto qc = src_.config.find("quantization_config");
      qc != src_.config.end() && qc->is_object() && qc->contains("weight_block_size")) {
    const nlohmann::json& block = (*qc)["weight_block_size"];
    if (!block.is_array() || block.size() != 2 || !block[0].is_number_integer() ||
        !block[1].is_number_integer() || block[0].get<int64_t>() <= 0 ||
        block[1].get<int64_t>() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          opt_.in_dir, "/config.json: `quantization_config.weight_block_size` must be two "
          "integers > 0, got ", block.dump()));
    }
    src_.fp8_blocks = {block[0].get<int64_t>(), block[1].get<int64_t>()};
  }
  absl::StatusOr<ModelArch> arch = ModelArchFromConfig(src_.config);
  if (!arch.ok()) return Annotate(arch.status(), opt_.in_dir);
  src_.arch = std::move(*arch);
  EXL3_ASSIGN_OR_RETURN(src_.ckpt, SafetensorsCheckpoint::Open(opt_.in_dir));

  // Every linear must be present with the right shape and a float dtype before
  // any work starts, so a bad input fails in seconds, not after hours.
  for (const LinearSpec& l : src_.arch.linears) {
    std::string name = l.key + std::string(kWeightSuffix);
    if (l.is_head) {
      EXL3_ASSIGN_OR_RETURN(name, HeadSourceName(src_));
    }
    auto t = src_.ckpt->Find(name);
    if (!t) {
      return absl::NotFoundError(absl::StrCat(opt_.in_dir, ": tensor `", name,
                                              "` is missing (", src_.arch.architecture,
                                              " layer ", l.layer, ")"));
    }
    if (t->info->dtype == DType::kF8E4M3) {
      // An FP8 linear needs its block scales (read and checked with it).
      if (!src_.ckpt->Has(ScaleInvName(name))) {
        return absl::DataLossError(absl::StrCat(opt_.in_dir, ": tensor `", name,
                                                "` is F8_E4M3 but `", ScaleInvName(name),
                                                "` (its block scales) is missing"));
      }
    } else {
      EXL3_RETURN_IF_ERROR(Annotate(CheckFloatDType(*t), opt_.in_dir));
    }
    if (t->info->shape != std::vector<int64_t>{l.out_features, l.in_features}) {
      return absl::DataLossError(absl::StrCat(opt_.in_dir, ": tensor `", name, "` has shape ",
                                              ShapeToString(t->info->shape),
                                              ", config.json implies [", l.out_features, ",",
                                              l.in_features, "]"));
    }
  }
  if (!src_.ckpt->Has(src_.arch.EmbedName())) {
    return absl::NotFoundError(
        absl::StrCat(opt_.in_dir, ": tensor `", src_.arch.EmbedName(), "` is missing"));
  }
  return absl::OkStatus();
}

nlohmann::json Converter::JobDescription() const {
  nlohmann::json allocation = nlohmann::json::object();
  for (const auto& [key, k] : bits_) allocation[key] = k;
  return nlohmann::json{{"work_format", kWorkFormatVersion},
                        {"bits", opt_.bits},
                        {"head_bits", opt_.head_bits},
                        {"codebook", std::string(kernels::CodebookName(opt_.codebook))},
                        {"out_scales", std::string(OutScalesName(opt_.out_scales))},
                        {"calibrated", opt_.hessians != nullptr},
                        {"source_tensor_bytes", src_.ckpt->total_tensor_bytes()},
                        {"allocation", allocation}};
}

absl::Status Converter::PrepareOutput() {
  std::error_code ec;
  work_dir_ = opt_.out_dir + "/" + std::string(kWorkDirName);
  const std::string job_path = work_dir_ + "/" + std::string(kJobFileName);
  const nlohmann::json job = JobDescription();
  if (fs::exists(opt_.out_dir, ec)) {
    if (!fs::is_directory(opt_.out_dir, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--out ", opt_.out_dir, " exists and is not a directory"));
    }
    bool has_other = false;
    for (const auto& entry : fs::directory_iterator(opt_.out_dir, ec)) {
      if (entry.path().filename() != std::string(kWorkDirName)) has_other = true;
    }
    const bool has_work = fs::exists(job_path, ec);
    if (opt_.resume) {
      if (!has_work) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--resume: ", opt_.out_dir, " holds no interrupted conversion (no ",
            kWorkDirName, "/", kJobFileName, ")"));
      }
      EXL3_ASSIGN_OR_RETURN(nlohmann::json previous, ReadJsonFile(job_path));
      if (previous != job) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--resume: the interrupted conversion in ", opt_.out_dir,
            " used other options or another source (", previous.dump(),
            "); rerun with the same options or choose a new --out"));
      }
      return absl::OkStatus();
    }
    if (has_other || has_work) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--out ", opt_.out_dir,
          " is not empty; pass --resume to continue an interrupted conversion, or choose an "
          "empty directory"));
    }
  }
  fs::create_directories(work_dir_, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", work_dir_, ": ", ec.message()));
  }
  return WriteFileAtomically(job_path, job.dump(2));
}

absl::Status Converter::Allocate() {
  std::vector<quant::AllocationItem> items;
  for (const LinearSpec& l : src_.arch.linears) {
    if (!l.quantized || l.is_head) continue;
    quant::AllocationItem item;
    item.name = l.key;
    item.layer_index = l.layer;
    item.num_layers = src_.arch.num_layers;
    item.qgroup = l.qgroup;
    item.priority = l.priority;
    item.numel = PadToChannelGroup(l.in_features) * PadToChannelGroup(l.out_features);
    items.push_back(std::move(item));
  }
  EXL3_ASSIGN_OR_RETURN(quant::BitAllocation allocation, quant::AllocateBits(items, opt_.bits));
  for (size_t i = 0; i < items.size(); ++i) bits_[items[i].name] = allocation.bits[i];
  for (const LinearSpec& l : src_.arch.linears) {
    if (l.is_head) bits_[l.key] = opt_.head_bits;
    if (!l.quantized) bits_[l.key] = 16;
  }
  return absl::OkStatus();
}

absl::Status Converter::ConvertGroup(const ModuleGroup& group, int group_index,
                                     ProgressBar& progress, std::vector<ConvertedLinear>* reports) {
  std::vector<TensorToWrite> tensors;
  nlohmann::json report_json = nlohmann::json::array();
  for (const LinearSpec* spec : group.linears) {
    const auto start = Clock::now();
    ConvertedLinear report;
    report.key = spec->key;
    report.in_features = spec->in_features;
    report.out_features = spec->out_features;
    report.bits = BitsOf(*spec);
    const std::string weight_name =
        spec->is_head ? *HeadSourceName(src_) : spec->key + std::string(kWeightSuffix);

    if (!spec->quantized || report.bits == 16) {
      // Router / head at 16 bits: fp16 weight in HF orientation (§2.5). The
      // router stays unpadded; the head is padded to 128 rows of vocab.
      report.quantized = false;
      const int64_t out_pad = spec->is_head ? PadToChannelGroup(spec->out_features)
                                            : spec->out_features;
      EXL3_ASSIGN_OR_RETURN(std::vector<float> w,
                            LoadPaddedWeight(*src_.ckpt, weight_name, spec->out_features,
                                             spec->in_features, out_pad, spec->in_features,
                                             src_.fp8_blocks));
      tensors.push_back(TensorFromHalfBits(spec->key + std::string(kWeightSuffix), DType::kF16,
                                           {out_pad, spec->in_features}, ToHalfBits(w)));
      EXL3_ASSIGN_OR_RETURN(auto bias, LoadBiasHalf(*src_.ckpt, spec->key + ".bias",
                                                    spec->out_features, out_pad));
      if (bias) {
        tensors.push_back(TensorFromHalfBits(spec->key + std::string(kBiasSuffix), DType::kF16,
                                             {out_pad}, std::move(*bias)));
      }
      report.seconds = Seconds(start);
      report_json.push_back(ReportToJson(report));
      reports->push_back(report);
      continue;
    }

    const int64_t k = PadToChannelGroup(spec->in_features);
    const int64_t n = PadToChannelGroup(spec->out_features);
    EXL3_ASSIGN_OR_RETURN(std::vector<float> w,
                          LoadPaddedWeight(*src_.ckpt, weight_name, spec->out_features,
                                           spec->in_features, n, k, src_.fp8_blocks));
    // Calibration (§6.2): pad the provider's averaged H with zero rows and
    // columns for padded input channels, then damp and check it; a Hessian
    // without data falls back to quantization without error feedback.
    std::optional<quant::FinalizedHessian> hessian;
    if (opt_.hessians != nullptr) {
      EXL3_ASSIGN_OR_RETURN(std::optional<HessianProvider::MeanHessian> mean,
                            opt_.hessians->InputHessian(*spec));
      if (mean && mean->count > 0) {
        const int64_t in = spec->in_features;
        if (static_cast<int64_t>(mean->h.size()) != in * in) {
          return absl::InvalidArgumentError(absl::StrCat("hessian for `", spec->key, "` has ",
                                                         mean->h.size(), " values, expected ",
                                                         in, "^2"));
        }
        std::vector<float> padded(static_cast<size_t>(k * k), 0.0f);
        for (int64_t r = 0; r < in; ++r) {
          std::memcpy(&padded[r * k], &mean->h[r * in], sizeof(float) * in);
        }
        EXL3_ASSIGN_OR_RETURN(quant::FinalizedHessian finalized,
                              quant::FinalizeMeanHessian(std::move(padded), k, mean->count));
        if (!finalized.fallback) hessian = std::move(finalized);
      }
    }
    quant::QuantizeLinearOptions qopt;
    qopt.bits = report.bits;
    qopt.codebook = opt_.codebook;
    qopt.out_scales = opt_.out_scales;
    // §6.1: sign vectors seeded per module; the linear's index in the model
    // keeps every tensor's seed distinct and the run reproducible.
    qopt.seed = static_cast<uint64_t>(spec - src_.arch.linears.data());
    qopt.threads = threads_;
    qopt.hessian = hessian ? hessian->h.data() : nullptr;
    const std::string detail = absl::StrCat(spec->key, " K=", report.bits);
    int64_t reported = 0;
    progress.SetDetail(detail);
    EXL3_ASSIGN_OR_RETURN(
        quant::QuantizedLinear q,
        quant::QuantizeLinear(w.data(), n, k, qopt, [&](int64_t done, int64_t /*total*/) {
          // `done` is cumulative for this linear; the bar counts all tiles.
          const int64_t delta = done - reported;
          reported = done;
          if (delta > 0) progress.Advance(static_cast<uint64_t>(delta));
        }));
    std::vector<uint16_t> trellis(static_cast<size_t>(k / 16 * n / 16 * 16 * report.bits));
    EXL3_RETURN_IF_ERROR(Annotate(
        kernels::PackTensorStates(q.states.data(), k, n, report.bits, trellis.data()),
        spec->key));
    EXL3_ASSIGN_OR_RETURN(report.relative_error,
                          StoredRelativeError(trellis, k, n, report.bits, opt_.codebook, q.suh,
                                              q.svh, w, spec->out_features, spec->in_features));
    report.proxy_error = q.proxy_error;

    const std::string& key = spec->key;
    tensors.push_back(TensorFromHalfBits(key + std::string(kSuhSuffix), DType::kF16, {k},
                                         std::move(q.suh)));
    tensors.push_back(TensorFromHalfBits(key + std::string(kSvhSuffix), DType::kF16, {n},
                                         std::move(q.svh)));
    std::vector<int16_t> trellis_i16(trellis.size());
    std::memcpy(trellis_i16.data(), trellis.data(), trellis.size() * sizeof(uint16_t));
    tensors.push_back(TensorFromInt16(key + std::string(kTrellisSuffix),
                                      {k / 16, n / 16, 16 * report.bits},
                                      std::move(trellis_i16)));
    if (opt_.codebook == Codebook::kMcg) {
      tensors.push_back(TensorScalarInt32(key + std::string(kMcgSuffix), kMcgMarkerValue));
    } else if (opt_.codebook == Codebook::kMul1) {
      tensors.push_back(TensorScalarInt32(key + std::string(kMul1Suffix), kMul1MarkerValue));
    }
    if (!spec->is_head) {
      EXL3_ASSIGN_OR_RETURN(auto bias, LoadBiasHalf(*src_.ckpt, key + ".bias",
                                                    spec->out_features, n));
      if (bias) {
        tensors.push_back(TensorFromHalfBits(key + std::string(kBiasSuffix), DType::kF16, {n},
                                             std::move(*bias)));
      }
    }
    report.seconds = Seconds(start);
    report_json.push_back(ReportToJson(report));
    reports->push_back(report);
  }
  (void)group_index;
  return Annotate(WriteSafetensorsFile(GroupFile(group), std::move(tensors),
                                       {{std::string(kReportMetadataKey), report_json.dump()}}),
                  group.name);
}

absl::StatusOr<std::vector<ConvertedLinear>> Converter::LoadGroupReport(
    const ModuleGroup& group) const {
  EXL3_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(GroupFile(group)));
  auto it = file->metadata().find(std::string(kReportMetadataKey));
  if (it == file->metadata().end()) {
    return absl::DataLossError(absl::StrCat(GroupFile(group), ": no conversion report"));
  }
  EXL3_ASSIGN_OR_RETURN(nlohmann::json j, ParseJson(it->second, GroupFile(group)));
  std::vector<ConvertedLinear> out;
  try {  // a field of the wrong type (a damaged file) throws in json::value
    for (const auto& entry : j) out.push_back(ReportFromJson(entry));
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(GroupFile(group), ": malformed conversion report: ",
                                            e.what()));
  }
  if (out.size() != group.linears.size()) {
    return absl::DataLossError(absl::StrCat(GroupFile(group), ": report lists ", out.size(),
                                            " linears, expected ", group.linears.size()));
  }
  return out;
}

// One unit of the final shards: tensors that stay together in one file.
struct CompileUnit {
  std::vector<std::string> names;        // final tensor names, in order
  std::string source_file;               // work file, or empty for source tensors
};

absl::Status Converter::Compile(ConvertReport* report) {
  const std::vector<ModuleGroup> groups = MakeGroups(src_.arch);
  const std::set<std::string> linear_tensors = LinearTensorNames(src_.arch);

  // Plain tensors by layer (-1: before the layers, num_layers: after).
  std::map<int, std::vector<std::string>> plain_by_layer;
  int skipped_mtp = 0, skipped_vision = 0;
  const std::string embed_prefix = src_.arch.tensor_prefix + ".embed_tokens.";
  const std::string layers_prefix = src_.arch.tensor_prefix + ".layers.";
  for (const std::string& name : src_.ckpt->TensorNames()) {
    if (linear_tensors.count(name)) continue;
    int layer = src_.arch.num_layers;
    // Qwen3.5: the vision tower (image input is not served yet) and the
    // MTP head (`mtp.*`, not built yet) are not written.
    if (absl::StartsWith(name, "model.visual.") || absl::StartsWith(name, "visual.")) {
      ++skipped_vision;
      continue;
    }
    if (absl::StartsWith(name, "mtp.")) {
      ++skipped_mtp;
      continue;
    }
    if (absl::StartsWith(name, embed_prefix)) {
      layer = -1;
    } else if (absl::StartsWith(name, layers_prefix)) {
      layer = std::atoi(name.c_str() + layers_prefix.size());
      // Layers past num_hidden_layers are next-token-prediction (MTP) layers
      // (GLM-4 MoE): never built, so not written (architectures.md §1.3).
      if (layer >= src_.arch.num_layers) {
        ++skipped_mtp;
        continue;
      }
    }
    plain_by_layer[layer].push_back(name);
  }

  if (skipped_vision > 0) {
    EXL3_LOG(kInfo) << "convert: not writing " << skipped_vision
                    << " vision-tower tensor(s) (text-only model)";
  }
  if (skipped_mtp > 0) {
    EXL3_LOG(kInfo) << "convert: not writing " << skipped_mtp << " tensor(s) of layers >= "
                    << src_.arch.num_layers << " (next-token-prediction layers)";
  }
  // Work files stay open (mapped) while the shards are written.
  std::map<std::string, std::unique_ptr<SafetensorsFile>> work_files;
  std::vector<CompileUnit> units;
  auto add_plain = [&](int layer) {
    auto it = plain_by_layer.find(layer);
    if (it != plain_by_layer.end()) units.push_back(CompileUnit{it->second, ""});
  };
  auto add_group = [&](const ModuleGroup& g) -> absl::Status {
    EXL3_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(GroupFile(g)));
    CompileUnit unit{{}, GroupFile(g)};
    for (const TensorInfo& t : file->tensors()) unit.names.push_back(t.name);
    // Keep the writer's order (file order is by offset, which is write order).
    work_files[GroupFile(g)] = std::move(file);
    units.push_back(std::move(unit));
    return absl::OkStatus();
  };
  add_plain(-1);
  for (int l = 0; l < src_.arch.num_layers; ++l) {
    add_plain(l);
    for (const ModuleGroup& g : groups) {
      if (g.layer == l) EXL3_RETURN_IF_ERROR(add_group(g));
    }
  }
  add_plain(src_.arch.num_layers);
  for (const ModuleGroup& g : groups) {
    if (g.layer < 0) EXL3_RETURN_IF_ERROR(add_group(g));
  }

  // What each final tensor is: dtype, shape, bytes and where its data comes from.
  struct Planned {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    const SafetensorsFile* file;
    const TensorInfo* info;
    bool to_half;  // F32/F64 source carried over as F16 (§2.5)
  };
  auto plan_tensor = [&](const CompileUnit& unit, const std::string& name) -> Planned {
    if (!unit.source_file.empty()) {
      const SafetensorsFile* f = work_files.at(unit.source_file).get();
      const TensorInfo* info = f->Find(name);
      return Planned{name, info->dtype, info->shape, f, info, false};
    }
    const auto located = *src_.ckpt->Find(name);
    const DType d = located.info->dtype;
    const bool to_half = d == DType::kF32 || d == DType::kF64;
    return Planned{name, to_half ? DType::kF16 : d, located.info->shape, located.file,
                   located.info, to_half};
  };
  auto planned_bytes = [](const Planned& p) {
    uint64_t n = DTypeSize(p.dtype);
    for (int64_t d : p.shape) n *= static_cast<uint64_t>(d);
    return n;
  };

  const uint64_t shard_limit = opt_.max_shard_bytes;
  std::vector<std::vector<Planned>> shards(1);
  uint64_t shard_bytes = 0;
  for (const CompileUnit& unit : units) {
    std::vector<Planned> planned;
    uint64_t unit_bytes = 0;
    for (const std::string& name : unit.names) {
      planned.push_back(plan_tensor(unit, name));
      unit_bytes += planned_bytes(planned.back());
    }
    if (!shards.back().empty() && shard_bytes + unit_bytes > shard_limit) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    for (Planned& p : planned) shards.back().push_back(std::move(p));
    shard_bytes += unit_bytes;
  }

  const int num_shards = static_cast<int>(shards.size());
  std::map<std::string, std::string> weight_map;
  nlohmann::ordered_json storage = nlohmann::ordered_json::object();
  uint64_t total = 0;
  for (int s = 0; s < num_shards; ++s) {
    const std::string file_name =
        num_shards == 1 ? std::string(kSingleFileName)
                        : absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, num_shards);
    std::vector<TensorToWrite> tensors;
    for (const Planned& p : shards[s]) {
      TensorToWrite t;
      t.name = p.name;
      t.dtype = p.dtype;
      t.shape = p.shape;
      const SafetensorsFile* file = p.file;
      const TensorInfo* info = p.info;
      if (p.to_half) {
        t.fill = [file, info](std::span<uint8_t> out) -> absl::Status {
          EXL3_ASSIGN_OR_RETURN(std::vector<float> v, file->ReadAsFloat(*info));
          for (size_t i = 0; i < v.size(); ++i) {
            const uint16_t h = kernels::FloatToHalfBits(v[i]);
            std::memcpy(out.data() + 2 * i, &h, 2);
          }
          return absl::OkStatus();
        };
      } else {
        t.fill = [file, info](std::span<uint8_t> out) -> absl::Status {
          file->ReadTensorBytes(*info, out.data());
          return absl::OkStatus();
        };
      }
      weight_map[p.name] = file_name;
      total += planned_bytes(p);
      // quantization_config.json tensor_storage (§2.3), keyed by module.
      std::string module = p.name.substr(0, p.name.rfind('.'));
      nlohmann::ordered_json& entry = storage[module];
      nlohmann::ordered_json shape = nlohmann::ordered_json::array();
      for (int64_t d : p.shape) shape.push_back(d);
      entry["stored_tensors"][p.name] = {{"shape", shape},
                                         {"n_bytes", planned_bytes(p)},
                                         {"dtype", std::string(TorchDTypeName(p.dtype))}};
      tensors.push_back(std::move(t));
    }
    EXL3_RETURN_IF_ERROR(Annotate(
        WriteSafetensorsFile(opt_.out_dir + "/" + file_name, std::move(tensors),
                             {{"format", "pt"}, {"producer", "exl3serve"}}),
        file_name));
  }
  if (num_shards > 1) {
    EXL3_RETURN_IF_ERROR(WriteShardIndex(opt_.out_dir, total, weight_map));
  }
  for (const LinearSpec& l : src_.arch.linears) {
    auto it = storage.find(l.key);
    if (it == storage.end() || !l.quantized || BitsOf(l) == 16) continue;
    (*it)["quant_format"] = "exl3";
    (*it)["bits_per_weight"] = BitsOf(l);
    if (opt_.codebook == Codebook::kMcg) {
      (*it)["mcg_multiplier"] = static_cast<uint32_t>(kMcgMarkerValue);
    } else if (opt_.codebook == Codebook::kMul1) {
      (*it)["mul1_multiplier"] = static_cast<uint32_t>(kMul1MarkerValue);
    }
  }
  report->output_bytes = total;
  report->shards = num_shards;

  // quantization_config (§2.2): the achieved bits of the budget linears.
  double weighted = 0.0, count = 0.0, weighted_all = 0.0, count_all = 0.0;
  for (const LinearSpec& l : src_.arch.linears) {
    if (!l.quantized || BitsOf(l) == 16) continue;
    const double numel =
        static_cast<double>(PadToChannelGroup(l.in_features) * PadToChannelGroup(l.out_features));
    weighted_all += numel * BitsOf(l);
    count_all += numel;
    if (l.is_head) continue;
    weighted += numel * BitsOf(l);
    count += numel;
  }
  report->bits_achieved = count > 0 ? weighted / count : 0.0;
  report->bits_with_head = count_all > 0 ? weighted_all / count_all : 0.0;
  nlohmann::ordered_json qc = {
      {"quant_method", std::string(kQuantMethod)},
      {"version", std::string(kFormatVersion)},
      {"bits", std::round(report->bits_achieved * 100.0) / 100.0},
      {"head_bits", opt_.head_bits},
      {"calibration", {{"rows", opt_.calibration_rows}, {"cols", opt_.calibration_cols}}},
      {"out_scales", std::string(OutScalesName(opt_.out_scales))},
      {"codebook", std::string(kernels::CodebookName(opt_.codebook))}};
  nlohmann::ordered_json qc_file = qc;
  qc_file["tensor_storage"] = storage;
  EXL3_RETURN_IF_ERROR(
      WriteFileAtomically(opt_.out_dir + "/quantization_config.json", qc_file.dump(4)));

  // Copy the other files (tokenizer, generation config, ...), §2.1.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(opt_.in_dir, ec)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    if (name == "config.json" || name == "quantization_config.json" ||
        name == kShardIndexFileName || absl::EndsWith(name, ".safetensors") ||
        absl::EndsWith(name, ".bin") || absl::EndsWith(name, ".ckpt") ||
        absl::EndsWith(name, ".pth") || absl::EndsWith(name, ".pt")) {
      continue;
    }
    EXL3_ASSIGN_OR_RETURN(std::string contents, ReadFileToString(entry.path().string()));
    EXL3_RETURN_IF_ERROR(WriteFileAtomically(opt_.out_dir + "/" + name, contents));
  }
  // config.json last: its presence marks a complete model.
  nlohmann::json config = src_.config;
  config["quantization_config"] = nlohmann::json::parse(qc.dump());
  if (config.contains("tied_word_embeddings")) config["tied_word_embeddings"] = true;  // §2.2
  return WriteFileAtomically(opt_.out_dir + "/config.json", config.dump(2));
}

absl::StatusOr<ConvertReport> Converter::Run() {
  const auto start = Clock::now();
  EXL3_RETURN_IF_ERROR(ValidateOptions());
  EXL3_RETURN_IF_ERROR(OpenSource());
  threads_ = opt_.threads > 0 ? opt_.threads
                              : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  EXL3_RETURN_IF_ERROR(Allocate());
  EXL3_RETURN_IF_ERROR(PrepareOutput());

  const std::vector<ModuleGroup> groups = MakeGroups(src_.arch);
  ConvertReport report;
  uint64_t total_tiles = 0;
  for (const LinearSpec& l : src_.arch.linears) {
    if (l.quantized && BitsOf(l) != 16) {
      total_tiles += static_cast<uint64_t>(PadToChannelGroup(l.in_features) *
                                           PadToChannelGroup(l.out_features) / 256);
    }
  }
  ProgressBar progress("tiles", total_tiles, opt_.show_progress);
  std::error_code ec;
  for (size_t g = 0; g < groups.size(); ++g) {
    const ModuleGroup& group = groups[g];
    uint64_t group_tiles = 0;
    for (const LinearSpec* l : group.linears) {
      if (l->quantized && BitsOf(*l) != 16) {
        group_tiles += static_cast<uint64_t>(PadToChannelGroup(l->in_features) *
                                             PadToChannelGroup(l->out_features) / 256);
      }
    }
    if (opt_.resume && fs::exists(GroupFile(group), ec)) {
      absl::StatusOr<std::vector<ConvertedLinear>> previous = LoadGroupReport(group);
      if (previous.ok()) {
        for (ConvertedLinear& r : *previous) report.linears.push_back(std::move(r));
        ++report.resumed_groups;
        progress.Advance(group_tiles, group.name + " (resumed)");
        continue;
      }
      EXL3_LOG(kWarning) << "redoing " << group.name << ": " << previous.status().message();
    }
    EXL3_RETURN_IF_ERROR(Annotate(ConvertGroup(group, static_cast<int>(g), progress,
                                               &report.linears),
                                  absl::StrCat("converting ", group.name)));
  }
  progress.Finish();
  EXL3_RETURN_IF_ERROR(Compile(&report));
  fs::remove_all(work_dir_, ec);
  report.seconds = Seconds(start);
  return report;
}

}  // namespace

absl::StatusOr<ConvertReport> ConvertModel(const ConvertOptions& options) {
  Converter converter(options);
  return converter.Run();
}

}  // namespace exl3serve::sharding
