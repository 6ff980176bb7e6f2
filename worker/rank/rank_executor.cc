#include "worker/rank/rank_executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "sharding/exl3_model.h"
#include "sharding/shard_plan.h"
#include "worker/api/verified_forward.h"
#include "worker/model/linear.h"

namespace exl3serve::worker::rank {

const char* ForwardPhaseName(ForwardPhase phase) {
  switch (phase) {
    case ForwardPhase::kPrefill: return "prefill";
    case ForwardPhase::kDecode: return "decode";
    case ForwardPhase::kMixed: return "mixed";
  }
  return "mixed";
}

absl::StatusOr<LoadedRank> LoadRank(const RankSetup& setup) {
  EXL3_RETURN_IF_ERROR(CheckCapacities(setup.capacities, setup.world_size));
  EXL3_RETURN_IF_ERROR(SetPrefillPrecision(setup.prefill_precision));
  EXL3_RETURN_IF_ERROR(SetDecodePrecision(setup.decode_precision));
  EXL3_LOG(kInfo) << "rank " << setup.rank << ": precision prefill="
                  << GemmPrecisionName(setup.prefill_precision)
                  << " decode=" << GemmPrecisionName(setup.decode_precision);
  LoadedRank loaded;
  loaded.rank = setup.rank;
  loaded.observer = setup.observer;
  EXL3_ASSIGN_OR_RETURN(loaded.comm,
                        comm::CreateCommunicator(setup.comm, setup.rank, setup.world_size,
                                                 absl::Now() + setup.join_timeout));
  loaded.comm = comm::WithCollectiveTiming(std::move(loaded.comm), setup.observer);
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<sharding::Exl3Model> checkpoint,
                        sharding::Exl3Model::Open(setup.model_dir));
  if (!checkpoint->arch().has_value()) {
    return absl::UnimplementedError(
        absl::StrCat(setup.model_dir, ": unsupported architecture for tensor parallelism"));
  }
  sharding::ShardOptions shard_options;
  shard_options.expert_parallel = setup.expert_parallel;
  sharding::WorldSpec world = sharding::WorldSpec::Uniform(setup.world_size);
  for (size_t r = 0; r < setup.capacities.size(); ++r) {
    world.ranks[r].capacity = setup.capacities[r];
  }
  EXL3_ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                        sharding::PlanShards(*checkpoint->arch(), world, shard_options,
                                             checkpoint.get()));
  TensorParallelism tp;
  tp.shard = plan.ranks[setup.rank];
  tp.comm = loaded.comm.get();
  tp.collective_timeout = setup.collective_timeout;
  loaded.planned_bytes = tp.shard.weight_bytes;
  TransformerLoadOptions load_options;
  load_options.spill = setup.spill;
  EXL3_ASSIGN_OR_RETURN(loaded.model, Transformer::LoadShard(setup.model_dir, tp, load_options));
  loaded.bytes_read = loaded.model->bytes_read();
  EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, loaded.model->CreateKvCache(setup.kv));
  loaded.cache.emplace(std::move(cache));
  loaded.collective_timeout = setup.collective_timeout;
  if (setup.kv_disk_slots > 0) {
    EXL3_ASSIGN_OR_RETURN(loaded.disk_tier,
                          KvDiskTier::Open({.path = KvDiskPathOfRank(setup.kv_disk_path, setup.rank),
                                            .slots = setup.kv_disk_slots,
                                            .slot_bytes = loaded.cache->bytes_per_page()}));
    EXL3_LOG(kInfo) << "rank " << setup.rank << ": KV disk tier " << loaded.disk_tier->options().path
                    << ", " << setup.kv_disk_slots << " blocks of "
                    << loaded.cache->bytes_per_page() << " bytes";
  }
  loaded.sampler.emplace(MakeVocabSampler(*loaded.model));
  EXL3_RETURN_IF_ERROR(loaded.comm->Barrier(absl::Now() + setup.join_timeout));
  return loaded;
}

absl::Status ExecuteRankCommand(LoadedRank& rank, const RankCommand& command,
                                std::vector<float>* logits, std::vector<SampledToken>* tokens,
                                std::vector<uint8_t>* loaded,
                                std::vector<std::vector<SampledToken>>* runs) {
  switch (command.op) {
    case RankCommand::Op::kSaveKvBlocks:
      SaveKvBlocksToDisk(*rank.cache, rank.disk_tier.get(), command.transfers);
      if (rank.observer != nullptr && rank.disk_tier != nullptr) {
        rank.observer->OnKvDiskTier(rank.disk_tier->stats());
      }
      return absl::OkStatus();
    case RankCommand::Op::kLoadKvBlocks: {
      std::vector<uint8_t> mine;
      LoadKvBlocksFromDisk(&*rank.cache, rank.disk_tier.get(), command.transfers, &mine);
      if (rank.comm != nullptr && rank.comm->world_size() > 1 && !mine.empty()) {
        // A block is usable only if every rank has its shard of it.
        std::vector<float> misses(mine.size());
        for (size_t i = 0; i < mine.size(); ++i) misses[i] = mine[i] ? 0.0f : 1.0f;
        EXL3_RETURN_IF_ERROR(rank.comm->AllReduce(misses.data(), misses.size(),
                                                  comm::CommDataType::kF32,
                                                  absl::Now() + rank.collective_timeout));
        for (size_t i = 0; i < mine.size(); ++i) mine[i] = misses[i] == 0.0f ? 1 : 0;
      }
      if (rank.observer != nullptr && rank.disk_tier != nullptr) {
        rank.observer->OnKvDiskTier(rank.disk_tier->stats());
      }
      if (loaded != nullptr) *loaded = std::move(mine);
      return absl::OkStatus();
    }
    case RankCommand::Op::kAddSequence: {
      if (!command.sampling.has_value()) return rank.cache->AddSequence(command.seq_id);
      if (rank.sampler->HasSequence(command.seq_id)) {
        return absl::AlreadyExistsError(
            absl::StrCat("sequence ", command.seq_id, " already exists"));
      }
      EXL3_RETURN_IF_ERROR(rank.cache->AddSequence(
          command.seq_id, static_cast<int64_t>(command.sampling->cached_prefix.size()),
          CachedStateOf(*command.sampling)));
      if (absl::Status s = rank.sampler->AddSequence(command.seq_id, *command.sampling);
          !s.ok()) {
        (void)rank.cache->RemoveSequence(command.seq_id);
        return s;
      }
      return absl::OkStatus();
    }
    case RankCommand::Op::kSaveStateSnapshots:
      return SaveStateSnapshots(&*rank.cache, command.snapshots);
    case RankCommand::Op::kRemoveSequence:
      rank.sampler->RemoveSequence(command.seq_id);
      return rank.cache->RemoveSequence(command.seq_id);
    case RankCommand::Op::kForward: {
      if (command.batch_seq_ids.size() != command.batch_tokens.size()) {
        return absl::InvalidArgumentError("forward: sequence ids and token lists differ in count");
      }
      if (!command.batch_new_pages.empty() &&
          command.batch_new_pages.size() != command.batch_seq_ids.size()) {
        return absl::InvalidArgumentError(
            "forward: sequence ids and assigned page lists differ in count");
      }
      std::vector<SequenceTokens> batch(command.batch_seq_ids.size());
      if (!command.batch_allowed.empty() &&
          command.batch_allowed.size() != command.batch_seq_ids.size()) {
        return absl::InvalidArgumentError(
            "forward: sequence ids and allowed-token masks differ in count");
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        batch[i] = {command.batch_seq_ids[i], command.batch_tokens[i]};
        if (!command.batch_allowed.empty()) batch[i].allowed_tokens = command.batch_allowed[i];
      }
      const bool any_mask =
          std::any_of(command.batch_allowed.begin(), command.batch_allowed.end(),
                      [](const std::vector<uint32_t>& m) { return !m.empty(); });
      if (any_mask) {
        // Before the pages, like the draft counts.
        if (command.batch_sample.empty()) {
          return absl::InvalidArgumentError("forward: allowed-token masks on an unsampled forward");
        }
        EXL3_RETURN_IF_ERROR(CheckAllowedTokens(batch, command.batch_sample, command.batch_draft,
                                                rank.model->vocab_size()));
      }
      if (!command.batch_draft.empty()) {
        // Before the pages: a refused verification changes nothing.
        EXL3_RETURN_IF_ERROR(CheckDraftCounts(batch, command.batch_sample, command.batch_draft));
      }
      for (size_t i = 0; i < command.batch_new_pages.size(); ++i) {
        if (command.batch_new_pages[i].empty()) continue;
        EXL3_RETURN_IF_ERROR(
            rank.cache->AssignPages(command.batch_seq_ids[i], command.batch_new_pages[i]));
      }
      std::vector<float> scratch;
      const absl::Time start = absl::Now();
      absl::Status status;
      if (!command.batch_draft.empty()) {
        std::vector<std::vector<SampledToken>> drawn;
        status = RunVerifiedForward(*rank.model, &*rank.cache, &*rank.sampler, batch,
                                    command.batch_sample, command.batch_draft, &scratch,
                                    runs ? runs : &drawn);
      } else if (!command.batch_sample.empty()) {
        std::vector<SampledToken> drawn;
        status = RunSampledForward(*rank.model, &*rank.cache, &*rank.sampler, batch,
                                   command.batch_sample, &scratch, tokens ? tokens : &drawn);
      } else {
        status = rank.model->Forward(batch, command.rows, &*rank.cache, logits ? logits : &scratch);
      }
      if (rank.observer != nullptr) {
        int64_t tokens = 0, single = 0;
        for (size_t i = 0; i < command.batch_tokens.size(); ++i) {
          // A verifying entry (the last token and its drafts) is a decode.
          const size_t fed = command.batch_tokens[i].size();
          const size_t drafts = command.batch_draft.empty() ? 0 : command.batch_draft[i];
          tokens += static_cast<int64_t>(fed);
          single += fed - drafts == 1 ? 1 : 0;
        }
        const int64_t n = static_cast<int64_t>(command.batch_tokens.size());
        const ForwardPhase phase = single == n   ? ForwardPhase::kDecode
                                   : single == 0 ? ForwardPhase::kPrefill
                                                 : ForwardPhase::kMixed;
        rank.observer->OnForward(phase, tokens, absl::Now() - start, status);
        rank.observer->OnModelCounters(*rank.model);
        // The disk tier writes asynchronously: its counters move between
        // saves, so they are exported after every forward as well.
        if (rank.disk_tier != nullptr) rank.observer->OnKvDiskTier(rank.disk_tier->stats());
      }
      return status;
    }
  }
  return absl::InvalidArgumentError("unknown rank command");
}

}  // namespace exl3serve::worker::rank
