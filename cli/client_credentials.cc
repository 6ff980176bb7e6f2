#include "cli/client_credentials.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace exl3serve::cli {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

void AddClientCredentialFlags(CLI::App& app, ClientCredentialOptions* options) {
  app.add_option("--tls-ca", options->tls_ca, "TLS: PEM CA that signed the server's certificate");
  app.add_option("--tls-cert", options->tls_cert, "mutual TLS: this client's PEM certificate");
  app.add_option("--tls-key", options->tls_key, "mutual TLS: its PEM private key");
  app.add_option("--tls-server-name", options->tls_server_name,
                 "TLS: the name the server's certificate must carry (default: the --addr host)");
  app.add_option("--token", options->token, "bearer token (sent as `authorization: Bearer ...`)");
  app.add_option("--token-file", options->token_file, "read the bearer token from this file");
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeClientChannel(const std::string& addr,
                                                                 ClientCredentialOptions* options,
                                                                 grpc::ChannelArguments args) {
  if (!options->token_file.empty()) {
    EXL3_ASSIGN_OR_RETURN(std::string token, ReadFile(options->token_file, "--token-file"));
    options->token = std::string(absl::StripAsciiWhitespace(token));
  }
  if (options->tls_cert.empty() != options->tls_key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (options->tls_ca.empty()) {
    if (!options->tls_cert.empty()) {
      return absl::InvalidArgumentError("--tls-cert needs --tls-ca (the server's CA)");
    }
    return grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions ssl;
  EXL3_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(options->tls_ca, "--tls-ca"));
  if (!options->tls_cert.empty()) {
    EXL3_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(options->tls_cert, "--tls-cert"));
    EXL3_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(options->tls_key, "--tls-key"));
  }
  if (!options->tls_server_name.empty()) {
    args.SetSslTargetNameOverride(options->tls_server_name);
  }
  return grpc::CreateCustomChannel(addr, grpc::SslCredentials(ssl), args);
}

void AddCallCredentials(const ClientCredentialOptions& options, grpc::ClientContext* context) {
  if (!options.token.empty()) context->AddMetadata("authorization", absl::StrCat("Bearer ", options.token));
}

}  // namespace exl3serve::cli
