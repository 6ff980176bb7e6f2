#include "worker/rank/rank_server.h"

#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/cpu/thread_pool.h"
#include "sharding/exl3_model.h"
#include "sharding/shard_plan.h"
#include "worker/comm/communicator.h"
#include "worker/model/transformer.h"
#include "worker/rank/control_wire.h"

namespace exl3serve::worker::rank {
namespace {

// How long a reply may take to reach the driver (it is waiting for it).
constexpr absl::Duration kReplyTimeout = absl::Seconds(30);

struct LoadedRank {
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<Transformer> model;
  std::optional<PagedKvCache> cache;
  uint64_t bytes_read = 0;
  uint64_t planned_bytes = 0;
};

absl::StatusOr<LoadedRank> Load(const RankServerOptions& options) {
  LoadedRank loaded;
  EXL3_ASSIGN_OR_RETURN(loaded.comm,
                        comm::CreateCommunicator(options.comm, options.rank, options.world_size,
                                                 absl::Now() + options.join_timeout));
  EXL3_ASSIGN_OR_RETURN(std::unique_ptr<sharding::Exl3Model> checkpoint,
                        sharding::Exl3Model::Open(options.model_dir));
  if (!checkpoint->arch().has_value()) {
    return absl::UnimplementedError(
        absl::StrCat(options.model_dir, ": unsupported architecture for tensor parallelism"));
  }
  sharding::ShardOptions shard_options;
  shard_options.expert_parallel = options.expert_parallel;
  EXL3_ASSIGN_OR_RETURN(sharding::ShardPlan plan,
                        sharding::PlanShards(*checkpoint->arch(),
                                             sharding::WorldSpec::Uniform(options.world_size),
                                             shard_options, checkpoint.get()));
  TensorParallelism tp;
  tp.shard = plan.ranks[options.rank];
  tp.comm = loaded.comm.get();
  tp.collective_timeout = options.collective_timeout;
  loaded.planned_bytes = tp.shard.weight_bytes;
  EXL3_ASSIGN_OR_RETURN(loaded.model, Transformer::LoadShard(options.model_dir, tp));
  loaded.bytes_read = loaded.model->bytes_read();
  EXL3_ASSIGN_OR_RETURN(PagedKvCache cache, loaded.model->CreateKvCache(options.kv));
  loaded.cache.emplace(std::move(cache));
  // Everyone loaded before anyone reports ready: a rank that fails to load
  // makes the others' barrier fail instead of leaving them waiting at the
  // first step.
  EXL3_RETURN_IF_ERROR(loaded.comm->Barrier(absl::Now() + options.join_timeout));
  return loaded;
}

// Executes one command; `reply` gets whatever follows the status.
absl::Status Execute(LoadedRank& rank, int rank_index, std::string_view frame,
                     WireWriter* reply, bool* shutdown) {
  WireReader in(frame);
  const auto op = static_cast<ControlOp>(in.U8());
  switch (op) {
    case ControlOp::kAddSequence: {
      const int64_t seq = in.I64();
      EXL3_RETURN_IF_ERROR(in.Finish("add-sequence"));
      return rank.cache->AddSequence(seq);
    }
    case ControlOp::kRemoveSequence: {
      const int64_t seq = in.I64();
      EXL3_RETURN_IF_ERROR(in.Finish("remove-sequence"));
      return rank.cache->RemoveSequence(seq);
    }
    case ControlOp::kForward: {
      const uint8_t rows = in.U8();
      const uint32_t n = in.U32();
      if (!in.ok() || n > kMaxFrameBytes / 12) {
        return absl::InvalidArgumentError("forward: malformed batch header");
      }
      std::vector<int64_t> seqs(n);
      std::vector<std::vector<int32_t>> tokens(n);
      for (uint32_t i = 0; i < n && in.ok(); ++i) {
        seqs[i] = in.I64();
        tokens[i] = in.I32s();
      }
      EXL3_RETURN_IF_ERROR(in.Finish("forward"));
      if (rows > 1) return absl::InvalidArgumentError("forward: unknown logits rows mode");
      std::vector<SequenceTokens> batch(n);
      for (uint32_t i = 0; i < n; ++i) batch[i] = {seqs[i], tokens[i]};
      std::vector<float> logits;
      EXL3_RETURN_IF_ERROR(rank.model->Forward(
          batch, rows == 0 ? LogitsRows::kLastToken : LogitsRows::kAllTokens, &*rank.cache,
          &logits));
      if (rank_index == 0) reply->F32s(logits.data(), logits.size());
      return absl::OkStatus();
    }
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
  absl::StatusOr<LoadedRank> loaded = Load(options);
  {
    WireWriter hello;
    hello.U32(kControlWireVersion);
    WriteStatus(hello, loaded.status());
    hello.I64(loaded.ok() ? loaded->model->vocab_size() : 0);
    hello.U64(loaded.ok() ? loaded->bytes_read : 0);
    hello.U64(loaded.ok() ? loaded->planned_bytes : 0);
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
    const absl::Status status = Execute(*loaded, options.rank, *frame, &body, &shutdown);
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
