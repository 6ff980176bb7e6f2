#include "cli/spill_flags.h"

#include <algorithm>

namespace exl3serve::cli {

sharding::SpillPolicy SpillFlags::Policy() const {
  sharding::SpillPolicy policy;
  policy.spill = tensors;
  constexpr char kEmbed[] = "model.embed_tokens.weight";
  if (embeddings && std::find(policy.spill.begin(), policy.spill.end(), kEmbed) == policy.spill.end()) {
    policy.spill.push_back(kEmbed);
  }
  policy.auto_threshold_bytes = threshold_bytes;
  policy.memory_budget_bytes = memory_budget_bytes;
  policy.cache_budget_bytes = cache_bytes;
  policy.cache_dir = cache_dir;
  policy.extract = extract;
  return policy;
}

void AddSpillFlags(CLI::App& app, SpillFlags* flags) {
  app.add_flag("--spill-embeddings", flags->embeddings,
               "read the token embedding from disk through a bounded, checksummed row cache "
               "instead of holding it in memory (on every rank)");
  app.add_option("--spill-tensor", flags->tensors,
                 "spill this row-lookup table by name (repeatable)");
  app.add_option("--spill-threshold-bytes", flags->threshold_bytes,
                 "spill every row-lookup table at least this large in memory (fp32; 0 = off)")
      ->capture_default_str();
  app.add_option("--memory-budget-bytes", flags->memory_budget_bytes,
                 "per rank: spill the largest tables while weights plus row caches exceed this "
                 "(0 = unlimited)")
      ->capture_default_str();
  app.add_option("--spill-cache-bytes", flags->cache_bytes,
                 "row cache budget of each spilled table in bytes")
      ->capture_default_str();
  app.add_option("--spill-cache-dir", flags->cache_dir,
                 "keep block checksums (and --spill-extract copies) here (else recomputed per run)");
  app.add_flag("--spill-extract", flags->extract,
               "copy spilled tables once into --spill-cache-dir and read the copy");
}

}  // namespace exl3serve::cli
