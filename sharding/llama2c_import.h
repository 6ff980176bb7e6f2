// sharding/llama2c_import.h — a llama2.c checkpoint (Karpathy's `run.c`
// format, e.g. shared/models/stories260K) as a Hugging Face Llama directory:
// config.json, generation_config.json and model.safetensors (fp32), so the
// rest of exl3serve (converter, runtime) can use it.
//
//   EXL3_RETURN_IF_ERROR(ImportLlama2c("stories260K.bin", out_dir));
//
// Format (little-endian): seven int32 — dim, hidden_dim, n_layers, n_heads,
// n_kv_heads, vocab_size (negative: a separate classifier follows the
// weights), seq_len — then float32 arrays: token embedding [vocab, dim];
// attention RMSNorm [layers, dim]; wq [layers, dim, dim]; wk, wv [layers,
// kv_dim, dim]; wo [layers, dim, dim]; FFN RMSNorm [layers, dim]; w1 [layers,
// hidden, dim]; w2 [layers, dim, hidden]; w3 [layers, hidden, dim]; final
// RMSNorm [dim]; two RoPE tables [seq_len, head_dim/2] (skipped); then the
// classifier [vocab, dim] when vocab_size was negative. Matrices are (out, in).
//
// llama2.c rotates adjacent pairs (2i, 2i+1) of each head; Hugging Face's
// Llama rotates (i, i + head_dim/2). The import permutes the rows of wq and wk
// within each head — even rows first, then odd — which turns one into the
// other exactly. RMSNorm epsilon 1e-5, rope_theta 10000, BOS 1, EOS 2.
#ifndef EXL3SERVE_SHARDING_LLAMA2C_IMPORT_H_
#define EXL3SERVE_SHARDING_LLAMA2C_IMPORT_H_

#include <string>

#include "absl/status/status.h"

namespace exl3serve::sharding {

// Reads `bin_path` and writes the HF directory `out_dir` (created if
// missing; existing files of the same names are replaced).
// Errors: NotFound / PermissionDenied for the input file; DataLoss when the
// header has a non-positive dimension, heads that do not divide dim, or the
// file is shorter than the header implies (naming sizes); errors of the
// safetensors writer for the output.
absl::Status ImportLlama2c(const std::string& bin_path, const std::string& out_dir);

}  // namespace exl3serve::sharding

#endif  // EXL3SERVE_SHARDING_LLAMA2C_IMPORT_H_
