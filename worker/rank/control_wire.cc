#include "worker/rank/control_wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace exl3serve::worker::rank {
namespace {

// Milliseconds until `deadline` for poll(): -1 forever, 0 when past.
int PollTimeoutMs(absl::Time deadline) {
  if (deadline == absl::InfiniteFuture()) return -1;
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 60'000));
}

absl::Status WaitFd(int fd, short events, absl::Time deadline, const char* what) {
  while (true) {
    pollfd p{fd, events, 0};
    const int timeout = PollTimeoutMs(deadline);
    const int rc = poll(&p, 1, timeout);
    if (rc > 0) return absl::OkStatus();  // ready, or HUP/ERR: the read/write says which
    if (rc < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat(what, ": poll: ", std::strerror(errno)));
    }
    if (rc == 0 && timeout == 0) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": deadline passed"));
    }
  }
}

absl::Status ReadAll(int fd, char* p, size_t n, absl::Time deadline) {
  while (n > 0) {
    if (absl::Status s = WaitFd(fd, POLLIN, deadline, "control read"); !s.ok()) return s;
    const ssize_t got = read(fd, p, n);
    if (got == 0) return absl::UnavailableError("control channel closed by the peer");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat("control read: ", std::strerror(errno)));
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return absl::OkStatus();
}

}  // namespace

void WireWriter::Raw(const void* p, size_t n) {
  buf_.append(static_cast<const char*>(p), n);
}

void WireWriter::Str(std::string_view s) {
  U32(static_cast<uint32_t>(s.size()));
  Raw(s.data(), s.size());
}

void WireWriter::I32s(const int32_t* v, size_t n) {
  U32(static_cast<uint32_t>(n));
  Raw(v, n * sizeof(int32_t));
}

void WireWriter::U32s(const uint32_t* v, size_t n) {
  U32(static_cast<uint32_t>(n));
  Raw(v, n * sizeof(uint32_t));
}

void WireWriter::F32s(const float* v, size_t n) {
  U64(n);
  Raw(v, n * sizeof(float));
}

bool WireReader::Raw(void* p, size_t n) {
  if (!ok_ || data_.size() - pos_ < n) {
    ok_ = false;
    return false;
  }
  std::memcpy(p, data_.data() + pos_, n);
  pos_ += n;
  return true;
}

uint8_t WireReader::U8() {
  uint8_t v = 0;
  Raw(&v, 1);
  return v;
}
uint32_t WireReader::U32() {
  uint32_t v = 0;
  Raw(&v, 4);
  return v;
}
int64_t WireReader::I64() {
  int64_t v = 0;
  Raw(&v, 8);
  return v;
}
int32_t WireReader::I32() {
  int32_t v = 0;
  Raw(&v, 4);
  return v;
}

float WireReader::F32() {
  float v = 0;
  Raw(&v, 4);
  return v;
}

uint64_t WireReader::U64() {
  uint64_t v = 0;
  Raw(&v, 8);
  return v;
}

std::string WireReader::Str() {
  const uint32_t n = U32();
  if (!ok_ || data_.size() - pos_ < n) {
    ok_ = false;
    return {};
  }
  std::string s(data_.substr(pos_, n));
  pos_ += n;
  return s;
}

std::vector<int32_t> WireReader::I32s() {
  const uint32_t n = U32();
  if (!ok_ || (data_.size() - pos_) / sizeof(int32_t) < n) {
    ok_ = false;
    return {};
  }
  std::vector<int32_t> v(n);
  Raw(v.data(), n * sizeof(int32_t));
  return v;
}

std::vector<uint32_t> WireReader::U32s() {
  const uint32_t n = U32();
  if (!ok_ || (data_.size() - pos_) / sizeof(uint32_t) < n) {
    ok_ = false;
    return {};
  }
  std::vector<uint32_t> v(n);
  Raw(v.data(), n * sizeof(uint32_t));
  return v;
}

std::vector<float> WireReader::F32s() {
  const uint64_t n = U64();
  if (!ok_ || (data_.size() - pos_) / sizeof(float) < n) {
    ok_ = false;
    return {};
  }
  std::vector<float> v(n);
  Raw(v.data(), n * sizeof(float));
  return v;
}

absl::Status WireReader::Finish(std::string_view what) const {
  if (!ok_) return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": truncated message"));
  if (!at_end()) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(what), ": ", data_.size() - pos_,
                                                   " unexpected trailing bytes"));
  }
  return absl::OkStatus();
}

absl::Status WriteFrame(int fd, std::string_view payload, absl::Time deadline) {
  if (payload.size() > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("control frame of ", payload.size(), " bytes exceeds the limit"));
  }
  const uint32_t length = static_cast<uint32_t>(payload.size());
  std::string frame(reinterpret_cast<const char*>(&length), 4);
  frame.append(payload);
  const char* p = frame.data();
  size_t n = frame.size();
  while (n > 0) {
    if (absl::Status s = WaitFd(fd, POLLOUT, deadline, "control write"); !s.ok()) return s;
    const ssize_t put = send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return absl::UnavailableError(absl::StrCat("control write: ", std::strerror(errno)));
    }
    p += put;
    n -= static_cast<size_t>(put);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadFrame(int fd, absl::Time deadline) {
  uint32_t length = 0;
  if (absl::Status s = ReadAll(fd, reinterpret_cast<char*>(&length), 4, deadline); !s.ok()) {
    return s;
  }
  if (length > kMaxFrameBytes) {
    return absl::DataLossError(absl::StrCat("control frame announces ", length, " bytes"));
  }
  std::string payload(length, '\0');
  if (absl::Status s = ReadAll(fd, payload.data(), length, deadline); !s.ok()) return s;
  return payload;
}

void WriteStatus(WireWriter& w, const absl::Status& status) {
  w.U32(static_cast<uint32_t>(status.code()));
  w.Str(std::string(status.message()));
}

absl::Status ReadStatus(WireReader& r) {
  const uint32_t code = r.U32();
  std::string message = r.Str();
  if (!r.ok()) return absl::DataLossError("control: truncated status");
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::DataLossError(absl::StrCat("control: unknown status code ", code));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), message);
}

namespace {
constexpr uint32_t kMaxTopLogprobsOnWire = 20;
constexpr uint32_t kMaxLogitBiasOnWire = 1u << 20;
}  // namespace

void EncodeSequenceSampling(const SequenceSampling& sampling, WireWriter* w) {
  const SamplingParams& p = sampling.params;
  w->F32(p.temperature);
  w->I32(p.top_k);
  w->F32(p.top_p);
  w->F32(p.min_p);
  w->F32(p.repetition_penalty);
  w->F32(p.presence_penalty);
  w->F32(p.frequency_penalty);
  w->U8(p.seed.has_value() ? 1 : 0);
  w->U64(p.seed.value_or(0));
  w->U8(p.logprobs ? 1 : 0);
  w->I32(p.top_logprobs);
  w->I64(sampling.prompt_len);
  w->U32(static_cast<uint32_t>(p.logit_bias.size()));
  for (const auto& [id, bias] : p.logit_bias) {
    w->I32(id);
    w->F32(bias);
  }
  w->I32s(sampling.cached_prefix.data(), sampling.cached_prefix.size());
  w->I64(sampling.cached_state_slot);
  w->U64(sampling.cached_state_hash_hi);
  w->U64(sampling.cached_state_hash_lo);
}

absl::Status DecodeSequenceSampling(WireReader* in, SequenceSampling* out) {
  SamplingParams& p = out->params;
  p.temperature = in->F32();
  p.top_k = in->I32();
  p.top_p = in->F32();
  p.min_p = in->F32();
  p.repetition_penalty = in->F32();
  p.presence_penalty = in->F32();
  p.frequency_penalty = in->F32();
  const bool has_seed = in->U8() != 0;
  const uint64_t seed = in->U64();
  if (has_seed) p.seed = seed;
  p.logprobs = in->U8() != 0;
  p.top_logprobs = in->I32();
  out->prompt_len = in->I64();
  const uint32_t n = in->U32();
  if (!in->ok()) return absl::InvalidArgumentError("sampling parameters: truncated");
  if (n > kMaxLogitBiasOnWire) {
    return absl::InvalidArgumentError(absl::StrCat("sampling parameters: ", n,
                                                   " logit_bias entries (at most ",
                                                   kMaxLogitBiasOnWire, ")"));
  }
  p.logit_bias.clear();
  for (uint32_t i = 0; i < n && in->ok(); ++i) {
    const int32_t id = in->I32();
    const float bias = in->F32();
    p.logit_bias.emplace_back(id, bias);
  }
  if (!in->ok()) return absl::InvalidArgumentError("sampling parameters: truncated logit_bias");
  out->cached_prefix = in->I32s();
  out->cached_state_slot = in->I64();
  out->cached_state_hash_hi = in->U64();
  out->cached_state_hash_lo = in->U64();
  if (!in->ok()) return absl::InvalidArgumentError("sampling parameters: truncated cached prefix");
  return absl::OkStatus();
}

void EncodeKvBlockTransfers(std::span<const KvBlockTransfer> transfers, WireWriter* w) {
  w->U32(static_cast<uint32_t>(transfers.size()));
  for (const KvBlockTransfer& t : transfers) {
    w->I32(t.page);
    w->I64(t.slot);
    w->U64(t.hash_hi);
    w->U64(t.hash_lo);
  }
}

absl::Status DecodeKvBlockTransfers(WireReader* in, std::vector<KvBlockTransfer>* out) {
  const uint32_t n = in->U32();
  if (!in->ok() || n > in->rest().size() / 28) {
    return absl::InvalidArgumentError("kv block transfers: truncated or oversized list");
  }
  out->resize(n);
  for (KvBlockTransfer& t : *out) {
    t.page = in->I32();
    t.slot = in->I64();
    t.hash_hi = in->U64();
    t.hash_lo = in->U64();
  }
  if (!in->ok()) return absl::InvalidArgumentError("kv block transfers: truncated");
  return absl::OkStatus();
}

void EncodeStateSnapshotSaves(std::span<const StateSnapshotSave> saves, WireWriter* w) {
  w->U32(static_cast<uint32_t>(saves.size()));
  for (const StateSnapshotSave& s : saves) {
    w->I64(s.seq_id);
    w->I64(s.snapshot.slot);
    w->U64(s.snapshot.hash_hi);
    w->U64(s.snapshot.hash_lo);
  }
}

absl::Status DecodeStateSnapshotSaves(WireReader* in, std::vector<StateSnapshotSave>* out) {
  const uint32_t n = in->U32();
  if (!in->ok() || n > in->rest().size() / 32) {
    return absl::InvalidArgumentError("state snapshot saves: truncated or oversized list");
  }
  out->resize(n);
  for (StateSnapshotSave& s : *out) {
    s.seq_id = in->I64();
    s.snapshot.slot = in->I64();
    s.snapshot.hash_hi = in->U64();
    s.snapshot.hash_lo = in->U64();
  }
  if (!in->ok()) return absl::InvalidArgumentError("state snapshot saves: truncated");
  return absl::OkStatus();
}

void EncodeSampledTokens(std::span<const SampledToken> tokens, WireWriter* w) {
  w->U32(static_cast<uint32_t>(tokens.size()));
  for (const SampledToken& t : tokens) {
    w->I32(t.id);
    w->F32(t.logprob);
    w->U8(static_cast<uint8_t>(t.top_logprobs.size()));
    for (const TokenLogprob& top : t.top_logprobs) {
      w->I32(top.id);
      w->F32(top.logprob);
    }
  }
}

absl::Status DecodeSampledTokens(WireReader* in, std::vector<SampledToken>* out) {
  const uint32_t n = in->U32();
  if (!in->ok() || n > kMaxFrameBytes / 9) {
    return absl::InvalidArgumentError("sampled tokens: malformed count");
  }
  out->assign(n, SampledToken{});
  for (uint32_t i = 0; i < n && in->ok(); ++i) {
    SampledToken& t = (*out)[i];
    t.id = in->I32();
    t.logprob = in->F32();
    const uint32_t tops = in->U8();
    if (tops > kMaxTopLogprobsOnWire) {
      return absl::InvalidArgumentError(
          absl::StrCat("sampled tokens: ", tops, " top logprobs (at most 20)"));
    }
    for (uint32_t k = 0; k < tops && in->ok(); ++k) {
      TokenLogprob top;
      top.id = in->I32();
      top.logprob = in->F32();
      t.top_logprobs.push_back(top);
    }
  }
  if (!in->ok()) return absl::InvalidArgumentError("sampled tokens: truncated");
  return absl::OkStatus();
}

void EncodeSampledRuns(std::span<const std::vector<SampledToken>> runs, WireWriter* w) {
  w->U32(static_cast<uint32_t>(runs.size()));
  for (const std::vector<SampledToken>& run : runs) EncodeSampledTokens(run, w);
}

absl::Status DecodeSampledRuns(WireReader* in, std::vector<std::vector<SampledToken>>* out) {
  const uint32_t n = in->U32();
  // Every run takes at least its 4-byte count.
  if (!in->ok() || n > in->rest().size() / 4) {
    return absl::InvalidArgumentError("verified runs: malformed count");
  }
  out->assign(n, {});
  for (std::vector<SampledToken>& run : *out) {
    if (absl::Status s = DecodeSampledTokens(in, &run); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("verified runs: ", s.message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace exl3serve::worker::rank
