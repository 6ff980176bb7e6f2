// libFuzzer target: a model's config.json (and generation_config.json after
// a NUL byte) through worker::ModelConfigFromJson, which every loader and
// `inspect`/`plan` call. Contract: no crash or UB; a refusal is a status with
// a message; an accepted config has positive sizes that divide as the forward
// pass assumes (heads x head_dim, kv heads dividing heads).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "nlohmann/json.hpp"
#include "worker/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const nlohmann::json config = nlohmann::json::parse(input.substr(0, nul), nullptr, false);
  if (config.is_discarded()) return 0;
  nlohmann::json generation;
  const nlohmann::json* gen = nullptr;
  if (nul != std::string::npos) {
    generation = nlohmann::json::parse(input.substr(nul + 1), nullptr, false);
    if (!generation.is_discarded()) gen = &generation;
  }
  auto parsed = exl3serve::worker::ModelConfigFromJson(config, gen);
  if (!parsed.ok()) {
    if (parsed.status().message().empty() || parsed.status().code() == absl::StatusCode::kOk) std::abort();
    return 0;
  }
  const auto& a = parsed->arch;
  if (a.num_layers <= 0 || a.hidden_size <= 0 || a.vocab_size <= 0) std::abort();
  if (a.num_attention_heads <= 0 || a.num_key_value_heads <= 0 || a.head_dim <= 0 ||
      a.num_attention_heads % a.num_key_value_heads != 0) {
    std::abort();
  }
  (void)exl3serve::worker::RopeInverseFrequencies(*parsed);
  return 0;
}
