// coordinator/local_engine.h — the serving engine (engine.h) over one
// worker::StepExecutor — in-process, local rank processes or remote ranks
// alike: validation and tokenization at Submit, one scheduler thread that
// runs the continuous-batching schedule (scheduler.h), stop conditions,
// streaming detokenization and the responses. Tokens are drawn on the
// ranks (worker/api/sampling.h), not here.
//
//   EngineOptions options;  options.model_dir = dir;  options.tensor_parallel = 2;
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, CreateLocalEngine(options));
//   EXL3_RETURN_IF_ERROR(engine->Submit(request, on_response));
//
// CreateLocalEngine runs the model in this process (tensor_parallel 1) or in
// N local rank processes (worker/rank/local_group.h). LocalEngine's
// constructor takes any StepExecutor (a fake in tests; remote ranks,
// coordinator/rank_group.h, with LoadEngineModel in `exl3serve coordinator`).
//
// The scheduler thread owns every request once it left Submit's inbox. Each
// iteration: take new requests and aborts from the inbox (mutex), Schedule(),
// RemoveSequence / AddSampledSequence (a request's sampling parameters, seed
// and prompt length travel once, at admission; the ranks' samplers apply
// penalties over prompt + output and choose each row's precision by its
// position), disk-tier and snapshot transfers, then one ForwardSampled: each
// entry that needs a token gets the id the ranks drew. Then stop ids / EOS /
// max_tokens / stop strings, stream a chunk, or complete. Responses are
// delivered on this thread; callbacks must not block (engine.h). When idle
// it waits on a condition variable.
// With speculative decoding (EngineOptions::speculative) each decoding
// sequence first proposes draft tokens (ProposeDrafts), a step with drafts
// runs ForwardVerified instead, and each drafting sequence's verified run
// (accepted drafts + one token) is handled token by token and streamed as
// one chunk.
//
// Output rules: stop token ids and EOS end the request without being part of
// the output (as worker::Generate); the token that completes a stop string
// is part of output_ids, the stop string is not part of the text. Text is
// streamed only when the model has a tokenizer.json (else empty).
//
// Failure: an executor error (a rank died: Unavailable, Aborted,
// DeadlineExceeded; or anything else) ends every in-flight request with a
// GenerateError (UNAVAILABLE for a broken group, INTERNAL otherwise) and the
// engine stops being ready for a broken group — unless the group re-forms
// within options.reform_timeout (StepExecutor::Recover), in which case every
// in-flight request is replayed (OnExecutorFailure). A group that did not
// re-form in time is retried (Recover again) while the engine idles, so the
// engine becomes ready again once its ranks are back.
//
// Thread safety: every public method is thread-safe.
#ifndef EXL3SERVE_COORDINATOR_LOCAL_ENGINE_H_
#define EXL3SERVE_COORDINATOR_LOCAL_ENGINE_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/constrained/constraint.h"
#include "coordinator/engine.h"
#include "coordinator/draft_governor.h"
#include "coordinator/draft_length.h"
#include "coordinator/draft_model.h"
#include "coordinator/engine_observer.h"
#include "coordinator/ngram_drafter.h"
#include "coordinator/scheduler.h"
#include "coordinator/speculative_method.h"
#include "coordinator/stop_strings.h"
#include "coordinator/tokenizer/stream_decoder.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "kernels/trellis_gemm.h"
#include "sharding/spill_store.h"
#include "worker/api/step_executor.h"
#include "worker/rank/executor_factory.h"

namespace exl3serve::coordinator {


struct EngineOptions {
  // --- Behaviour ---
  std::string model_dir;          // EXL3 or plain Hugging Face directory
  int tensor_parallel = 1;        // ranks; 1 = the model runs in this process
  int expert_parallel = 0;        // as LocalGroupOptions::expert_parallel
  int threads_per_rank = 1;
  // The rank binary for tensor_parallel > 1 (empty: this process's executable).
  std::string rank_executable;
  // KV cache of every rank; the scheduler's block allocator mirrors it. The
  // pool must hold max_context positions (num_pages * page_size_tokens).
  worker::KvCacheOptions kv;
  // Reuse the KV blocks of cached prompt prefixes (coordinator/scheduler.h,
  // block_pool.h); a request opts out with no_prefix_cache. serve/coordinator
  // --no-prefix-cache turns it off.
  bool enable_prefix_caching = true;
  // The prefix cache's second tier: every rank keeps up to kv_disk_blocks
  // evicted blocks in a file at kv_disk_path ("{rank}" = the rank; one file
  // per rank) and reads them back on a hit (worker/model/kv_disk_tier.h).
  // 0 = none. Needs enable_prefix_caching.
  std::string kv_disk_path;
  int64_t kv_disk_blocks = 0;
  // Waiting requests at most; Submit fails with ResourceExhausted beyond.
  int64_t max_queue = 256;
  // max_tokens of a request that leaves it unset.
  int64_t default_max_tokens = 256;
  // Deadline of a request that leaves deadline_ms unset; infinite = none.
  absl::Duration default_deadline = absl::InfiniteDuration();
  // Positions one sequence may hold (prompt + max_tokens); 0 = the pool's
  // positions, capped by config.json's max_position_embeddings when present.
  int64_t max_context = 0;
  absl::Duration rank_step_timeout = absl::Seconds(60);
  // Row tables (the token embedding) read from disk through a bounded row
  // cache (worker::TransformerLoadOptions::spill), in process or on every
  // local rank (each applies it to its own shard). Default: none.
  sharding::SpillPolicy spill;
  // Relative capacity per local rank (LocalGroupOptions::capacities); empty =
  // uniform, else one finite value > 0 per rank (InvalidArgument otherwise).
  std::vector<double> rank_capacities;
  // Arithmetic of EXL3 linears (worker/model/linear.h): prefill kFloat|kBf16,
  // decode kFloat|kInt8; set process-wide for one rank (InvalidArgument for
  // other values), else passed to every local rank (LocalGroupOptions).
  kernels::TrellisGemmPrecision prefill_precision = kernels::TrellisGemmPrecision::kFloat;
  kernels::TrellisGemmPrecision decode_precision = kernels::TrellisGemmPrecision::kFloat;
  // When the rank group breaks (a rank died or hung), the engine waits this
  // long for it to re-form (StepExecutor::Recover: new local ranks, or
  // remote ranks re-registering) and then replays every in-flight request
  // (prompt + tokens generated so far); past it they end with UNAVAILABLE.
  // Zero: no replay.
  absl::Duration reform_timeout = absl::Seconds(60);

  // --- Performance ---
  int64_t max_running = 64;         // sequences per decode step
  // Models with a recurrent state per sequence (sharding::ModelArch::
  // has_recurrent_state): the most sequences holding one at a time (every
  // running sequence holds its own, recurrent_state_bytes_per_sequence over
  // the ranks); more wait in the queue. 0 = max_running.
  int64_t max_state_sequences = 0;
  // ... and with the prefix cache: snapshots of the state at block
  // boundaries (coordinator/scheduler.h), state_snapshots of them at most
  // (each recurrent_state_bytes_per_sequence over the ranks; 0 = no prefix
  // hits for such a model), taken at each prompt's last full block and every
  // state_snapshot_interval blocks (0 = only there).
  int64_t state_snapshots = 32;
  int64_t state_snapshot_interval = 32;
  int64_t step_token_budget = 512;  // new tokens per forward (chunked prefill)
  // Speculative decoding: each decoding sequence proposes up to
  // draft_tokens tokens per step (its window adapts to its acceptance,
  // draft_length.h), the ranks verify them in the step's forward and the
  // output is exactly the output without drafts. At most
  // draft_token_budget draft tokens per step, from what the step's token
  // budget leaves after decodes and running prefills (scheduler.h). An
  // executor that cannot verify (StepExecutor::ForwardVerified
  // Unimplemented) runs without drafts (logged once).
  SpeculativeMethod speculative = SpeculativeMethod::kNone;
  int draft_tokens = 4;               // 1..kMaxDraftTokens
  int64_t draft_token_budget = 128;   // >= 1
  NgramDrafterOptions ngram;          // kNgram's match lengths
  // Time decode steps with drafts allowed and without and keep drafting
  // only while it costs less per token (draft_governor.h); false: draft
  // whenever the windows say so (tests, measurements of the raw cost).
  bool draft_governor = true;
  // kDraftModel: the draft model's directory (EXL3 or Hugging Face, the
  // target's vocabulary). It runs in the coordinator's process with a KV
  // pool of kv.num_pages pages of its own (LoadDraftModel).
  std::string draft_model_dir;

  // --- An executor whose ranks live elsewhere (`exl3serve coordinator`) ---
  // When set, ready() and Submit also require executor_ready() (a remote
  // group can break while the engine is idle; e.g. RemoteRankGroup::ready),
  // and GetServerInfo lists rank_info(). Called from any thread, without the
  // engine's lock held; must not call into the engine. CreateLocalEngine
  // fills rank_info for its local rank processes (tensor_parallel or
  // expert_parallel > 1) when it is unset.
  std::function<bool()> executor_ready;
  std::function<std::vector<v1::RankInfo>()> rank_info;

  // --- Observability ---
  // Receives request timings and step costs (metrics); borrowed, must
  // outlive the engine. Null: none.
  EngineObserver* observer = nullptr;
  // Local rank processes serve /metrics on rank_metrics_host, rank r on
  // port rank_metrics_port + r (worker --metrics-port). 0 = off.
  int rank_metrics_port = 0;
  std::string rank_metrics_host = "127.0.0.1";

  // --- Testing ---
  // The clock of arrivals, deadlines and timings (tests inject a fake one).
  std::function<absl::Time()> clock = [] { return absl::Now(); };
};

// Starts the model (in process or as local ranks), loads the tokenizer when
// model_dir has tokenizer.json, and returns a ready engine.
// Errors: InvalidArgument for bad options (named); those of loading the
// model, the tokenizer or starting the ranks.
absl::StatusOr<std::unique_ptr<Engine>> CreateLocalEngine(const EngineOptions& options);

// What the engine knows about the model besides the executor.
struct EngineModel {
  worker::rank::ModelFacts facts;  // shape and EOS ids (config.json)
  // Null: only tokenized input; text output is empty.
  std::unique_ptr<Tokenizer> tokenizer;
  double bits_per_weight = 16.0;
};

// For an engine whose executor is built elsewhere (remote ranks): validates
// `options` as CreateLocalEngine does (InvalidArgument naming the field),
// caps options->max_context by config.json's max_position_embeddings, and
// reads the model's config, quantization bits and tokenizer (when
// model_dir has tokenizer.json). No transformer is loaded.
absl::StatusOr<EngineModel> LoadEngineModel(EngineOptions* options);

// kDraftModel: loads options.draft_model_dir in this process as a
// DraftModel (its own KV pool: kv's page size and count), after checking
// that its vocabulary equals the target's (`target`). Null for other
// methods. Errors: InvalidArgument (no directory, another vocabulary),
// those of loading the model.
absl::StatusOr<std::unique_ptr<DraftModel>> LoadDraftModel(const EngineOptions& options,
                                                          const EngineModel& target);

class LocalEngine final : public Engine {
 public:
  // Starts the scheduler thread. `executor`'s cache must have options.kv's
  // page size and page count. Requires options validated (CreateLocalEngine
  // does; tests pass sane values).
  // The scheduler's block tables are authoritative: every page a sequence
  // uses reaches the executor through StepExecutor::AssignPages (ranks never
  // allocate pages themselves). An executor whose kv_options() disagree
  // with options.kv on page size or count leaves the engine refusing every
  // request with FailedPrecondition naming both.
  // `draft_model`: speculative decoding's draft source for kDraftModel
  // (LoadDraftModel); required then (else the engine does not draft).
  LocalEngine(const EngineOptions& options, EngineModel model,
              std::unique_ptr<worker::StepExecutor> executor,
              std::unique_ptr<DraftModel> draft_model = nullptr);
  ~LocalEngine() override;

  absl::Status Submit(const v1::GenerateRequest& request, ResponseCallback on_response) override;
  int Abort(const std::vector<std::string>& request_ids, const std::string& reason) override;
  v1::GetModelInfoResponse GetModelInfo() const override;
  v1::GetServerInfoResponse GetServerInfo() const override;
  const Tokenizer* tokenizer() const override { return tokenizer_.get(); }
  absl::StatusOr<std::string> RenderChat(const v1::ChatInput& chat) const override;
  bool AdmitsRequests() const override;
  bool ready() const override;
  absl::Status DeepHealthCheck(absl::Time deadline) override;
  void Shutdown() override;

  // Positions one sequence may hold (the effective max_context).
  int64_t max_context() const { return max_context_; }

  // Waits until no request is queued or running and every KV block is free
  // (the step after the last completion). False when `deadline` passed first.
  bool WaitForIdle(absl::Time deadline) const;

 private:
  // A validated request on its way to the scheduler thread.
  struct Pending {
    int64_t seq_id = 0;
    std::string request_id;
    std::vector<int32_t> prompt;
    worker::SamplingParams sampling;
    int64_t max_tokens = 0;
    std::vector<int32_t> request_stop_ids;  // sampling_params.stop_token_ids
    bool ignore_eos = false;
    std::vector<std::string> stop_strings;
    bool text_output = false;
    bool skip_special_tokens = true;
    bool use_prefix_cache = true;
    // Structured output (GenerateRequest.constraint); null: none.
    std::shared_ptr<const constrained::CompiledConstraint> constraint;
    absl::Time arrival;
    absl::Time deadline;
    ResponseCallback callback;
  };
  // A request the scheduler thread owns.
  struct Live {
    Pending p;
    std::optional<StreamDecoder> decoder;
    std::optional<StopStringMatcher> stops;
    std::vector<int32_t> output;
    std::optional<absl::Time> admitted;
    int64_t cached_tokens = 0;  // prompt positions from the prefix cache (first admission)
    std::optional<absl::Time> first_token;
    std::optional<absl::Time> last_token;  // for inter-token latency
    std::string abort_reason;
    // Speculative decoding: the sequence's tokens (prompt + output) and its
    // draft window; absent when the engine does not draft.
    std::optional<NgramDrafter> drafter;
    std::optional<AdaptiveDraftLength> draft_length;
    // Structured output: where the output stands in its constraint (every
    // output token accepted; drafts are walked and rolled back).
    std::optional<constrained::TokenMatcher> matcher;
  };

  // Validates and converts `request` (the caller holds no lock).
  absl::StatusOr<Pending> Validate(const v1::GenerateRequest& request) const;
  // Compiles request.constraint (cached per constraint). InvalidArgument
  // naming the field for a bad constraint or a model without a tokenizer.
  absl::StatusOr<std::shared_ptr<const constrained::CompiledConstraint>> CompileRequestConstraint(
      const v1::OutputConstraint& constraint) const;
  // Cuts `draft` at its first token the sequence's constraint does not
  // allow there (no-op without a constraint); the matcher is left as it was.
  void ConstrainDraft(Live& live, std::vector<int32_t>* draft);
  // The allowed-token mask rows of a constrained chunk's draws (1 + its
  // drafts) into *rows; drafts the constraint refuses, and a draft after
  // which nothing may follow (EOS, a completed constraint under ignore_eos),
  // are cut (*num_draft shrinks); with ignore_eos the EOS ids are taken
  // out. False when no token can continue the constraint.
  bool FillChunkMasks(Live& live, std::span<const int32_t> drafts, int32_t* num_draft,
                      std::vector<uint32_t>* rows);

  void Loop();
  // Runs one Schedule + Forward + sampling. Scheduler thread only.
  void Step();
  // Proposes each decoding sequence's draft for the next Schedule.
  void ProposeDrafts();
  // Handles the tokens drawn for `live` in one step (one, or a verified run:
  // accepted drafts + the next token) in order — stop ids / EOS / stop
  // strings / max_tokens end it there — and streams them as one chunk; true
  // when the request ended.
  bool OnRun(int64_t seq_id, Live& live, std::span<const worker::SampledToken> run,
             absl::Time now);
  // Final responses; erase the request (scheduler thread only).
  void Complete(int64_t seq_id, v1::FinishReason reason, const std::string& matched_stop);
  void Fail(int64_t seq_id, absl::StatusCode code, const std::string& message);
  void Forget(int64_t seq_id);
  // The executor failed with `status`. A broken group (Unavailable, Aborted,
  // DeadlineExceeded) gets options_.reform_timeout to re-form (Recover);
  // then every in-flight request is requeued and replayed (prompt + output so
  // far, scheduler_.tokens(seq_id)). Otherwise every in-flight request ends
  // with an error and a broken group leaves the engine not ready (Loop
  // retries Recover while idle).
  void OnExecutorFailure(const absl::Status& status);
  void PublishStats();

  // --- Constant after construction ---
  const EngineOptions options_;
  const worker::rank::ModelFacts facts_;
  const std::unique_ptr<Tokenizer> tokenizer_;
  const double bits_per_weight_;
  const int64_t vocab_size_;
  const int64_t max_context_;
  const absl::Time started_;
  // FailedPrecondition when the executor's KV page size or count differs from
  // options.kv (the scheduler's block allocator): Submit refuses everything
  // with it and ready() is false. OK otherwise (also for executors that do not
  // say, StepExecutor::kv_options()).
  const absl::Status kv_layout_error_;

  // Structured output: the vocabulary's token bytes and compiled
  // constraints, built at the first constrained request (thread-safe;
  // null until then, and always without a tokenizer).
  mutable absl::Mutex constraint_mu_;
  mutable std::unique_ptr<constrained::ConstraintCache> constraints_
      ABSL_GUARDED_BY(constraint_mu_);

  // --- Scheduler thread only ---
  std::unique_ptr<worker::StepExecutor> executor_;
  Scheduler scheduler_;
  // Whether the scheduler caches prefixes (constant; read from any thread).
  const bool prefix_cache_on_;
  absl::flat_hash_map<int64_t, Live> live_;
  std::vector<worker::SampledToken> tokens_;  // the last step's, per batch entry
  std::vector<std::vector<worker::SampledToken>> runs_;  // the same, of a verified step
  // Structured output: each batch entry's mask rows of the step (scratch).
  std::vector<std::vector<uint32_t>> mask_rows_;
  // False once the executor answered ForwardVerified with Unimplemented.
  bool drafting_ = false;
  std::unique_ptr<DraftModel> draft_model_;  // kDraftModel's source
  DraftGovernor governor_;
  uint64_t spec_drafts_ = 0, spec_draft_tokens_ = 0, spec_accepted_tokens_ = 0;
  // Structured output: mask rows computed and the time they took.
  uint64_t constraint_masks_ = 0;
  double constraint_mask_seconds_ = 0;
  // Steps that ran a forward, their wall time and the coordinator's share
  // (GetServerInfo num_steps, step_seconds_total, coordinator_seconds_total).
  uint64_t steps_ = 0;
  uint64_t sampled_sequences_ = 0;
  double step_seconds_ = 0, coordinator_seconds_ = 0;

  // --- Guarded by mu_ ---
  mutable absl::Mutex mu_;
  absl::CondVar wake_;
  std::deque<Pending> inbox_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<int64_t, std::string>> abort_inbox_ ABSL_GUARDED_BY(mu_);
  // Live request ids (submitted, not yet completed) -> seq id.
  absl::flat_hash_map<std::string, int64_t> ids_ ABSL_GUARDED_BY(mu_);
  int64_t next_seq_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t stat_replays_ ABSL_GUARDED_BY(mu_) = 0;  // requests replayed after re-formation
  // Published by the scheduler thread after every step.
  int64_t stat_running_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t stat_waiting_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t stat_free_blocks_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_preemptions_ ABSL_GUARDED_BY(mu_) = 0;
  bool stat_idle_ ABSL_GUARDED_BY(mu_) = true;  // the scheduler holds nothing
  uint64_t stat_steps_ ABSL_GUARDED_BY(mu_) = 0;
  double stat_step_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  double stat_coordinator_seconds_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_result_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_sampled_sequences_ ABSL_GUARDED_BY(mu_) = 0;
  PrefixCacheStats stat_prefix_ ABSL_GUARDED_BY(mu_);
  uint64_t stat_spec_drafts_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_spec_draft_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_spec_accepted_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t stat_constraint_masks_ ABSL_GUARDED_BY(mu_) = 0;
  double stat_constraint_mask_seconds_ ABSL_GUARDED_BY(mu_) = 0;

  std::thread thread_;  // the scheduler thread; joined by Shutdown
  absl::Mutex join_mu_;  // serialises Shutdown's join
};

}  // namespace exl3serve::coordinator

#endif  // EXL3SERVE_COORDINATOR_LOCAL_ENGINE_H_
