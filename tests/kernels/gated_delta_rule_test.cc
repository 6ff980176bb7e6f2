// kernels/cpu/gated_delta_rule.h: every variant against a float64 recurrence
// written here from the equations (state [dk][dv], dk != dv, decays across
// (0, 1]), bit-identical variants, and the kept history equals a run that
// stops at each token.
#include "kernels/cpu/gated_delta_rule.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "tests/kernels/gated_delta_inputs.h"

namespace exl3serve::kernels {
namespace {

using Fn = void (*)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                    const float*, int64_t, const float*, const float*, int64_t, float*, float*,
                    int64_t, float*, int64_t);

using Inputs = testing::GatedDeltaInputs;
constexpr auto Random = testing::RandomGatedDeltaInputs;

TEST(GatedDeltaRuleTest, MatchesFloat64RecurrenceAndVariantsAreBitIdentical) {
  for (auto [dk, dv] : {std::pair<int64_t, int64_t>{24, 20}, {128, 128}, {13, 37}}) {
    const int64_t tokens = 33;
    const Inputs in = Random(tokens, dk, dv, 7 + static_cast<uint32_t>(dk));
    std::vector<double> s;
    const std::vector<double> want = testing::Float64Recurrence(in, &s);
    std::vector<float> first_state, first_out;
    struct Variant {
      const char* name;
      cpu::CpuIsa isa;
      Fn fn;
    };
    for (const Variant& v : {Variant{"scalar", cpu::CpuIsa::kScalar, &cpu::scalar::GatedDeltaRule},
                             Variant{"avx2", cpu::CpuIsa::kAvx2, &cpu::avx2::GatedDeltaRule},
                             Variant{"avx512", cpu::CpuIsa::kAvx512, &cpu::avx512::GatedDeltaRule}}) {
      if (!cpu::CpuSupportsIsa(v.isa)) continue;
      std::vector<float> state(dk * dv, 0.0f), out(tokens * dv, NAN);
      v.fn(tokens, dk, dv, in.q.data(), dk, in.k.data(), dk, in.v.data(), dv, in.decay.data(),
           in.beta.data(), 1, state.data(), out.data(), dv, nullptr, 0);
      double err = 0.0, norm = 0.0;
      for (int64_t i = 0; i < tokens * dv; ++i) {
        err = std::max(err, std::abs(out[i] - want[i]));
        norm = std::max(norm, std::abs(want[i]));
      }
      EXPECT_LE(err / norm, 1e-5) << v.name << " dk=" << dk << " dv=" << dv;
      double serr = 0.0;
      for (int64_t i = 0; i < dk * dv; ++i) serr = std::max(serr, std::abs(state[i] - s[i]));
      EXPECT_LE(serr, 1e-4) << v.name;
      if (first_state.empty()) {
        first_state = state;
        first_out = out;
      } else {
        EXPECT_EQ(0, std::memcmp(state.data(), first_state.data(), state.size() * sizeof(float))) << v.name;
        EXPECT_EQ(0, std::memcmp(out.data(), first_out.data(), out.size() * sizeof(float))) << v.name;
      }
    }
  }
}

TEST(GatedDeltaRuleTest, HistoryHoldsTheStateAfterEachToken) {
  const int64_t tokens = 9, dk = 24, dv = 20;
  const Inputs in = Random(tokens, dk, dv, 3);
  std::vector<float> state(dk * dv, 0.0f), out(tokens * dv), history(tokens * dk * dv, NAN);
  GatedDeltaRule(tokens, dk, dv, in.q.data(), dk, in.k.data(), dk, in.v.data(), dv,
                 in.decay.data(), in.beta.data(), 1, state.data(), out.data(), dv, history.data(),
                 dk * dv);
  for (int64_t stop = 1; stop <= tokens; ++stop) {
    std::vector<float> partial(dk * dv, 0.0f), o(stop * dv);
    GatedDeltaRule(stop, dk, dv, in.q.data(), dk, in.k.data(), dk, in.v.data(), dv,
                   in.decay.data(), in.beta.data(), 1, partial.data(), o.data(), dv, nullptr, 0);
    EXPECT_EQ(0, std::memcmp(partial.data(), &history[(stop - 1) * dk * dv],
                             partial.size() * sizeof(float)))
        << "after token " << stop - 1;
  }
  EXPECT_EQ(0, std::memcmp(state.data(), &history[(tokens - 1) * dk * dv], state.size() * sizeof(float)));
}

}  // namespace
}  // namespace exl3serve::kernels
