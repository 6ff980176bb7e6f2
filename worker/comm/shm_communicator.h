// worker/comm/shm_communicator.h — the `shm` backend: CPU ranks on one box
// meet in one POSIX shared-memory segment and run every collective of
// worker/comm/communicator.h through it, with no locks and no helper thread.
//
//   ShmOptions options;
//   options.name = "/exl3-<uuid>";  options.rank = r;  options.world_size = n;
//   options.join_deadline = Deadline(absl::Seconds(30));
//   EXL3_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, CreateShmCommunicator(options));
//   EXL3_RETURN_IF_ERROR(comm->AllReduce(buf, count, CommDataType::kF32, Deadline(absl::Seconds(5))));
//
// Joining: rank 0 creates the segment (it must not exist yet), the others
// open it once rank 0 has initialised it; every rank registers its pid and
// waits for all the others. Once all have joined, rank 0 removes the name
// (the memory lives on while mapped), so a later crash leaks nothing. Rank 0
// also removes it when it gives up on the join; a rank that had not opened
// the segment by then fails at its own join_deadline. If rank 0 dies before
// either, a parent removes the name with UnlinkShmSegment.
//
// Algorithms (the protocol, its invariants and memory-ordering table are at
// the top of shm_communicator.cc): AllReduce is one-shot (every rank sums all
// staged inputs) up to one_shot_max_bytes and two-shot (reduce-scatter, then
// all-gather) above; messages larger than a staging slot go in chunks of
// slot_bytes. Sums run in rank order with worker/comm/reduce_sum.h, so all
// ranks get bit-identical results whichever algorithm and ISA ran.
//
// Waiting: a rank spins `spin_iterations` polls, yields `yield_iterations`
// times, then sleeps on a futex in the segment that the awaited peer rings
// (the peer makes the system call only when someone sleeps); every
// `poll_interval` it checks
// its deadline, the group's `broken` word and whether the ranks it waits for
// still live (pidfds taken at join). A dead peer fails the call with
// Unavailable "rank R (pid P) exited"; the rank then marks the group broken
// and every other rank fails promptly with Aborted (communicator.h).
//
// Limits: world_size <= 64; all ranks run as one user (the segment is
// created 0600) in one pid namespace (liveness uses pids). Thread safety: as Communicator (one caller thread; Abort and health
// from any thread). Ownership: the communicator owns its mapping and pidfds;
// it borrows the caller's buffers only during a call.
#ifndef EXL3SERVE_WORKER_COMM_SHM_COMMUNICATOR_H_
#define EXL3SERVE_WORKER_COMM_SHM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"

namespace exl3serve::worker::comm {

// Defaults measured with tests/bench/allreduce_bench.sh on the 2-core CI box
// (docs/BENCHMARKS.md, "All-reduce on one box", N = 2, 3, 4).
//
// one_shot_max_bytes = kShmAutoOneShot: ShmAutoOneShotMaxBytes(world_size)
// (capped at slot_bytes). One-shot moves (N-1)·size bytes between cores per
// rank, two-shot 2·(N-1)/N·size plus a second barrier: two-shot ties at
// 128 KiB for N = 2 and at 256 KiB for N = 3; for N = 4 (on 2 cores) it is
// 10-20 % faster at 32-64 KiB on a quiet box, 20-35 % slower under load.
inline constexpr size_t kShmAutoOneShot = ~size_t{0};
inline size_t ShmAutoOneShotMaxBytes(int world_size) {
  return world_size <= 3 ? size_t{128} << 10 : size_t{64} << 10;
}
// Per rank and per buffer (two buffers per rank, see slot_bytes). Chunks of
// 256 KiB stay in the 2 MiB L2 across the phases of a round; 128 KiB to
// 1 MiB measured within noise of it, 4 MiB 10-30 % slower.
inline constexpr size_t kShmDefaultSlotBytes = 256 << 10;
// spin_iterations = kShmAutoSpin: kShmSpinWhenCoresSuffice busy polls (one
// PAUSE each, ~10 ns on the CI box) when the process may use at least
// world_size CPUs, none when ranks outnumber cores (a spinning rank then
// holds the core its peer needs: with 4 ranks on 2 cores, 1-64 KiB took
// 3.5-10x longer with 2000 polls than with 0).
inline constexpr int kShmAutoSpin = -1;
inline constexpr int kShmSpinWhenCoresSuffice = 1000;
// sched_yield() polls after the spin; 20 to 1000 measured alike, 0 (straight
// to the futex) 3.5-10x slower at 1-64 KiB with 4 ranks on 2 cores.
inline constexpr int kShmDefaultYieldIterations = 100;
inline constexpr int kShmMaxWorldSize = 64;

struct ShmOptions {
  // --- behaviour
  // POSIX shared-memory name, "/" followed by up to 200 characters without
  // "/" (e.g. "/exl3-<uuid>"); unique per group. Required.
  std::string name;
  int rank = 0;
  int world_size = 1;
  // Every rank must have joined by this time (each rank waits until then for
  // the others; rank 0 removes the segment when it gives up). Required: the
  // default has already passed.
  absl::Time join_deadline = absl::InfinitePast();

  // --- performance (rank 0's values apply to the whole group; the other
  // ranks take slot_bytes and one_shot_max_bytes from the segment header)
  // AllReduce messages up to this size use one-shot, larger ones two-shot.
  // Must be <= slot_bytes (or kShmAutoOneShot: measured, by world size).
  size_t one_shot_max_bytes = kShmAutoOneShot;
  // Staging bytes per rank and per buffer. Each rank has two buffers (even
  // and odd rounds), so the segment holds 2 · world_size · slot_bytes plus
  // a few KiB of flags. Larger messages go through in chunks of this size.
  // Rounded up to 4 KiB; at least 64 KiB.
  size_t slot_bytes = kShmDefaultSlotBytes;
  // How often a sleeping rank wakes to check its deadline, the broken word
  // and its peers' liveness; also the most a call can overrun its deadline.
  absl::Duration poll_interval = absl::Milliseconds(1);
  // Busy polls before a waiting rank yields, then sleeps. More lowers
  // latency when every rank has a core; less frees the core for a peer when
  // ranks outnumber cores. 0: none; kShmAutoSpin: chosen from the CPU count.
  int spin_iterations = kShmAutoSpin;
  // Then this many sched_yield() polls before sleeping: cheap hand-offs when
  // ranks outnumber cores (the peer being waited for gets the core at once,
  // and no futex wake-up is needed). 0: none.
  int yield_iterations = kShmDefaultYieldIterations;

  // --- tests only
  // Called with 0 once this rank has registered at join, then with the
  // epoch after it has published its arrival in each round (a test kills the
  // process here to die mid-join or mid-collective).
  std::function<void(uint64_t epoch)> round_hook_for_testing;
};

// Joins the group `options.name` as options.rank.
// Errors: InvalidArgument for bad options (named) or a rank that joined
// twice; AlreadyExists (rank 0) when the name exists — a stale group, remove
// it with UnlinkShmSegment; DeadlineExceeded when the segment or some ranks
// did not appear by join_deadline (names them); Unavailable when a rank that
// had joined exited; Aborted when another rank gave up on the join;
// Internal for a failed system call (named, with errno text).
// Cost: blocks until every rank has joined.
absl::StatusOr<std::unique_ptr<Communicator>> CreateShmCommunicator(const ShmOptions& options);

// Removes the name of segment `name` if it still exists (a parent cleaning up
// after a group that never finished joining). Harmless when it is gone.
void UnlinkShmSegment(const std::string& name);

}  // namespace exl3serve::worker::comm

#endif  // EXL3SERVE_WORKER_COMM_SHM_COMMUNICATOR_H_
