// libFuzzer target: the rank protocol as a rank receives it — sequences of
// Step messages (proto/exl3serve/rank/v1/rank.proto) through the rank's own
// path: the wire (SerializeAsString / ParseFromString), RankCommandFromStep
// (worker/rank/step_command.h) and ExecuteRankCommand (rank_executor.h) on a
// rank that LoadRank loaded (world size 1, shm backend) from a tiny EXL3
// model ($EXL3_FUZZ_MODEL_DIR, made by run_target.sh).
//
// Structured: the input drives a FuzzedDataProvider that builds up to 24
// steps — AddSequence with fuzzed sampling specs (NaN, inf, negative and huge
// values, logit_bias on ids outside the vocabulary), RemoveSequence, plain,
// sampled and verified forwards (speculative decoding: num_draft per entry,
// mostly in range, sometimes negative, too large, on an unsampled entry or on
// a forward that is not verified) with tokens, KV pages and sequence ids near
// and far outside their ranges, steps of another group generation — and, for
// one kind in sixteen, raw bytes parsed as a Step.
//
// Contract: no crash, leak or UB; a refusal is one of the codes a rank
// answers with and has a message; an accepted forward returns rows x vocab
// finite logits, or one token in [0, vocab) per sampling entry, or (verified)
// runs that worker::CheckVerifiedRuns accepts, with each sequence's KV length
// advanced by exactly its accepted positions; after every
// input, removing the sequences it touched returns every KV page to the
// pool and leaves no sampler state (the next input starts from an empty rank).
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "exl3serve/rank/v1/rank.pb.h"
#include "worker/api/verified_forward.h"
#include "worker/model/transformer.h"
#include "worker/rank/rank_executor.h"
#include "worker/rank/step_command.h"

namespace pb = ::exl3serve::rank::v1;
namespace rk = ::exl3serve::worker::rank;
using exl3serve::worker::SampledToken;

namespace {

constexpr uint64_t kGeneration = 7;
constexpr int64_t kNumPages = 12;
constexpr int kPageTokens = 4;

struct Fixture {
  rk::LoadedRank rank;
  int32_t vocab = 0;
};

// How deep the inputs reach, printed at exit with EXL3_FUZZ_STATS=1 (a
// fuzzer that only ever hits refusals tests little).
struct Reach {
  int64_t steps = 0, refused_by_translation = 0, refused_by_rank = 0;
  int64_t added = 0, removed = 0, forwards = 0, sampled_forwards = 0, verified_forwards = 0;
  int64_t accepted_drafts = 0;
  ~Reach() {
    if (std::getenv("EXL3_FUZZ_STATS") == nullptr) return;
    std::fprintf(stderr,
                 "rank_protocol_fuzz: %lld steps: %lld refused by translation, %lld by the rank; "
                 "accepted %lld adds, %lld removes, %lld forwards, %lld sampled forwards, "
                 "%lld verified forwards (%lld drafts accepted)\n",
                 (long long)steps, (long long)refused_by_translation, (long long)refused_by_rank,
                 (long long)added, (long long)removed, (long long)forwards,
                 (long long)sampled_forwards, (long long)verified_forwards,
                 (long long)accepted_drafts);
  }
} reach;

Fixture& TheRank() {
  static Fixture* fixture = [] {
    const char* dir = std::getenv("EXL3_FUZZ_MODEL_DIR");
    if (dir == nullptr) {
      std::fprintf(stderr, "rank_protocol_fuzz: set EXL3_FUZZ_MODEL_DIR (tests/fuzz/run.sh does)\n");
      std::abort();
    }
    rk::RankSetup setup;
    setup.model_dir = dir;
    setup.comm.backend = "shm";
    setup.comm.shm_name = absl::StrCat("/exl3-rank-fuzz-", ::getpid());
    setup.kv.num_pages = kNumPages;
    setup.kv.page_size_tokens = kPageTokens;
    setup.kv.caller_assigns_pages = true;
    absl::StatusOr<rk::LoadedRank> loaded = rk::LoadRank(setup);
    if (!loaded.ok()) {
      std::fprintf(stderr, "rank_protocol_fuzz: %s\n", loaded.status().ToString().c_str());
      std::abort();
    }
    auto* f = new Fixture{std::move(*loaded), 0};
    f->vocab = static_cast<int32_t>(f->rank.model->vocab_size());
    return f;
  }();
  return *fixture;
}

void CheckRefusal(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAborted:
      break;
    default:
      std::fprintf(stderr, "unexpected refusal: %s\n", s.ToString().c_str());
      std::abort();
  }
  if (s.message().empty()) std::abort();
}

float FuzzFloat(FuzzedDataProvider& in, float usual) {
  static const float kOdd[] = {0.0f, 1.0f, -1.0f, 1e-30f, 1e30f, 0.5f,
                               std::numeric_limits<float>::quiet_NaN(),
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity()};
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  if (pick < 128) return usual;
  if (pick < 200) return kOdd[pick % std::size(kOdd)];
  return in.ConsumeFloatingPoint<float>();
}

int64_t SeqId(FuzzedDataProvider& in) {
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  return pick < 240 ? pick % 4 : in.ConsumeIntegral<int64_t>();
}

int32_t Token(FuzzedDataProvider& in, int32_t vocab) {
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  if (pick < 240) return in.ConsumeIntegralInRange<int32_t>(0, vocab - 1);
  static const int32_t kOdd[] = {-1, std::numeric_limits<int32_t>::min(),
                                 std::numeric_limits<int32_t>::max()};
  return pick < 252 ? kOdd[pick % 3] : vocab + (pick & 3);
}

int32_t Page(FuzzedDataProvider& in) {
  const uint8_t pick = in.ConsumeIntegral<uint8_t>();
  if (pick < 240) return static_cast<int32_t>(pick % kNumPages);
  return pick < 248 ? -1 - (pick & 1) : in.ConsumeIntegral<int32_t>();
}

void FillSampling(FuzzedDataProvider& in, int32_t vocab, pb::SamplingSpec* s) {
  s->set_temperature(FuzzFloat(in, 0.8f));
  s->set_top_k(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-2, vocab + 2)
                                : in.ConsumeIntegral<int32_t>());
  s->set_top_p(FuzzFloat(in, 0.9f));
  s->set_min_p(FuzzFloat(in, 0.0f));
  s->set_repetition_penalty(FuzzFloat(in, 1.0f));
  s->set_presence_penalty(FuzzFloat(in, 0.0f));
  s->set_frequency_penalty(FuzzFloat(in, 0.0f));
  s->set_seed(in.ConsumeIntegral<uint64_t>());
  s->set_logprobs(in.ConsumeBool());
  s->set_top_logprobs(in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, 21)
                                       : in.ConsumeIntegral<int32_t>());
  s->set_prompt_len(in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(-1, 40)
                                     : in.ConsumeIntegral<int64_t>());
  const int biases = in.ConsumeIntegralInRange(0, 4);
  for (int i = 0; i < biases; ++i) {
    const int32_t id = in.ConsumeBool() ? in.ConsumeIntegralInRange<int32_t>(-1, vocab + 1)
                                        : in.ConsumeIntegral<int32_t>();
    (*s->mutable_logit_bias())[id] = FuzzFloat(in, -100.0f);
  }
}

// One step built from the input (false: the input is used up). `last_drawn`:
// each sequence's last token drawn in this input, which verified forwards
// often use as the token before the drafts and as the drafts (a sequence
// that repeats itself would accept them; short runs of this random model
// rarely do, so acceptance is covered by the unit and multi-process tests).
bool NextStep(FuzzedDataProvider& in, int32_t vocab, uint64_t step_id,
              const std::map<int64_t, int32_t>& last_drawn, pb::Step* step) {
  if (in.remaining_bytes() == 0) return false;
  const uint8_t kind = in.ConsumeIntegral<uint8_t>();
  if (kind < 16) {
    const std::string bytes = in.ConsumeRandomLengthString(512);
    if (!step->ParseFromString(bytes)) step->Clear();
    return true;
  }
  step->set_step_id(step_id);
  step->set_group_generation(in.ConsumeIntegral<uint8_t>() < 250 ? kGeneration
                                                                 : in.ConsumeIntegral<uint64_t>());
  switch (kind % 5) {
    case 0: {
      pb::AddSequence* add = step->mutable_add_sequence();
      add->set_seq_id(SeqId(in));
      if (in.ConsumeIntegral<uint8_t>() < 200) FillSampling(in, vocab, add->mutable_sampling());
      break;
    }
    case 1:
      step->mutable_remove_sequence()->set_seq_id(SeqId(in));
      break;
    case 4:
      break;  // no operation
    default: {
      pb::ForwardBatch* forward = step->mutable_forward();
      forward->set_sampled(kind % 5 == 3);
      // Verified: half the sampled forwards, and rarely one that is not sampled.
      const uint8_t verify = in.ConsumeIntegral<uint8_t>();
      forward->set_verified(kind % 5 == 3 ? verify < 128 : verify >= 250);
      static const pb::LogitsRows kRows[] = {pb::LOGITS_ROWS_LAST_TOKEN, pb::LOGITS_ROWS_ALL_TOKENS,
                                             pb::LOGITS_ROWS_UNSPECIFIED,
                                             static_cast<pb::LogitsRows>(9)};
      forward->set_rows(kRows[in.ConsumeIntegral<uint8_t>() % 4 == 3 ? 3 : (kind / 5) % 3]);
      const int entries = in.ConsumeIntegralInRange(0, 4);
      for (int e = 0; e < entries; ++e) {
        pb::SequenceTokens* seq = forward->add_sequences();
        seq->set_seq_id(SeqId(in));
        const int tokens = in.ConsumeIntegralInRange(0, 18);
        for (int t = 0; t < tokens; ++t) seq->add_token_ids(Token(in, vocab));
        const int pages = in.ConsumeIntegralInRange(0, 3);
        for (int p = 0; p < pages; ++p) seq->add_block_ids(Page(in));
        seq->set_sample(in.ConsumeBool());
        const uint8_t draft = in.ConsumeIntegral<uint8_t>();
        if (forward->verified()) {  // mostly 0 .. tokens (= tokens is refused)
          seq->set_num_draft(draft < 200 ? in.ConsumeIntegralInRange(0, std::min(tokens, 6))
                             : draft < 240 ? 0
                                           : in.ConsumeIntegral<int32_t>());
          auto last = last_drawn.find(seq->seq_id());
          const int d = seq->num_draft();
          if (last != last_drawn.end() && d > 0 && d < tokens && in.ConsumeBool()) {
            for (int t = tokens - d - 1; t < tokens; ++t) seq->set_token_ids(t, last->second);
          }
        } else if (draft >= 250) {
          seq->set_num_draft(in.ConsumeIntegralInRange(-2, 3));  // refused unless 0
        }
        // Allowed-token masks (structured output): mostly none; else one row
        // per draw (dense, sparse or all zero), sometimes a wrong size.
        const uint8_t mask = in.ConsumeIntegral<uint8_t>();
        if (mask >= 160) {
          const int words = (vocab + 31) / 32;
          const int draws = 1 + std::clamp(seq->num_draft(), 0, 8);  // num_draft may be huge
          const int rows = mask >= 245 ? in.ConsumeIntegralInRange(0, draws + 1) : draws;
          const int extra = mask >= 250 ? in.ConsumeIntegralInRange(-1, 1) : 0;
          const uint32_t density = in.ConsumeIntegral<uint32_t>();
          for (int w = 0; w < rows * words + extra; ++w) {
            seq->add_allowed_tokens(mask % 3 == 0 ? 0u : mask % 3 == 1 ? density : ~0u);
          }
        }
      }
      break;
    }
  }
  return true;
}

void CheckForward(const rk::RankCommand& command, int32_t vocab, const std::vector<float>& logits,
                  const std::vector<SampledToken>& tokens,
                  const std::vector<std::vector<SampledToken>>& runs,
                  const std::vector<int64_t>& lengths_before, const exl3serve::worker::PagedKvCache& cache) {
  if (!command.batch_draft.empty()) {
    std::vector<exl3serve::worker::SequenceTokens> batch(command.batch_seq_ids.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i] = {command.batch_seq_ids[i], command.batch_tokens[i]};
    }
    const absl::Status s = exl3serve::worker::CheckVerifiedRuns(
        batch, command.batch_sample, command.batch_draft, vocab, runs);
    if (!s.ok()) {
      std::fprintf(stderr, "rank_protocol_fuzz: impossible runs: %s\n", s.ToString().c_str());
      std::abort();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      const int64_t accepted = runs[i].empty() ? 0 : static_cast<int64_t>(runs[i].size()) - 1;
      const int64_t want = lengths_before[i] + static_cast<int64_t>(batch[i].tokens.size()) -
                           command.batch_draft[i] + accepted;
      if (cache.Length(batch[i].seq_id) != want) {
        std::fprintf(stderr, "rank_protocol_fuzz: sequence %lld has length %lld, expected %lld\n",
                     (long long)batch[i].seq_id, (long long)cache.Length(batch[i].seq_id),
                     (long long)want);
        std::abort();
      }
      reach.accepted_drafts += accepted;
    }
    return;
  }
  if (!command.batch_sample.empty()) {
    if (tokens.size() != command.batch_sample.size()) std::abort();
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (command.batch_sample[i] != 0 && (tokens[i].id < 0 || tokens[i].id >= vocab)) std::abort();
      // A drawn token is allowed by its mask unless the mask allows none.
      if (command.batch_sample[i] != 0 && i < command.batch_allowed.size() &&
          !command.batch_allowed[i].empty()) {
        const std::vector<uint32_t>& m = command.batch_allowed[i];
        bool any = false;
        for (int32_t id = 0; id < vocab; ++id) any = any || ((m[id / 32] >> (id % 32)) & 1u);
        if (any && ((m[tokens[i].id / 32] >> (tokens[i].id % 32)) & 1u) == 0) {
          std::fprintf(stderr, "rank_protocol_fuzz: drew masked token %d\n", tokens[i].id);
          std::abort();
        }
      }
    }
    return;
  }
  size_t rows = 0;
  for (const auto& t : command.batch_tokens) {
    rows += command.rows == exl3serve::worker::LogitsRows::kAllTokens ? t.size() : 1;
  }
  if (logits.size() != rows * static_cast<size_t>(vocab)) std::abort();
  for (float v : logits) {
    if (!std::isfinite(v)) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Fixture& f = TheRank();
  FuzzedDataProvider in(data, size);
  std::set<int64_t> touched;
  std::map<int64_t, int32_t> last_drawn;
  pb::Step built;
  for (uint64_t i = 0; i < 24 && NextStep(in, f.vocab, i, last_drawn, &built); ++i, built.Clear()) {
    pb::Step step;  // what the rank reads off the wire
    if (!step.ParseFromString(built.SerializeAsString())) std::abort();
    ++reach.steps;
    absl::StatusOr<rk::RankCommand> command = rk::RankCommandFromStep(step, kGeneration);
    if (!command.ok()) {
      ++reach.refused_by_translation;
      CheckRefusal(command.status());
      continue;
    }
    touched.insert(command->seq_id);
    touched.insert(command->batch_seq_ids.begin(), command->batch_seq_ids.end());
    std::vector<float> logits;
    std::vector<SampledToken> tokens;
    std::vector<std::vector<SampledToken>> runs;
    std::vector<int64_t> lengths_before;
    for (int64_t id : command->batch_seq_ids) {
      lengths_before.push_back(f.rank.cache->HasSequence(id) ? f.rank.cache->Length(id) : 0);
    }
    const absl::Status status =
        rk::ExecuteRankCommand(f.rank, *command, &logits, &tokens, nullptr, &runs);
    if (!status.ok()) {
      ++reach.refused_by_rank;
      CheckRefusal(status);
    } else if (command->op == rk::RankCommand::Op::kForward) {
      ++(!command->batch_draft.empty()  ? reach.verified_forwards
         : command->batch_sample.empty() ? reach.forwards
                                         : reach.sampled_forwards);
      CheckForward(*command, f.vocab, logits, tokens, runs, lengths_before, *f.rank.cache);
      for (size_t i = 0; i < command->batch_seq_ids.size(); ++i) {
        if (!runs.empty() && !runs[i].empty()) last_drawn[command->batch_seq_ids[i]] = runs[i].back().id;
        if (runs.empty() && i < tokens.size() && !command->batch_sample.empty() &&
            command->batch_sample[i] != 0) {
          last_drawn[command->batch_seq_ids[i]] = tokens[i].id;
        }
      }
    } else {
      ++(command->op == rk::RankCommand::Op::kAddSequence ? reach.added : reach.removed);
    }
  }
  for (int64_t id : touched) {
    rk::RankCommand remove;
    remove.op = rk::RankCommand::Op::kRemoveSequence;
    remove.seq_id = id;
    (void)rk::ExecuteRankCommand(f.rank, remove, nullptr, nullptr);
    if (f.rank.sampler->HasSequence(id)) std::abort();
  }
  if (f.rank.cache->free_pages() != kNumPages) {
    std::fprintf(stderr, "rank_protocol_fuzz: %lld of %lld pages not returned\n",
                 static_cast<long long>(kNumPages - f.rank.cache->free_pages()),
                 static_cast<long long>(kNumPages));
    std::abort();
  }
  return 0;
}
