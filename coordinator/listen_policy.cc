// The listen policies of the public API (grpc_server.h: IsLoopbackHost,
// CheckListenPolicy) and of the rank endpoint (rank_group.h:
// CheckRankListenPolicy), apart from the servers so that config readers (and
// their fuzzer, tests/fuzz/cluster_config_fuzz.cc) link without gRPC.
#include <arpa/inet.h>
#include <netinet/in.h>

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "coordinator/grpc_server.h"
#include "coordinator/rank_group.h"

namespace exl3serve::coordinator {

bool IsLoopbackHost(const std::string& host) {
  std::string h = host;
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  if (absl::AsciiStrToLower(h) == "localhost") return true;
  in_addr v4;
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (::inet_pton(AF_INET6, h.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::Status CheckListenPolicy(const GrpcServerOptions& options) {
  const bool client_check = !options.auth_token_file.empty() ||
                            !options.service.auth_token.empty() ||
                            !options.tls.client_ca_file.empty();
  if (IsLoopbackHost(options.host) || options.insecure_listen_any ||
      (options.tls.enabled() && client_check)) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to listen on ", options.host,
      " without credentials: an address other than loopback needs TLS and a client check (",
      options.credentials_hint, "); listen on 127.0.0.1, or accept the risk with ",
      "--insecure-listen-any"));
}

absl::Status CheckRankListenPolicy(const std::string& listen_address,
                                   const RankEndpointSecurity& security, const std::string& hint) {
  std::string host = listen_address;
  if (const size_t colon = listen_address.rfind(':'); colon != std::string::npos) {
    host = listen_address.substr(0, colon);
  }
  if (IsLoopbackHost(host) || security.insecure_listen_any ||
      (security.tls() && security.rank_check())) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "refusing to listen for ranks on ", host,
      " without credentials: an address other than loopback needs TLS and a rank check (", hint,
      "); listen on 127.0.0.1, or accept the risk with insecure_rank_listen_any"));
}

}  // namespace exl3serve::coordinator
