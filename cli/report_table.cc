#include "cli/report_table.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace exl3serve::cli {

std::string FormatConvertReport(const sharding::ConvertReport& report) {
  size_t width = 6;
  for (const auto& l : report.linears) width = std::max(width, l.key.size());
  std::string out;
  absl::StrAppendFormat(&out, "%-*s  %11s  %4s  %9s  %9s  %7s\n", static_cast<int>(width),
                        "linear", "in x out", "bits", "rel.err", "proxy", "seconds");
  for (const auto& l : report.linears) {
    if (l.quantized) {
      absl::StrAppendFormat(&out, "%-*s  %5d x %-5d  %4d  %9.5f  %9.6f  %7.2f\n",
                            static_cast<int>(width), l.key, l.in_features, l.out_features, l.bits,
                            l.relative_error, l.proxy_error, l.seconds);
    } else {
      absl::StrAppendFormat(&out, "%-*s  %5d x %-5d  %4s  %9s  %9s  %7.2f\n",
                            static_cast<int>(width), l.key, l.in_features, l.out_features, "fp16",
                            "-", "-", l.seconds);
    }
  }
  absl::StrAppendFormat(&out,
                        "\nbits per weight: %.3f (decoder linears, quantization_config.bits), "
                        "%.3f with the head\n",
                        report.bits_achieved, report.bits_with_head);
  absl::StrAppendFormat(&out, "%d shard(s), %.2f MiB of tensors, %.1f s%s\n", report.shards,
                        report.output_bytes / 1048576.0, report.seconds,
                        report.resumed_groups > 0
                            ? absl::StrFormat(", %d module groups resumed", report.resumed_groups)
                            : std::string());
  return out;
}

}  // namespace exl3serve::cli
