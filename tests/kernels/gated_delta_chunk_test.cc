// kernels/cpu/gated_delta_chunk.h: the chunked form against a float64
// recurrence written here token by token from the equations (dk != dv, odd
// sizes, decays across (0, 1], runs over several chunks and a partial one);
// every variant bit-identical; outputs and state independent of how the
// tokens are cut into calls; the kept history equals a run that stops there.
#include "kernels/cpu/gated_delta_chunk.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_features.h"
#include "tests/kernels/gated_delta_inputs.h"

namespace exl3serve::kernels {
namespace {

using Fn = void (*)(int64_t, int64_t, int64_t, int64_t, const float*, int64_t, const float*,
                    int64_t, const float*, int64_t, const float*, const float*, int64_t, float*,
                    float*, int64_t, float*, int64_t);

using Inputs = testing::GatedDeltaInputs;
constexpr auto Random = testing::RandomGatedDeltaInputs;

// Runs `in` from position 0, cut into calls at `cuts` (ascending, exclusive
// of 0 and tokens); returns the outputs, leaves the state in *state.
std::vector<float> RunCut(Fn fn, const Inputs& in, const std::vector<int64_t>& cuts,
                       std::vector<float>* state) {
  const int64_t dk = in.dk, dv = in.dv;
  state->assign(GatedDeltaHeadStateFloats(dk, dv), 0.0f);
  std::vector<float> out(in.tokens * dv, NAN);
  int64_t begin = 0;
  std::vector<int64_t> ends = cuts;
  ends.push_back(in.tokens);
  for (int64_t end : ends) {
    fn(begin, end - begin, dk, dv, &in.q[begin * dk], dk, &in.k[begin * dk], dk,
       &in.v[begin * dv], dv, &in.g[begin], &in.beta[begin], 1, state->data(), &out[begin * dv],
       dv, nullptr, 0);
    begin = end;
  }
  return out;
}

TEST(GatedDeltaChunkTest, MatchesFloat64RecurrenceAndVariantsAreBitIdentical) {
  for (auto [dk, dv] : {std::pair<int64_t, int64_t>{24, 20}, {128, 128}, {13, 37}, {40, 16}}) {
    const int64_t tokens = 3 * kGatedDeltaChunk + 7;
    const Inputs in = Random(tokens, dk, dv, 11 + static_cast<uint32_t>(dk + dv));
    std::vector<double> s;
    const std::vector<double> want = testing::Float64Recurrence(in, &s);
    std::vector<float> first_state, first_out;
    struct Variant {
      const char* name;
      cpu::CpuIsa isa;
      Fn fn;
    };
    for (const Variant& v :
         {Variant{"scalar", cpu::CpuIsa::kScalar, &cpu::scalar::GatedDeltaChunked},
          Variant{"avx2", cpu::CpuIsa::kAvx2, &cpu::avx2::GatedDeltaChunked},
          Variant{"avx512", cpu::CpuIsa::kAvx512, &cpu::avx512::GatedDeltaChunked}}) {
      if (!cpu::CpuSupportsIsa(v.isa)) continue;
      std::vector<float> state;
      const std::vector<float> out = RunCut(v.fn, in, {}, &state);
      double err = 0.0, norm = 0.0;
      for (int64_t i = 0; i < tokens * dv; ++i) {
        err = std::max(err, std::abs(out[i] - want[i]));
        norm = std::max(norm, std::abs(want[i]));
      }
      EXPECT_LE(err / norm, 1e-5) << v.name << " dk=" << dk << " dv=" << dv;
      // The state at the end: S0 advanced over the open rows, as the chunk's
      // end would (the equations of the header), against the float64 S.
      const int64_t open = tokens % kGatedDeltaChunk;
      const float* krows = &state[dk * dv];
      const float* urows = krows + (kGatedDeltaChunk - 1) * dk;
      const float* grows = urows + (kGatedDeltaChunk - 1) * dv;
      double serr = 0.0;
      std::vector<double> cumulative(open);  // G_j of the open rows, from their gates
      for (int64_t j = 0; j < open; ++j) cumulative[j] = (j ? cumulative[j - 1] : 0.0) + grows[j];
      for (int64_t r = 0; r < dk; ++r) {
        for (int64_t d = 0; d < dv; ++d) {
          const double last = cumulative[open - 1];
          double x = std::exp(last) * state[r * dv + d];
          for (int64_t j = 0; j < open; ++j) {
            x += std::exp(last - cumulative[j]) * krows[j * dk + r] * urows[j * dv + d];
          }
          serr = std::max(serr, std::abs(x - s[r * dv + d]));
        }
      }
      EXPECT_LE(serr, 1e-4) << v.name;
      if (first_state.empty()) {
        first_state = state;
        first_out = out;
      } else {
        EXPECT_EQ(0, std::memcmp(state.data(), first_state.data(), state.size() * sizeof(float)))
            << v.name;
        EXPECT_EQ(0, std::memcmp(out.data(), first_out.data(), out.size() * sizeof(float)))
            << v.name;
      }
    }
  }
}

TEST(GatedDeltaChunkTest, AnyCutOfTheTokensIntoCallsGivesTheSameBits) {
  const int64_t tokens = 4 * kGatedDeltaChunk + 5, dk = 40, dv = 37;
  const Inputs in = Random(tokens, dk, dv, 5);
  std::vector<float> whole_state;
  const std::vector<float> whole = RunCut(&GatedDeltaChunked, in, {}, &whole_state);
  std::vector<int64_t> each;  // one token per call (decode)
  for (int64_t t = 1; t < tokens; ++t) each.push_back(t);
  std::mt19937 rng(9);
  std::vector<std::vector<int64_t>> cuts = {each, {1}, {kGatedDeltaChunk}, {15, 17, 31, 32, 50}};
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> c;
    for (int64_t t = 1; t < tokens; ++t) {
      if (rng() % 5 == 0) c.push_back(t);
    }
    cuts.push_back(c);
  }
  for (const std::vector<int64_t>& c : cuts) {
    std::vector<float> state;
    const std::vector<float> out = RunCut(&GatedDeltaChunked, in, c, &state);
    ASSERT_EQ(0, std::memcmp(out.data(), whole.data(), out.size() * sizeof(float)))
        << c.size() << " cuts";
    ASSERT_EQ(0, std::memcmp(state.data(), whole_state.data(), state.size() * sizeof(float)))
        << c.size() << " cuts";
  }
}

TEST(GatedDeltaChunkTest, HistoryHoldsTheStateAfterEachTokenAndResumesFromIt) {
  const int64_t tokens = 2 * kGatedDeltaChunk + 3, dk = 24, dv = 20;
  const int64_t floats = GatedDeltaHeadStateFloats(dk, dv);
  const Inputs in = Random(tokens, dk, dv, 3);
  // Tokens 0..4 first, then the rest in one call that keeps its history.
  const int64_t first = 5, rest = tokens - first;
  std::vector<float> state(floats, 0.0f), out(tokens * dv), history(rest * floats, NAN);
  GatedDeltaChunked(0, first, dk, dv, in.q.data(), dk, in.k.data(), dk, in.v.data(), dv,
                    in.g.data(), in.beta.data(), 1, state.data(), out.data(), dv, nullptr, 0);
  GatedDeltaChunked(first, rest, dk, dv, &in.q[first * dk], dk, &in.k[first * dk], dk,
                    &in.v[first * dv], dv, &in.g[first], &in.beta[first], 1, state.data(),
                    &out[first * dv], dv, history.data(), floats);
  for (int64_t stop = first + 1; stop <= tokens; ++stop) {
    std::vector<int64_t> none;
    Inputs part = in;
    part.tokens = stop;
    std::vector<float> partial;
    RunCut(&GatedDeltaChunked, part, none, &partial);
    const float* kept = &history[(stop - 1 - first) * floats];
    ASSERT_EQ(0, std::memcmp(partial.data(), kept, floats * sizeof(float))) << "after " << stop;
    // Resumed from the kept state, the remaining tokens give the same outputs.
    if (stop < tokens) {
      std::vector<float> resumed(kept, kept + floats), o((tokens - stop) * dv);
      GatedDeltaChunked(stop, tokens - stop, dk, dv, &in.q[stop * dk], dk, &in.k[stop * dk], dk,
                        &in.v[stop * dv], dv, &in.g[stop], &in.beta[stop], 1, resumed.data(),
                        o.data(), dv, nullptr, 0);
      ASSERT_EQ(0, std::memcmp(o.data(), &out[stop * dv], o.size() * sizeof(float)))
          << "resumed at " << stop;
    }
  }
}

}  // namespace
}  // namespace exl3serve::kernels
