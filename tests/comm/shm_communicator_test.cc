// The shm backend with real processes: each test forks one child per rank
// (world sizes 2, 3 and 4), every child joins the same fresh segment, runs
// its part and reports through a pipe (a fixed-size record: pass/fail,
// status code, elapsed time, a hash of its results); the parent waits with a
// hard bound, kills the children if it passes, and compares the reports.
// Children never use gtest macros (their failures would stay in the child).
//
// Synchronisation is by the collectives themselves, by pipes and by process
// exit; nothing sleeps. Inputs come from gtest's random seed (printed on
// failure) and are regenerated in every child, so each child can check its
// own results against references computed from all ranks' inputs.
#include "worker/comm/shm_communicator.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

// The parent's bound on one whole group (a hang fails the test, never the CI).
constexpr absl::Duration kGroupTimeout = absl::Seconds(120);
// Deadline of calls that are expected to succeed.
constexpr absl::Duration kCallTimeout = absl::Seconds(30);
// How late a failing call may return after its deadline: the poll interval
// (1 ms) plus scheduling delay on a loaded 2-core box with 4 ranks.
constexpr absl::Duration kDeadlineSlack = absl::Milliseconds(300);
// How fast peers must notice a dead or aborting rank (they wait on a 30 s
// deadline): a few poll intervals plus scheduling delay.
constexpr absl::Duration kFailFast = absl::Seconds(3);

// Small slots make every chunking path run on small inputs: one-shot up to
// 8 KiB, chunks of 64 KiB (fp32: 2048 and 16384 elements).
constexpr size_t kSmallOneShotBytes = 8 << 10;
constexpr size_t kSmallSlotBytes = 64 << 10;

// ------------------------------------------------------------ child reports

struct RankReport {
  int32_t rank = -1;
  int32_t passed = 0;       // 1: every check in the child held
  int32_t status_code = 0;  // absl::StatusCode of the call under test, if any
  int32_t reported = 0;     // 1 once written
  int64_t elapsed_us = 0;   // duration of the call under test, if any
  uint64_t hash = 0;        // FNV-1a over the child's results
  char message[600] = {};   // first failed check, or the status message
};
static_assert(sizeof(RankReport) < PIPE_BUF, "one atomic write per report");

// What a child's body uses: its rank, checks and the report.
class Child {
 public:
  Child(int rank, int world_size, std::string name, int done_read_fd, int done_write_fd)
      : rank_(rank), world_size_(world_size), name_(std::move(name)),
        done_read_fd_(done_read_fd), done_write_fd_(done_write_fd) {
    report_.rank = rank;
    report_.passed = 1;
  }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const std::string& name() const { return name_; }
  RankReport& report() { return report_; }

  // Records the first failed check.
  bool Check(bool ok, const std::string& what) {
    if (!ok && report_.passed) {
      report_.passed = 0;
      SetMessage(what);
    }
    return ok;
  }
  void SetMessage(const std::string& text) {
    std::snprintf(report_.message, sizeof(report_.message), "%s", text.c_str());
  }
  void RecordStatus(const absl::Status& status, absl::Duration elapsed) {
    report_.status_code = static_cast<int32_t>(status.code());
    report_.elapsed_us = absl::ToInt64Microseconds(elapsed);
    if (report_.passed) SetMessage(std::string(status.message()));
  }
  void Hash(const void* data, size_t bytes) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; ++i) {
      hash_ ^= p[i];
      hash_ *= 1099511628211ull;
    }
    report_.hash = hash_;
  }

  // Blocks until every other child has exited: each child holds a copy of
  // the write end of one pipe (nobody writes), so the read end sees EOF once
  // all copies but this one, closed here, are gone. Used by a rank that must
  // stay alive but idle; the parent's bound still applies.
  void WaitUntilOthersExited() {
    close(done_write_fd_);
    char byte;
    while (read(done_read_fd_, &byte, 1) > 0 || errno == EINTR) {
    }
  }

  ShmOptions Options() const {
    ShmOptions o;
    o.name = name_;
    o.rank = rank_;
    o.world_size = world_size_;
    o.join_deadline = absl::Now() + kCallTimeout;
    return o;
  }
  ShmOptions SmallOptions() const {
    ShmOptions o = Options();
    o.one_shot_max_bytes = kSmallOneShotBytes;
    o.slot_bytes = kSmallSlotBytes;
    return o;
  }

  // Joins, or records the failure and returns null.
  std::unique_ptr<Communicator> Join(const ShmOptions& options) {
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateShmCommunicator(options);
    if (!Check(comm.ok(), absl::StrCat("join: ", comm.status().ToString()))) return nullptr;
    return std::move(comm).value();
  }

 private:
  const int rank_;
  const int world_size_;
  const std::string name_;
  const int done_read_fd_;
  const int done_write_fd_;
  RankReport report_;
  uint64_t hash_ = 1469598103934665603ull;
};

struct GroupResult {
  std::vector<RankReport> reports;  // by rank; reported == 0 if none came
  std::vector<int> wait_status;     // waitpid status by rank
  bool timed_out = false;
  bool segment_left_behind = false;  // the name still existed when all had exited
  std::string name;
};

bool SegmentExists(const std::string& name) {
  const int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) {
    close(fd);
    return true;
  }
  return false;
}

std::string UniqueName() {
  static std::atomic<int> counter{0};
  std::random_device entropy;
  return absl::StrCat("/exl3-test-", getpid(), "-", counter.fetch_add(1), "-", entropy());
}

// Forks `world_size` children running body(child) and waits for all of them
// (at most kGroupTimeout; then they are killed). The segment name is removed
// afterwards whatever happened.
GroupResult RunGroup(int world_size, const std::function<void(Child&)>& body) {
  GroupResult result;
  result.name = UniqueName();
  result.reports.resize(world_size);
  result.wait_status.assign(world_size, 0);
  int report_pipe[2];
  int done_pipe[2];
  if (pipe2(report_pipe, O_CLOEXEC) != 0 || pipe2(done_pipe, O_CLOEXEC) != 0) {
    ADD_FAILURE() << "pipe: " << std::strerror(errno);
    return result;
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < world_size; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      close(report_pipe[0]);
      Child child(r, world_size, result.name, done_pipe[0], done_pipe[1]);
      body(child);
      child.report().reported = 1;
      const ssize_t wrote = write(report_pipe[1], &child.report(), sizeof(RankReport));
      _exit(wrote == static_cast<ssize_t>(sizeof(RankReport)) ? 0 : 3);
    }
    if (pid < 0) {
      ADD_FAILURE() << "fork: " << std::strerror(errno);
      break;
    }
    pids.push_back(pid);
  }
  close(done_pipe[1]);  // only the children's copies keep it open
  close(report_pipe[1]);

  std::vector<int> pidfds;
  for (pid_t pid : pids) pidfds.push_back(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  const absl::Time deadline = absl::Now() + kGroupTimeout;
  std::vector<bool> exited(pids.size(), false);
  size_t left = pids.size();
  while (left > 0) {
    std::vector<pollfd> fds;
    std::vector<size_t> which;
    for (size_t i = 0; i < pids.size(); ++i) {
      if (!exited[i]) {
        fds.push_back(pollfd{pidfds[i], POLLIN, 0});
        which.push_back(i);
      }
    }
    const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (ms <= 0) {
      result.timed_out = true;
      break;
    }
    if (poll(fds.data(), fds.size(), static_cast<int>(std::min<int64_t>(ms, 1000))) < 0 &&
        errno != EINTR) {
      break;
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      if (fds[k].revents == 0) continue;
      const size_t i = which[k];
      int status = 0;
      if (waitpid(pids[i], &status, 0) == pids[i]) {
        result.wait_status[i] = status;
        exited[i] = true;
        --left;
      }
    }
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    if (!exited[i]) {
      kill(pids[i], SIGKILL);
      int status = 0;
      waitpid(pids[i], &status, 0);
      result.wait_status[i] = status;
    }
    if (pidfds[i] >= 0) close(pidfds[i]);
  }
  RankReport report;
  while (read(report_pipe[0], &report, sizeof(report)) == static_cast<ssize_t>(sizeof(report))) {
    if (report.rank >= 0 && report.rank < world_size) result.reports[report.rank] = report;
  }
  close(report_pipe[0]);
  close(done_pipe[0]);
  result.segment_left_behind = SegmentExists(result.name);
  UnlinkShmSegment(result.name);
  EXPECT_FALSE(result.timed_out) << "group " << result.name << " did not finish within "
                                 << kGroupTimeout << "; children killed";
  return result;
}

// Every rank reported, passed, exited 0; all hashes equal (bit-identical).
void ExpectAllPassedWithEqualHashes(const GroupResult& g) {
  for (size_t r = 0; r < g.reports.size(); ++r) {
    const RankReport& rep = g.reports[r];
    EXPECT_TRUE(WIFEXITED(g.wait_status[r]) && WEXITSTATUS(g.wait_status[r]) == 0)
        << "rank " << r << " wait status " << g.wait_status[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r << " sent no report";
    EXPECT_EQ(rep.passed, 1) << "rank " << r << ": " << rep.message;
    EXPECT_EQ(rep.hash, g.reports[0].hash) << "rank " << r << " results differ from rank 0's";
  }
}

// ------------------------------------------------------------ inputs and references

uint64_t Seed() { return ::testing::UnitTest::GetInstance()->random_seed(); }

std::mt19937_64 Rng(uint64_t salt, int rank, size_t size) {
  return std::mt19937_64(Seed() * 1000003u + salt * 7919u + rank * 104729u + size);
}

std::vector<float> F32Input(uint64_t salt, int rank, size_t count) {
  std::mt19937_64 rng = Rng(salt, rank, count);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> v(count);
  for (float& x : v) x = std::ldexp(unit(rng), exponent(rng));
  return v;
}

uint16_t ToBF16(float f) {  // inputs are finite; truncation is enough to make bf16 values
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return static_cast<uint16_t>(b >> 16);
}

float FromBF16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// Round to nearest even, written independently of the library (finite values).
uint16_t RoundBF16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  const uint32_t low = b & 0xffffu;
  uint32_t high = b >> 16;
  if (low > 0x8000u || (low == 0x8000u && (high & 1))) ++high;
  return static_cast<uint16_t>(high);
}

std::vector<uint16_t> BF16Input(uint64_t salt, int rank, size_t count) {
  std::vector<float> f = F32Input(salt, rank, count);
  std::vector<uint16_t> h(count);
  for (size_t i = 0; i < count; ++i) h[i] = ToBF16(f[i]);
  return h;
}

// All ranks' inputs -> the contract's result (fp32 rank order; bf16: fp32
// rank order, rounded once) and the float64 sum with a bound on |error|.
struct Reference {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  std::vector<double> exact;
  std::vector<double> bound;
};

Reference AllReduceReference(CommDataType type, uint64_t salt, int world, size_t count) {
  Reference ref;
  std::vector<float> acc(count, 0.0f);
  ref.exact.assign(count, 0.0);
  ref.bound.assign(count, 0.0);
  for (int r = 0; r < world; ++r) {
    std::vector<float> in(count);
    if (type == CommDataType::kF32) {
      in = F32Input(salt, r, count);
    } else {
      std::vector<uint16_t> h = BF16Input(salt, r, count);
      for (size_t i = 0; i < count; ++i) in[i] = FromBF16(h[i]);
    }
    for (size_t i = 0; i < count; ++i) {
      acc[i] = r == 0 ? in[i] : acc[i] + in[i];
      ref.exact[i] += in[i];
      ref.bound[i] += std::fabs(in[i]);
    }
  }
  for (size_t i = 0; i < count; ++i) {
    // fp32 rank-order sum: at most (world - 1) roundings of 2^-24 relative to Σ|x|.
    ref.bound[i] *= world * std::ldexp(1.0, -24);
  }
  if (type == CommDataType::kF32) {
    ref.f32 = std::move(acc);
  } else {
    ref.bf16.resize(count);
    for (size_t i = 0; i < count; ++i) {
      ref.bf16[i] = RoundBF16(acc[i]);
      ref.bound[i] += std::fabs(ref.exact[i]) * std::ldexp(1.0, -8);  // the final rounding
    }
  }
  return ref;
}

// Runs AllReduce on this rank's input and checks it: bit-exact against the
// rank-order reference, within bounds of the float64 sum. Hashes the result.
void CheckAllReduce(Child& c, Communicator& comm, CommDataType type, size_t count, uint64_t salt) {
  const Reference ref = AllReduceReference(type, salt, c.world_size(), count);
  const std::string what = absl::StrCat("all_reduce ", CommDataTypeName(type), " count ", count,
                                        " world ", c.world_size(), " rank ", c.rank(), " seed ",
                                        Seed());
  if (type == CommDataType::kF32) {
    std::vector<float> buf = F32Input(salt, c.rank(), count);
    absl::Status s = comm.AllReduce(buf.data(), count, type, Deadline(kCallTimeout));
    if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
    for (size_t i = 0; i < count; ++i) {
      if (!c.Check(std::memcmp(&buf[i], &ref.f32[i], 4) == 0,
                   absl::StrCat(what, ": element ", i, " is ", buf[i], ", rank-order sum is ",
                                ref.f32[i])) ||
          !c.Check(std::fabs(buf[i] - ref.exact[i]) <= ref.bound[i],
                   absl::StrCat(what, ": element ", i, " is ", buf[i], ", float64 sum ",
                                ref.exact[i]))) {
        return;
      }
    }
    c.Hash(buf.data(), count * 4);
  } else {
    std::vector<uint16_t> buf = BF16Input(salt, c.rank(), count);
    absl::Status s = comm.AllReduce(buf.data(), count, type, Deadline(kCallTimeout));
    if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
    for (size_t i = 0; i < count; ++i) {
      if (!c.Check(buf[i] == ref.bf16[i],
                   absl::StrCat(what, ": element ", i, " is 0x", absl::Hex(buf[i]),
                                ", rank-order sum rounds to 0x", absl::Hex(ref.bf16[i]))) ||
          !c.Check(std::fabs(FromBF16(buf[i]) - ref.exact[i]) <= ref.bound[i],
                   absl::StrCat(what, ": element ", i, " is ", FromBF16(buf[i]),
                                ", float64 sum ", ref.exact[i]))) {
        return;
      }
    }
    c.Hash(buf.data(), count * 2);
  }
}

std::vector<unsigned char> Bytes(uint64_t salt, int rank, size_t n) {
  std::mt19937_64 rng = Rng(salt, rank, n);
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

class ShmCommunicatorTest : public ::testing::TestWithParam<int> {
 protected:
  int World() const { return GetParam(); }
};

// ------------------------------------------------------------ correctness

TEST_P(ShmCommunicatorTest, AllReduceMatchesRankOrderAndFloat64References) {
  // Around the one-shot threshold (2048 fp32 / 4096 bf16 elements), around
  // the chunk size (16384 / 32768) and well past it.
  const std::vector<size_t> counts = {1,     7,     1023,  2047,  2048,  2049,  4095,
                                      4096,  4097,  16383, 16384, 16385, 32769, 100003};
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    uint64_t salt = 0;
    for (CommDataType type : {CommDataType::kF32, CommDataType::kBF16}) {
      for (size_t count : counts) CheckAllReduce(c, *comm, type, count, ++salt);
    }
    c.Check(comm->health().ok(), "health after success: " + comm->health().ToString());
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, AllReduceOfThreeMiBPlusFiveWithDefaultOptions) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    // 3 MiB + 20 bytes (fp32) and 3 MiB + 10 bytes (bf16): twelve default
    // 256 KiB chunks and a partial one.
    CheckAllReduce(c, *comm, CommDataType::kF32, (3u << 20) / 4 + 5, 1);
    CheckAllReduce(c, *comm, CommDataType::kBF16, (3u << 20) / 2 + 5, 2);
    CheckAllReduce(c, *comm, CommDataType::kF32, 5000, 3);  // one-shot after two-shot
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, AllGatherConcatenatesInRankOrderAlsoInPlace) {
  const std::vector<size_t> sizes = {1, 7, 1023, kSmallSlotBytes - 1, kSmallSlotBytes + 1,
                                     (3u << 20) + 5};
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    const int n = c.world_size();
    for (size_t bytes : sizes) {
      for (bool in_place : {false, true}) {
        std::vector<unsigned char> want;
        for (int r = 0; r < n; ++r) {
          std::vector<unsigned char> part = Bytes(bytes, r, bytes);
          want.insert(want.end(), part.begin(), part.end());
        }
        std::vector<unsigned char> mine = Bytes(bytes, c.rank(), bytes);
        std::vector<unsigned char> recv(n * bytes, 0xee);
        const void* send = mine.data();
        if (in_place) {
          std::memcpy(recv.data() + c.rank() * bytes, mine.data(), bytes);
          send = recv.data() + c.rank() * bytes;
        }
        absl::Status s = comm->AllGather(send, bytes, recv.data(), Deadline(kCallTimeout));
        const std::string what =
            absl::StrCat("all_gather bytes ", bytes, in_place ? " in place" : "", " rank ", c.rank());
        if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
        if (!c.Check(recv == want, what + ": wrong bytes")) return;
        c.Hash(recv.data(), recv.size());
      }
    }
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, AllGatherVWithUnevenSizesIncludingZeros) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    const int n = c.world_size();
    const std::vector<std::vector<size_t>> patterns = {
        {0, 5, 70001, 1}, {3, 0, 0, 0}, {0, 0, 0, 0}, {kSmallSlotBytes, 1, 0, 2 * kSmallSlotBytes + 9}};
    for (const auto& pattern : patterns) {
      std::vector<size_t> sizes(pattern.begin(), pattern.begin() + n);
      std::vector<unsigned char> want;
      for (int r = 0; r < n; ++r) {
        std::vector<unsigned char> part = Bytes(sizes[0] + 17, r, sizes[r]);
        want.insert(want.end(), part.begin(), part.end());
      }
      std::vector<unsigned char> mine = Bytes(sizes[0] + 17, c.rank(), sizes[c.rank()]);
      std::vector<unsigned char> recv(want.size() + 1, 0xee);
      absl::Status s = comm->AllGatherV(mine.data(), sizes, recv.data(), Deadline(kCallTimeout));
      const std::string what = absl::StrCat("all_gather_v rank ", c.rank(), " sizes[0] ", sizes[0]);
      if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
      if (!c.Check(std::equal(want.begin(), want.end(), recv.begin()) && recv.back() == 0xee,
                   what + ": wrong bytes")) {
        return;
      }
      c.Hash(recv.data(), want.size());
    }
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, ReduceScatterSumsEachBlockInRankOrder) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    const int n = c.world_size();
    uint64_t salt = 500;
    for (CommDataType type : {CommDataType::kF32, CommDataType::kBF16}) {
      for (size_t count : {size_t{1}, size_t{7}, size_t{1023}, size_t{5000}, size_t{70001}}) {
        ++salt;
        // Each rank's input is the concatenation of n blocks of `count`;
        // the reference is an all-reduce of n·count elements, block rank.
        const Reference ref = AllReduceReference(type, salt, n, n * count);
        const size_t esize = CommDataTypeSize(type);
        std::vector<unsigned char> in(n * count * esize), out(count * esize + 1, 0xee);
        if (type == CommDataType::kF32) {
          std::vector<float> v = F32Input(salt, c.rank(), n * count);
          std::memcpy(in.data(), v.data(), in.size());
        } else {
          std::vector<uint16_t> v = BF16Input(salt, c.rank(), n * count);
          std::memcpy(in.data(), v.data(), in.size());
        }
        std::vector<unsigned char> in_place = in;
        absl::Status s = comm->ReduceScatter(in.data(), count, type, out.data(), Deadline(kCallTimeout));
        const std::string what = absl::StrCat("reduce_scatter ", CommDataTypeName(type), " count ",
                                              count, " rank ", c.rank(), " seed ", Seed());
        if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
        const void* want = type == CommDataType::kF32
                               ? static_cast<const void*>(ref.f32.data() + c.rank() * count)
                               : static_cast<const void*>(ref.bf16.data() + c.rank() * count);
        if (!c.Check(std::memcmp(out.data(), want, count * esize) == 0 && out.back() == 0xee,
                     what + ": differs from the rank-order reference")) {
          return;
        }
        // In place: recv = data + rank·count.
        unsigned char* mine = in_place.data() + c.rank() * count * esize;
        s = comm->ReduceScatter(in_place.data(), count, type, mine, Deadline(kCallTimeout));
        if (!c.Check(s.ok(), what + " in place: " + s.ToString())) return;
        if (!c.Check(std::memcmp(mine, want, count * esize) == 0,
                     what + " in place: differs from the rank-order reference")) {
          return;
        }
        // Every rank hashes the whole reduced vector so hashes must agree:
        // gather the blocks.
        std::vector<unsigned char> all(n * count * esize);
        s = comm->AllGather(out.data(), count * esize, all.data(), Deadline(kCallTimeout));
        if (!c.Check(s.ok(), what + ": gather: " + s.ToString())) return;
        c.Hash(all.data(), all.size());
      }
    }
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, AllToAllVWithUnevenSizesIncludingZeros) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    const int n = c.world_size();
    // bytes from src to dst, in three patterns: small with zeros, one big
    // pair (several rounds), everything zero.
    auto size = [](int pattern, int src, int dst) -> size_t {
      switch (pattern) {
        case 0:
          return (src + 2 * dst) % 3 == 0 ? 0 : static_cast<size_t>(1 + src * 7 + dst * 13);
        case 1:
          return src == 1 && dst == 0 ? 3 * kSmallSlotBytes + 11 : static_cast<size_t>(src == dst ? 5 : dst);
        default:
          return 0;
      }
    };
    for (int pattern = 0; pattern < 3; ++pattern) {
      std::vector<size_t> send_bytes(n), recv_bytes(n);
      std::vector<unsigned char> send, want;
      for (int p = 0; p < n; ++p) {
        send_bytes[p] = size(pattern, c.rank(), p);
        recv_bytes[p] = size(pattern, p, c.rank());
        std::vector<unsigned char> out_part = Bytes(pattern * 64 + p, c.rank(), send_bytes[p]);
        send.insert(send.end(), out_part.begin(), out_part.end());
        std::vector<unsigned char> in_part = Bytes(pattern * 64 + c.rank(), p, recv_bytes[p]);
        want.insert(want.end(), in_part.begin(), in_part.end());
      }
      std::vector<unsigned char> recv(want.size() + 1, 0xee);
      absl::Status s = comm->AllToAllV(send.data(), send_bytes, recv.data(), recv_bytes,
                                       Deadline(kCallTimeout));
      const std::string what = absl::StrCat("all_to_all_v pattern ", pattern, " rank ", c.rank());
      if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
      if (!c.Check(std::equal(want.begin(), want.end(), recv.begin()) && recv.back() == 0xee,
                   what + ": wrong bytes")) {
        return;
      }
    }
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, BroadcastFromEveryRoot) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.SmallOptions());
    if (!comm) return;
    for (int root = 0; root < c.world_size(); ++root) {
      for (size_t bytes : {size_t{1}, size_t{7}, 2 * kSmallSlotBytes + 3}) {
        std::vector<unsigned char> want = Bytes(bytes + 3, root, bytes);
        std::vector<unsigned char> buf =
            c.rank() == root ? want : std::vector<unsigned char>(bytes, 0xee);
        absl::Status s = comm->Broadcast(buf.data(), bytes, root, Deadline(kCallTimeout));
        const std::string what = absl::StrCat("broadcast root ", root, " bytes ", bytes);
        if (!c.Check(s.ok(), what + ": " + s.ToString())) return;
        if (!c.Check(buf == want, what + ": wrong bytes")) return;
        c.Hash(buf.data(), bytes);
      }
    }
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, ManyConsecutiveCallsReuseTheSlotsSafely) {
  // Values change every call, so a rank reading a slot its owner already
  // overwrote (or not yet wrote) would see the wrong sum. Spinning is off for
  // half the ranks so they sleep on the futex and fall behind.
  GroupResult g = RunGroup(World(), [&](Child& c) {
    ShmOptions options = c.SmallOptions();
    if (c.rank() % 2 == 1) options.spin_iterations = 0;
    std::unique_ptr<Communicator> comm = c.Join(options);
    if (!comm) return;
    const int n = c.world_size();
    const size_t small = 7;
    const size_t large = 3000;  // two-shot (12 KB > 8 KB)
    std::vector<float> buf(large);
    for (int i = 0; i < 1500; ++i) {
      const size_t count = i % 3 == 2 ? large : small;
      for (size_t k = 0; k < count; ++k) buf[k] = static_cast<float>(i * 8 + c.rank() + k % 5);
      absl::Status s = comm->AllReduce(buf.data(), count, CommDataType::kF32, Deadline(kCallTimeout));
      if (!c.Check(s.ok(), absl::StrCat("call ", i, ": ", s.ToString()))) return;
      for (size_t k = 0; k < count; ++k) {
        const float want = static_cast<float>(n * (i * 8 + k % 5) + n * (n - 1) / 2);
        if (!c.Check(buf[k] == want, absl::StrCat("call ", i, " element ", k, ": got ", buf[k],
                                                   ", want ", want))) {
          return;
        }
      }
      if (i % 10 == 0) {
        s = comm->Barrier(Deadline(kCallTimeout));
        if (!c.Check(s.ok(), absl::StrCat("barrier ", i, ": ", s.ToString()))) return;
      }
      if (i % 7 == 0) {
        int32_t mine = i * 100 + c.rank();
        std::vector<int32_t> all(n);
        s = comm->AllGather(&mine, sizeof(mine), all.data(), Deadline(kCallTimeout));
        if (!c.Check(s.ok(), absl::StrCat("gather ", i, ": ", s.ToString()))) return;
        for (int r = 0; r < n; ++r) {
          if (!c.Check(all[r] == i * 100 + r, absl::StrCat("gather ", i, " rank ", r))) return;
        }
      }
    }
    c.Hash(buf.data(), large * sizeof(float));
  });
  ExpectAllPassedWithEqualHashes(g);
}

TEST_P(ShmCommunicatorTest, SegmentNameIsRemovedOnceAllJoined) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    // Rank 0 removes the name before its Create returns; after a barrier
    // every rank knows rank 0 got that far.
    absl::Status s = comm->Barrier(Deadline(kCallTimeout));
    if (!c.Check(s.ok(), "barrier: " + s.ToString())) return;
    c.Check(!SegmentExists(c.name()), "the segment name still exists after the join");
    c.Check(comm->backend_name() == "shm" && comm->rank() == c.rank() &&
                comm->world_size() == c.world_size(),
            "identity");
  });
  ExpectAllPassedWithEqualHashes(g);
  EXPECT_FALSE(g.segment_left_behind);
}

TEST_P(ShmCommunicatorTest, MismatchedCallsFailWithInvalidArgument) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    std::vector<float> buf(11, 1.0f);
    const size_t count = c.rank() == 0 ? 10 : 11;
    const absl::Time start = absl::Now();
    absl::Status s = comm->AllReduce(buf.data(), count, CommDataType::kF32, Deadline(kCallTimeout));
    c.RecordStatus(s, absl::Now() - start);
    c.Check(s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kAborted,
            "mismatch: " + s.ToString());
    c.Check(!comm->health().ok(), "health stays broken");
  });
  bool some_invalid = false;
  for (const RankReport& r : g.reports) {
    EXPECT_EQ(r.passed, 1) << r.message;
    EXPECT_LT(absl::Microseconds(r.elapsed_us), kFailFast);
    if (r.status_code == static_cast<int>(absl::StatusCode::kInvalidArgument)) {
      some_invalid = true;
      EXPECT_THAT(std::string(r.message), HasSubstr("collective mismatch"));
    }
  }
  EXPECT_TRUE(some_invalid);
}

// ------------------------------------------------------------ failures

TEST_P(ShmCommunicatorTest, DeadlinePassesWhenOneRankNeverCalls) {
  const absl::Duration timeout = absl::Milliseconds(500);
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    const int idle = c.world_size() - 1;
    if (c.rank() == idle) {
      c.WaitUntilOthersExited();
      absl::Status h = comm->health();
      c.Check(h.code() == absl::StatusCode::kAborted, "idle rank's health: " + h.ToString());
      absl::Status s = comm->Barrier(Deadline(kCallTimeout));
      c.Check(s.code() == absl::StatusCode::kAborted, "idle rank's next call: " + s.ToString());
      return;
    }
    std::vector<float> buf(100, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status s = comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, start + timeout);
    c.RecordStatus(s, absl::Now() - start);
    // Broken for good: the next call fails at once.
    absl::Status next = comm->Barrier(Deadline(kCallTimeout));
    c.Check(next.code() == absl::StatusCode::kAborted, "next call: " + next.ToString());
  });
  int deadline_exceeded = 0;
  for (int r = 0; r + 1 < World(); ++r) {
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    EXPECT_EQ(rep.passed, 1) << "rank " << r << ": " << rep.message;
    const auto code = static_cast<absl::StatusCode>(rep.status_code);
    EXPECT_THAT(code, AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted))
        << rep.message;
    EXPECT_LE(absl::Microseconds(rep.elapsed_us), timeout + kDeadlineSlack) << "rank " << r;
    if (code == absl::StatusCode::kDeadlineExceeded) {
      ++deadline_exceeded;
      EXPECT_GE(absl::Microseconds(rep.elapsed_us), timeout) << "rank " << r;
      EXPECT_THAT(std::string(rep.message),
                  HasSubstr(absl::StrCat("not heard from ranks ", World() - 1)));
    }
  }
  EXPECT_GE(deadline_exceeded, 1);
  EXPECT_EQ(g.reports[World() - 1].passed, 1) << g.reports[World() - 1].message;
}

TEST_P(ShmCommunicatorTest, PeerKilledBeforeTheCallFailsTheOthersFast) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    // Everyone has joined once the barrier is through; then rank 1 dies.
    absl::Status joined = comm->Barrier(Deadline(kCallTimeout));
    if (!c.Check(joined.ok(), "barrier: " + joined.ToString())) return;
    if (c.rank() == 1) raise(SIGKILL);
    std::vector<float> buf(1000, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status s =
        comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
    c.RecordStatus(s, absl::Now() - start);
  });
  ASSERT_TRUE(WIFSIGNALED(g.wait_status[1]) && WTERMSIG(g.wait_status[1]) == SIGKILL);
  int unavailable = 0;
  for (int r = 0; r < World(); ++r) {
    if (r == 1) continue;
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    const auto code = static_cast<absl::StatusCode>(rep.status_code);
    EXPECT_THAT(code, AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
        << rep.message;
    EXPECT_LT(absl::Microseconds(rep.elapsed_us), kFailFast) << "rank " << r;
    if (code == absl::StatusCode::kUnavailable) {
      ++unavailable;
      EXPECT_THAT(std::string(rep.message), HasSubstr("rank 1 (pid "));
      EXPECT_THAT(std::string(rep.message), HasSubstr("exited"));
    }
  }
  EXPECT_GE(unavailable, 1);
}

TEST_P(ShmCommunicatorTest, PeerKilledInTheMiddleOfAChunkedAllReduceFailsTheOthersFast) {
  GroupResult g = RunGroup(World(), [&](Child& c) {
    ShmOptions options = c.SmallOptions();
    const int victim = c.world_size() - 1;
    if (c.rank() == victim) {
      // Dies right after publishing its arrival in the third round: the
      // others have its data but will wait for its reduced block forever.
      options.round_hook_for_testing = [](uint64_t epoch) {
        if (epoch == 3) raise(SIGKILL);
      };
    }
    std::unique_ptr<Communicator> comm = c.Join(options);
    if (!comm) return;
    std::vector<float> buf(10 * kSmallSlotBytes / 4, 1.0f);  // 10 two-shot rounds
    const absl::Time start = absl::Now();
    absl::Status s =
        comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
    c.RecordStatus(s, absl::Now() - start);
  });
  const int victim = World() - 1;
  ASSERT_TRUE(WIFSIGNALED(g.wait_status[victim]) && WTERMSIG(g.wait_status[victim]) == SIGKILL);
  for (int r = 0; r < victim; ++r) {
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    EXPECT_THAT(static_cast<absl::StatusCode>(rep.status_code),
                AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted))
        << rep.message;
    EXPECT_LT(absl::Microseconds(rep.elapsed_us), kFailFast) << "rank " << r;
    EXPECT_THAT(std::string(rep.message), HasSubstr(absl::StrCat("rank ", victim, " (pid ")));
  }
}

TEST_P(ShmCommunicatorTest, AbortOnOneRankFailsTheOthersWithTheReason) {
  // The last rank never calls, so the all-reduce cannot complete before the
  // abort; rank 0 aborts from a second thread while (or before) its own
  // thread waits in the call.
  GroupResult g = RunGroup(World(), [&](Child& c) {
    std::unique_ptr<Communicator> comm = c.Join(c.Options());
    if (!comm) return;
    const int idle = c.world_size() - 1;
    if (c.rank() == idle) {
      c.WaitUntilOthersExited();
      absl::Status h = comm->health();
      c.RecordStatus(h, absl::ZeroDuration());
      c.Check(h.code() == absl::StatusCode::kAborted, "idle rank's health: " + h.ToString());
      return;
    }
    std::vector<float> buf(1000, 1.0f);
    const absl::Time start = absl::Now();
    absl::Status s;
    if (c.rank() == 0) {
      std::thread aborter(
          [&] { comm->Abort(absl::InternalError("kernel exploded on rank zero")); });
      s = comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
      aborter.join();
    } else {
      s = comm->AllReduce(buf.data(), buf.size(), CommDataType::kF32, Deadline(kCallTimeout));
    }
    c.RecordStatus(s, absl::Now() - start);
    c.Check(s.code() == absl::StatusCode::kAborted, "status: " + s.ToString());
    c.Check(!comm->health().ok(), "health stays broken");
  });
  for (int r = 0; r < World(); ++r) {
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    EXPECT_EQ(rep.passed, 1) << "rank " << r << ": " << rep.message;
    EXPECT_LT(absl::Microseconds(rep.elapsed_us), kFailFast) << "rank " << r;
    EXPECT_THAT(std::string(rep.message), HasSubstr("communicator broken: rank 0 aborted"));
    EXPECT_THAT(std::string(rep.message), HasSubstr("kernel exploded on rank zero"));
  }
}

TEST_P(ShmCommunicatorTest, JoinTimesOutWhenARankNeverAppears) {
  const absl::Duration timeout = absl::Milliseconds(400);
  GroupResult g = RunGroup(World(), [&](Child& c) {
    if (c.rank() == c.world_size() - 1) {
      c.WaitUntilOthersExited();
      return;
    }
    ShmOptions options = c.Options();
    const absl::Time start = absl::Now();
    options.join_deadline = start + timeout;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateShmCommunicator(options);
    c.RecordStatus(comm.status(), absl::Now() - start);
  });
  for (int r = 0; r + 1 < World(); ++r) {
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    const auto code = static_cast<absl::StatusCode>(rep.status_code);
    EXPECT_THAT(code, AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted))
        << rep.message;
    EXPECT_LE(absl::Microseconds(rep.elapsed_us), timeout + kDeadlineSlack) << "rank " << r;
    if (code == absl::StatusCode::kDeadlineExceeded) {
      EXPECT_THAT(std::string(rep.message),
                  AnyOf(HasSubstr(absl::StrCat("ranks ", World() - 1, " did not join")),
                        HasSubstr("rank 0 did not create")));  // opened after rank 0 gave up
    }
  }
  EXPECT_FALSE(g.segment_left_behind);
}

TEST_P(ShmCommunicatorTest, JoinTimesOutWhenRankZeroNeverCreatesTheSegment) {
  const absl::Duration timeout = absl::Milliseconds(300);
  GroupResult g = RunGroup(World(), [&](Child& c) {
    if (c.rank() == 0) {
      c.WaitUntilOthersExited();
      return;
    }
    ShmOptions options = c.Options();
    const absl::Time start = absl::Now();
    options.join_deadline = start + timeout;
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateShmCommunicator(options);
    c.RecordStatus(comm.status(), absl::Now() - start);
  });
  for (int r = 1; r < World(); ++r) {
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    EXPECT_EQ(static_cast<absl::StatusCode>(rep.status_code), absl::StatusCode::kDeadlineExceeded)
        << rep.message;
    EXPECT_THAT(std::string(rep.message), HasSubstr("rank 0 did not create"));
    EXPECT_LE(absl::Microseconds(rep.elapsed_us), timeout + kDeadlineSlack) << "rank " << r;
  }
}

TEST_P(ShmCommunicatorTest, RankDyingDuringJoinFailsTheOthersFast) {
  if (World() < 3) GTEST_SKIP() << "needs a rank that dies and one that never comes";
  GroupResult g = RunGroup(World(), [&](Child& c) {
    const int late = c.world_size() - 1;
    if (c.rank() == late) {  // never joins, so the join cannot complete
      c.WaitUntilOthersExited();
      return;
    }
    ShmOptions options = c.Options();
    // A rank that only opens the segment after rank 0 gave up (and removed
    // the name) can only fail at its own join deadline.
    options.join_deadline = absl::Now() + absl::Seconds(3);
    if (c.rank() == 1) {
      options.round_hook_for_testing = [](uint64_t epoch) {
        if (epoch == 0) raise(SIGKILL);  // right after registering its pid
      };
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateShmCommunicator(options);
    c.RecordStatus(comm.status(), absl::Now() - start);
    const absl::StatusCode code = comm.status().code();
    c.Check(code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kAborted ||
                (c.rank() != 0 && code == absl::StatusCode::kDeadlineExceeded),
            "join: " + comm.status().ToString());
  });
  ASSERT_TRUE(WIFSIGNALED(g.wait_status[1]) && WTERMSIG(g.wait_status[1]) == SIGKILL);
  for (int r = 0; r < World() - 1; ++r) {
    if (r == 1) continue;
    const RankReport& rep = g.reports[r];
    ASSERT_EQ(rep.reported, 1) << "rank " << r;
    EXPECT_EQ(rep.passed, 1) << rep.message;
    if (r == 0) {  // rank 0 created the segment, so it sees rank 1 register and die
      EXPECT_LT(absl::Microseconds(rep.elapsed_us), kFailFast) << rep.message;
    }
  }
  EXPECT_FALSE(g.segment_left_behind);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, ShmCommunicatorTest, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("world", info.param);
                         });

// ------------------------------------------------------------ in-process

TEST(ShmCommunicatorSingleRankTest, EveryCollectiveWorksAlone) {
  ShmOptions options;
  options.name = UniqueName();
  options.join_deadline = Deadline(kCallTimeout);
  absl::StatusOr<std::unique_ptr<Communicator>> comm = CreateShmCommunicator(options);
  ASSERT_TRUE(comm.ok()) << comm.status();
  Communicator& c = **comm;
  EXPECT_FALSE(SegmentExists(options.name));
  std::vector<float> v = {1.5f, -2.0f, 3.25f};
  ASSERT_TRUE(c.AllReduce(v.data(), v.size(), CommDataType::kF32, Deadline(kCallTimeout)).ok());
  EXPECT_EQ(v, (std::vector<float>{1.5f, -2.0f, 3.25f}));
  std::vector<float> out(3);
  ASSERT_TRUE(c.ReduceScatter(v.data(), 3, CommDataType::kF32, out.data(), Deadline(kCallTimeout)).ok());
  EXPECT_EQ(out, v);
  std::vector<char> gathered(4);
  ASSERT_TRUE(c.AllGather("abcd", 4, gathered.data(), Deadline(kCallTimeout)).ok());
  EXPECT_EQ(std::string(gathered.begin(), gathered.end()), "abcd");
  const size_t sizes[] = {3};
  ASSERT_TRUE(c.AllToAllV("xyz", sizes, gathered.data(), sizes, Deadline(kCallTimeout)).ok());
  EXPECT_EQ(std::string(gathered.begin(), gathered.begin() + 3), "xyz");
  EXPECT_TRUE(c.Broadcast(v.data(), 12, 0, Deadline(kCallTimeout)).ok());
  EXPECT_TRUE(c.Barrier(Deadline(kCallTimeout)).ok());
  EXPECT_TRUE(c.health().ok());
  c.Abort(absl::CancelledError("shutting down"));
  EXPECT_EQ(c.Barrier(Deadline(kCallTimeout)).code(), absl::StatusCode::kAborted);
  EXPECT_THAT(std::string(c.health().message()), HasSubstr("shutting down"));
}

TEST(ShmCommunicatorOptionsTest, BadOptionsAreRejectedWithTheirName) {
  ShmOptions o;
  o.join_deadline = Deadline(kCallTimeout);
  o.name = "no-slash";
  EXPECT_THAT(std::string(CreateShmCommunicator(o).status().message()), HasSubstr("segment name"));
  o.name = UniqueName();
  o.world_size = 2;
  o.rank = 2;
  EXPECT_THAT(std::string(CreateShmCommunicator(o).status().message()), HasSubstr("rank must be"));
  o.rank = 0;
  o.slot_bytes = 1024;
  EXPECT_THAT(std::string(CreateShmCommunicator(o).status().message()), HasSubstr("slot_bytes"));
  o.slot_bytes = 1 << 20;
  o.one_shot_max_bytes = 2 << 20;
  EXPECT_THAT(std::string(CreateShmCommunicator(o).status().message()),
              HasSubstr("one_shot_max_bytes"));
  EXPECT_FALSE(SegmentExists(o.name));
}

TEST(ShmCommunicatorOptionsTest, AnExistingNameIsAlreadyExistsAndUnlinkRemovesIt) {
  const std::string name = UniqueName();
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  close(fd);
  ShmOptions o;
  o.name = name;
  o.join_deadline = Deadline(kCallTimeout);
  absl::Status s = CreateShmCommunicator(o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("UnlinkShmSegment"));
  EXPECT_TRUE(SegmentExists(name));
  UnlinkShmSegment(name);
  EXPECT_FALSE(SegmentExists(name));
  UnlinkShmSegment(name);  // harmless when gone
}

}  // namespace
}  // namespace exl3serve::worker::comm
