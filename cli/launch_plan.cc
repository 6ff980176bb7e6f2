#include "cli/launch_plan.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "cli/coordinator_config.h"
#include "common/status_macros.h"
#include "coordinator/grpc_server.h"

namespace exl3serve::cli {
namespace {

absl::Status KeyError(const std::string& key, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("config key `", key, "` ", what));
}

template <typename T>
absl::Status ReadKey(const YAML::Node& node, const std::string& key, T* out) {
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return KeyError(key, absl::StrCat("has a value of the wrong type: ", DumpForError(node)));
  }
  return absl::OkStatus();
}

absl::Status ReadIntList(const YAML::Node& node, const std::string& key, std::vector<int>* out) {
  if (!node.IsSequence()) return KeyError(key, "must be a list");
  for (size_t i = 0; i < node.size(); ++i) {
    int v = 0;
    EXL3_RETURN_IF_ERROR(ReadKey(node[i], absl::StrCat(key, "[", i, "]"), &v));
    out->push_back(v);
  }
  return absl::OkStatus();
}

absl::StatusOr<LaunchPlan> ReadLaunchPlanOrThrow(const YAML::Node& root) {
  // Every coordinator key is validated the coordinator's way first.
  EXL3_RETURN_IF_ERROR(ReadCoordinatorConfig(root).status());
  LaunchPlan plan;
  EXL3_RETURN_IF_ERROR(ReadKey(root["world_size"], "world_size", &plan.world_size));
  if (const YAML::Node tls = root["tls"]; tls.IsDefined()) {
    EXL3_RETURN_IF_ERROR(ReadRankTls(tls, &plan.rank_tls));
  }
  if (root["rank_token_file"].IsDefined() && !root["rank_token_file"].IsNull()) {
    EXL3_RETURN_IF_ERROR(ReadKey(root["rank_token_file"], "rank_token_file", &plan.rank_token_file));
  }
  NcclKeys nccl;
  // (Subscripting an absent node throws in yaml-cpp: check comm first.)
  if (const YAML::Node comm = root["comm"]; comm.IsDefined() && comm.IsMap() && comm["nccl"].IsDefined()) {
    const YAML::Node n = comm["nccl"];
    EXL3_RETURN_IF_ERROR(ReadNcclKeys(n, "comm.nccl", &nccl));
  }
  const YAML::Node boxes = root["boxes"];
  if (!boxes.IsDefined() || !boxes.IsSequence() || boxes.size() == 0) {
    return KeyError("boxes", "must be a non-empty list of {name, address, ranks} (launch needs it)");
  }
  std::map<int, std::string> rank_box;
  std::set<std::string> names;
  const Box* coordinator_box = nullptr;
  for (size_t i = 0; i < boxes.size(); ++i) {
    const YAML::Node b = boxes[i];
    const std::string path = absl::StrCat("boxes[", i, "]");
    if (!b.IsMap()) return KeyError(path, "must be a mapping");
    for (const auto& entry : b) {
      if (!entry.first.IsScalar()) return KeyError(path, "has a key that is not a string");
      const std::string key = entry.first.Scalar();
      static const std::set<std::string> kKnown = {
          "name",  "address", "coordinator",  "metrics_port",      "devices",
          "nics",  "nccl",    "ranks",        "rank_devices",      "rank_metrics_ports"};
      if (kKnown.count(key) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("unknown config key `", path, ".", key, "`"));
      }
    }
    Box box;
    if (!b["name"].IsDefined()) return KeyError(path + ".name", "is required");
    EXL3_RETURN_IF_ERROR(ReadKey(b["name"], path + ".name", &box.name));
    if (box.name.empty() || !names.insert(box.name).second) {
      return KeyError(path + ".name", absl::StrCat("must be unique and non-empty, got \"", box.name, "\""));
    }
    if (!b["address"].IsDefined()) return KeyError(path + ".address", "is required");
    EXL3_RETURN_IF_ERROR(ReadKey(b["address"], path + ".address", &box.address));
    if (box.address.empty()) return KeyError(path + ".address", "must not be empty");
    if (b["coordinator"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadKey(b["coordinator"], path + ".coordinator", &box.coordinator));
    }
    if (b["metrics_port"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadKey(b["metrics_port"], path + ".metrics_port", &box.metrics_port));
      if (box.metrics_port < 0 || box.metrics_port > 65535) {
        return KeyError(path + ".metrics_port", "must be 0..65535");
      }
    }
    if (b["devices"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadIntList(b["devices"], path + ".devices", &box.devices));
      std::set<int> seen;
      for (size_t j = 0; j < box.devices.size(); ++j) {
        if (box.devices[j] < 0 || !seen.insert(box.devices[j]).second) {
          return KeyError(absl::StrCat(path, ".devices[", j, "]"),
                          absl::StrCat("must be a CUDA device id >= 0, unique, got ", box.devices[j]));
        }
      }
    }
    if (b["nics"].IsDefined()) {
      const YAML::Node nics = b["nics"];
      if (!nics.IsSequence()) return KeyError(path + ".nics", "must be a list of interface names");
      for (size_t j = 0; j < nics.size(); ++j) {
        std::string nic;
        EXL3_RETURN_IF_ERROR(ReadKey(nics[j], absl::StrCat(path, ".nics[", j, "]"), &nic));
        if (nic.empty() || nic.find_first_of(", \t") != std::string::npos) {
          return KeyError(absl::StrCat(path, ".nics[", j, "]"),
                          absl::StrCat("must be one interface name, got \"", nic, "\""));
        }
        box.nics.push_back(nic);
      }
    }
    box.nccl = nccl;
    if (b["nccl"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadNcclKeys(b["nccl"], path + ".nccl", &box.nccl));
    }
    if (b["ranks"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadIntList(b["ranks"], path + ".ranks", &box.ranks));
    }
    if (b["rank_devices"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(ReadIntList(b["rank_devices"], path + ".rank_devices", &box.rank_devices));
      if (box.rank_devices.size() != box.ranks.size()) {
        return KeyError(path + ".rank_devices", "must have one device per entry of ranks");
      }
      for (size_t j = 0; j < box.rank_devices.size(); ++j) {
        const int d = box.rank_devices[j];
        const bool listed = box.devices.empty() ||
                            std::find(box.devices.begin(), box.devices.end(), d) != box.devices.end();
        if (d < 0 || !listed) {
          return KeyError(absl::StrCat(path, ".rank_devices[", j, "]"),
                          absl::StrCat("must be one of ", path, ".devices, got ", d));
        }
      }
    }
    for (size_t j = 0; j < box.ranks.size(); ++j) {
      const int r = box.ranks[j];
      const std::string key = absl::StrCat(path, ".ranks[", j, "]");
      if (r < 0 || r >= plan.world_size) {
        return KeyError(key, absl::StrCat("must be in [0, world_size=", plan.world_size, "), got ", r));
      }
      if (auto [it, inserted] = rank_box.emplace(r, box.name); !inserted) {
        return KeyError(key, absl::StrCat("rank ", r, " is already on box \"", it->second, "\""));
      }
    }
    if (b["rank_metrics_ports"].IsDefined()) {
      EXL3_RETURN_IF_ERROR(
          ReadIntList(b["rank_metrics_ports"], path + ".rank_metrics_ports", &box.rank_metrics_ports));
      if (box.rank_metrics_ports.size() != box.ranks.size()) {
        return KeyError(path + ".rank_metrics_ports", "must have one port per entry of ranks");
      }
    }
    plan.boxes.push_back(std::move(box));
  }
  for (const Box& box : plan.boxes) {
    if (!box.coordinator) continue;
    if (coordinator_box != nullptr) {
      return KeyError("boxes[].coordinator", absl::StrCat("is true on two boxes (\"",
                                                          coordinator_box->name, "\", \"", box.name, "\")"));
    }
    coordinator_box = &box;
  }
  if (coordinator_box == nullptr) return KeyError("boxes[].coordinator", "must be true on one box");
  for (int r = 0; r < plan.world_size; ++r) {
    if (rank_box.count(r) == 0) {
      return KeyError("boxes[].ranks", absl::StrCat("must place every rank; rank ", r, " is on no box"));
    }
  }
  std::string listen = "127.0.0.1:50061";  // coordinator_command.cc's default
  if (root["listen_address"].IsDefined()) {
    EXL3_RETURN_IF_ERROR(ReadKey(root["listen_address"], "listen_address", &listen));
  }
  const size_t colon = listen.rfind(':');
  const std::string port = colon == std::string::npos ? "" : listen.substr(colon + 1);
  if (port.empty() || port == "0") {
    return KeyError("listen_address", "needs a fixed port for launch (the ranks dial it)");
  }
  // A loopback rank endpoint is reachable from its own box only.
  const std::string listen_host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (coordinator::IsLoopbackHost(listen_host)) {
    for (const Box& box : plan.boxes) {
      if (&box != coordinator_box && !box.ranks.empty()) {
        return KeyError("listen_address",
                        absl::StrCat("is loopback (", listen, ") but box \"", box.name,
                                     "\" has ranks: listen on an address the other boxes reach, "
                                     "with tls.rank_* and rank_token_file"));
      }
    }
  }
  const std::string& host = coordinator_box->address;
  plan.coordinator_host = host;
  plan.coordinator_address =
      host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                          : absl::StrCat(host, ":", port);
  return plan;
}

}  // namespace

absl::StatusOr<LaunchPlan> ReadLaunchPlan(const YAML::Node& root) {
  try {
    return ReadLaunchPlanOrThrow(root);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("malformed config: ", e.what()));
  }
}

absl::StatusOr<LaunchPlan> LoadLaunchPlan(const std::string& file) {
  EXL3_ASSIGN_OR_RETURN(YAML::Node root, LoadClusterYaml(file));
  return ReadLaunchPlan(root);
}

}  // namespace exl3serve::cli
