// worker/rank/step_command.h — what a rank makes of the coordinator's Step
// messages (proto/exl3serve/rank/v1/rank.proto): the translation into a
// RankCommand (rank_executor.h) and its checks, apart from the gRPC session
// (rank_client.cc) so that the protocol fuzzer
// (tests/fuzz/rank_protocol_fuzz.cc) drives the same code.
//
// A Step is untrusted input here: anything it carries (ids, tokens, pages,
// sampling values) reaches ExecuteRankCommand, whose checks refuse what the
// rank's state does not allow; this layer refuses what no state allows.
#ifndef EXL3SERVE_WORKER_RANK_STEP_COMMAND_H_
#define EXL3SERVE_WORKER_RANK_STEP_COMMAND_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "worker/rank/rank_executor.h"

namespace exl3serve::rank::v1 {
class SamplingSpec;
class Step;
}  // namespace exl3serve::rank::v1

namespace exl3serve::worker::rank {

// The command of `step` for a rank of group generation `group_generation`.
// Errors: Aborted for a step of another generation (every rank of the group
// refuses it alike; the coordinator replays), InvalidArgument naming the
// step for no operation, a forward without rows, a sampled forward with no
// sequences, a verified forward that is not sampled or whose draft counts
// fail worker::CheckDraftCounts (naming the entry), a num_draft on a forward
// that is not verified.
absl::StatusOr<RankCommand> RankCommandFromStep(const ::exl3serve::rank::v1::Step& step,
                                                uint64_t group_generation);

// AddSequence.sampling as the sampler takes it (logit_bias in ascending id
// order, so every rank applies it alike). Values are checked by the sampler.
SequenceSampling SamplingFromProto(const ::exl3serve::rank::v1::SamplingSpec& spec);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_STEP_COMMAND_H_
