#include "cli/cluster_keys.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::cli {
namespace {

absl::Status KeyError(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config key `", key, "` ", what));
}

template <typename T>
absl::Status ReadOptional(const YAML::Node& parent, const std::string& path, const char* key,
                          T* out) {
  const YAML::Node node = parent[key];
  if (!node.IsDefined() || node.IsNull()) return absl::OkStatus();
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return KeyError(absl::StrCat(path, ".", key),
                    absl::StrCat("has a value of the wrong type: ", YAML::Dump(node)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadRankTls(const YAML::Node& tls, RankTlsPaths* out) {
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_cert", &out->cert));
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_key", &out->key));
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_ca", &out->ca));
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_client_cert", &out->client_cert));
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_client_key", &out->client_key));
  EXL3_RETURN_IF_ERROR(ReadOptional(tls, "tls", "rank_server_name", &out->server_name));
  if (out->cert.empty() != out->key.empty()) {
    return absl::InvalidArgumentError("config keys `tls.rank_cert` and `tls.rank_key` go together");
  }
  if (out->client_cert.empty() != out->client_key.empty()) {
    return absl::InvalidArgumentError(
        "config keys `tls.rank_client_cert` and `tls.rank_client_key` go together");
  }
  if (!out->cert.empty() && out->ca.empty()) {
    return KeyError("tls.rank_ca",
                    "is required with tls.rank_cert (the ranks verify the coordinator with it)");
  }
  if (out->cert.empty() && (!out->ca.empty() || !out->client_cert.empty() ||
                            !out->server_name.empty())) {
    return KeyError("tls.rank_cert",
                    "is required with tls.rank_ca / tls.rank_client_cert / tls.rank_server_name "
                    "(TLS on the rank endpoint)");
  }
  return absl::OkStatus();
}

absl::Status ReadNcclKeys(const YAML::Node& node, const std::string& path, NcclKeys* out) {
  if (!node.IsMap()) return KeyError(path, "must be a mapping");
  for (const auto& entry : node) {
    const std::string key = entry.first.as<std::string>();
    if (key != "net" && key != "ib_hca" && key != "ib_gid_index" && key != "socket_ifname") {
      return absl::InvalidArgumentError(absl::StrCat("unknown config key `", path, ".", key, "`"));
    }
  }
  EXL3_RETURN_IF_ERROR(ReadOptional(node, path, "net", &out->net));
  EXL3_RETURN_IF_ERROR(ReadOptional(node, path, "ib_hca", &out->ib_hca));
  EXL3_RETURN_IF_ERROR(ReadOptional(node, path, "ib_gid_index", &out->ib_gid_index));
  EXL3_RETURN_IF_ERROR(ReadOptional(node, path, "socket_ifname", &out->socket_ifname));
  if (node["ib_gid_index"].IsDefined() && (out->ib_gid_index < 0 || out->ib_gid_index > 255)) {
    return KeyError(absl::StrCat(path, ".ib_gid_index"),
                    absl::StrCat("must be 0..255, got ", out->ib_gid_index));
  }
  return absl::OkStatus();
}

std::vector<std::string> NcclWorkerFlags(const NcclKeys& keys) {
  std::vector<std::string> flags;
  if (!keys.net.empty()) flags.insert(flags.end(), {"--nccl-net", keys.net});
  if (!keys.ib_hca.empty()) flags.insert(flags.end(), {"--nccl-ib-hca", keys.ib_hca});
  if (keys.ib_gid_index >= 0) {
    flags.insert(flags.end(), {"--nccl-ib-gid-index", std::to_string(keys.ib_gid_index)});
  }
  if (!keys.socket_ifname.empty()) {
    flags.insert(flags.end(), {"--nccl-socket-ifname", keys.socket_ifname});
  }
  return flags;
}

}  // namespace exl3serve::cli
