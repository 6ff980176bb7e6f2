#include "worker/comm/tcp_bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "openssl/crypto.h"
#include "openssl/evp.h"
#include "openssl/hmac.h"
#include "openssl/rand.h"

namespace exl3serve::worker::comm {
namespace {

constexpr uint32_t kFrameMagic = 0x31425845;  // "EXB1" little-endian
constexpr size_t kFrameHeaderBytes = 16;
// Largest frame we accept: blobs are worker addresses and ids (KBs); this
// only guards against a stray client sending garbage.
constexpr uint64_t kMaxFrameBytes = uint64_t{1} << 30;
// Pause between connection attempts while rank 0 is not listening yet:
// starts short so a rank started right after rank 0 connects at once, grows
// so a long wait does not flood the host with SYNs.
constexpr absl::Duration kFirstRetryDelay = absl::Milliseconds(5);
constexpr absl::Duration kMaxRetryDelay = absl::Milliseconds(200);
// How long a failing rank 0 spends telling its peers why before closing.
constexpr absl::Duration kErrorNoticeTimeout = absl::Milliseconds(200);

enum class FrameKind : uint32_t {
  kHello = 1, kBlob = 2, kAll = 3, kError = 4, kChallenge = 5, kWelcome = 6
};

constexpr size_t kHelloBytes = 16;
constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
// Connections rank 0 holds that have not identified themselves yet; beyond
// it the oldest is closed (a flood of stray connections cannot exhaust
// descriptors or memory).
constexpr size_t kMaxPendingConnections = 64;
// The largest frame a connection may send before it has identified itself.
constexpr uint64_t kMaxUnidentifiedFrameBytes = 1024;
constexpr char kHelloLabel[] = "exl3serve bootstrap hello v1";
constexpr char kWelcomeLabel[] = "exl3serve bootstrap welcome v1";

std::string RandomNonce() {
  std::string n(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    // Without the CSPRNG there is no safe challenge; a fixed one would be
    // replayable, so the handshake fails (the MAC check never matches).
    n.assign(kNonceBytes, '\xff');
  }
  return n;
}

std::string Mac(const std::string& key, std::string_view label, const std::string& a,
                const std::string& b, const std::string& c = "") {
  std::string message(label);
  message += a;
  message += b;
  message += c;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

bool SameMac(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

constexpr char kPeerToRootKeyLabel[] = "exl3serve bootstrap key v1 peer->root";
constexpr char kRootToPeerKeyLabel[] = "exl3serve bootstrap key v1 root->peer";
constexpr size_t kTagBytes = 16;

}  // namespace

// One direction pair of AES-256-GCM on an authenticated connection. Keys:
// HMAC-SHA256(rank token, label | N0 | Np), one per direction, so a frame
// cannot be reflected back; the 96-bit GCM nonce is 4 zero bytes | u64
// sequence number, which both sides count (a replayed, dropped or reordered
// frame fails to open). AAD = u32 kind | u64 sequence: the kind cannot be
// swapped. A frame body is ciphertext | 16-byte tag.
struct SealedLink {
  std::string send_key, recv_key;
  uint64_t send_seq = 0, recv_seq = 0;

  SealedLink(const std::string& auth_key, const std::string& root_nonce,
             const std::string& peer_nonce, bool is_root) {
    std::string up = Mac(auth_key, kPeerToRootKeyLabel, root_nonce, peer_nonce);
    std::string down = Mac(auth_key, kRootToPeerKeyLabel, root_nonce, peer_nonce);
    send_key = is_root ? down : up;
    recv_key = is_root ? up : down;
  }

  static void NonceAndAad(uint32_t kind, uint64_t seq, unsigned char nonce[12],
                          unsigned char aad[12]) {
    std::memset(nonce, 0, 12);
    for (int i = 0; i < 8; ++i) nonce[4 + i] = static_cast<unsigned char>(seq >> (8 * i));
    for (int i = 0; i < 4; ++i) aad[i] = static_cast<unsigned char>(kind >> (8 * i));
    std::memcpy(aad + 4, nonce + 4, 8);
  }

  // Empty on a failure of the cipher library (the caller fails the group).
  std::optional<std::string> Seal(uint32_t kind, const std::string& plain) {
    unsigned char nonce[12], aad[12];
    NonceAndAad(kind, send_seq, nonce, aad);
    std::string out(plain.size() + kTagBytes, '\0');
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    int len = 0, total = 0;
    bool ok = ctx != nullptr &&
              EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                                 reinterpret_cast<const unsigned char*>(send_key.data()), nonce) == 1 &&
              EVP_EncryptUpdate(ctx, nullptr, &len, aad, sizeof(aad)) == 1 &&
              EVP_EncryptUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                                reinterpret_cast<const unsigned char*>(plain.data()),
                                static_cast<int>(plain.size())) == 1;
    total = len;
    ok = ok && EVP_EncryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(out.data()) + total, &len) == 1;
    total += len;
    ok = ok && EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes,
                                   reinterpret_cast<unsigned char*>(out.data()) + total) == 1;
    EVP_CIPHER_CTX_free(ctx);
    if (!ok || static_cast<size_t>(total) != plain.size()) return std::nullopt;
    ++send_seq;
    return out;
  }

  // The plaintext, or nothing when the frame does not authenticate.
  std::optional<std::string> Open(uint32_t kind, const std::string& sealed) {
    if (sealed.size() < kTagBytes) return std::nullopt;
    unsigned char nonce[12], aad[12];
    NonceAndAad(kind, recv_seq, nonce, aad);
    const size_t n = sealed.size() - kTagBytes;
    std::string out(n, '\0');
    std::string tag = sealed.substr(n);
    EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
    int len = 0;
    bool ok = ctx != nullptr &&
              EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                                 reinterpret_cast<const unsigned char*>(recv_key.data()), nonce) == 1 &&
              EVP_DecryptUpdate(ctx, nullptr, &len, aad, sizeof(aad)) == 1 &&
              EVP_DecryptUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                                reinterpret_cast<const unsigned char*>(sealed.data()),
                                static_cast<int>(n)) == 1 &&
              EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, tag.data()) == 1 &&
              EVP_DecryptFinal_ex(ctx, reinterpret_cast<unsigned char*>(out.data()) + len, &len) == 1;
    EVP_CIPHER_CTX_free(ctx);
    if (!ok) return std::nullopt;
    ++recv_seq;
    return out;
  }
};

namespace {

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

std::string Frame(FrameKind kind, const std::string& body) {
  std::string out;
  out.reserve(kFrameHeaderBytes + body.size());
  PutU32(out, kFrameMagic);
  PutU32(out, static_cast<uint32_t>(kind));
  PutU64(out, body.size());
  out += body;
  return out;
}

std::string ErrnoText(int err) { return std::string(strerror(err)); }

// Milliseconds poll() may wait before `deadline` (rounded up so we never wake
// just before it and spin); 0 once it has passed.
int PollTimeoutMs(absl::Time deadline) {
  absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(
      absl::ToInt64Milliseconds(absl::Ceil(left, absl::Milliseconds(1))), 1 << 30));
}

void SetSocketOptions(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Reads frames incrementally from a non-blocking socket.
class FrameReader {
 public:
  enum class Result { kNeedMore, kFrame, kClosed, kError };

  // Reads what is available; kFrame when a whole frame is buffered (taken
  // with Take()). kError sets error().
  Result Read(int fd) {
    while (true) {
      if (Complete()) return Result::kFrame;
      size_t want = buffer_.size() < kFrameHeaderBytes
                        ? kFrameHeaderBytes - buffer_.size()
                        : kFrameHeaderBytes + length_ - buffer_.size();
      want = std::min<size_t>(want, 1 << 20);
      size_t old = buffer_.size();
      buffer_.resize(old + want);
      ssize_t n = recv(fd, buffer_.data() + old, want, MSG_DONTWAIT);
      if (n <= 0) {
        buffer_.resize(old);
        if (n == 0) return Result::kClosed;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return Result::kNeedMore;
        if (errno == ECONNRESET || errno == EPIPE) return Result::kClosed;
        error_ = ErrnoText(errno);
        return Result::kError;
      }
      buffer_.resize(old + static_cast<size_t>(n));
      if (buffer_.size() == kFrameHeaderBytes) {
        if (GetU32(buffer_.data()) != kFrameMagic) {
          error_ = "not an exl3serve bootstrap frame (bad magic)";
          return Result::kError;
        }
        length_ = GetU64(buffer_.data() + 8);
        if (length_ > max_bytes_) {
          error_ =
              absl::StrCat("frame of ", length_, " bytes exceeds the limit of ", max_bytes_);
          return Result::kError;
        }
      }
    }
  }

  // Hands out the buffered frame and resets for the next one.
  std::pair<FrameKind, std::string> Take() {
    FrameKind kind = static_cast<FrameKind>(GetU32(buffer_.data() + 4));
    std::string body = buffer_.substr(kFrameHeaderBytes);
    buffer_.clear();
    length_ = 0;
    return {kind, std::move(body)};
  }

  const std::string& error() const { return error_; }
  void set_max_bytes(uint64_t max_bytes) { max_bytes_ = max_bytes; }

 private:
  bool Complete() const {
    return buffer_.size() >= kFrameHeaderBytes && buffer_.size() == kFrameHeaderBytes + length_;
  }
  std::string buffer_;
  uint64_t length_ = 0;
  uint64_t max_bytes_ = kMaxFrameBytes;
  std::string error_;
};

// Writes all of `data`; Unavailable on a dropped connection, DeadlineExceeded
// when the socket stays full until the deadline.
absl::Status SendAll(int fd, const std::string& data, absl::Time deadline,
                     const std::string& what) {
  size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n = send(fd, data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int timeout = PollTimeoutMs(deadline);
      if (timeout == 0) {
        return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded while sending"));
      }
      pollfd p{fd, POLLOUT, 0};
      poll(&p, 1, timeout);
      continue;
    }
    return absl::UnavailableError(
        absl::StrCat(what, ": connection dropped while sending (", ErrnoText(errno), ")"));
  }
  return absl::OkStatus();
}

struct Resolved {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};

absl::StatusOr<Resolved> Resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  std::string port_text = std::to_string(port);
  int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("tcp bootstrap: cannot resolve host '", host, "': ", gai_strerror(rc)));
  }
  Resolved out;
  std::memcpy(&out.addr, res->ai_addr, res->ai_addrlen);
  out.len = res->ai_addrlen;
  out.family = res->ai_family;
  freeaddrinfo(res);
  return out;
}

std::string PeerAddressText(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&addr);
    inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    port = ntohs(in->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* in = reinterpret_cast<const sockaddr_in6*>(&addr);
    inet_ntop(AF_INET6, &in->sin6_addr, text, sizeof(text));
    port = ntohs(in->sin6_port);
  }
  return absl::StrCat(text, ":", port);
}

std::string RankList(const std::vector<int>& ranks) {
  return absl::StrCat(ranks.size() == 1 ? "rank " : "ranks ", absl::StrJoin(ranks, ", "));
}

}  // namespace

struct TcpBootstrap::Peer {
  int fd = -1;
  int rank = -1;
  std::string address;  // host:port it connected from
  FrameReader reader;
  bool has_blob = false;
  std::string blob;
  std::string nonce;        // the challenge sent on accept (auth)
  absl::Time accepted_at;   // for the handshake timeout
  std::unique_ptr<SealedLink> link;  // auth: blob/all/error frames sealed (set at the welcome)
  ~Peer() {
    if (fd >= 0) close(fd);
  }
};

TcpBootstrap::TcpBootstrap(const TcpBootstrapOptions& options)
    : rank_(options.rank),
      world_size_(options.world_size),
      host_(options.host),
      group_id_(options.group_id),
      auth_key_(options.auth_key),
      handshake_timeout_(options.handshake_timeout),
      port_(options.port) {}

TcpBootstrap::~TcpBootstrap() { CloseAll(); }

void TcpBootstrap::CloseAll() {
  if (listen_fd_ >= 0) close(listen_fd_);
  listen_fd_ = -1;
  if (root_fd_ >= 0) close(root_fd_);
  root_fd_ = -1;
  peers_.clear();
  unidentified_.clear();
}

absl::StatusOr<std::unique_ptr<TcpBootstrap>> TcpBootstrap::Create(
    const TcpBootstrapOptions& options, absl::Time deadline) {
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp bootstrap: rank must be in [0, world_size), got rank ", options.rank,
                     " of world_size ", options.world_size));
  }
  std::unique_ptr<TcpBootstrap> boot(new TcpBootstrap(options));
  if (options.world_size == 1) return boot;

  if (options.rank == 0) {
    auto resolved = Resolve(options.host, options.port, /*passive=*/true);
    if (!resolved.ok()) return resolved.status();
    int fd = socket(resolved->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return absl::UnavailableError(absl::StrCat("tcp bootstrap: socket: ", ErrnoText(errno)));
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, reinterpret_cast<const sockaddr*>(&resolved->addr), resolved->len) != 0 ||
        listen(fd, std::max(16, options.world_size)) != 0) {
      int err = errno;
      close(fd);
      return absl::UnavailableError(absl::StrCat("tcp bootstrap: rank 0 cannot listen on ",
                                                 options.host, ":", options.port, ": ",
                                                 ErrnoText(err)));
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
    boot->port_ = bound.ss_family == AF_INET6
                      ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                      : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    boot->listen_fd_ = fd;
    boot->peers_.resize(options.world_size);
    return boot;
  }

  if (options.port == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp bootstrap: rank ", options.rank, " needs rank 0's port (got port 0)"));
  }
  auto resolved = Resolve(options.host, options.port, /*passive=*/false);
  if (!resolved.ok()) return resolved.status();
  const std::string target = absl::StrCat(options.host, ":", options.port);
  absl::Duration delay = kFirstRetryDelay;
  std::string last_error = "no attempt made";
  while (true) {
    int fd = socket(resolved->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
      return absl::UnavailableError(absl::StrCat("tcp bootstrap: socket: ", ErrnoText(errno)));
    int rc = connect(fd, reinterpret_cast<const sockaddr*>(&resolved->addr), resolved->len);
    int err = rc == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int ready = poll(&p, 1, PollTimeoutMs(deadline));
      if (ready == 1) {
        socklen_t elen = sizeof(err);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen);
      } else {
        err = ETIMEDOUT;
      }
    }
    if (err == 0) {
      SetSocketOptions(fd);
      boot->root_fd_ = fd;
      break;
    }
    close(fd);
    last_error = ErrnoText(err);
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) {
      return absl::DeadlineExceededError(
          absl::StrCat("tcp bootstrap: rank ", options.rank, " could not connect to rank 0 at ",
                       target, " before the deadline (last error: ", last_error, ")"));
    }
    // A back-off between attempts, not synchronisation: rank 0 may not be
    // listening yet and nothing can tell us when it will be.
    poll(nullptr, 0,
         static_cast<int>(
             absl::ToInt64Milliseconds(absl::Ceil(std::min(delay, left), absl::Milliseconds(1)))));
    delay = std::min(delay * 2, kMaxRetryDelay);
  }
  // With a key the hello waits for rank 0's challenge (PeerHandshake, at the
  // first AllGather: rank 0 accepts inside its AllGather).
  if (!options.auth_key.empty()) return boot;
  std::string hello;
  PutU32(hello, static_cast<uint32_t>(options.rank));
  PutU32(hello, static_cast<uint32_t>(options.world_size));
  PutU64(hello, options.group_id);
  absl::Status sent =
      SendAll(boot->root_fd_, Frame(FrameKind::kHello, hello), deadline,
              absl::StrCat("tcp bootstrap: rank ", options.rank, " hello to rank 0 at ", target));
  if (!sent.ok()) return sent;
  return boot;
}

absl::StatusOr<std::vector<std::string>> TcpBootstrap::AllGather(const std::string& blob,
                                                                 absl::Time deadline) {
  ++calls_;
  if (!broken_.ok()) {
    return absl::FailedPreconditionError(absl::StrCat("tcp bootstrap broken: ", broken_.message()));
  }
  if (world_size_ == 1) return std::vector<std::string>{blob};
  return rank_ == 0 ? RootAllGather(blob, deadline) : PeerAllGather(blob, deadline);
}

absl::Status TcpBootstrap::Fail(absl::Status status) {
  if (broken_.ok()) broken_ = status;
  if (rank_ == 0) {
    std::string body;
    PutU32(body, static_cast<uint32_t>(status.code()));
    body += std::string(status.message());
    const std::string plain_frame = Frame(FrameKind::kError, body);
    absl::Time notice_deadline = absl::Now() + kErrorNoticeTimeout;
    for (auto& peer : peers_) {
      if (peer == nullptr) continue;
      std::string frame = plain_frame;
      if (peer->link != nullptr) {
        std::optional<std::string> sealed =
            peer->link->Seal(static_cast<uint32_t>(FrameKind::kError), body);
        if (!sealed.has_value()) continue;
        frame = Frame(FrameKind::kError, *sealed);
      }
      SendAll(peer->fd, frame, notice_deadline, "error notice").IgnoreError();
      // FIN after the notice; then read what the peer already sent, since
      // closing with unread input resets the connection and can discard
      // the notice before the peer reads it.
      shutdown(peer->fd, SHUT_WR);
      char sink[4096];
      while (recv(peer->fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
      }
    }
  }
  CloseAll();
  return status;
}

absl::StatusOr<std::vector<std::string>> TcpBootstrap::RootAllGather(const std::string& blob,
                                                                     absl::Time deadline) {
  const std::string what =
      absl::StrCat("tcp bootstrap AllGather #", calls_, " (rank 0 of ", world_size_, ")");
  while (true) {
    std::vector<int> missing, unconnected;
    for (int r = 1; r < world_size_; ++r) {
      if (peers_[r] == nullptr) unconnected.push_back(r);
      if (peers_[r] == nullptr || !peers_[r]->has_blob) missing.push_back(r);
    }
    if (unconnected.empty() && !unidentified_.empty()) {
      // Every rank is here: whoever else is connected is not one of ours.
      for (auto& u : unidentified_) {
        EXL3_LOG(kWarning) << what << ": refused the connection from " << u->address
                           << ": every rank has joined";
      }
      unidentified_.clear();
    }
    if (missing.empty()) break;

    // Connections that have not identified themselves in time are closed
    // (a slow loris or a scanner must not hold a slot or stall the group).
    const absl::Time now = absl::Now();
    for (auto it = unidentified_.begin(); it != unidentified_.end();) {
      if (now - (*it)->accepted_at >= handshake_timeout_) {
        EXL3_LOG(kWarning) << what << ": refused the connection from " << (*it)->address
                           << ": no valid hello within " << absl::FormatDuration(handshake_timeout_);
        it = unidentified_.erase(it);
      } else {
        ++it;
      }
    }
    absl::Time wake = deadline;
    for (auto& u : unidentified_) wake = std::min(wake, u->accepted_at + handshake_timeout_);

    // Who we poll: the listener while someone is missing, every accepted
    // connection (also finished ones, to notice a drop at once).
    std::vector<pollfd> fds;
    if (!unconnected.empty()) fds.push_back({listen_fd_, POLLIN, 0});
    const size_t first_unidentified = fds.size();
    for (auto& u : unidentified_) fds.push_back({u->fd, POLLIN, 0});
    const size_t first_peer = fds.size();
    std::vector<int> peer_of_fd;
    for (int r = 1; r < world_size_; ++r) {
      if (peers_[r] == nullptr) continue;
      fds.push_back({peers_[r]->fd, POLLIN, 0});
      peer_of_fd.push_back(r);
    }
    int timeout = PollTimeoutMs(deadline);
    if (timeout > 0 && wake < deadline) timeout = std::max(1, PollTimeoutMs(wake));
    if (timeout == 0) {
      std::string detail =
          unconnected.empty() ? "" : absl::StrCat("; never connected: ", RankList(unconnected));
      return Fail(absl::DeadlineExceededError(
          absl::StrCat(what, ": deadline exceeded waiting for ", RankList(missing), detail)));
    }
    int ready = poll(fds.data(), fds.size(), timeout);
    if (ready < 0 && errno != EINTR) {
      return Fail(absl::InternalError(absl::StrCat(what, ": poll: ", ErrnoText(errno))));
    }
    if (ready <= 0) continue;

    if (!unconnected.empty() && (fds[0].revents & POLLIN)) {
      while (true) {
        sockaddr_storage from{};
        socklen_t len = sizeof(from);
        int fd = accept4(listen_fd_, reinterpret_cast<sockaddr*>(&from), &len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        SetSocketOptions(fd);
        auto peer = std::make_unique<Peer>();
        peer->fd = fd;
        peer->address = PeerAddressText(from);
        peer->accepted_at = absl::Now();
        peer->reader.set_max_bytes(kMaxUnidentifiedFrameBytes);
        if (!auth_key_.empty()) {
          peer->nonce = RandomNonce();
          if (!SendAll(fd, Frame(FrameKind::kChallenge, peer->nonce),
                       absl::Now() + kErrorNoticeTimeout, "challenge").ok()) {
            EXL3_LOG(kWarning) << what << ": connection from " << peer->address
                               << " dropped before its challenge";
            continue;
          }
        }
        if (unidentified_.size() >= kMaxPendingConnections) {
          EXL3_LOG(kWarning) << what << ": more than " << kMaxPendingConnections
                             << " unidentified connections; closed the oldest, from "
                             << unidentified_.front()->address;
          unidentified_.erase(unidentified_.begin());
        }
        unidentified_.push_back(std::move(peer));
      }
    }

    // Hellos. Iterate over the snapshot taken for poll; entries that finish
    // (identified or dropped) are removed afterwards.
    std::vector<size_t> done;
    for (size_t i = 0; i + first_unidentified < first_peer; ++i) {
      if (fds[first_unidentified + i].revents == 0) continue;
      Peer& u = *unidentified_[i];
      FrameReader::Result res = u.reader.Read(u.fd);
      if (res == FrameReader::Result::kNeedMore) continue;
      done.push_back(i);
      if (res != FrameReader::Result::kFrame) {
        EXL3_LOG(kWarning) << what << ": connection from " << u.address
                           << " closed before its hello";
        continue;
      }
      auto [kind, body] = u.reader.Take();
      const size_t authed_size = kHelloBytes + kNonceBytes + kMacBytes;
      if (kind != FrameKind::kHello || (body.size() != kHelloBytes && body.size() != authed_size)) {
        EXL3_LOG(kWarning) << what << ": connection from " << u.address << " sent no hello; closed";
        continue;
      }
      if (!auth_key_.empty()) {
        if (body.size() != authed_size) {
          EXL3_LOG(kWarning) << what << ": refused " << u.address
                             << ": its hello carries no rank token proof (give every rank the "
                                "same --rank-token-file)";
          continue;
        }
        const std::string hello = body.substr(0, kHelloBytes);
        const std::string peer_nonce = body.substr(kHelloBytes, kNonceBytes);
        if (!SameMac(body.substr(kHelloBytes + kNonceBytes), Mac(auth_key_, kHelloLabel, u.nonce, hello, peer_nonce))) {
          EXL3_LOG(kWarning) << what << ": refused " << u.address << ": wrong rank token";
          continue;
        }
        if (!SendAll(u.fd, Frame(FrameKind::kWelcome, Mac(auth_key_, kWelcomeLabel, peer_nonce, u.nonce)),
                     absl::Now() + kErrorNoticeTimeout, "welcome").ok()) {
          EXL3_LOG(kWarning) << what << ": connection from " << u.address << " dropped before its welcome";
          continue;
        }
        u.link = std::make_unique<SealedLink>(auth_key_, u.nonce, peer_nonce, /*is_root=*/true);
        body = hello;
      } else if (body.size() != kHelloBytes) {
        EXL3_LOG(kWarning) << what << ": refused " << u.address
                           << ": it proves a rank token but this rank 0 has none (give every rank "
                              "the same --rank-token-file)";
        continue;
      }
      int peer_rank = static_cast<int>(GetU32(body.data()));
      int peer_world = static_cast<int>(GetU32(body.data() + 4));
      uint64_t peer_group = GetU64(body.data() + 8);
      if (peer_world != world_size_ || peer_group != group_id_ || peer_rank <= 0 ||
          peer_rank >= world_size_) {
        EXL3_LOG(kWarning) << what << ": turned away " << u.address << " (rank " << peer_rank
                           << " of world_size " << peer_world << ", group " << peer_group
                           << "; this group has world_size " << world_size_ << ", group "
                           << group_id_ << ")";
        continue;
      }
      if (peers_[peer_rank] != nullptr) {
        return Fail(absl::InvalidArgumentError(
            absl::StrCat(what, ": rank ", peer_rank, " connected twice (from ",
                         peers_[peer_rank]->address, " and ", u.address, ")")));
      }
      u.rank = peer_rank;
      u.reader.set_max_bytes(kMaxFrameBytes);
      if (!auth_key_.empty()) {
        EXL3_LOG(kInfo) << "tcp bootstrap: rank " << peer_rank << " joined from " << u.address
                        << " (rank token verified)";
      }
      peers_[peer_rank] = std::move(unidentified_[i]);
    }
    for (auto it = done.rbegin(); it != done.rend(); ++it)
      unidentified_.erase(unidentified_.begin() + *it);

    for (size_t i = 0; i < peer_of_fd.size(); ++i) {
      if (fds[first_peer + i].revents == 0) continue;
      int r = peer_of_fd[i];
      Peer& p = *peers_[r];
      FrameReader::Result res = p.reader.Read(p.fd);
      if (res == FrameReader::Result::kNeedMore) continue;
      if (res == FrameReader::Result::kClosed) {
        return Fail(absl::UnavailableError(
            absl::StrCat(what, ": connection from rank ", r, " (", p.address, ") dropped")));
      }
      if (res == FrameReader::Result::kError) {
        return Fail(absl::UnavailableError(
            absl::StrCat(what, ": reading from rank ", r, ": ", p.reader.error())));
      }
      auto [kind, body] = p.reader.Take();
      if (kind != FrameKind::kBlob || p.has_blob) {
        return Fail(
            absl::InternalError(absl::StrCat(what, ": rank ", r, " sent an unexpected frame (kind ",
                                             static_cast<uint32_t>(kind), ")")));
      }
      if (p.link != nullptr) {
        std::optional<std::string> plain = p.link->Open(static_cast<uint32_t>(kind), body);
        if (!plain.has_value()) {
          return Fail(absl::UnauthenticatedError(absl::StrCat(
              what, ": a frame from rank ", r, " (", p.address,
              ") failed authentication (tampered with, or not from that rank)")));
        }
        body = std::move(*plain);
      }
      p.blob = std::move(body);
      p.has_blob = true;
    }
  }

  std::vector<std::string> all(world_size_);
  all[0] = blob;
  std::string body;
  PutU32(body, static_cast<uint32_t>(world_size_));
  for (int r = 0; r < world_size_; ++r) {
    if (r > 0) {
      all[r] = std::move(peers_[r]->blob);
      peers_[r]->has_blob = false;
    }
    PutU64(body, all[r].size());
    body += all[r];
  }
  const std::string plain_frame = Frame(FrameKind::kAll, body);
  for (int r = 1; r < world_size_; ++r) {
    std::string sealed_frame;
    if (peers_[r]->link != nullptr) {
      std::optional<std::string> sealed =
          peers_[r]->link->Seal(static_cast<uint32_t>(FrameKind::kAll), body);
      if (!sealed.has_value()) {
        return Fail(absl::InternalError(absl::StrCat(what, ": sealing the reply failed")));
      }
      sealed_frame = Frame(FrameKind::kAll, *sealed);
    }
    absl::Status sent = SendAll(peers_[r]->fd, peers_[r]->link != nullptr ? sealed_frame : plain_frame,
                                deadline, absl::StrCat(what, ": to rank ", r));
    if (!sent.ok()) return Fail(sent);
  }
  return all;
}

// Reads one frame from `fd` by `deadline`.
absl::StatusOr<std::pair<uint32_t, std::string>> ReadOneFrame(int fd, absl::Time deadline,
                                                              const std::string& what) {
  FrameReader reader;
  reader.set_max_bytes(kMaxUnidentifiedFrameBytes);
  while (true) {
    FrameReader::Result res = reader.Read(fd);
    if (res == FrameReader::Result::kFrame) {
      auto [kind, body] = reader.Take();
      return std::make_pair(static_cast<uint32_t>(kind), std::move(body));
    }
    if (res == FrameReader::Result::kClosed) {
      return absl::UnavailableError(absl::StrCat(what, ": the connection closed"));
    }
    if (res == FrameReader::Result::kError) {
      return absl::UnavailableError(absl::StrCat(what, ": ", reader.error()));
    }
    const int timeout = PollTimeoutMs(deadline);
    if (timeout == 0) return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded"));
    pollfd p{fd, POLLIN, 0};
    poll(&p, 1, timeout);
  }
}

absl::Status TcpBootstrap::PeerHandshake(absl::Time deadline, const std::string& what) {
  const std::string root = absl::StrCat("rank 0 at ", host_, ":", port_);
  absl::StatusOr<std::pair<uint32_t, std::string>> challenge =
      ReadOneFrame(root_fd_, deadline, absl::StrCat(what, ": waiting for the challenge of ", root));
  if (!challenge.ok()) {
    return absl::Status(challenge.status().code(),
                        absl::StrCat(challenge.status().message(),
                                     " (rank 0 sends one only with a rank token: is "
                                     "--rank-token-file the same on every rank?)"));
  }
  if (challenge->first != static_cast<uint32_t>(FrameKind::kChallenge) ||
      challenge->second.size() != kNonceBytes) {
    return absl::UnavailableError(absl::StrCat(what, ": ", root, " sent no challenge"));
  }
  std::string hello;
  PutU32(hello, static_cast<uint32_t>(rank_));
  PutU32(hello, static_cast<uint32_t>(world_size_));
  PutU64(hello, group_id_);
  const std::string nonce = RandomNonce();
  const std::string body = hello + nonce + Mac(auth_key_, kHelloLabel, challenge->second, hello, nonce);
  EXL3_RETURN_IF_ERROR(SendAll(root_fd_, Frame(FrameKind::kHello, body), deadline,
                               absl::StrCat(what, ": hello to ", root)));
  absl::StatusOr<std::pair<uint32_t, std::string>> welcome =
      ReadOneFrame(root_fd_, deadline, absl::StrCat(what, ": waiting for the welcome of ", root));
  if (!welcome.ok()) {
    return absl::Status(welcome.status().code(),
                        absl::StrCat(welcome.status().message(),
                                     " (rank 0 closes a hello with a wrong rank token: is "
                                     "--rank-token-file the same on every rank?)"));
  }
  if (welcome->first != static_cast<uint32_t>(FrameKind::kWelcome) ||
      !SameMac(welcome->second, Mac(auth_key_, kWelcomeLabel, nonce, challenge->second))) {
    return absl::UnauthenticatedError(absl::StrCat(
        what, ": ", root, " does not know the rank token (wrong welcome); refusing to join it"));
  }
  root_link_ = std::make_unique<SealedLink>(auth_key_, challenge->second, nonce, /*is_root=*/false);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> TcpBootstrap::PeerAllGather(const std::string& blob,
                                                                     absl::Time deadline) {
  const std::string what =
      absl::StrCat("tcp bootstrap AllGather #", calls_, " (rank ", rank_, " of ", world_size_, ")");
  const std::string root = absl::StrCat("rank 0 at ", host_, ":", port_);
  if (!auth_key_.empty() && !handshaken_) {
    absl::Status handshake = PeerHandshake(deadline, what);
    if (!handshake.ok()) return Fail(handshake);
    handshaken_ = true;
  }
  std::string frame;
  if (root_link_ != nullptr) {
    std::optional<std::string> sealed = root_link_->Seal(static_cast<uint32_t>(FrameKind::kBlob), blob);
    if (!sealed.has_value()) return Fail(absl::InternalError(absl::StrCat(what, ": sealing failed")));
    frame = Frame(FrameKind::kBlob, *sealed);
  } else {
    frame = Frame(FrameKind::kBlob, blob);
  }
  absl::Status sent = SendAll(root_fd_, frame, deadline, absl::StrCat(what, ": to ", root));
  if (!sent.ok()) return Fail(sent);
  FrameReader reader;
  while (true) {
    FrameReader::Result res = reader.Read(root_fd_);
    if (res == FrameReader::Result::kFrame) break;
    if (res == FrameReader::Result::kClosed) {
      return Fail(absl::UnavailableError(absl::StrCat(what, ": connection to ", root, " dropped")));
    }
    if (res == FrameReader::Result::kError) {
      return Fail(absl::UnavailableError(
          absl::StrCat(what, ": reading from ", root, ": ", reader.error())));
    }
    int timeout = PollTimeoutMs(deadline);
    if (timeout == 0) {
      return Fail(absl::DeadlineExceededError(
          absl::StrCat(what, ": deadline exceeded waiting for ", root,
                       " to send every rank's blob (rank 0 or another rank has not contributed)")));
    }
    pollfd p{root_fd_, POLLIN, 0};
    poll(&p, 1, timeout);
  }
  auto [kind, body] = reader.Take();
  if (root_link_ != nullptr) {
    std::optional<std::string> plain = root_link_->Open(static_cast<uint32_t>(kind), body);
    if (!plain.has_value()) {
      return Fail(absl::UnauthenticatedError(absl::StrCat(
          what, ": a frame from ", root, " failed authentication (tampered with, or not from rank 0)")));
    }
    body = std::move(*plain);
  }
  if (kind == FrameKind::kError && body.size() >= 4) {
    auto code = static_cast<absl::StatusCode>(GetU32(body.data()));
    return Fail(absl::Status(code, absl::StrCat(what, ": rank 0 failed: ", body.substr(4))));
  }
  if (kind != FrameKind::kAll || body.size() < 4 ||
      GetU32(body.data()) != static_cast<uint32_t>(world_size_)) {
    return Fail(absl::InternalError(absl::StrCat(what, ": malformed reply from ", root)));
  }
  std::vector<std::string> all(world_size_);
  size_t pos = 4;
  for (int r = 0; r < world_size_; ++r) {
    if (pos + 8 > body.size())
      return Fail(absl::InternalError(absl::StrCat(what, ": truncated reply from ", root)));
    uint64_t len = GetU64(body.data() + pos);
    pos += 8;
    if (len > body.size() - pos)
      return Fail(absl::InternalError(absl::StrCat(what, ": truncated reply from ", root)));
    all[r] = body.substr(pos, len);
    pos += len;
  }
  return all;
}

}  // namespace exl3serve::worker::comm
