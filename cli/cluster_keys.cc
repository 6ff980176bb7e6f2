#include "cli/cluster_keys.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::cli {
namespace {

// Depth-first walk counting every node visit (aliases again at each use).
absl::Status CheckShape(const YAML::Node& node, int depth, int64_t* visited,
                        const std::string& name) {
  if (++*visited > kMaxClusterYamlNodes) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": more than kMaxClusterYamlNodes = ", kMaxClusterYamlNodes,
        " YAML nodes (counting each use of an alias); a cluster config is far smaller"));
  }
  if (depth > kMaxClusterYamlDepth) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": nested deeper than kMaxClusterYamlDepth = ",
                                                   kMaxClusterYamlDepth, " levels"));
  }
  if (node.IsMap()) {
    for (const auto& entry : node) {
      EXL3_RETURN_IF_ERROR(CheckShape(entry.first, depth + 1, visited, name));
      EXL3_RETURN_IF_ERROR(CheckShape(entry.second, depth + 1, visited, name));
    }
  } else if (node.IsSequence()) {
    for (const auto& item : node) EXL3_RETURN_IF_ERROR(CheckShape(item, depth + 1, visited, name));
  }
  return absl::OkStatus();
}

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
                    absl::StrCat("has a value of the wrong type: ", DumpForError(node)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<YAML::Node> ParseClusterYaml(std::string_view text, const std::string& name) {
  if (text.size() > kMaxClusterYamlBytes) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", text.size(),
                                                   " bytes, over kMaxClusterYamlBytes = ",
                                                   kMaxClusterYamlBytes));
  }
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {  // also yaml-cpp's own recursion guard
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", e.what()));
  }
  int64_t visited = 0;
  EXL3_RETURN_IF_ERROR(CheckShape(root, 0, &visited, name));
  return root;
}

absl::StatusOr<YAML::Node> LoadClusterYaml(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(file, ": cannot open the config"));
  std::string text(kMaxClusterYamlBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(file, ": cannot read the config"));
  text.resize(static_cast<size_t>(in.gcount()));
  return ParseClusterYaml(text, file);
}

std::string DumpForError(const YAML::Node& node) {
  std::string text = YAML::Dump(node);
  constexpr size_t kMaxChars = 200;
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return text;
}

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
    if (!entry.first.IsScalar()) return KeyError(path, "has a key that is not a string");
    const std::string key = entry.first.Scalar();
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
