#include "sharding/inspect.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "kernels/trellis_lut.h"

namespace exl3serve::sharding {

std::string FormatModelSummary(const Exl3Model& model) {
  std::string out;
  const auto& qc = model.quantization_config();
  absl::StrAppendFormat(&out, "model: %s\n", model.dir());
  if (model.arch()) {
    const ModelArch& a = *model.arch();
    absl::StrAppendFormat(&out,
                          "architecture: %s, %d layers, hidden %d, vocab %d, heads %d/%d (kv), "
                          "head_dim %d%s\n",
                          a.architecture, a.num_layers, a.hidden_size, a.vocab_size,
                          a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                          a.num_experts > 0 ? absl::StrFormat(", %d experts (top %d)",
                                                              a.num_experts,
                                                              a.num_experts_per_token)
                                            : std::string());
    if (a.shared_expert_intermediate_size > 0 || a.num_mtp_layers > 0) {
      int dense = 0;
      for (bool moe : a.layer_is_moe) dense += moe ? 0 : 1;
      absl::StrAppendFormat(&out,
                            "moe layers: %d dense first, shared expert width %d; %d MTP layer(s) "
                            "not built\n",
                            dense, a.shared_expert_intermediate_size, a.num_mtp_layers);
    }
    if (a.mla()) {
      // architectures.md §2: what attention holds and caches per token.
      absl::StrAppendFormat(
          &out,
          "mla: q_lora_rank %s, kv_lora_rank %d, q/k head %d nope + %d rope, v %d; kv_b_proj "
          "16-bit; latent cache %d + %d values per token per layer\n",
          a.q_lora_rank > 0 ? absl::StrCat(a.q_lora_rank) : std::string("null (q_proj)"),
          a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim, a.kv_lora_rank,
          a.qk_rope_head_dim);
    }
  }
  if (qc.present) {
    absl::StrAppendFormat(&out,
                          "quantization_config (advisory): method %s, version %s, bits %.2f, "
                          "head_bits %d, codebook %s\n",
                          qc.quant_method, qc.version, qc.bits, qc.head_bits, qc.codebook);
  }
  size_t width = 10;
  for (const Exl3LinearInfo& l : model.linears()) width = std::max(width, l.key.size());
  absl::StrAppendFormat(&out, "\n%-*s  %11s  %2s  %-8s  %-5s  %-4s  %12s\n",
                        static_cast<int>(width), "linear", "in x out", "K", "codebook", "signs",
                        "bias", "bytes");
  uint64_t quant_bytes = 0;
  for (const Exl3LinearInfo& l : model.linears()) {
    absl::StrAppendFormat(&out, "%-*s  %5d x %-5d  %2d  %-8s  %-5s  %-4s  %12d\n",
                          static_cast<int>(width), l.key, l.k, l.n, l.bits,
                          kernels::CodebookName(l.codebook), l.legacy_signs ? "su/sv" : "suh",
                          l.has_bias ? "yes" : "no", l.stored_bytes);
    quant_bytes += l.stored_bytes;
  }
  uint64_t plain_bytes = 0;
  for (const PlainTensorInfo& p : model.plain_tensors()) plain_bytes += p.stored_bytes;
  absl::StrAppendFormat(&out, "\n%d quantized linears, %d bytes; %d other tensors, %d bytes\n",
                        model.linears().size(), quant_bytes, model.plain_tensors().size(),
                        plain_bytes);
  absl::StrAppendFormat(&out,
                        "average bits per weight: %.3f (decoder linears), %.3f (with head)\n",
                        model.AverageBitsPerWeight(false), model.AverageBitsPerWeight(true));
  return out;
}

absl::StatusOr<DequantizedWeight> DequantizeWeight(const Exl3Model& model, std::string_view name_view) {
  const absl::string_view name(name_view.data(), name_view.size());
  std::string key(name);
  for (absl::string_view suffix : {kWeightSuffix, kTrellisSuffix}) {
    if (absl::EndsWith(key, suffix) && model.FindLinear(key.substr(0, key.size() - suffix.size()))) {
      key = key.substr(0, key.size() - suffix.size());
    }
  }
  DequantizedWeight result;
  if (const Exl3LinearInfo* info = model.FindLinear(key)) {
    EXL3_ASSIGN_OR_RETURN(kernels::Exl3LinearData data, model.LoadLinear(key));
    std::vector<float> w_eff(static_cast<size_t>(data.k * data.n));
    EXL3_RETURN_IF_ERROR(kernels::ReconstructEffectiveWeight(data.view(), w_eff.data()));
    int64_t out = data.n, in = data.k;
    if (info->spec != nullptr) {
      out = info->spec->out_features;
      in = info->spec->in_features;
    }
    result.shape = {out, in};
    result.values.resize(static_cast<size_t>(out * in));
    for (int64_t o = 0; o < out; ++o) {
      for (int64_t i = 0; i < in; ++i) result.values[o * in + i] = w_eff[i * data.n + o];
    }
    return result;
  }
  std::string plain_name = key;
  if (!model.FindPlain(plain_name)) plain_name = key + std::string(kWeightSuffix);
  if (const PlainTensorInfo* plain = model.FindPlain(plain_name)) {
    if (plain->shape.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("tensor `", plain_name, "` has shape ",
                                                     ShapeToString(plain->shape),
                                                     "; --dequant writes 2-d weights"));
    }
    result.shape = plain->shape;
    EXL3_ASSIGN_OR_RETURN(result.values, model.LoadTensorAsFloat(plain_name));
    return result;
  }
  return absl::NotFoundError(absl::StrCat("no layer `", name, "` in ", model.dir(),
                                          "; `exl3serve inspect ", model.dir(),
                                          "` lists the layers"));
}

}  // namespace exl3serve::sharding
