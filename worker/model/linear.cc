#include "worker/model/linear.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/trellis_gemm.h"
#include "sharding/exl3_model.h"
#include "worker/api/sampling.h"

namespace exl3serve::worker {
namespace {

// Output rows of w handled per thread-pool task: 32 rows of a 4096-wide
// weight are 512 KiB, which stays in L2 while every x row passes over them.
constexpr int64_t kDenseRowsPerTask = 32;

// Eight independent partial sums (the compiler maps them onto SIMD lanes
// without reassociating anything), combined in a fixed order.
inline float Dot(const float* a, const float* b, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= k; j += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[j + l] * b[j + l];
  }
  for (int l = 0; j < k; ++j, ++l) acc[l] += a[j] * b[j];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// The 16-bit type a plain weight of checkpoint dtype `dtype` is held in.
std::optional<kernels::cpu::Dense16Type> HeldDense16Type(sharding::DType dtype) {
  if (dtype == sharding::DType::kBF16) return kernels::cpu::Dense16Type::kBf16;
  if (dtype == sharding::DType::kF16) return kernels::cpu::Dense16Type::kF16;
  return std::nullopt;
}

absl::StatusOr<std::vector<float>> LoadBias(const sharding::Exl3Model& model,
                                            const std::string& name, int64_t out) {
  const sharding::PlainTensorInfo* info = model.FindPlain(name);
  if (info == nullptr) return std::vector<float>();
  if (info->shape.size() != 1 || info->shape[0] < out) {
    return absl::DataLossError(absl::StrCat(model.dir(), ": tensor `", name,
                                            "` must be 1-d with at least ", out, " elements"));
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> bias, model.LoadTensorAsFloat(name));
  bias.resize(out);
  return bias;
}

}  // namespace

void DenseGemmTransposed(const float* x, int64_t m, int64_t k, const float* w, int64_t n,
                         const float* bias, float* y) {
  const int64_t tasks = (n + kDenseRowsPerTask - 1) / kDenseRowsPerTask;
  kernels::cpu::SharedThreadPool().ParallelFor(tasks, 0, [&](int64_t task, int) {
    const int64_t o0 = task * kDenseRowsPerTask;
    const int64_t o1 = std::min(n, o0 + kDenseRowsPerTask);
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * k;
      float* yi = y + i * n;
      for (int64_t o = o0; o < o1; ++o) {
        const float dot = Dot(xi, w + o * k, k);
        yi[o] = bias != nullptr ? dot + bias[o] : dot;
      }
    }
  });
}

absl::StatusOr<Linear> Linear::Load(const sharding::Exl3Model& model, std::string_view key_view,
                                    int64_t in_features, int64_t out_features) {
  const std::string key(key_view);
  if (const sharding::Exl3LinearInfo* info = model.FindLinear(key_view)) {
    if (info->k < in_features || info->n < out_features) {
      return absl::DataLossError(absl::StrCat(model.dir(), ": EXL3 linear `", key, "` holds ",
                                              info->k, " x ", info->n, ", smaller than ",
                                              in_features, " x ", out_features));
    }
    Linear linear;
    linear.in_ = in_features;
    linear.out_ = out_features;
    linear.quantized_ = true;
    EXL3_ASSIGN_OR_RETURN(linear.exl3_, model.LoadLinear(key_view));
    return linear;
  }
  EXL3_ASSIGN_OR_RETURN(Linear linear, LoadPlain(model, key + ".weight", in_features, out_features));
  EXL3_ASSIGN_OR_RETURN(linear.bias_, LoadBias(model, key + ".bias", out_features));
  return linear;
}

absl::StatusOr<Linear> Linear::LoadPlain(const sharding::Exl3Model& model,
                                         std::string_view weight_name_view, int64_t in_features,
                                         int64_t out_features) {
  const std::string weight_name(weight_name_view);
  const sharding::PlainTensorInfo* info = model.FindPlain(weight_name_view);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(model.dir(), ": no tensor `", weight_name, "` (nor an EXL3 linear)"));
  }
  if (info->shape.size() != 2 || info->shape[0] < out_features || info->shape[1] < in_features) {
    std::string shape;
    for (int64_t d : info->shape) absl::StrAppend(&shape, shape.empty() ? "" : ",", d);
    return absl::DataLossError(absl::StrCat(model.dir(), ": tensor `", weight_name,
                                            "` has shape [", shape, "], expected at least [",
                                            out_features, ",", in_features, "]"));
  }
  if (const auto type = HeldDense16Type(info->dtype)) {  // [out, in] of its 16 bits, no widening
    EXL3_ASSIGN_OR_RETURN(std::vector<uint16_t> bits,
                          model.LoadTensorSlice16(weight_name_view, 0, out_features, 0, in_features));
    return FromDense16(std::move(bits), *type, in_features, out_features, {});
  }
  EXL3_ASSIGN_OR_RETURN(std::vector<float> stored, model.LoadTensorAsFloat(weight_name_view));
  const int64_t stride = info->shape[1];
  if (stride != in_features || info->shape[0] != out_features) {
    std::vector<float> cut(static_cast<size_t>(out_features * in_features));
    for (int64_t o = 0; o < out_features; ++o) {
      std::memcpy(&cut[o * in_features], &stored[o * stride], sizeof(float) * in_features);
    }
    stored = std::move(cut);
  }
  return FromDense(std::move(stored), in_features, out_features, {});
}

absl::StatusOr<Linear> Linear::LoadWindow(const sharding::Exl3Model& model,
                                          std::string_view key_view, int64_t in_features,
                                          int64_t out_features, int64_t in_begin, int64_t in_end,
                                          int64_t out_begin, int64_t out_end, bool with_bias) {
  const std::string key(key_view);
  if (in_begin < 0 || in_begin > in_end || in_end > in_features || out_begin < 0 ||
      out_begin > out_end || out_end > out_features) {
    return absl::InvalidArgumentError(absl::StrCat(
        "linear `", key, "`: window [", in_begin, ", ", in_end, ") x [", out_begin, ", ", out_end,
        ") is outside its ", in_features, " x ", out_features, " features"));
  }
  Linear linear;
  linear.in_ = in_end - in_begin;
  linear.out_ = out_end - out_begin;
  linear.key_ = key;
  if (const sharding::Exl3LinearInfo* info = model.FindLinear(key_view)) {
    if (info->k < in_features || info->n < out_features) {
      return absl::DataLossError(absl::StrCat(model.dir(), ": EXL3 linear `", key, "` holds ",
                                              info->k, " x ", info->n, ", smaller than ",
                                              in_features, " x ", out_features));
    }
    constexpr int64_t g = kernels::kExl3ChannelGranularity;
    auto down = [](int64_t x) { return x / g * g; };
    auto up = [](int64_t x, int64_t limit) { return std::min(limit, (x + g - 1) / g * g); };
    const int64_t k0 = down(in_begin), k1 = in_end > in_begin ? up(in_end, info->k) : k0;
    const int64_t n0 = down(out_begin), n1 = out_end > out_begin ? up(out_end, info->n) : n0;
    linear.quantized_ = true;
    linear.in_offset_ = in_begin - k0;
    linear.out_offset_ = out_begin - n0;
    EXL3_ASSIGN_OR_RETURN(linear.exl3_, model.LoadLinearSlice(key_view, k0, k1, n0, n1, with_bias));
    return linear;
  }
  const std::string weight_name = key + ".weight";
  const sharding::PlainTensorInfo* info = model.FindPlain(weight_name);
  if (info == nullptr) {
    return absl::NotFoundError(
        absl::StrCat(model.dir(), ": no tensor `", weight_name, "` (nor an EXL3 linear)"));
  }
  if (info->shape.size() != 2 || info->shape[0] < out_features || info->shape[1] < in_features) {
    return absl::DataLossError(absl::StrCat(model.dir(), ": tensor `", weight_name,
                                            "` must be 2-d of at least [", out_features, ",",
                                            in_features, "]"));
  }
  const auto type16 = HeldDense16Type(info->dtype);
  if (type16) {
    linear.plain_dtype_ = *type16 == kernels::cpu::Dense16Type::kBf16 ? PlainDType::kBf16
                                                                      : PlainDType::kF16;
  }
  if (type16 && linear.in_ > 0 && linear.out_ > 0) {
    EXL3_ASSIGN_OR_RETURN(linear.weight16_, model.LoadTensorSlice16(weight_name, out_begin,
                                                                    out_end, in_begin, in_end));
  } else if (linear.in_ > 0 && linear.out_ > 0) {
    EXL3_ASSIGN_OR_RETURN(linear.weight_, model.LoadTensorSliceAsFloat(weight_name, out_begin,
                                                                      out_end, in_begin, in_end));
  } else {
    linear.weight_.clear();
  }

  if (with_bias && linear.out_ > 0) {
    const std::string bias_name = key + ".bias";
    if (const sharding::PlainTensorInfo* b = model.FindPlain(bias_name)) {
      if (b->shape.size() != 1 || b->shape[0] < out_features) {
        return absl::DataLossError(absl::StrCat(model.dir(), ": tensor `", bias_name,
                                                "` must be 1-d with at least ", out_features,
                                                " elements"));
      }
      EXL3_ASSIGN_OR_RETURN(linear.bias_,
                            model.LoadTensorSliceAsFloat(bias_name, out_begin, out_end, 0, 1));
    }
  }
  return linear;
}

Linear Linear::FromDense16(std::vector<uint16_t> weight, kernels::cpu::Dense16Type type,
                           int64_t in_features, int64_t out_features, std::vector<float> bias) {
  EXL3_CHECK(static_cast<int64_t>(weight.size()) == in_features * out_features)
      << weight.size() << " != " << in_features << " x " << out_features;
  EXL3_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == out_features);
  Linear linear;
  linear.in_ = in_features;
  linear.out_ = out_features;
  linear.plain_dtype_ =
      type == kernels::cpu::Dense16Type::kBf16 ? PlainDType::kBf16 : PlainDType::kF16;
  linear.weight16_ = std::move(weight);
  linear.bias_ = std::move(bias);
  return linear;
}

void Linear::DenseRowsToFloat(int64_t row, int64_t rows, float* out) const {
  EXL3_CHECK(!quantized_ && row >= 0 && rows >= 0 && row + rows <= out_)
      << "DenseRowsToFloat(" << row << ", " << rows << ") on " << key_;
  if (plain_dtype_ == PlainDType::kF32) {
    std::memcpy(out, weight_.data() + row * in_, sizeof(float) * rows * in_);
    return;
  }
  kernels::cpu::Dense16ToFloat(weight16_.data() + row * in_,
                               plain_dtype_ == PlainDType::kBf16 ? kernels::cpu::Dense16Type::kBf16
                                                                 : kernels::cpu::Dense16Type::kF16,
                               rows * in_, out);
}

int64_t Linear::weight_bytes() const {
  if (quantized_) {
    return static_cast<int64_t>(exl3_.trellis.size() * sizeof(uint16_t) +
                                (exl3_.suh.size() + exl3_.svh.size()) * sizeof(float));
  }
  return static_cast<int64_t>(weight_.size() * sizeof(float) + weight16_.size() * sizeof(uint16_t));
}

Linear Linear::FromDense(std::vector<float> weight, int64_t in_features, int64_t out_features,
                         std::vector<float> bias) {
  EXL3_CHECK(static_cast<int64_t>(weight.size()) == in_features * out_features)
      << weight.size() << " != " << in_features << " x " << out_features;
  EXL3_CHECK(bias.empty() || static_cast<int64_t>(bias.size()) == out_features);
  Linear linear;
  linear.in_ = in_features;
  linear.out_ = out_features;
  linear.weight_ = std::move(weight);
  linear.bias_ = std::move(bias);
  return linear;
}

namespace {
std::atomic<kernels::TrellisGemmPrecision> g_prefill_precision{kernels::TrellisGemmPrecision::kFloat};
}  // namespace

absl::Status SetPrefillPrecision(kernels::TrellisGemmPrecision precision) {
  if (precision == kernels::TrellisGemmPrecision::kInt8) {
    return absl::InvalidArgumentError("prefill precision must be fp32 or bf16, not int8");
  }
  g_prefill_precision.store(precision, std::memory_order_relaxed);
  return absl::OkStatus();
}

kernels::TrellisGemmPrecision PrefillPrecision() {
  return g_prefill_precision.load(std::memory_order_relaxed);
}

namespace {
std::atomic<kernels::TrellisGemmPrecision> g_decode_precision{kernels::TrellisGemmPrecision::kFloat};
}  // namespace

absl::Status SetDecodePrecision(kernels::TrellisGemmPrecision precision) {
  if (precision == kernels::TrellisGemmPrecision::kBf16) {
    return absl::InvalidArgumentError(
        "decode precision must be fp32 or int8, not bf16 (bf16 is a prefill mode: at decode "
        "sizes it is slower than fp32)");
  }
  g_decode_precision.store(precision, std::memory_order_relaxed);
  return absl::OkStatus();
}

kernels::TrellisGemmPrecision DecodePrecision() {
  return g_decode_precision.load(std::memory_order_relaxed);
}

const char* GemmPrecisionName(kernels::TrellisGemmPrecision precision) {
  switch (precision) {
    case kernels::TrellisGemmPrecision::kFloat:
      return "fp32";
    case kernels::TrellisGemmPrecision::kBf16:
      return "bf16";
    case kernels::TrellisGemmPrecision::kInt8:
      return "int8";
  }
  return "?";
}

static_assert(kPrefillMinRows == kPrefillKindMinTokens,
              "the size rule and the position rule share their threshold");

int64_t PrefillRowsOfEntry(int64_t start, int64_t rows, int64_t prompt_len) {
  if (prompt_len < 0) return RowKindForRows(rows) == RowKind::kPrefill ? rows : 0;
  return std::clamp<int64_t>(PrefillKindEnd(prompt_len) - start, 0, rows);
}

void AppendEntryRows(std::vector<RowRun>* plan, int64_t prefill_rows, int64_t first,
                     int64_t count) {
  const int64_t prefill = std::clamp<int64_t>(prefill_rows - first, 0, count);
  AppendRowRun(plan, prefill, RowKind::kPrefill);
  AppendRowRun(plan, count - prefill, RowKind::kDecode);
}

void AppendRowRun(std::vector<RowRun>* plan, int64_t rows, RowKind kind) {
  if (rows <= 0) return;
  if (!plan->empty() && plan->back().kind == kind) {
    plan->back().rows += rows;
  } else {
    plan->push_back({rows, kind});
  }
}

absl::Status Linear::Forward(const float* x, int64_t m, float* y) const {
  const RowRun all{m, RowKindForRows(m)};
  return Forward(x, m, y, {&all, 1});
}

absl::Status Linear::Forward(const float* x, int64_t m, float* y,
                             std::span<const RowRun> plan) const {
  int64_t planned = 0;
  bool negative = false;
  for (const RowRun& run : plan) {
    planned += run.rows;
    negative |= run.rows < 0;
  }
  if (planned != m || negative) {
    return absl::InvalidArgumentError(absl::StrCat("linear `", key_, "`: row plan covers ",
                                                   planned, " rows, the call has ", m));
  }
  if (m == 0 || out_ == 0) return absl::OkStatus();
  if (observer_ != nullptr) observer_->ObserveInput(key_, x, m, in_);
  if (in_ == 0) {  // a row-parallel window without input channels: bias or zero
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t o = 0; o < out_; ++o) y[i * out_ + o] = bias_.empty() ? 0.0f : bias_[o];
    }
    if (quantized_ && !exl3_.bias.empty()) {
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t o = 0; o < out_; ++o) y[i * out_ + o] = exl3_.bias[out_offset_ + o];
      }
    }
    return absl::OkStatus();
  }
  if (!quantized_) {
    const float* bias = bias_.empty() ? nullptr : bias_.data();
    if (plain_dtype_ == PlainDType::kF32) {
      DenseGemmTransposed(x, m, in_, weight_.data(), out_, bias, y);
    } else {
      kernels::cpu::Dense16GemmTransposed(x, m, in_, weight16_.data(),
                                          plain_dtype_ == PlainDType::kBf16
                                              ? kernels::cpu::Dense16Type::kBf16
                                              : kernels::cpu::Dense16Type::kF16,
                                          out_, bias, y);
    }
    return absl::OkStatus();
  }
  const int64_t k = exl3_.k, n = exl3_.n;
  const float* input = x;
  // Per-thread scratch for windows/shapes not aligned to 128: reused across
  // calls (decode runs this per token and layer), never shared between threads.
  thread_local std::vector<float> padded_x;
  thread_local std::vector<float> padded_y;
  if (k != in_) {
    padded_x.assign(static_cast<size_t>(m * k), 0.0f);
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(&padded_x[i * k + in_offset_], x + i * in_, sizeof(float) * in_);
    }
    input = padded_x.data();
  }
  float* output = y;
  if (n != out_) {
    padded_y.resize(static_cast<size_t>(m * n));
    output = padded_y.data();
  }
  // kInt8 is mul1-only (TrellisGemm refuses it for 3inst/mcg): those stay kFloat.
  const kernels::TrellisGemmPrecision decode = exl3_.codebook == kernels::Codebook::kMul1
                                                   ? DecodePrecision()
                                                   : kernels::TrellisGemmPrecision::kFloat;
  const kernels::TrellisGemmPrecision prefill = PrefillPrecision();
  auto precision_of = [&](const RowRun& run) {
    return run.kind == RowKind::kDecode ? decode : prefill;
  };
  // One kernel call per maximal group of consecutive runs of one precision.
  int64_t row = 0;
  for (size_t i = 0; i < plan.size();) {
    if (plan[i].rows == 0) {
      ++i;
      continue;
    }
    kernels::TrellisGemmOptions options;
    options.precision = precision_of(plan[i]);
    int64_t rows = 0;
    for (; i < plan.size() && (plan[i].rows == 0 || precision_of(plan[i]) == options.precision);
         ++i) {
      rows += plan[i].rows;
    }
    EXL3_RETURN_IF_ERROR(
        kernels::TrellisGemm(exl3_.view(), input + row * k, rows, output + row * n, options));
    row += rows;
  }
  if (n != out_) {
    for (int64_t i = 0; i < m; ++i) {
      std::memcpy(y + i * out_, &padded_y[i * n + out_offset_], sizeof(float) * out_);
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker
