// kernels/trellis_pack.h — symbols, states and the packed bit layout of one
// EXL3 trellis tile, and whole-tensor pack/unpack (exl3-format.md §3.1-3.4).
//
// A tile holds 256 positions. Position i carries a K-bit symbol c_i; its
// 16-bit state s_i is the window of the most recent symbols ending with c_i,
// wrapping around the tile (tail-biting, §3.3). The packed tile is the symbol
// stream c_0..c_255, MSB first, cut into 8K 32-bit words stored as 16K int16,
// low half first (§3.4). Any 16K int16 values are a valid packed tile: reading
// windows from a circular stream always gives tail-biting states.
//
// Usage sketch (encoder side, then decoder side):
//   uint16_t states[256];   StatesFromSymbols(symbols, K, states);
//   uint16_t tile[16 * 8];  PackTile(symbols, K, tile);
//   UnpackTileStates(tile, K, states);                 // same states back
//   UnpackTensorStates(trellis, k, n, K, all_states);  // [k/16][n/16][256]
//
// Layouts used by the tensor functions (C-contiguous):
//   trellis: [k/16][n/16][16*K] uint16 (the file's I16 data reinterpreted;
//            reading int16 storage through uint16_t* is allowed aliasing)
//   states:  [k/16][n/16][256], position order within a tile (trellis order,
//            not row-major; see TilePermutation in trellis_decode.h, §3.2)
//
// All functions are pure; no global state. Thread-compatible.
#ifndef EXL3SERVE_KERNELS_TRELLIS_PACK_H_
#define EXL3SERVE_KERNELS_TRELLIS_PACK_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/trellis_decode.h"

namespace exl3serve::kernels {

// Number of int16 values in one packed tile of K bits per weight (§3.1).
constexpr int TileInt16Count(int bits) { return 16 * bits; }

// The 256 tail-biting states of a tile from its symbols (§3.3):
// s_i = low 16 bits of (c_{i-m+1} ... c_i), m = ceil(16/K), indices mod 256.
// Only the low K bits of each symbol are used.
// Requires: 1 <= bits <= 8.
void StatesFromSymbols(const uint8_t symbols[kTileWeights], int bits,
                       uint16_t states[kTileWeights]);

// True when every state agrees with its predecessor (§3.3):
//   s_i >> K == s_{i-1} & (2^(16-K) - 1), with s_{-1} = s_255.
// Requires: 1 <= bits <= 8.
bool IsTailBiting(const uint16_t states[kTileWeights], int bits);

// The symbols c_i = s_i & (2^K - 1) of a tail-biting state sequence. Returns
// false, leaving `symbols` untouched, when the states are not tail-biting
// (they cannot come from any symbol sequence).
// Requires: 1 <= bits <= 8.
bool SymbolsFromStates(const uint16_t states[kTileWeights], int bits,
                       uint8_t symbols[kTileWeights]);

// Packs the symbols into TileInt16Count(bits) int16 values (§3.4): the symbol
// stream MSB first, 32-bit words, each stored low half first. Only the low K
// bits of each symbol are used.
// Requires: 1 <= bits <= 8; `tile` has room for 16*bits values.
void PackTile(const uint8_t symbols[kTileWeights], int bits, uint16_t* tile);

// PackTile from states. Returns false, leaving `tile` untouched, when the
// states are not tail-biting. Requires: as PackTile.
bool PackTileStates(const uint16_t states[kTileWeights], int bits, uint16_t* tile);

// The 256 states of a packed tile, via ReadTileState (trellis_decode.h).
// Requires: 1 <= bits <= 8; `tile` holds 16*bits values.
void UnpackTileStates(const uint16_t* tile, int bits, uint16_t states[kTileWeights]);

// Packs a whole tensor: states [k/16][n/16][256] -> trellis [k/16][n/16][16K].
// Errors: InvalidArgument if k or n is negative or not a multiple of 16, bits
// is outside 1..8, or a tile's states are not tail-biting (the message names
// the first offending tiles as [tk, tn] and position, and the count). On
// error `trellis` may be partially written.
// Cost: O(k·n) time, no allocation.
absl::Status PackTensorStates(const uint16_t* states, int64_t k, int64_t n, int bits,
                              uint16_t* trellis);

// Unpacks a whole tensor: trellis [k/16][n/16][16K] -> states
// [k/16][n/16][256] in position order, the layout of the `states` test
// vectors. Errors: InvalidArgument for k or n negative or not a multiple of
// 16, or bits outside 1..8 (`states` untouched).
absl::Status UnpackTensorStates(const uint16_t* trellis, int64_t k, int64_t n, int bits,
                                uint16_t* states);

}  // namespace exl3serve::kernels

#endif  // EXL3SERVE_KERNELS_TRELLIS_PACK_H_
