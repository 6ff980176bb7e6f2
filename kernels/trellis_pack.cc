#include "kernels/trellis_pack.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace exl3serve::kernels {
namespace {

absl::Status ValidateTensorShape(int64_t k, int64_t n, int bits) {
  if (bits < kMinBits || bits > kMaxBits) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis bits per weight must be in 1..8, got ", bits));
  }
  if (k < 0 || n < 0 || k % kTileDim != 0 || n % kTileDim != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "trellis shape k=", k, ", n=", n, " must be non-negative multiples of 16"));
  }
  return absl::OkStatus();
}

// First position i whose state breaks the tail-biting rule, or -1.
int FirstNonTailBiting(const uint16_t states[kTileWeights], int bits) {
  const uint32_t low_mask = (1u << (16 - bits)) - 1u;
  for (int i = 0; i < kTileWeights; ++i) {
    const uint32_t previous = states[i == 0 ? kTileWeights - 1 : i - 1];
    if ((static_cast<uint32_t>(states[i]) >> bits) != (previous & low_mask)) return i;
  }
  return -1;
}

}  // namespace

void StatesFromSymbols(const uint8_t symbols[kTileWeights], int bits,
                       uint16_t states[kTileWeights]) {
  const uint32_t symbol_mask = (1u << bits) - 1u;
  const int window_symbols = (16 + bits - 1) / bits;  // m = ceil(16/K)
  // Prime the window with the symbols before position 0 (tail-biting wrap).
  uint32_t window = 0;
  for (int t = kTileWeights - window_symbols + 1; t < kTileWeights; ++t) {
    window = (window << bits) | (symbols[t] & symbol_mask);
  }
  for (int i = 0; i < kTileWeights; ++i) {
    window = (window << bits) | (symbols[i] & symbol_mask);
    states[i] = static_cast<uint16_t>(window & 0xFFFFu);
  }
}

bool IsTailBiting(const uint16_t states[kTileWeights], int bits) {
  return FirstNonTailBiting(states, bits) < 0;
}

bool SymbolsFromStates(const uint16_t states[kTileWeights], int bits,
                       uint8_t symbols[kTileWeights]) {
  if (!IsTailBiting(states, bits)) return false;
  const uint32_t symbol_mask = (1u << bits) - 1u;
  for (int i = 0; i < kTileWeights; ++i) {
    symbols[i] = static_cast<uint8_t>(states[i] & symbol_mask);
  }
  return true;
}

void PackTile(const uint8_t symbols[kTileWeights], int bits, uint16_t* tile) {
  // Append symbols MSB first to a bit accumulator; emit each full 32-bit word
  // as (low half, high half). 256*K bits fill exactly 8K words.
  const uint32_t symbol_mask = (1u << bits) - 1u;
  uint64_t pending = 0;
  int pending_bits = 0;
  int word = 0;
  for (int i = 0; i < kTileWeights; ++i) {
    pending = (pending << bits) | (symbols[i] & symbol_mask);
    pending_bits += bits;
    if (pending_bits >= 32) {
      pending_bits -= 32;
      const uint32_t w = static_cast<uint32_t>(pending >> pending_bits);
      pending &= (uint64_t{1} << pending_bits) - 1u;
      tile[2 * word] = static_cast<uint16_t>(w & 0xFFFFu);
      tile[2 * word + 1] = static_cast<uint16_t>(w >> 16);
      ++word;
    }
  }
}

bool PackTileStates(const uint16_t states[kTileWeights], int bits, uint16_t* tile) {
  uint8_t symbols[kTileWeights];
  if (!SymbolsFromStates(states, bits, symbols)) return false;
  PackTile(symbols, bits, tile);
  return true;
}

void UnpackTileStates(const uint16_t* tile, int bits, uint16_t states[kTileWeights]) {
  for (int i = 0; i < kTileWeights; ++i) states[i] = ReadTileState(tile, bits, i);
}

absl::Status PackTensorStates(const uint16_t* states, int64_t k, int64_t n, int bits,
                              uint16_t* trellis) {
  if (absl::Status status = ValidateTensorShape(k, n, bits); !status.ok()) return status;
  const int64_t tiles_k = k / kTileDim;
  const int64_t tiles_n = n / kTileDim;
  constexpr int kMaxNamed = 4;  // name a few bad tiles, count the rest
  int64_t bad_tiles = 0;
  std::string named;
  for (int64_t tk = 0; tk < tiles_k; ++tk) {
    for (int64_t tn = 0; tn < tiles_n; ++tn) {
      const int64_t tile_index = tk * tiles_n + tn;
      const uint16_t* tile_states = states + tile_index * kTileWeights;
      const int bad_position = FirstNonTailBiting(tile_states, bits);
      if (bad_position >= 0) {
        if (bad_tiles < kMaxNamed) {
          absl::StrAppend(&named, bad_tiles == 0 ? "" : ", ", "[", tk, ", ", tn,
                          "] at position ", bad_position);
        }
        ++bad_tiles;
        continue;
      }
      PackTileStates(tile_states, bits, trellis + tile_index * TileInt16Count(bits));
    }
  }
  if (bad_tiles > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        bad_tiles, " of ", tiles_k * tiles_n, " tiles are not tail-biting for K=", bits,
        " (s_i >> K must equal the low 16-K bits of s_{i-1}, wrapping): ", named,
        bad_tiles > kMaxNamed ? ", ..." : ""));
  }
  return absl::OkStatus();
}

absl::Status UnpackTensorStates(const uint16_t* trellis, int64_t k, int64_t n, int bits,
                                uint16_t* states) {
  if (absl::Status status = ValidateTensorShape(k, n, bits); !status.ok()) return status;
  const int64_t tiles = (k / kTileDim) * (n / kTileDim);
  for (int64_t t = 0; t < tiles; ++t) {
    UnpackTileStates(trellis + t * TileInt16Count(bits), bits, states + t * kTileWeights);
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::kernels
