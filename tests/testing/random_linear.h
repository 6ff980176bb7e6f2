// tests/testing/random_linear.h — random EXL3 linears and inputs for the
// kernel tests (CPU and CUDA TrellisGemm tests use the same generators, so a
// GPU result and a CPU result are compared on the same kind of data).
//
//   std::mt19937 rng(seed);
//   kernels::Exl3LinearData d = RandomLinear(rng, 256, 384, 3, Codebook::kMul1, true);
//   std::vector<float> x = RandomInput(rng, 5, d.k);
#ifndef EXL3SERVE_TESTS_TESTING_RANDOM_LINEAR_H_
#define EXL3SERVE_TESTS_TESTING_RANDOM_LINEAR_H_

#include <cstdint>
#include <random>
#include <vector>

#include "kernels/reconstruct.h"

namespace exl3serve::testing {

// A k x n linear (k, n multiples of 16) of K = `bits` with random trellis
// words (any bits are a valid tile), sign/scale vectors of magnitude
// 0.05..2 with channel 3 zeroed (exl3-format.md §10), and optionally a
// standard-normal bias.
inline kernels::Exl3LinearData RandomLinear(std::mt19937& rng, int64_t k, int64_t n, int bits,
                                            kernels::Codebook cb, bool with_bias) {
  kernels::Exl3LinearData d;
  d.k = k;
  d.n = n;
  d.bits = bits;
  d.codebook = cb;
  d.trellis.resize(static_cast<size_t>(k / 16 * n / 16 * 16 * bits));
  std::uniform_int_distribution<int> word(0, 65535);
  for (auto& v : d.trellis) v = static_cast<uint16_t>(word(rng));
  std::uniform_real_distribution<float> mag(0.05f, 2.0f);
  std::bernoulli_distribution neg(0.5);
  auto scales = [&](int64_t size) {
    std::vector<float> v(static_cast<size_t>(size));
    for (auto& s : v) s = neg(rng) ? -mag(rng) : mag(rng);
    if (size > 3) v[3] = 0.0f;  // an all-zero channel
    return v;
  };
  d.suh = scales(k);
  d.svh = scales(n);
  if (with_bias) {
    std::normal_distribution<float> b(0.0f, 1.0f);
    d.bias.resize(static_cast<size_t>(n));
    for (auto& v : d.bias) v = b(rng);
  }
  return d;
}

// m x k standard-normal inputs, row-major.
inline std::vector<float> RandomInput(std::mt19937& rng, int64_t m, int64_t k) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(m * k));
  for (auto& v : x) v = g(rng);
  return x;
}

}  // namespace exl3serve::testing

#endif  // EXL3SERVE_TESTS_TESTING_RANDOM_LINEAR_H_
