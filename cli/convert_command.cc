// `exl3serve convert`: HF model directory -> EXL3 model directory.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "cli/commands.h"
#include "cli/report_table.h"
#include "kernels/trellis_lut.h"
#include "common/status_macros.h"
#include "coordinator/tokenizer/tokenizer.h"
#include "sharding/converter.h"
#include "sharding/quant/tile_quantizer.h"
#include "worker/model/calibration.h"

namespace exl3serve::cli {

CommandRunner RegisterConvertCommand(CLI::App& app) {
  auto opt = std::make_shared<sharding::ConvertOptions>();
  auto codebook = std::make_shared<std::string>("mul1");
  auto out_scales = std::make_shared<std::string>("always");
  app.add_option("--in", opt->in_dir, "Hugging Face model directory (safetensors)")->required();
  app.add_option("--out", opt->out_dir, "output directory (empty or new)")->required();
  app.add_option("--bits", opt->bits, "target bits per weight, 1..8 (fractional: mixed K)")
      ->required();
  app.add_option("--head-bits", opt->head_bits, "K of lm_head (1..8, 16 = keep fp16)")
      ->capture_default_str();
  app.add_option("--codebook", *codebook, "mul1 | mcg | 3inst")
      ->check(CLI::IsMember({"mul1", "mcg", "3inst"}))
      ->capture_default_str();
  app.add_option("--out-scales", *out_scales, "always | never | auto (exl3-format.md 6.3)")
      ->check(CLI::IsMember({"always", "never", "auto"}))
      ->capture_default_str();
  app.add_option("--threads", opt->threads, "worker threads (0 = all cores)")
      ->capture_default_str();
  auto shard_mib = std::make_shared<int64_t>(sharding::kDefaultShardSizeMiB);
  app.add_option("--shard-size", *shard_mib, "maximum shard size in MiB")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--resume", opt->resume, "continue an interrupted conversion in --out");
  auto viterbi = std::make_shared<std::string>("auto");
  app.add_option("--viterbi", *viterbi,
                 "tile Viterbi path metric: auto (fp16 on CPUs with AVX-512 FP16, ~2x faster, "
                 "quality within 0.3 %) | fp32 (the same states on every x86-64 CPU)")
      ->check(CLI::IsMember({"auto", "fp32"}))
      ->capture_default_str();
  struct Calibration {
    std::string file;
    int64_t tokens_per_sequence = 2048;
    int64_t max_sequences = 250;
  };
  auto calib = std::make_shared<Calibration>();
  app.add_option("--calib", calib->file,
                 "calibration data: a JSON array of token ids (or of arrays), or text tokenized "
                 "with the model's tokenizer.json; enables block-LDL error feedback");
  app.add_option("--calib-cols", calib->tokens_per_sequence, "tokens per calibration sequence")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--calib-rows", calib->max_sequences, "maximum calibration sequences")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_flag("--no-progress", [opt](int64_t) { opt->show_progress = false; },
               "no progress bar");
  return [opt, codebook, out_scales, shard_mib, calib, viterbi]() -> absl::Status {
    sharding::quant::SetViterbiPrecision(*viterbi == "fp32" ? sharding::quant::ViterbiPrecision::kFp32
                                                            : sharding::quant::ViterbiPrecision::kAuto);
    opt->max_shard_bytes = static_cast<uint64_t>(*shard_mib) << 20;
    std::unique_ptr<worker::CalibrationHessians> hessians;
    if (!calib->file.empty()) {
      EXL3_ASSIGN_OR_RETURN(worker::CalibrationText data,
                            worker::ReadCalibrationFile(calib->file));
      std::vector<std::vector<int32_t>> sequences = std::move(data.sequences);
      if (data.was_text) {
        EXL3_ASSIGN_OR_RETURN(auto tokenizer, coordinator::Tokenizer::Load(opt->in_dir));
        sequences = worker::SplitIntoSequences(tokenizer->Encode(data.text),
                                               calib->tokens_per_sequence);
      } else {
        std::vector<std::vector<int32_t>> split;
        for (const auto& seq : sequences) {
          for (auto& part : worker::SplitIntoSequences(seq, calib->tokens_per_sequence)) {
            split.push_back(std::move(part));
          }
        }
        sequences = std::move(split);
      }
      if (static_cast<int64_t>(sequences.size()) > calib->max_sequences) {
        sequences.resize(static_cast<size_t>(calib->max_sequences));
      }
      std::fprintf(stderr, "calibration: %zu sequences through %s\n", sequences.size(),
                   opt->in_dir.c_str());
      EXL3_ASSIGN_OR_RETURN(hessians, worker::CalibrationHessians::Collect(opt->in_dir, sequences));
      std::fprintf(stderr, "calibration: %lld tokens captured\n",
                   static_cast<long long>(hessians->tokens()));
      opt->hessians = hessians.get();
      opt->calibration_rows = static_cast<int64_t>(sequences.size());
      for (const auto& seq : sequences) {
        opt->calibration_cols = std::max<int64_t>(opt->calibration_cols, seq.size());
      }
    }
    kernels::ParseCodebookName(*codebook, &opt->codebook);
    opt->out_scales = *out_scales == "never"  ? sharding::OutScalesMode::kNever
                      : *out_scales == "auto" ? sharding::OutScalesMode::kAuto
                                              : sharding::OutScalesMode::kAlways;
    absl::StatusOr<sharding::ConvertReport> report = sharding::ConvertModel(*opt);
    if (!report.ok()) return report.status();
    std::fputs(FormatConvertReport(*report).c_str(), stdout);
    std::printf("wrote %s\n", opt->out_dir.c_str());
    return absl::OkStatus();
  };
}

}  // namespace exl3serve::cli
