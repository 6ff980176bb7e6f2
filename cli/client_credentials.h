// cli/client_credentials.h — the client side of the public API's security
// (coordinator/grpc_server.h): TLS (--tls-ca, with --tls-cert/--tls-key for
// mutual TLS) and the bearer token (--token / --token-file) that `client`
// and `bench-serve` send as `authorization: Bearer <token>` metadata.
#ifndef EXL3SERVE_CLI_CLIENT_CREDENTIALS_H_
#define EXL3SERVE_CLI_CLIENT_CREDENTIALS_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "absl/status/statusor.h"

namespace exl3serve::cli {

struct ClientCredentialOptions {
  std::string tls_ca;           // PEM CA of the server's certificate; set = TLS
  std::string tls_cert;         // PEM client certificate (mutual TLS)
  std::string tls_key;          // its private key
  std::string tls_server_name;  // the name to check in the server's certificate
  std::string token;            // bearer token
  std::string token_file;       // ... or read from this file
};

// Adds --tls-ca, --tls-cert, --tls-key, --tls-server-name, --token, --token-file.
void AddClientCredentialFlags(CLI::App& app, ClientCredentialOptions* options);

// A channel to `addr` with TLS when --tls-ca is given (plaintext otherwise).
// Also resolves the token (from --token-file) into options->token.
absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeClientChannel(const std::string& addr,
                                                                 ClientCredentialOptions* options,
                                                                 grpc::ChannelArguments args = {});

// Adds the bearer token to a call's metadata (no-op without one).
void AddCallCredentials(const ClientCredentialOptions& options, grpc::ClientContext* context);

}  // namespace exl3serve::cli

#endif  // EXL3SERVE_CLI_CLIENT_CREDENTIALS_H_
