#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <chrono>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace exl3serve::kernels::cpu {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins until pred() or `spin_us` elapsed; returns pred()'s last value.
template <typename Pred>
bool SpinFor(int spin_us, Pred pred) {
  if (pred()) return true;
  if (spin_us <= 0) return false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (pred()) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() >= deadline) return pred();
  }
}

}  // namespace

ThreadPool::ThreadPool(int threads, int spin_us)
    : size_(std::max(threads, 1)), spin_us_(std::max(spin_us, 0)) {
  threads_.reserve(static_cast<size_t>(size_ - 1));
  for (int w = 1; w < size_; ++w) threads_.emplace_back([this, w] { WorkerLoop(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_.store(true, std::memory_order_seq_cst);
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::Drain(int worker) {
  for (;;) {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    if (i >= count_) return;
    (*fn_)(i, worker);
  }
}

void ThreadPool::WorkerLoop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    auto ready = [&] {
      return generation_.load(std::memory_order_acquire) != seen ||
             stop_.load(std::memory_order_acquire);
    };
    if (!SpinFor(spin_us_, ready)) {
      std::unique_lock<std::mutex> lock(mu_);
      // seq_cst pairs with the submitter's generation bump then
      // sleeping_workers_ read (Dekker): either it sees us sleeping and
      // notifies under mu_, or we see the new generation here.
      sleeping_workers_.fetch_add(1, std::memory_order_seq_cst);
      wake_.wait(lock, ready);
      sleeping_workers_.fetch_sub(1, std::memory_order_seq_cst);
    }
    if (stop_.load(std::memory_order_acquire)) return;
    seen = generation_.load(std::memory_order_acquire);
    if (static_cast<uint64_t>(worker) > (seen & 0xFFFF)) continue;  // not in this job
    Drain(worker);
    if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1 &&
        submitter_sleeping_.load(std::memory_order_seq_cst)) {
      std::lock_guard<std::mutex> lock(mu_);
      done_.notify_all();
    }
  }
}

void ThreadPool::ParallelFor(int64_t count, int max_threads,
                             const std::function<void(int64_t, int)>& fn) {
  if (count <= 0) return;
  int threads = max_threads <= 0 ? size_ : std::min(max_threads, size_);
  threads = std::min(threads, 0xFFFF);
  if (static_cast<int64_t>(threads) > count) threads = static_cast<int>(count);
  std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
  if (threads <= 1 || !submit.owns_lock()) {
    for (int64_t i = 0; i < count; ++i) fn(i, 0);
    return;
  }
  // Every worker observes every generation (non-participants skip it), and
  // the next job is published only after all participants finished this one,
  // so the job fields below are never read while being written.
  fn_ = &fn;
  count_ = count;
  next_.store(0, std::memory_order_relaxed);
  active_.store(threads - 1, std::memory_order_relaxed);
  const uint64_t job = ((generation_.load(std::memory_order_relaxed) >> 16) + 1) << 16;
  generation_.store(job | static_cast<uint64_t>(threads - 1), std::memory_order_seq_cst);
  if (sleeping_workers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    wake_.notify_all();
  }
  Drain(0);
  auto done = [&] { return active_.load(std::memory_order_acquire) == 0; };
  if (!SpinFor(spin_us_, done)) {
    std::unique_lock<std::mutex> lock(mu_);
    submitter_sleeping_.store(true, std::memory_order_seq_cst);
    done_.wait(lock, done);
    submitter_sleeping_.store(false, std::memory_order_relaxed);
  }
}

namespace {
std::mutex shared_pool_mu;
ThreadPool* shared_pool = nullptr;  // guarded by shared_pool_mu; never deleted
int shared_pool_size = 0;           // guarded by shared_pool_mu; 0 = hardware
}  // namespace

ThreadPool& SharedThreadPool() {
  static ThreadPool* pool = [] {
    std::lock_guard<std::mutex> lock(shared_pool_mu);
    const int threads = shared_pool_size > 0
                            ? shared_pool_size
                            : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    shared_pool = new ThreadPool(threads);
    return shared_pool;
  }();
  return *pool;
}

bool SetSharedThreadPoolSize(int threads) {
  std::lock_guard<std::mutex> lock(shared_pool_mu);
  if (shared_pool != nullptr || threads < 1) return false;
  shared_pool_size = threads;
  return true;
}

}  // namespace exl3serve::kernels::cpu
