// worker/model/counter_rng.h — the counter-based generator every sampler
// draws from: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
// as 1, 2, 3", SC'11) keyed by the request's seed and counted by the
// position of the token being drawn.
//
//   const double u = CounterUniform(seed, position);   // in [0, 1)
//
// Why counter-based: the draw for position p of a request depends on
// (seed, p) only — not on how many draws other requests made, which rank
// drew it, the batch it was in, or whether the sequence was preempted or
// replayed on a re-formed group. That is what makes seeded sampling give
// the same tokens alone or in any batch and at any tensor-parallel size, and
// what exact speculative decoding rests on (a verifier recomputes the draw
// of any position).
#ifndef EXL3SERVE_WORKER_MODEL_COUNTER_RNG_H_
#define EXL3SERVE_WORKER_MODEL_COUNTER_RNG_H_

#include <array>
#include <cstdint>

namespace exl3serve::worker {

// Philox4x32 with 10 rounds: 4 x 32 random bits for a 128-bit counter and a
// 64-bit key. Pure function; constants from the paper.
inline std::array<uint32_t, 4> Philox4x32(std::array<uint32_t, 4> ctr, std::array<uint32_t, 2> key) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * ctr[0];
    const uint64_t p1 = static_cast<uint64_t>(kMul1) * ctr[2];
    ctr = {static_cast<uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<uint32_t>(p1),
           static_cast<uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<uint32_t>(p0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

// Which stream of draws of one (seed, position): 0 is the token draw;
// speculative decoding and later users take other values.
enum class DrawStream : uint32_t { kToken = 0 };

// A uniform double in [0, 1) with 53 random bits for (seed, position).
inline double CounterUniform(uint64_t seed, int64_t position,
                             DrawStream stream = DrawStream::kToken) {
  const uint64_t pos = static_cast<uint64_t>(position);
  const std::array<uint32_t, 4> r =
      Philox4x32({static_cast<uint32_t>(pos), static_cast<uint32_t>(pos >> 32),
                  static_cast<uint32_t>(stream), 0u},
                 {static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)});
  const uint64_t bits = (static_cast<uint64_t>(r[0]) << 32 | r[1]) >> 11;
  return static_cast<double>(bits) * 0x1p-53;
}

}  // namespace exl3serve::worker

#endif  // EXL3SERVE_WORKER_MODEL_COUNTER_RNG_H_
