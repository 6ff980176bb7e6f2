// cli/cluster_keys.h — cluster YAML sections read by both `coordinator
// --config` (cli/coordinator_command.cc) and `launch` (cli/launch_command.cc):
// the rank channel's TLS paths (tls.rank_*) and the NCCL network settings
// (comm.nccl, boxes[].nccl). Errors are InvalidArgument naming the key
// (`comm.nccl.ib_gid_index`); unknown keys are errors too.
#ifndef EXL3SERVE_CLI_CLUSTER_KEYS_H_
#define EXL3SERVE_CLI_CLUSTER_KEYS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "yaml-cpp/yaml.h"

namespace exl3serve::cli {

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
