// worker/rank/control_wire.h — the frames a local driver (local_group.h) and
// its rank processes (rank_server.h) exchange over a socketpair: a 4-byte
// little-endian length, then the payload, built and parsed with WireWriter /
// WireReader (little-endian integers, length-prefixed strings and arrays).
//
// This is the single-box control channel of `exl3serve generate --tp N`; the
// coordinator's gRPC protocol (proto/) replaces it across boxes. Versioned:
// the first frame a rank sends carries kControlWireVersion and the driver
// refuses a mismatch.
#ifndef EXL3SERVE_WORKER_RANK_CONTROL_WIRE_H_
#define EXL3SERVE_WORKER_RANK_CONTROL_WIRE_H_

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/api/step_executor.h"
#include "worker/model/vocab_sampler.h"

namespace exl3serve::worker::rank {

// 2: forwards carry the pages the driver assigned; the hello reports the KV layout.
// 3: sequences that sample on the ranks (kAddSampledSequence, kForwardSampled).
// 4: prefix cache (cached prefix, KV disk tier).
// 5: speculative verification (kForwardVerified).
// 6: allowed-token masks (structured output) in sampled and verified forwards.
// 7: recurrent-state snapshots (kSaveStateSnapshots, the sampling's cached state).
inline constexpr uint32_t kControlWireVersion = 7;
// Frames larger than this are refused (a corrupt length must not allocate).
inline constexpr uint32_t kMaxFrameBytes = 1u << 30;

enum class ControlOp : uint8_t {
  kAddSequence = 1,     // i64 seq_id
  kRemoveSequence = 2,  // i64 seq_id
  kForward = 3,         // u8 rows (0 last token, 1 all), u32 n,
                        // n x {i64 seq, i32[] tokens, i32[] newly assigned pages}
  kShutdown = 4,        // no payload; the rank replies OK and exits 0
  kAddSampledSequence = 5,  // i64 seq_id, then EncodeSequenceSampling
  kForwardSampled = 6,      // u32 n, n x {i64 seq, i32[] tokens, i32[] pages, u8 sample,
                            // u32[] allowed-token mask rows};
                            // rank 0 replies EncodeSampledTokens of the n entries
  kSaveKvBlocks = 7,        // EncodeKvBlockTransfers; pages -> disk-tier slots
  kLoadKvBlocks = 8,        // EncodeKvBlockTransfers; rank 0 replies u8[] loaded flags
  kForwardVerified = 9,     // u32 n, n x {i64 seq, i32[] tokens, i32[] pages, u8 sample,
                            // i32 draft count, u32[] allowed-token mask rows}; rank 0 replies EncodeSampledRuns of the n entries
  kSaveStateSnapshots = 10,  // EncodeStateSnapshotSaves; sequences' states -> snapshot slots
};


class WireWriter {
 public:
  void U8(uint8_t v) { Raw(&v, 1); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void I64(int64_t v) { Raw(&v, 8); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void I32(int32_t v) { Raw(&v, 4); }
  void F32(float v) { Raw(&v, 4); }
  void Str(std::string_view s);
  void I32s(const int32_t* v, size_t n);
  void U32s(const uint32_t* v, size_t n);
  void F32s(const float* v, size_t n);
  const std::string& data() const { return buf_; }
  std::string Take() { return std::move(buf_); }

 private:
  void Raw(const void* p, size_t n);
  std::string buf_;  // x86-64 only: host order is little-endian
};

// Reads fields in order; after the first short read every call fails and
// ok() is false, so a caller checks once at the end.
class WireReader {
 public:
  explicit WireReader(std::string_view data) : data_(data) {}
  uint8_t U8();
  uint32_t U32();
  int64_t I64();
  uint64_t U64();
  int32_t I32();
  float F32();
  std::string Str();
  std::vector<int32_t> I32s();
  std::vector<uint32_t> U32s();
  std::vector<float> F32s();
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == data_.size(); }
  // The bytes not read yet.
  std::string_view rest() const { return data_.substr(pos_); }
  // InvalidArgument naming `what` unless every field was read and nothing is left.
  absl::Status Finish(std::string_view what) const;

 private:
  bool Raw(void* p, size_t n);
  std::string_view data_;
  size_t pos_ = 0;
  bool ok_ = true;
};

// Rank-side sampling on the wire (worker/model/vocab_sampler.h): a
// sequence's sampling parameters, and the tokens a sampled forward drew.
// Decoding fails (InvalidArgument naming the field) on truncated input or
// counts beyond the limits (top_logprobs <= 20, logit_bias <= 1<<20 entries).
void EncodeSequenceSampling(const SequenceSampling& sampling, WireWriter* w);
absl::Status DecodeSequenceSampling(WireReader* in, SequenceSampling* out);
void EncodeSampledTokens(std::span<const SampledToken> tokens, WireWriter* w);
absl::Status DecodeSampledTokens(WireReader* in, std::vector<SampledToken>* out);
// The runs of a verified forward (StepExecutor::ForwardVerified): u32 n, then
// n x EncodeSampledTokens. Decoding fails (InvalidArgument) as
// DecodeSampledTokens, or for a count the remaining bytes cannot hold.
void EncodeSampledRuns(std::span<const std::vector<SampledToken>> runs, WireWriter* w);
absl::Status DecodeSampledRuns(WireReader* in, std::vector<std::vector<SampledToken>>* out);

// Writes one frame, all of it, by `deadline`. Errors: Unavailable when the
// peer has gone (EPIPE/ECONNRESET; SIGPIPE is not raised), DeadlineExceeded.
absl::Status WriteFrame(int fd, std::string_view payload, absl::Time deadline);

// Reads one frame by `deadline` (absl::InfiniteFuture() to wait forever).
// Errors: Unavailable on end of file (the peer exited) or a reset,
// DeadlineExceeded, DataLoss for a frame above kMaxFrameBytes.
absl::StatusOr<std::string> ReadFrame(int fd, absl::Time deadline);

// A status as bytes (code + message) and back.
void WriteStatus(WireWriter& w, const absl::Status& status);
absl::Status ReadStatus(WireReader& r);

// KvBlockTransfer lists (u32 n, n x {i32 page, i64 slot, u64 hash_hi, u64 hash_lo}).
void EncodeKvBlockTransfers(std::span<const KvBlockTransfer> transfers, WireWriter* w);
absl::Status DecodeKvBlockTransfers(WireReader* in, std::vector<KvBlockTransfer>* out);

// StateSnapshotSave lists (u32 n, n x {i64 seq, i64 slot, u64 hash_hi, u64 hash_lo}).
void EncodeStateSnapshotSaves(std::span<const StateSnapshotSave> saves, WireWriter* w);
absl::Status DecodeStateSnapshotSaves(WireReader* in, std::vector<StateSnapshotSave>* out);

}  // namespace exl3serve::worker::rank

#endif  // EXL3SERVE_WORKER_RANK_CONTROL_WIRE_H_
