// libFuzzer target: an EXL3 model folder as a download would bring it —
// config.json, NUL, model.safetensors — written to a scratch directory and
// opened the way every loader does (sharding::Exl3Model::Open), then each
// quantized linear loaded whole and in 128-aligned slices, validated and
// decoded (kernels::DecodeInnerMatrix), each plain tensor converted to float,
// and, for a supported architecture, sharded over 1-3 ranks
// (sharding::PlanShards). Tensor shapes, dtypes, offsets, codebook markers
// (mcg/mul1), legacy su/sv signs and quantization_config are all fuzzed.
// Contract: no crash, leak or UB; a refusal is a status with a message and a
// code saying what is wrong (DataLoss, NotFound, InvalidArgument,
// Unimplemented, ResourceExhausted); whatever loads has the sizes its
// description promises.
#include <stdlib.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/reconstruct.h"
#include "sharding/exl3_model.h"
#include "sharding/shard_plan.h"

namespace sh = exl3serve::sharding;
namespace kn = exl3serve::kernels;

namespace {

// Work per input is bounded: linears and tensors larger than this are only
// described, not loaded.
constexpr uint64_t kMaxLoadBytes = 4 << 20;

void CheckRefusal(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      break;
    default:
      std::fprintf(stderr, "unexpected refusal: %s\n", s.ToString().c_str());
      std::abort();
  }
  if (s.message().empty()) std::abort();
}

bool WriteFile(const std::string& path, std::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  return std::fclose(f) == 0 && ok;
}

const std::string& ScratchDir() {
  static const std::string dir = [] {
    const char* base = std::getenv("TMPDIR");
    std::string t = std::string(base != nullptr ? base : "/tmp") + "/exl3-model-fuzz-XXXXXX";
    if (mkdtemp(t.data()) == nullptr) std::abort();
    return t;
  }();
  return dir;
}

void CheckLinear(const sh::Exl3Model& model, const sh::Exl3LinearInfo& info) {
  if (info.k <= 0 || info.n <= 0 || info.k % 128 != 0 || info.n % 128 != 0 || info.bits < 1 ||
      info.bits > 8) {
    std::abort();  // Open promises these (exl3_model.h)
  }
  if (info.stored_bytes > kMaxLoadBytes) return;
  absl::StatusOr<kn::Exl3LinearData> whole = model.LoadLinear(info.key);
  if (!whole.ok()) return CheckRefusal(whole.status());
  if (whole->k != info.k || whole->n != info.n || whole->bits != info.bits ||
      whole->trellis.size() != static_cast<size_t>(info.k * info.n / 16 * info.bits) ||
      whole->suh.size() != static_cast<size_t>(info.k) ||
      whole->svh.size() != static_cast<size_t>(info.n) ||
      (!whole->bias.empty() && whole->bias.size() != static_cast<size_t>(info.n))) {
    std::abort();
  }
  const kn::Exl3LinearView view = whole->view();
  if (!kn::ValidateExl3LinearView(view).ok()) std::abort();
  if (info.k * info.n <= (1 << 18)) {
    std::vector<uint16_t> w_h(static_cast<size_t>(info.k * info.n));
    if (!kn::DecodeInnerMatrix(view, w_h.data()).ok()) std::abort();
  }
  // The last 128 rows x first 128 columns, and one out-of-range request.
  absl::StatusOr<kn::Exl3LinearData> slice =
      model.LoadLinearSlice(info.key, info.k - 128, info.k, 0, 128, /*with_bias=*/true);
  if (!slice.ok()) return CheckRefusal(slice.status());
  if (slice->k != 128 || slice->n != 128 || slice->suh.size() != 128 || slice->svh.size() != 128 ||
      slice->trellis.size() != static_cast<size_t>(128 * 128 / 16 * info.bits)) {
    std::abort();
  }
  if (model.LoadLinearSlice(info.key, 0, info.k + 128, 0, 128, false).ok()) std::abort();
}

void CheckPlain(const sh::Exl3Model& model, const sh::PlainTensorInfo& info) {
  if (info.stored_bytes > kMaxLoadBytes) return;
  uint64_t numel = 1;
  for (int64_t d : info.shape) {
    if (d < 0) std::abort();
    numel *= static_cast<uint64_t>(d);
  }
  absl::StatusOr<std::vector<float>> values = model.LoadTensorAsFloat(info.name);
  if (!values.ok()) return CheckRefusal(values.status());
  if (values->size() != numel) std::abort();
  if (info.shape.size() == 2) {
    absl::StatusOr<std::vector<float>> rows =
        model.LoadTensorSliceAsFloat(info.name, 0, info.shape[0], 0, info.shape[1]);
    if (!rows.ok()) return CheckRefusal(rows.status());
    if (rows->size() != values->size() ||
        std::memcmp(rows->data(), values->data(), values->size() * sizeof(float)) != 0) {
      std::abort();  // bitwise: NaNs never compare equal
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  if (nul == std::string_view::npos) return 0;
  const std::string& dir = ScratchDir();
  if (!WriteFile(dir + "/config.json", input.substr(0, nul)) ||
      !WriteFile(dir + "/model.safetensors", input.substr(nul + 1))) {
    std::abort();
  }
  absl::StatusOr<std::unique_ptr<sh::Exl3Model>> model = sh::Exl3Model::Open(dir);
  if (!model.ok()) {
    CheckRefusal(model.status());
    return 0;
  }
  const sh::Exl3Model& m = **model;
  (void)m.AverageBitsPerWeight(true);
  (void)m.AverageBitsPerWeight(false);
  for (const sh::Exl3LinearInfo& linear : m.linears()) CheckLinear(m, linear);
  for (const sh::PlainTensorInfo& plain : m.plain_tensors()) CheckPlain(m, plain);
  if (m.arch().has_value()) {
    for (int ranks = 1; ranks <= 3; ++ranks) {
      absl::StatusOr<sh::ShardPlan> plan =
          sh::PlanShards(*m.arch(), sh::WorldSpec::Uniform(ranks), sh::ShardOptions{}, &m);
      if (!plan.ok()) {
        CheckRefusal(plan.status());
        continue;
      }
      if (static_cast<int>(plan->ranks.size()) != ranks) std::abort();
    }
  }
  return 0;
}
