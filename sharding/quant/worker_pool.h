// sharding/quant/worker_pool.h — a small fixed-size thread pool for the
// quantizer's data-parallel loops (tiles of a strip, rows of a Cholesky step).
//
//   WorkerPool pool(8);                          // threads live until ~WorkerPool
//   pool.ParallelFor(n, [&](int64_t i, int worker) { ... });   // blocks until done
//
// `worker` (0..size()-1) identifies the executing thread so callers can keep
// per-thread scratch (TileWorkspace) in a vector indexed by it.
// Thread safety: ParallelFor must not be called concurrently or re-entrantly.
// Ownership: owns its threads; the destructor joins them.
#ifndef EXL3SERVE_SHARDING_QUANT_WORKER_POOL_H_
#define EXL3SERVE_SHARDING_QUANT_WORKER_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace exl3serve::sharding::quant {

class WorkerPool {
 public:
  // `threads` <= 1 runs everything on the calling thread.
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  int size() const { return size_; }

  // Runs fn(i, worker) for i in [0, count), indices handed out dynamically.
  void ParallelFor(int64_t count, const std::function<void(int64_t, int)>& fn);

 private:
  void WorkerLoop(int worker);
  void Drain(int worker);

  const int size_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  // Guarded by mu_.
  uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
  // Set before a generation starts; read by workers of that generation.
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t count_ = 0;
  std::atomic<int64_t> next_{0};
};

}  // namespace exl3serve::sharding::quant

#endif  // EXL3SERVE_SHARDING_QUANT_WORKER_POOL_H_
