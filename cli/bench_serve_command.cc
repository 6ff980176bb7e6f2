// `exl3serve bench-serve --addr A --concurrency C --prompt-len P --gen-len G
// [--requests R]`: a load test of a running server over its public gRPC API.
// C client threads each run streams back to back (R in all) of random
// token-id prompts of P tokens, greedy (or --temperature/--top-p/--top-k, seeded per request), ignore_eos, max_tokens G, and the
// program prints a table: requests, output throughput (tokens/s), time to
// first token and inter-token latency p50/p99, decode throughput per stream
// (tokens after the first chunk over first-to-last-chunk time: 1 / TPOT), and the coordinator's own
// time per step as a fraction of step time (from GetServerInfo's cumulative
// step counters, taken before and after; "n/a" when the engine does not
// count steps).
//
// Multi-turn chats (--turns T > 0; the prefix cache's benchmark): C
// conversations in flight, each a client thread running its T turns one
// after another; a conversation shares one system prompt of --system-len
// tokens with every other, and turn t sends the system prompt + the whole
// history (earlier user messages and the answers the server gave) + a new
// user message of --prompt-len tokens, asking for --gen-len tokens. The
// table gives per turn: TTFT p50/p99, prompt tokens, and of those the ones
// the server took from its prefix cache (cached_tokens) and computed.
//
// --prompt-ids-file F: the prompts are F's lines (comma-separated token ids,
// e.g. from `exl3serve tokenize`), request r sending line r mod lines,
// instead of random ids (--prompt-len is then unused). Speculative decoding:
// when the server drafts (GetServerInfo speculative_method), the table adds
// the drafts verified in the run, their acceptance rate and the mean
// accepted length (1 + accepted / drafts).
//
// Structured output: --json-schema F (a JSON Schema file) or --regex RE
// constrains every request (GenerateRequest.constraint); ignore_eos still
// holds, but a request ends early when its constraint is complete (choose an
// open-ended one, e.g. an array of objects, to compare throughput). The table
// adds the coordinator's mask rows and their time (GetServerInfo).
//
// Inter-token latency: the gap between two chunks of a stream, divided
// evenly among the chunk's tokens (a server may merge tokens into one chunk
// for a slow reader).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "cli/client_credentials.h"
#include "cli/commands.h"
#include "common/status_macros.h"
#include "exl3serve/v1/generation.grpc.pb.h"

namespace exl3serve::cli {
namespace {

namespace v1 = ::exl3serve::v1;

// One stream's measurements.
struct StreamResult {
  grpc::Status status;
  uint32_t tokens = 0;
  double ttft_s = 0;
  double decode_s = 0;            // first chunk to last chunk: the decode phase
  uint32_t first_chunk_tokens = 0;
  std::vector<double> itl_s;
  std::vector<uint32_t> output_ids;  // GenerateComplete's
  uint32_t prompt_tokens = 0;
  uint32_t cached_tokens = 0;
};

// The q-quantile (0..1) of `v` (nearest rank); 0 for an empty vector.
double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(q * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, rank == 0 ? 0 : rank - 1)];
}

absl::StatusOr<v1::GetServerInfoResponse> ServerInfo(v1::Generation::Stub& stub,
                                                     const ClientCredentialOptions& credentials) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  AddCallCredentials(credentials, &context);
  v1::GetServerInfoResponse info;
  const grpc::Status status = stub.GetServerInfo(&context, {}, &info);
  if (!status.ok()) {
    return absl::UnavailableError(absl::StrCat("GetServerInfo: ", status.error_message()));
  }
  return info;
}

StreamResult RunStream(v1::Generation::Stub& stub, const v1::GenerateRequest& request,
                       absl::Duration timeout, const ClientCredentialOptions& credentials) {
  StreamResult result;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  AddCallCredentials(credentials, &context);
  const absl::Time start = absl::Now();
  absl::Time last = start;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    if (response.has_complete()) {
      const v1::GenerateComplete& c = response.complete();
      result.output_ids.assign(c.output_ids().begin(), c.output_ids().end());
      result.prompt_tokens = c.prompt_tokens();
      result.cached_tokens = c.cached_tokens();
    }
    if (!response.has_chunk() || response.chunk().token_ids_size() == 0) continue;
    const absl::Time now = absl::Now();
    const int n = response.chunk().token_ids_size();
    if (result.tokens == 0) {
      result.ttft_s = absl::ToDoubleSeconds(now - start);
      result.first_chunk_tokens = static_cast<uint32_t>(n);
      for (int i = 1; i < n; ++i) result.itl_s.push_back(0.0);
    } else {
      const double gap = absl::ToDoubleSeconds(now - last) / n;
      for (int i = 0; i < n; ++i) result.itl_s.push_back(gap);
    }
    result.tokens += static_cast<uint32_t>(n);
    last = now;
  }
  if (result.tokens > 0) result.decode_s = absl::ToDoubleSeconds(last - start) - result.ttft_s;
  result.status = reader->Finish();
  return result;
}

struct ChatOptions {
  int conversations = 1;
  int turns = 0;
  int system_len = 0;
  int user_len = 0;
  int answer_len = 0;
  int64_t vocab = 0;
  uint64_t seed = 1;
  absl::Duration timeout;
};

// The multi-turn chat load (see the top of the file); prints its table.
absl::Status RunChatBench(v1::Generation::Stub& stub, const ChatOptions& o,
                          const ClientCredentialOptions& credentials) {
  std::mt19937_64 rng(o.seed);
  std::uniform_int_distribution<int64_t> token(0, o.vocab - 1);
  std::vector<uint32_t> system;
  for (int i = 0; i < o.system_len; ++i) system.push_back(static_cast<uint32_t>(token(rng)));
  // Every user message, made up front so the clients only measure.
  std::vector<std::vector<std::vector<uint32_t>>> user(o.conversations);
  for (auto& conv : user) {
    conv.resize(o.turns);
    for (auto& msg : conv) {
      for (int i = 0; i < o.user_len; ++i) msg.push_back(static_cast<uint32_t>(token(rng)));
    }
  }
  std::vector<std::vector<StreamResult>> results(o.conversations,
                                                 std::vector<StreamResult>(o.turns));
  EXL3_ASSIGN_OR_RETURN(v1::GetServerInfoResponse before, ServerInfo(stub, credentials));
  const absl::Time start = absl::Now();
  std::vector<std::thread> clients;
  for (int c = 0; c < o.conversations; ++c) {
    clients.emplace_back([&, c] {
      std::vector<uint32_t> history = system;
      for (int t = 0; t < o.turns; ++t) {
        v1::GenerateRequest req;
        req.set_request_id(absl::StrCat("chat-", o.seed, "-", c, "-", t));
        history.insert(history.end(), user[c][t].begin(), user[c][t].end());
        for (uint32_t id : history) req.mutable_tokenized()->add_input_ids(id);
        req.mutable_sampling_params()->set_max_tokens(o.answer_len);
        req.mutable_sampling_params()->set_ignore_eos(true);
        req.mutable_sampling_params()->set_temperature(0.0f);
        results[c][t] = RunStream(stub, req, o.timeout, credentials);
        if (!results[c][t].status.ok()) return;
        history.insert(history.end(), results[c][t].output_ids.begin(),
                       results[c][t].output_ids.end());
      }
    });
  }
  for (std::thread& t : clients) t.join();
  const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  EXL3_ASSIGN_OR_RETURN(v1::GetServerInfoResponse after, ServerInfo(stub, credentials));
  std::printf(
      "bench-serve chat: %d conversations, %d turns, system %d + user %d tokens per turn, "
      "answers %d tokens; prefix cache %s\n",
      o.conversations, o.turns, o.system_len, o.user_len, o.answer_len,
      after.prefix_cache_enabled() ? "on" : "off");
  std::printf("  %-5s %10s %10s %12s %12s %12s\n", "turn", "TTFT p50", "TTFT p99",
              "prompt tok", "cached tok", "computed tok");
  std::string first_error;
  int ok = 0, total = 0;
  uint64_t tokens = 0;
  for (int t = 0; t < o.turns; ++t) {
    std::vector<double> ttft;
    double prompt = 0, cached = 0;
    int n = 0;
    for (int c = 0; c < o.conversations; ++c) {
      const StreamResult& r = results[c][t];
      ++total;
      if (!r.status.ok()) {
        if (first_error.empty() && r.status.error_code() != grpc::StatusCode::OK) {
          first_error = r.status.error_message();
        }
        continue;
      }
      ++ok;
      ++n;
      tokens += r.tokens;
      ttft.push_back(r.ttft_s);
      prompt += r.prompt_tokens;
      cached += r.cached_tokens;
    }
    if (n == 0) continue;
    std::printf("  %-5d %8.1f ms %8.1f ms %12.0f %12.0f %12.0f\n", t + 1,
                1e3 * Quantile(ttft, 0.5), 1e3 * Quantile(ttft, 0.99), prompt / n, cached / n,
                (prompt - cached) / n);
  }
  std::printf("  %-28s %d / %d%s%s\n", "requests ok", ok, total,
              first_error.empty() ? "" : "  first error: ", first_error.c_str());
  std::printf("  %-28s %.2f s, %.1f output tokens/s\n", "wall time", wall_s,
              wall_s > 0 ? tokens / wall_s : 0.0);
  const uint64_t queried = after.prefix_cache_queries_tokens() - before.prefix_cache_queries_tokens();
  const uint64_t hits = after.prefix_cache_hits_tokens() - before.prefix_cache_hits_tokens();
  std::printf("  %-28s %llu of %llu prompt tokens (%.1f %%), %llu blocks evicted\n",
              "prefix cache hits", static_cast<unsigned long long>(hits),
              static_cast<unsigned long long>(queried), queried > 0 ? 100.0 * hits / queried : 0.0,
              static_cast<unsigned long long>(after.prefix_cache_evicted_blocks() -
                                              before.prefix_cache_evicted_blocks()));
  if (after.prefix_cache_disk_capacity_blocks() > 0) {
    auto delta = [](uint64_t a, uint64_t b) { return static_cast<unsigned long long>(a - b); };
    std::printf("  %-28s %llu blocks saved, %llu hit, %llu missed (%llu of %llu slots used)\n",
                "prefix cache disk tier",
                delta(after.prefix_cache_disk_saved_blocks(), before.prefix_cache_disk_saved_blocks()),
                delta(after.prefix_cache_disk_hit_blocks(), before.prefix_cache_disk_hit_blocks()),
                delta(after.prefix_cache_disk_miss_blocks(), before.prefix_cache_disk_miss_blocks()),
                static_cast<unsigned long long>(after.prefix_cache_disk_used_blocks()),
                static_cast<unsigned long long>(after.prefix_cache_disk_capacity_blocks()));
  }
  if (ok == 0) return absl::UnavailableError(absl::StrCat("every stream failed: ", first_error));
  return absl::OkStatus();
}

// The lines of `path` as token-id prompts (comma-separated, ids < vocab).
absl::StatusOr<std::vector<std::vector<uint32_t>>> ReadPromptIds(const std::string& path,
                                                                 int64_t vocab) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--prompt-ids-file ", path, ": cannot open"));
  std::vector<std::vector<uint32_t>> prompts;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    std::vector<uint32_t> ids;
    for (absl::string_view field : absl::StrSplit(line, ',', absl::SkipWhitespace())) {
      uint32_t id = 0;
      if (!absl::SimpleAtoi(field, &id) || id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat("--prompt-ids-file ", path, " line ", number,
                                                       ": '", field, "' is not a token id below ",
                                                       vocab));
      }
      ids.push_back(id);
    }
    if (!ids.empty()) prompts.push_back(std::move(ids));
  }
  if (prompts.empty()) return absl::InvalidArgumentError(absl::StrCat("--prompt-ids-file ", path, " holds no prompt"));
  return prompts;
}

}  // namespace

CommandRunner RegisterBenchServeCommand(CLI::App& app) {
  struct Args {
    std::string addr = "127.0.0.1:50051";
    int concurrency = 1;
    int prompt_len = 128;
    int gen_len = 128;
    int requests = 0;
    int64_t vocab = 0;
    uint64_t seed = 1;
    float temperature = 0.0f;
    float top_p = 1.0f;
    int top_k = 0;
    int64_t timeout_s = 600;
    int turns = 0;
    int system_len = 1024;
    std::string prompt_ids_file;
    std::string json_schema_file;
    std::string regex;
    ClientCredentialOptions credentials;
  };
  auto args = std::make_shared<Args>();
  app.add_option("--addr", args->addr, "server address host:port")->capture_default_str();
  AddClientCredentialFlags(app, &args->credentials);
  app.add_option("--concurrency", args->concurrency, "streams in flight at once")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--prompt-len", args->prompt_len, "prompt tokens per request")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--gen-len", args->gen_len, "tokens generated per request (ignore_eos)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--requests", args->requests, "requests in all (default: 4 x concurrency)");
  app.add_option("--vocab", args->vocab, "prompt ids are drawn from [0, vocab) (default: the model's)");
  app.add_option("--seed", args->seed, "seed of the random prompts")->capture_default_str();
  app.add_option("--temperature", args->temperature, "sampling temperature (0 = greedy)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", args->top_p, "nucleus sampling mass")->capture_default_str();
  app.add_option("--top-k", args->top_k, "top-k sampling (0 = off)")->capture_default_str();
  app.add_option("--timeout-s", args->timeout_s, "deadline of each stream")->capture_default_str();
  app.add_option("--turns", args->turns,
                 "> 0: multi-turn chats (--concurrency conversations, --prompt-len user tokens and "
                 "--gen-len answer tokens per turn, greedy), a TTFT / cached-tokens table per turn")
      ->capture_default_str();
  app.add_option("--system-len", args->system_len, "chats: tokens of the shared system prompt")
      ->capture_default_str();
  app.add_option("--prompt-ids-file", args->prompt_ids_file,
                 "prompts from this file: one per line, comma-separated token ids (request r "
                 "sends line r mod lines)");
  app.add_option("--json-schema", args->json_schema_file,
                 "constrain every request's output to the JSON Schema in this file");
  app.add_option("--regex", args->regex, "constrain every request's output to this regex");
  return [args]() -> absl::Status {
    const int requests = args->requests > 0 ? args->requests : 4 * args->concurrency;
    std::optional<v1::OutputConstraint> constraint;
    if (!args->json_schema_file.empty() && !args->regex.empty()) {
      return absl::InvalidArgumentError("--json-schema and --regex: give one");
    }
    if (!args->json_schema_file.empty()) {
      std::ifstream in(args->json_schema_file);
      if (!in) return absl::NotFoundError(absl::StrCat("--json-schema ", args->json_schema_file, ": cannot open"));
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      constraint.emplace().set_json_schema(text);
    } else if (!args->regex.empty()) {
      constraint.emplace().set_regex(args->regex);
    }
    EXL3_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                          MakeClientChannel(args->addr, &args->credentials));
    auto stub = v1::Generation::NewStub(channel);
    int64_t vocab = args->vocab;
    if (vocab <= 0) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      AddCallCredentials(args->credentials, &context);
      v1::GetModelInfoResponse model;
      const grpc::Status status = stub->GetModelInfo(&context, {}, &model);
      if (!status.ok()) {
        return absl::UnavailableError(
            absl::StrCat("GetModelInfo on ", args->addr, ": ", status.error_message()));
      }
      vocab = model.vocab_size();
      if (vocab <= 0) return absl::FailedPreconditionError("the server reports vocab_size 0; pass --vocab");
    }
    if (args->turns > 0) {
      return RunChatBench(*stub,
                          ChatOptions{.conversations = args->concurrency,
                                      .turns = args->turns,
                                      .system_len = args->system_len,
                                      .user_len = args->prompt_len,
                                      .answer_len = args->gen_len,
                                      .vocab = vocab,
                                      .seed = args->seed,
                                      .timeout = absl::Seconds(args->timeout_s)},
                          args->credentials);
    }
    // The prompts, made up front so the clients only measure.
    std::vector<std::vector<uint32_t>> file_prompts;
    if (!args->prompt_ids_file.empty()) {
      EXL3_ASSIGN_OR_RETURN(file_prompts, ReadPromptIds(args->prompt_ids_file, vocab));
    }
    std::mt19937_64 rng(args->seed);
    std::uniform_int_distribution<int64_t> token(0, vocab - 1);
    std::vector<v1::GenerateRequest> prepared(requests);
    for (int r = 0; r < requests; ++r) {
      v1::GenerateRequest& req = prepared[r];
      req.set_request_id(absl::StrCat("bench-", args->seed, "-", r));
      if (!file_prompts.empty()) {
        for (uint32_t id : file_prompts[r % file_prompts.size()]) {
          req.mutable_tokenized()->add_input_ids(id);
        }
      }
      for (int i = 0; file_prompts.empty() && i < args->prompt_len; ++i) {
        req.mutable_tokenized()->add_input_ids(static_cast<uint32_t>(token(rng)));
      }
      req.mutable_sampling_params()->set_max_tokens(args->gen_len);
      req.mutable_sampling_params()->set_ignore_eos(true);
      req.mutable_sampling_params()->set_temperature(args->temperature);
      req.mutable_sampling_params()->set_top_p(args->top_p);
      req.mutable_sampling_params()->set_top_k(args->top_k);
      req.mutable_sampling_params()->set_seed(args->seed * 1000003 + r);
      if (constraint) *req.mutable_constraint() = *constraint;
    }

    EXL3_ASSIGN_OR_RETURN(v1::GetServerInfoResponse before, ServerInfo(*stub, args->credentials));
    std::atomic<int> next{0};
    std::vector<StreamResult> results(requests);
    std::vector<std::thread> clients;
    const absl::Time start = absl::Now();
    for (int c = 0; c < args->concurrency; ++c) {
      clients.emplace_back([&] {
        for (int r = next.fetch_add(1); r < requests; r = next.fetch_add(1)) {
          results[r] = RunStream(*stub, prepared[r], absl::Seconds(args->timeout_s), args->credentials);
        }
      });
    }
    for (std::thread& t : clients) t.join();
    const double wall_s = absl::ToDoubleSeconds(absl::Now() - start);
    EXL3_ASSIGN_OR_RETURN(v1::GetServerInfoResponse after, ServerInfo(*stub, args->credentials));

    int ok = 0;
    uint64_t tokens = 0;
    std::vector<double> ttft, itl;
    uint64_t decode_tokens = 0;  // tokens after each stream's first chunk
    double decode_s = 0;
    std::string first_error;
    for (const StreamResult& r : results) {
      if (!r.status.ok()) {
        if (first_error.empty()) first_error = r.status.error_message();
        continue;
      }
      ++ok;
      tokens += r.tokens;
      ttft.push_back(r.ttft_s);
      itl.insert(itl.end(), r.itl_s.begin(), r.itl_s.end());
      decode_tokens += r.tokens - r.first_chunk_tokens;
      decode_s += r.decode_s;
    }
    const uint64_t steps = after.num_steps() - before.num_steps();
    const double step_s = after.step_seconds_total() - before.step_seconds_total();
    const double coord_s = after.coordinator_seconds_total() - before.coordinator_seconds_total();
    if (file_prompts.empty()) {
      std::printf("bench-serve %s: concurrency %d, prompt %d tokens, gen %d tokens, %d requests\n",
                  args->addr.c_str(), args->concurrency, args->prompt_len, args->gen_len, requests);
    } else {
      std::printf("bench-serve %s: concurrency %d, prompts from %s (%zu), gen %d tokens, %d requests\n",
                  args->addr.c_str(), args->concurrency, args->prompt_ids_file.c_str(),
                  file_prompts.size(), args->gen_len, requests);
    }
    std::printf("  %-28s %d / %d%s%s\n", "requests ok", ok, requests,
                first_error.empty() ? "" : "  first error: ", first_error.c_str());
    std::printf("  %-28s %.2f s\n", "wall time", wall_s);
    std::printf("  %-28s %.1f tokens/s (%llu tokens)\n", "output throughput",
                wall_s > 0 ? tokens / wall_s : 0.0, static_cast<unsigned long long>(tokens));
    std::printf("  %-28s %.1f / %.1f ms\n", "TTFT p50 / p99", 1e3 * Quantile(ttft, 0.5),
                1e3 * Quantile(ttft, 0.99));
    std::printf("  %-28s %.2f / %.2f ms\n", "inter-token latency p50/p99", 1e3 * Quantile(itl, 0.5),
                1e3 * Quantile(itl, 0.99));
    // Decode speed of one stream without its prefill: tokens after the first
    // chunk over the time from the first chunk to the last, summed over
    // streams (1 / TPOT, token-weighted; others' prefill chunks in the same
    // steps count, as in vLLM's TPOT).
    std::printf("  %-28s %.1f tokens/s (TPOT %.2f ms)\n", "decode throughput / stream",
                decode_s > 0 ? decode_tokens / decode_s : 0.0,
                decode_tokens > 0 ? 1e3 * decode_s / decode_tokens : 0.0);
    if (steps > 0 && step_s > 0) {
      std::printf("  %-28s %llu, mean %.2f ms\n", "engine steps", static_cast<unsigned long long>(steps),
                  1e3 * step_s / steps);
      std::printf("  %-28s %.2f %% (%.3f of %.3f s)\n", "coordinator time / step", 100.0 * coord_s / step_s,
                  coord_s, step_s);
      const uint64_t bytes = after.rank_result_bytes_total() - before.rank_result_bytes_total();
      const uint64_t sampled = after.sampled_sequences_total() - before.sampled_sequences_total();
      if (bytes > 0 && sampled > 0) {
        std::printf("  %-28s %.0f B / step, %.1f B / sampled sequence\n", "rank 0 -> coordinator",
                    static_cast<double>(bytes) / steps, static_cast<double>(bytes) / sampled);
      } else {
        std::printf("  %-28s n/a (in-process model: nothing crosses)\n", "rank 0 -> coordinator");
      }
    } else {
      std::printf("  %-28s n/a\n", "engine steps");
      std::printf("  %-28s n/a (the engine does not report step times)\n", "coordinator time / step");
    }
    if (!after.speculative_method().empty()) {
      const uint64_t drafts = after.spec_decode_num_drafts() - before.spec_decode_num_drafts();
      const uint64_t drafted =
          after.spec_decode_num_draft_tokens() - before.spec_decode_num_draft_tokens();
      const uint64_t accepted =
          after.spec_decode_num_accepted_tokens() - before.spec_decode_num_accepted_tokens();
      std::printf("  %-28s %s: %llu drafts, %llu tokens, %llu accepted (%.1f %%), mean accepted "
                  "length %.2f\n",
                  "speculative decoding", after.speculative_method().c_str(),
                  static_cast<unsigned long long>(drafts), static_cast<unsigned long long>(drafted),
                  static_cast<unsigned long long>(accepted),
                  drafted > 0 ? 100.0 * accepted / drafted : 0.0,
                  drafts > 0 ? 1.0 + static_cast<double>(accepted) / drafts : 0.0);
    }
    if (constraint) {
      const uint64_t masks = after.structured_output_masks() - before.structured_output_masks();
      const double mask_s = after.structured_output_mask_seconds_total() -
                            before.structured_output_mask_seconds_total();
      std::printf("  %-28s %llu mask rows, %.3f ms each, %.2f ms / step (%.1f %% of step time)\n",
                  "structured output", static_cast<unsigned long long>(masks),
                  masks > 0 ? 1e3 * mask_s / masks : 0.0, steps > 0 ? 1e3 * mask_s / steps : 0.0,
                  step_s > 0 ? 100.0 * mask_s / step_s : 0.0);
    }
    if (ok == 0) return absl::UnavailableError(absl::StrCat("every stream failed: ", first_error));
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
