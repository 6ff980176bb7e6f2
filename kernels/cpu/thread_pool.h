// kernels/cpu/thread_pool.h — the process-wide pool of CPU worker threads
// that data-parallel kernels (TrellisGemm, later norms/attention) share, so no
// call ever creates a thread.
//
//   ThreadPool& pool = SharedThreadPool();
//   pool.ParallelFor(blocks, /*max_threads=*/0, [&](int64_t i, int worker) { ... });
//
// Scheduling: indices are handed out dynamically (an atomic counter), so a
// kernel that wants results independent of the thread count must make the
// work of index i independent of which thread runs it (TrellisGemm: one
// 128-column output block per index). The calling thread always takes part.
//
// Waiting: an idle worker spins for `spin_us` microseconds (cheap wake-up for
// back-to-back GEMVs of one decode step), then blocks on a condition variable,
// so several ranks sharing a few cores do not burn them while idle. The
// caller waits for stragglers the same way.
//
// Thread safety: thread-safe. One ParallelFor runs on the pool at a time; a
// call that finds the pool busy (another thread's call, or a nested call from
// inside a task) runs its whole loop on the calling thread instead of
// waiting, so it never deadlocks and results stay the same.
// Ownership: owns its threads; the destructor joins them.
#ifndef EXL3SERVE_KERNELS_CPU_THREAD_POOL_H_
#define EXL3SERVE_KERNELS_CPU_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3serve::kernels::cpu {

class ThreadPool {
 public:
  // Default idle spin before blocking. Long enough to bridge the gap between
  // the linears of one decode step (tens of microseconds), short enough that
  // an idle rank yields its core quickly.
  static constexpr int kDefaultSpinUs = 100;

  // `threads` is the total parallelism including the caller: threads - 1
  // workers are started (threads <= 1: none; everything runs inline).
  explicit ThreadPool(int threads, int spin_us = kDefaultSpinUs);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Total parallelism (workers + the caller).
  int size() const { return size_; }

  // Runs fn(i, worker) for every i in [0, count) and returns when all are
  // done. `worker` is in [0, used threads) and unique among concurrently
  // running calls of fn, so callers can index per-thread scratch by it
  // (0 is the calling thread). max_threads <= 0 means size(); it is capped at
  // size() and at count. Exceptions must not escape fn.
  void ParallelFor(int64_t count, int max_threads,
                   const std::function<void(int64_t index, int worker)>& fn);

 private:
  void WorkerLoop(int worker);
  void Drain(int worker);

  const int size_;
  const int spin_us_;
  std::vector<std::thread> threads_;

  // Serialises jobs (try_lock: a busy pool means "run inline").
  std::mutex submit_mu_;

  // Job description, written by the submitter before generation_ is bumped
  // (release) and read by workers after they observe it (acquire).
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};

  // (job generation << 16) | number of participating workers: one word, so a
  // worker always reads a generation together with its own participant count.
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> active_{0};          // participating workers not yet done
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> submitter_sleeping_{false};
  std::atomic<bool> stop_{false};

  std::mutex mu_;  // only for the condition variables below
  std::condition_variable wake_;
  std::condition_variable done_;
};

// The process-wide pool, created on first use with the size given to
// SetSharedThreadPoolSize, else std::thread::hardware_concurrency() threads
// (at least 1).
ThreadPool& SharedThreadPool();

// Sets the size of the process-wide pool (e.g. one thread per rank when
// several ranks share a box). Returns false, changing nothing, once the pool
// exists or for threads < 1. Thread-safe.
bool SetSharedThreadPoolSize(int threads);

}  // namespace exl3serve::kernels::cpu

#endif  // EXL3SERVE_KERNELS_CPU_THREAD_POOL_H_
