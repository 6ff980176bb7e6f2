// cli/spill_flags.h — the `--spill-*` flags that `generate`, `serve` and
// `worker` share: which row-lookup tables (the token embedding) a rank reads
// from its box's disk through a bounded, checksummed row cache
// (sharding/spill_store.h) instead of holding them in memory.
//
//   SpillFlags spill;  AddSpillFlags(app, &spill);
//   ... options.spill = spill.Policy();
//
// Thread safety: plain values, filled by CLI11 while parsing.
#ifndef EXL3SERVE_CLI_SPILL_FLAGS_H_
#define EXL3SERVE_CLI_SPILL_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "sharding/spill_store.h"

namespace exl3serve::cli {

struct SpillFlags {
  bool embeddings = false;           // --spill-embeddings
  std::vector<std::string> tensors;  // --spill-tensor NAME (repeatable)
  uint64_t threshold_bytes = 0;      // --spill-threshold-bytes
  uint64_t memory_budget_bytes = 0;  // --memory-budget-bytes
  uint64_t cache_bytes = 64ull << 20;  // --spill-cache-bytes
  std::string cache_dir;             // --spill-cache-dir
  bool extract = false;              // --spill-extract

  // Whether any flag that makes something spill was given.
  bool any() const {
    return embeddings || !tensors.empty() || threshold_bytes > 0 || memory_budget_bytes > 0;
  }
  // The policy these flags describe (--spill-embeddings adds
  // "model.embed_tokens.weight" to the named tensors).
  sharding::SpillPolicy Policy() const;
};

// Registers the flags on `app`; `flags` must outlive parsing.
void AddSpillFlags(CLI::App& app, SpillFlags* flags);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_SPILL_FLAGS_H_
