#include "kernels/reconstruct.h"

#include <cstring>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/hadamard.h"
#include "kernels/trellis_lut.h"
#include "kernels/trellis_pack.h"

namespace exl3serve::kernels {
namespace {

int64_t TilesN(const Exl3LinearView& view) { return view.n / kTileDim; }

const uint16_t* TileAt(const Exl3LinearView& view, int64_t tk, int64_t tn) {
  return view.trellis + (tk * TilesN(view) + tn) * TileInt16Count(view.bits);
}

// Decodes one row of tiles (rows 16·tk .. 16·tk+15, all n columns) into
// `strip`, row-major 16 x n, through `lookup` (state -> output value). §3.1-3.2.
template <typename T>
void DecodeTileRow(const Exl3LinearView& view, int64_t tk, const T* lookup, T* strip) {
  const int64_t n = view.n;
  uint16_t states[kTileWeights];
  for (int64_t tn = 0; tn < TilesN(view); ++tn) {
    UnpackTileStates(TileAt(view, tk, tn), view.bits, states);
    T* tile_origin = strip + tn * kTileDim;
    for (int j = 0; j < kTileWeights; ++j) {
      const int rc = TilePermutation(j);
      tile_origin[(rc / kTileDim) * n + (rc % kTileDim)] = lookup[states[j]];
    }
  }
}

template <typename T>
void DecodeAll(const Exl3LinearView& view, const T* lookup, T* out) {
  for (int64_t tk = 0; tk < view.k / kTileDim; ++tk) {
    DecodeTileRow(view, tk, lookup, out + tk * kTileDim * view.n);
  }
}

template <typename T>
absl::Status ReconstructImpl(const Exl3LinearView& view, T* w_eff) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  const CodebookTable& table = GetCodebookTable(view.codebook);
  if constexpr (std::is_same_v<T, float>) {
    DecodeAll(view, table.value, w_eff);
  } else {
    std::vector<T> lookup(table.value, table.value + kNumStates);
    DecodeAll(view, lookup.data(), w_eff);
  }
  BlockHadamardColumns(w_eff, view.k, view.n);  // B_k · W_h
  BlockHadamardRows(w_eff, view.k, view.n);     // (...) · B_n
  for (int64_t r = 0; r < view.k; ++r) {
    T* row = w_eff + r * view.n;
    const T row_scale = static_cast<T>(view.suh[r]);
    for (int64_t c = 0; c < view.n; ++c) row[c] = (row[c] * row_scale) * static_cast<T>(view.svh[c]);
  }
  return absl::OkStatus();
}

absl::Status ValidateRange(const char* what, int64_t lo, int64_t hi, int64_t size) {
  if (lo < 0 || lo > hi || hi > size || lo % kExl3ChannelGranularity != 0 ||
      hi % kExl3ChannelGranularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " slice [", lo, ", ", hi, ") must satisfy 0 <= start <= end <= ", size,
        " with both ends multiples of ", kExl3ChannelGranularity));
  }
  return absl::OkStatus();
}

}  // namespace

Exl3LinearView Exl3LinearData::view() const {
  Exl3LinearView v;
  v.trellis = trellis.data();
  v.k = k;
  v.n = n;
  v.bits = bits;
  v.codebook = codebook;
  v.suh = suh.data();
  v.svh = svh.data();
  v.bias = bias.empty() ? nullptr : bias.data();
  return v;
}

absl::Status ValidateExl3LinearView(const Exl3LinearView& view) {
  if (view.bits < kMinBits || view.bits > kMaxBits) {
    return absl::InvalidArgumentError(
        absl::StrCat("exl3 linear: bits per weight must be in 1..8, got ", view.bits));
  }
  if (view.k < 0 || view.k % kExl3ChannelGranularity != 0 || view.n < 0 ||
      view.n % kExl3ChannelGranularity != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "exl3 linear: k and n must be non-negative multiples of ", kExl3ChannelGranularity,
        " (the Hadamard block size), got k=", view.k, ", n=", view.n));
  }
  const int codebook = static_cast<int>(view.codebook);
  if (codebook < 0 || codebook > static_cast<int>(Codebook::kMul1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("exl3 linear: unknown codebook id ", codebook));
  }
  if (view.k > 0 && view.n > 0 && view.trellis == nullptr) {
    return absl::InvalidArgumentError("exl3 linear: trellis is null");
  }
  if (view.k > 0 && view.suh == nullptr) {
    return absl::InvalidArgumentError("exl3 linear: suh is null");
  }
  if (view.n > 0 && view.svh == nullptr) {
    return absl::InvalidArgumentError("exl3 linear: svh is null");
  }
  return absl::OkStatus();
}

absl::Status DecodeInnerMatrix(const Exl3LinearView& view, uint16_t* w_h) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  DecodeAll(view, GetCodebookTable(view.codebook).half_bits, w_h);
  return absl::OkStatus();
}

absl::Status DecodeInnerMatrixFloat(const Exl3LinearView& view, float* w_h) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  DecodeAll(view, GetCodebookTable(view.codebook).value, w_h);
  return absl::OkStatus();
}

absl::Status ReconstructEffectiveWeight(const Exl3LinearView& view, float* w_eff) {
  return ReconstructImpl(view, w_eff);
}

absl::Status ReconstructEffectiveWeight(const Exl3LinearView& view, double* w_eff) {
  return ReconstructImpl(view, w_eff);
}

absl::Status ReferenceForward(const Exl3LinearView& view, const float* x, int64_t m, float* y) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  if (m < 0) {
    return absl::InvalidArgumentError(absl::StrCat("exl3 linear: row count m must be >= 0, got ", m));
  }
  const int64_t k = view.k;
  const int64_t n = view.n;

  // 1. x' = (x ⊙ suh) · B_k
  std::vector<float> x_had(static_cast<size_t>(m * k));
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < k; ++r) x_had[i * k + r] = x[i * k + r] * view.suh[r];
  }
  BlockHadamardRows(x_had.data(), m, k);

  // 2. y' = x' · W_h, fp32, accumulated over r = 0, 1, ..., k-1 for every output.
  std::vector<float> y_inner(static_cast<size_t>(m * n), 0.0f);
  std::vector<float> strip(static_cast<size_t>(kTileDim * n));
  const float* lookup = GetCodebookTable(view.codebook).value;
  for (int64_t tk = 0; tk < k / kTileDim; ++tk) {
    DecodeTileRow(view, tk, lookup, strip.data());
    for (int64_t i = 0; i < m; ++i) {
      float* out = y_inner.data() + i * n;
      for (int r = 0; r < kTileDim; ++r) {
        const float xv = x_had[i * k + tk * kTileDim + r];
        const float* w_row = strip.data() + r * n;
        for (int64_t c = 0; c < n; ++c) out[c] += xv * w_row[c];
      }
    }
  }

  // 3. y = (y' · B_n) ⊙ svh + bias
  BlockHadamardRows(y_inner.data(), m, n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t c = 0; c < n; ++c) {
      float v = y_inner[i * n + c] * view.svh[c];
      if (view.bias != nullptr) v += view.bias[c];
      y[i * n + c] = v;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Exl3LinearData> SliceColumns(const Exl3LinearView& view, int64_t n0, int64_t n1) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  if (absl::Status status = ValidateRange("column", n0, n1, view.n); !status.ok()) return status;
  Exl3LinearData out;
  out.k = view.k;
  out.n = n1 - n0;
  out.bits = view.bits;
  out.codebook = view.codebook;
  const int64_t tile_values = TileInt16Count(view.bits);
  const int64_t run = (out.n / kTileDim) * tile_values;  // contiguous per row of tiles
  out.trellis.resize(static_cast<size_t>((view.k / kTileDim) * run));
  for (int64_t tk = 0; tk < view.k / kTileDim; ++tk) {
    if (run == 0) break;
    std::memcpy(out.trellis.data() + tk * run, TileAt(view, tk, n0 / kTileDim),
                static_cast<size_t>(run) * sizeof(uint16_t));
  }
  out.suh.assign(view.suh, view.suh + view.k);
  out.svh.assign(view.svh + n0, view.svh + n1);
  if (view.bias != nullptr) out.bias.assign(view.bias + n0, view.bias + n1);
  return out;
}

absl::StatusOr<Exl3LinearData> SliceRows(const Exl3LinearView& view, int64_t k0, int64_t k1) {
  if (absl::Status status = ValidateExl3LinearView(view); !status.ok()) return status;
  if (absl::Status status = ValidateRange("row", k0, k1, view.k); !status.ok()) return status;
  Exl3LinearData out;
  out.k = k1 - k0;
  out.n = view.n;
  out.bits = view.bits;
  out.codebook = view.codebook;
  const int64_t row_of_tiles = TilesN(view) * TileInt16Count(view.bits);
  const uint16_t* first = view.trellis == nullptr ? nullptr : view.trellis + (k0 / kTileDim) * row_of_tiles;
  if (first != nullptr) out.trellis.assign(first, first + (out.k / kTileDim) * row_of_tiles);
  out.suh.assign(view.suh + k0, view.suh + k1);
  out.svh.assign(view.svh, view.svh + view.n);
  if (view.bias != nullptr && k0 == 0) out.bias.assign(view.bias, view.bias + view.n);
  return out;
}

}  // namespace exl3serve::kernels
