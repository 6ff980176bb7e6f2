#include "worker/rank/step_command.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "exl3serve/rank/v1/rank.pb.h"
#include "worker/api/verified_forward.h"

namespace exl3serve::worker::rank {

namespace pb = ::exl3serve::rank::v1;

absl::StatusOr<RankCommand> RankCommandFromStep(const pb::Step& step, uint64_t group_generation) {
  RankCommand command;
  absl::Status status;
  if (step.group_generation() != group_generation) {
    // Every rank of the group sees the same step, so all refuse it alike.
    status = absl::AbortedError(absl::StrCat(
        "step ", step.step_id(), " is for rank group generation ", step.group_generation(),
        " but this rank belongs to generation ", group_generation,
        " (its sequences are not the caller's: replay them)"));
  }
  switch (status.ok() ? step.op_case() : pb::Step::OP_NOT_SET) {
    case pb::Step::OP_NOT_SET:
      if (status.ok()) {
        status = absl::InvalidArgumentError(
            absl::StrCat("step ", step.step_id(), ": no operation set"));
      }
      break;
    case pb::Step::kAddSequence:
      command.op = RankCommand::Op::kAddSequence;
      command.seq_id = step.add_sequence().seq_id();
      if (step.add_sequence().has_sampling()) {
        command.sampling = SamplingFromProto(step.add_sequence().sampling());
        const auto& cached = step.add_sequence().cached_prefix_ids();
        command.sampling->cached_prefix.assign(cached.begin(), cached.end());
        if (step.add_sequence().has_cached_state()) {
          const pb::StateSnapshotRef& state = step.add_sequence().cached_state();
          command.sampling->cached_state_slot = state.slot();
          command.sampling->cached_state_hash_hi = state.hash_hi();
          command.sampling->cached_state_hash_lo = state.hash_lo();
        }
      } else if (step.add_sequence().cached_prefix_ids_size() > 0) {
        status = absl::InvalidArgumentError(absl::StrCat(
            "step ", step.step_id(), ": a cached prefix without sampling parameters"));
      }
      break;
    case pb::Step::kRemoveSequence:
      command.op = RankCommand::Op::kRemoveSequence;
      command.seq_id = step.remove_sequence().seq_id();
      break;
    case pb::Step::kSaveKvBlocks:
    case pb::Step::kLoadKvBlocks: {
      const bool save = step.op_case() == pb::Step::kSaveKvBlocks;
      command.op = save ? RankCommand::Op::kSaveKvBlocks : RankCommand::Op::kLoadKvBlocks;
      for (const pb::KvBlockTransfer& t :
           (save ? step.save_kv_blocks() : step.load_kv_blocks()).blocks()) {
        command.transfers.push_back(
            {.page = t.page(), .slot = t.slot(), .hash_hi = t.hash_hi(), .hash_lo = t.hash_lo()});
      }
      break;
    }
    case pb::Step::kSaveStateSnapshots:
      command.op = RankCommand::Op::kSaveStateSnapshots;
      for (const pb::StateSnapshotSave& s : step.save_state_snapshots().saves()) {
        command.snapshots.push_back({.seq_id = s.seq_id(),
                                     .snapshot = {.slot = s.snapshot().slot(),
                                                  .hash_hi = s.snapshot().hash_hi(),
                                                  .hash_lo = s.snapshot().hash_lo()}});
      }
      break;
    case pb::Step::kForward: {
      command.op = RankCommand::Op::kForward;
      const pb::ForwardBatch& forward = step.forward();
      if (forward.sampled()) {
        command.rows = LogitsRows::kLastToken;
        for (const pb::SequenceTokens& seq : forward.sequences()) {
          command.batch_sample.push_back(seq.sample() ? 1 : 0);
        }
        if (command.batch_sample.empty()) {
          status = absl::InvalidArgumentError(
              absl::StrCat("step ", step.step_id(), ": a sampled forward with no sequences"));
        }
      } else if (forward.rows() == pb::LOGITS_ROWS_LAST_TOKEN) {
        command.rows = LogitsRows::kLastToken;
      } else if (forward.rows() == pb::LOGITS_ROWS_ALL_TOKENS) {
        command.rows = LogitsRows::kAllTokens;
      } else {
        status = absl::InvalidArgumentError(
            absl::StrCat("step ", step.step_id(), ": forward rows must be set"));
      }
      for (const pb::SequenceTokens& seq : forward.sequences()) {
        command.batch_seq_ids.push_back(seq.seq_id());
        command.batch_tokens.emplace_back(seq.token_ids().begin(), seq.token_ids().end());
        command.batch_new_pages.emplace_back(seq.block_ids().begin(), seq.block_ids().end());
        command.batch_allowed.emplace_back(seq.allowed_tokens().begin(),
                                           seq.allowed_tokens().end());
        if (forward.verified()) {
          command.batch_draft.push_back(seq.num_draft());
        } else if (seq.num_draft() != 0 && status.ok()) {
          status = absl::InvalidArgumentError(absl::StrCat(
              "step ", step.step_id(), ": sequence ", seq.seq_id(), " has num_draft ",
              seq.num_draft(), " in a forward that is not verified"));
        }
      }
      if (forward.verified() && status.ok()) {
        if (!forward.sampled()) {
          status = absl::InvalidArgumentError(
              absl::StrCat("step ", step.step_id(), ": a verified forward must be sampled"));
        } else {
          std::vector<SequenceTokens> batch(command.batch_seq_ids.size());
          for (size_t i = 0; i < batch.size(); ++i) {
            batch[i] = {command.batch_seq_ids[i], command.batch_tokens[i]};
          }
          if (absl::Status s = CheckDraftCounts(batch, command.batch_sample, command.batch_draft);
              !s.ok()) {
            status = absl::InvalidArgumentError(absl::StrCat("step ", step.step_id(), ": ", s.message()));
          }
        }
      }
      break;
    }
    default:
      status = absl::InvalidArgumentError(
          absl::StrCat("step ", step.step_id(), ": no operation set"));
  }
  if (!status.ok()) return status;
  return command;
}

SequenceSampling SamplingFromProto(const pb::SamplingSpec& spec) {
  SequenceSampling out;
  SamplingParams& p = out.params;
  p.temperature = spec.temperature();
  p.top_k = spec.top_k();
  p.top_p = spec.top_p();
  p.min_p = spec.min_p();
  p.repetition_penalty = spec.repetition_penalty();
  p.presence_penalty = spec.presence_penalty();
  p.frequency_penalty = spec.frequency_penalty();
  p.seed = spec.seed();
  p.logprobs = spec.logprobs();
  p.top_logprobs = spec.top_logprobs();
  // Ascending ids: every rank applies the bias in the same order.
  for (const auto& [id, bias] : spec.logit_bias()) p.logit_bias.emplace_back(id, bias);
  std::sort(p.logit_bias.begin(), p.logit_bias.end());
  out.prompt_len = spec.prompt_len();
  return out;
}

}  // namespace exl3serve::worker::rank
