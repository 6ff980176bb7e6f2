// tests/kernels/gated_delta_inputs.h — random inputs of the gated delta rule
// kernels' tests (gated_delta_rule_test, gated_delta_chunk_test): q and k
// L2-normalised (q scaled by dk^-1/2), v normal, gates g = -4u (decays
// exp(g) across (e^-4, 1]) and beta uniform in [0, 1).
#ifndef EXL3SERVE_TESTS_KERNELS_GATED_DELTA_INPUTS_H_
#define EXL3SERVE_TESTS_KERNELS_GATED_DELTA_INPUTS_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace exl3serve::kernels::testing {

struct GatedDeltaInputs {
  int64_t tokens, dk, dv;
  std::vector<float> q, k, v, g, decay, beta;  // decay = exp(g)
};

inline GatedDeltaInputs RandomGatedDeltaInputs(int64_t tokens, int64_t dk, int64_t dv,
                                               uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  GatedDeltaInputs in{tokens, dk, dv, {}, {}, {}, {}, {}, {}};
  auto normalised = [&](std::vector<float>* x, float scale) {
    for (int64_t t = 0; t < tokens; ++t) {
      double sum = 0.0;
      std::vector<float> row(dk);
      for (float& r : row) {
        r = normal(rng);
        sum += r * r;
      }
      for (float r : row) x->push_back(static_cast<float>(r / std::sqrt(sum) * scale));
    }
  };
  normalised(&in.q, 1.0f / std::sqrt(static_cast<float>(dk)));
  normalised(&in.k, 1.0f);
  for (int64_t i = 0; i < tokens * dv; ++i) in.v.push_back(normal(rng));
  for (int64_t t = 0; t < tokens; ++t) {
    in.g.push_back(-4.0f * unit(rng));
    in.decay.push_back(std::exp(in.g.back()));
    in.beta.push_back(unit(rng));
  }
  return in;
}

// The recurrence in float64, token by token from the equations:
//   S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
// from a zero state; returns o [tokens][dv], leaves S [dk][dv] in *state.
inline std::vector<double> Float64Recurrence(const GatedDeltaInputs& in,
                                             std::vector<double>* state) {
  const int64_t dk = in.dk, dv = in.dv;
  std::vector<double>& s = *state;
  s.assign(dk * dv, 0.0);
  std::vector<double> out(in.tokens * dv);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (double& x : s) x *= std::exp(static_cast<double>(in.g[t]));
    for (int64_t j = 0; j < dv; ++j) {
      double r = 0.0;
      for (int64_t i = 0; i < dk; ++i) r += s[i * dv + j] * in.k[t * dk + i];
      const double u = in.beta[t] * (in.v[t * dv + j] - r);
      for (int64_t i = 0; i < dk; ++i) s[i * dv + j] += in.k[t * dk + i] * u;
    }
    for (int64_t j = 0; j < dv; ++j) {
      double o = 0.0;
      for (int64_t i = 0; i < dk; ++i) o += s[i * dv + j] * in.q[t * dk + i];
      out[t * dv + j] = o;
    }
  }
  return out;
}

}  // namespace exl3serve::kernels::testing

#endif  // EXL3SERVE_TESTS_KERNELS_GATED_DELTA_INPUTS_H_
