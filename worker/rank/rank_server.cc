#include "worker/rank/rank_server.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/rank/control_wire.h"
#include "worker/rank/rank_executor.h"

namespace exl3serve::worker::rank {
namespace {

// How long a reply may take to reach the driver (it is waiting for it).
constexpr absl::Duration kReplyTimeout = absl::Seconds(30);

// Parses one command frame and executes it; `reply` gets whatever follows
// the status (rank 0's logits for a forward).
absl::Status Execute(LoadedRank& rank, std::string_view frame, WireWriter* reply,
                     bool* shutdown) {
  WireReader in(frame);
  const auto op = static_cast<ControlOp>(in.U8());
  RankCommand command;
  switch (op) {
    case ControlOp::kAddSequence:
      command.op = RankCommand::Op::kAddSequence;
      command.seq_id = in.I64();
      EXL3_RETURN_IF_ERROR(in.Finish("add-sequence"));
      return ExecuteRankCommand(rank, command, nullptr);
    case ControlOp::kRemoveSequence:
      command.op = RankCommand::Op::kRemoveSequence;
      command.seq_id = in.I64();
      EXL3_RETURN_IF_ERROR(in.Finish("remove-sequence"));
      return ExecuteRankCommand(rank, command, nullptr);
    case ControlOp::kForward: {
      const uint8_t rows = in.U8();
      const uint32_t n = in.U32();
      if (!in.ok() || n > kMaxFrameBytes / 12) {
        return absl::InvalidArgumentError("forward: malformed batch header");
      }
      command.op = RankCommand::Op::kForward;
      command.batch_seq_ids.resize(n);
      command.batch_tokens.resize(n);
      command.batch_new_pages.resize(n);
      for (uint32_t i = 0; i < n && in.ok(); ++i) {
        command.batch_seq_ids[i] = in.I64();
        command.batch_tokens[i] = in.I32s();
        command.batch_new_pages[i] = in.I32s();
      }
      EXL3_RETURN_IF_ERROR(in.Finish("forward"));
      if (rows > 1) return absl::InvalidArgumentError("forward: unknown logits rows mode");
      command.rows = rows == 0 ? LogitsRows::kLastToken : LogitsRows::kAllTokens;
      std::vector<float> logits;
      EXL3_RETURN_IF_ERROR(ExecuteRankCommand(rank, command, &logits));
      if (rank.rank == 0) reply->F32s(logits.data(), logits.size());
      return absl::OkStatus();
    }
    case ControlOp::kAddSampledSequence: {
      command.op = RankCommand::Op::kAddSequence;
      command.seq_id = in.I64();
      SequenceSampling sampling;
      EXL3_RETURN_IF_ERROR(DecodeSequenceSampling(&in, &sampling));
      EXL3_RETURN_IF_ERROR(in.Finish("add-sampled-sequence"));
      command.sampling = std::move(sampling);
      return ExecuteRankCommand(rank, command, nullptr);
    }
    case ControlOp::kForwardSampled: {
      const uint32_t n = in.U32();
      // An entry takes at least 21 bytes (i64, two empty lists, u8, an
      // empty list).
      if (!in.ok() || n > in.rest().size() / 21) {
        return absl::InvalidArgumentError("sampled forward: malformed batch header");
      }
      command.op = RankCommand::Op::kForward;
      command.batch_seq_ids.resize(n);
      command.batch_tokens.resize(n);
      command.batch_new_pages.resize(n);
      command.batch_sample.resize(n);
      command.batch_allowed.resize(n);
      for (uint32_t i = 0; i < n && in.ok(); ++i) {
        command.batch_seq_ids[i] = in.I64();
        command.batch_tokens[i] = in.I32s();
        command.batch_new_pages[i] = in.I32s();
        command.batch_sample[i] = in.U8();
        command.batch_allowed[i] = in.U32s();
      }
      EXL3_RETURN_IF_ERROR(in.Finish("sampled forward"));
      std::vector<SampledToken> tokens;
      EXL3_RETURN_IF_ERROR(ExecuteRankCommand(rank, command, nullptr, &tokens));
      if (rank.rank == 0) EncodeSampledTokens(tokens, reply);
      return absl::OkStatus();
    }
    case ControlOp::kForwardVerified: {
      const uint32_t n = in.U32();
      // An entry takes at least 25 bytes (i64, two empty lists, u8, i32,
      // an empty list).
      if (!in.ok() || n > in.rest().size() / 25) {
        return absl::InvalidArgumentError("verified forward: malformed batch header");
      }
      command.op = RankCommand::Op::kForward;
      command.batch_seq_ids.resize(n);
      command.batch_tokens.resize(n);
      command.batch_new_pages.resize(n);
      command.batch_sample.resize(n);
      command.batch_draft.resize(n);
      command.batch_allowed.resize(n);
      for (uint32_t i = 0; i < n && in.ok(); ++i) {
        command.batch_seq_ids[i] = in.I64();
        command.batch_tokens[i] = in.I32s();
        command.batch_new_pages[i] = in.I32s();
        command.batch_sample[i] = in.U8();
        command.batch_draft[i] = in.I32();
        command.batch_allowed[i] = in.U32s();
      }
      EXL3_RETURN_IF_ERROR(in.Finish("verified forward"));
      if (n == 0) return absl::InvalidArgumentError("verified forward: no batch entries");
      std::vector<std::vector<SampledToken>> runs;
      EXL3_RETURN_IF_ERROR(ExecuteRankCommand(rank, command, nullptr, nullptr, nullptr, &runs));
      if (rank.rank == 0) EncodeSampledRuns(runs, reply);
      return absl::OkStatus();
    }
    case ControlOp::kSaveKvBlocks:
    case ControlOp::kLoadKvBlocks: {
      const bool save = op == ControlOp::kSaveKvBlocks;
      command.op = save ? RankCommand::Op::kSaveKvBlocks : RankCommand::Op::kLoadKvBlocks;
      EXL3_RETURN_IF_ERROR(DecodeKvBlockTransfers(&in, &command.transfers));
      EXL3_RETURN_IF_ERROR(in.Finish(save ? "save-kv-blocks" : "load-kv-blocks"));
      std::vector<uint8_t> loaded;
      EXL3_RETURN_IF_ERROR(ExecuteRankCommand(rank, command, nullptr, nullptr, &loaded));
      if (!save && rank.rank == 0) {
        reply->U32(static_cast<uint32_t>(loaded.size()));
        for (uint8_t flag : loaded) reply->U8(flag);
      }
      return absl::OkStatus();
    }
    case ControlOp::kSaveStateSnapshots:
      command.op = RankCommand::Op::kSaveStateSnapshots;
      EXL3_RETURN_IF_ERROR(DecodeStateSnapshotSaves(&in, &command.snapshots));
      EXL3_RETURN_IF_ERROR(in.Finish("save-state-snapshots"));
      return ExecuteRankCommand(rank, command, nullptr);
    case ControlOp::kShutdown:
      EXL3_RETURN_IF_ERROR(in.Finish("shutdown"));
      *shutdown = true;
      return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown control op ", static_cast<int>(op)));
}

}  // namespace

absl::Status RunRankServer(const RankServerOptions& options) {
  if (options.control_fd < 0) return absl::InvalidArgumentError("worker: no control channel");
  if (options.threads >= 1) kernels::cpu::SetSharedThreadPoolSize(options.threads);
  RankSetup setup;
  setup.model_dir = options.model_dir;
  setup.rank = options.rank;
  setup.world_size = options.world_size;
  setup.expert_parallel = options.expert_parallel;
  setup.comm = options.comm;
  setup.kv = options.kv;
  setup.kv_disk_path = options.kv_disk_path;
  setup.kv_disk_slots = options.kv_disk_slots;
  setup.join_timeout = options.join_timeout;
  setup.collective_timeout = options.collective_timeout;
  setup.spill = options.spill;
  setup.capacities = options.capacities;
  setup.prefill_precision = options.prefill_precision;
  setup.decode_precision = options.decode_precision;
  setup.observer = options.observer;
  absl::StatusOr<LoadedRank> loaded = LoadRank(setup);
  {
    WireWriter hello;
    hello.U32(kControlWireVersion);
    WriteStatus(hello, loaded.status());
    hello.I64(loaded.ok() ? loaded->model->vocab_size() : 0);
    hello.U64(loaded.ok() ? loaded->bytes_read : 0);
    hello.U64(loaded.ok() ? loaded->planned_bytes : 0);
    hello.I64(loaded.ok() ? loaded->cache->options().num_pages : 0);
    hello.U32(loaded.ok() ? loaded->cache->options().page_size_tokens : 0);
    EXL3_RETURN_IF_ERROR(WriteFrame(options.control_fd, hello.data(), absl::Now() + kReplyTimeout));
  }
  if (!loaded.ok()) return loaded.status();
  EXL3_LOG(kInfo) << "rank " << options.rank << "/" << options.world_size << " ready ("
                  << loaded->comm->backend_name() << ", " << loaded->bytes_read
                  << " checkpoint bytes read)";
  while (true) {
    absl::StatusOr<std::string> frame = ReadFrame(options.control_fd, absl::InfiniteFuture());
    if (!frame.ok()) return absl::OkStatus();  // the driver has gone: nothing left to do
    WireWriter body;
    bool shutdown = false;
    const absl::Status status = Execute(*loaded, *frame, &body, &shutdown);
    WireWriter reply;
    WriteStatus(reply, status);
    std::string payload = reply.Take() + (status.ok() ? body.Take() : std::string());
    const absl::Status sent = WriteFrame(options.control_fd, payload, absl::Now() + kReplyTimeout);
    if (absl::Status health = loaded->comm->health(); !health.ok()) {
      EXL3_LOG(kError) << "rank " << options.rank << ": lost its peers: " << health;
      return health;
    }
    if (shutdown || !sent.ok()) return absl::OkStatus();
  }
}

}  // namespace exl3serve::worker::rank
