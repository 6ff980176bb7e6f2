#include "worker/model/calibration.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "sharding/model_arch.h"
#include "sharding/quant/hessian.h"
#include "sharding/safetensors_json.h"
#include "worker/model/kv_cache.h"
#include "worker/model/transformer.h"

namespace exl3serve::worker {

using sharding::LinearRole;
using sharding::LinearSpec;
using sharding::quant::HessianAccumulator;

CalibrationHessians::~CalibrationHessians() = default;

absl::StatusOr<std::unique_ptr<CalibrationHessians>> CalibrationHessians::Collect(
    const std::string& model_dir, const std::vector<std::vector<int32_t>>& sequences) {
  if (sequences.empty()) {
    return absl::InvalidArgumentError("calibration: no sequences");
  }
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Transformer> model, Transformer::Load(model_dir));
  const sharding::ModelArch& arch = model->config().arch;
  std::unique_ptr<CalibrationHessians> result(new CalibrationHessians());
  // Linears reading the same activations share one accumulator.
  for (const LinearSpec& l : arch.linears) {
    std::string source = l.key;
    if (l.role == LinearRole::kK || l.role == LinearRole::kV) {
      source = arch.Find(l.layer, LinearRole::kQ)->key;
    } else if (l.role == LinearRole::kKVA) {  // MLA: reads the layer input, as q_a (or q) does
      const LinearSpec* q = arch.Find(l.layer, LinearRole::kQA);
      source = (q != nullptr ? q : arch.Find(l.layer, LinearRole::kQ))->key;
    } else if (l.role == LinearRole::kUp) {
      source = arch.Find(l.layer, LinearRole::kGate, l.expert)->key;
    }
    result->input_of_[l.key] = source;
    if (source == l.key && l.quantized) {
      result->acc_[l.key] = std::make_unique<HessianAccumulator>(l.in_features);
    }
  }
  int64_t longest = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    if (sequences[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("calibration: sequence ", i, " is empty"));
    }
    for (int32_t id : sequences[i]) {
      if (id < 0 || id >= arch.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("calibration: token id ", id,
                                                       " is outside the vocabulary [0, ",
                                                       arch.vocab_size, ")"));
      }
    }
    longest = std::max<int64_t>(longest, static_cast<int64_t>(sequences[i].size()));
  }
  KvCacheOptions cache_options;
  cache_options.dtype = KvCacheDtype::kFp32;  // calibration wants the model's own activations
  cache_options.num_pages = (longest + cache_options.page_size_tokens - 1) /
                            cache_options.page_size_tokens;
  EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, model->CreateKvCache(cache_options));
  model->SetInputObserver(result.get());
  std::vector<float> logits;
  for (const std::vector<int32_t>& seq : sequences) {
    EXL3_RETURN_IF_ERROR(cache.AddSequence(0));
    SequenceTokens entry{0, std::span<const int32_t>(seq)};
    absl::Status status = model->Forward({&entry, 1}, LogitsRows::kLastToken, &cache, &logits);
    EXL3_RETURN_IF_ERROR(cache.RemoveSequence(0));
    EXL3_RETURN_IF_ERROR(status);
    result->tokens_ += static_cast<int64_t>(seq.size());
  }
  model->SetInputObserver(nullptr);
  return result;
}

void CalibrationHessians::ObserveInput(const std::string& key, const float* x, int64_t rows,
                                       int64_t in_features) {
  auto it = acc_.find(key);
  if (it == acc_.end() || it->second->k() != in_features) return;
  it->second->Add(x, rows, in_features);
}

absl::StatusOr<std::optional<sharding::HessianProvider::MeanHessian>>
CalibrationHessians::InputHessian(const LinearSpec& linear) {
  auto source = input_of_.find(linear.key);
  if (source == input_of_.end()) return std::optional<MeanHessian>();
  auto it = acc_.find(source->second);
  if (it == acc_.end() || it->second->count() == 0) return std::optional<MeanHessian>();
  const HessianAccumulator& acc = *it->second;
  MeanHessian mean;
  mean.count = acc.count();
  mean.h.resize(acc.sum().size());
  const double inv = 1.0 / static_cast<double>(acc.count());
  for (size_t i = 0; i < mean.h.size(); ++i) mean.h[i] = static_cast<float>(acc.sum()[i] * inv);
  return std::optional<MeanHessian>(std::move(mean));
}

absl::StatusOr<CalibrationText> ReadCalibrationFile(const std::string& path) {
  EXL3_ASSIGN_OR_RETURN(std::string contents, sharding::ReadFileToString(path));
  CalibrationText out;
  absl::StatusOr<nlohmann::json> json = sharding::ParseJson(contents, path);
  auto ids_of = [&](const nlohmann::json& array, std::vector<int32_t>* ids) {
    if (!array.is_array() || array.empty()) return false;
    for (const auto& v : array) {
      if (!v.is_number_integer()) return false;
      ids->push_back(v.get<int32_t>());
    }
    return true;
  };
  if (json.ok() && json->is_array() && !json->empty()) {
    if ((*json)[0].is_array()) {
      for (const auto& row : *json) {
        std::vector<int32_t> ids;
        if (!ids_of(row, &ids)) {
          return absl::InvalidArgumentError(
              absl::StrCat(path, ": expected an array of arrays of token ids"));
        }
        out.sequences.push_back(std::move(ids));
      }
      return out;
    }
    std::vector<int32_t> ids;
    if (ids_of(*json, &ids)) {
      out.sequences.push_back(std::move(ids));
      return out;
    }
  }
  if (contents.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty"));
  out.was_text = true;
  out.text = std::move(contents);
  return out;
}

std::vector<std::vector<int32_t>> SplitIntoSequences(const std::vector<int32_t>& ids,
                                                     int64_t max_tokens_per_sequence) {
  std::vector<std::vector<int32_t>> out;
  const int64_t step = std::max<int64_t>(1, max_tokens_per_sequence);
  for (size_t i = 0; i < ids.size(); i += static_cast<size_t>(step)) {
    out.emplace_back(ids.begin() + i, ids.begin() + std::min(ids.size(), i + step));
  }
  return out;
}

}  // namespace exl3serve::worker
