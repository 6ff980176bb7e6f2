// cli/cluster_keys.h — reading the cluster YAML, shared by `coordinator
// --config` (cli/coordinator_config.h) and `launch` (cli/launch_plan.h): the
// loader with its input limits, and the sections both read — the rank
// channel's TLS paths (tls.rank_*) and the NCCL network settings (comm.nccl,
// boxes[].nccl). Errors are InvalidArgument naming the key
// (`comm.nccl.ib_gid_index`) or the limit; unknown keys are errors too.
#ifndef EXL3SERVE_CLI_CLUSTER_KEYS_H_
#define EXL3SERVE_CLI_CLUSTER_KEYS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {

// Limits on a cluster YAML (a config is a few hundred bytes; these stop a
// hostile or broken file before it costs memory or time). Each error names
// its limit.
inline constexpr size_t kMaxClusterYamlBytes = 1 << 20;  // the file
inline constexpr int kMaxClusterYamlDepth = 32;          // nested mappings/lists
// Nodes visited by a walk over the document, an alias counted at every use:
// a "billion laughs" file (aliases of aliases) is refused here, before any
// reader expands it.
inline constexpr int64_t kMaxClusterYamlNodes = 100'000;
// world_size and the ranks a file may place.
inline constexpr int kMaxWorldSize = 4096;

// Parses `text` (named `name` in errors) and checks the limits above.
absl::StatusOr<YAML::Node> ParseClusterYaml(std::string_view text, const std::string& name);
// Reads `file` (at most kMaxClusterYamlBytes) and parses it.
absl::StatusOr<YAML::Node> LoadClusterYaml(const std::string& file);

// `node` as YAML for an error message, cut to 200 characters.
std::string DumpForError(const YAML::Node& node);

// tls.rank_* of the cluster YAML. One CA (rank_ca) for the rank channel:
// ranks verify the coordinator's rank_cert with it and, when rank_client_cert
// is set (mutual TLS), the coordinator accepts only rank certificates it signed.
struct RankTlsPaths {
  std::string cert;         // tls.rank_cert: the coordinator's rank endpoint
  std::string key;          // tls.rank_key
  std::string ca;           // tls.rank_ca
  std::string client_cert;  // tls.rank_client_cert: what every rank presents
  std::string client_key;   // tls.rank_client_key
  std::string server_name;  // tls.rank_server_name: "" = the coordinator box's address
};

// Reads the rank_* keys of the `tls` mapping (other keys are the caller's)
// and checks they fit together: rank_cert/rank_key and
// rank_client_cert/rank_client_key in pairs, rank_cert needs rank_ca,
// rank_client_cert needs rank_cert.
absl::Status ReadRankTls(const YAML::Node& tls, RankTlsPaths* out);

// comm.nccl / boxes[].nccl: worker --nccl-net, --nccl-ib-hca,
// --nccl-ib-gid-index (0..255), --nccl-socket-ifname.
struct NcclKeys {
  std::string net;
  std::string ib_hca;
  int ib_gid_index = -1;  // -1 = unset
  std::string socket_ifname;
};

// Reads `node` (a mapping at `path`) into *out, overriding only the keys it
// sets; unknown keys are errors.
absl::Status ReadNcclKeys(const YAML::Node& node, const std::string& path, NcclKeys* out);

// The worker flags for `keys` (only the set ones).
std::vector<std::string> NcclWorkerFlags(const NcclKeys& keys);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_CLUSTER_KEYS_H_
