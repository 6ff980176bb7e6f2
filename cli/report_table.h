// cli/report_table.h — the per-layer bits and error table printed by
// `convert` and `demo`.
#ifndef EXL3SERVE_CLI_REPORT_TABLE_H_
#define EXL3SERVE_CLI_REPORT_TABLE_H_

#include <string>

#include "sharding/converter.h"

namespace exl3serve::cli {

std::string FormatConvertReport(const sharding::ConvertReport& report);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_REPORT_TABLE_H_
