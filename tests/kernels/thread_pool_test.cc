// kernels/cpu/thread_pool.h: coverage of every index exactly once, worker ids,
// the thread cap, nested and concurrent calls, and the blocking wake-up path.
#include "kernels/cpu/thread_pool.h"

#include <atomic>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace exl3serve::kernels::cpu {
namespace {

TEST(ThreadPoolTest, RunsEveryIndexExactlyOnce) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.ParallelFor(1000, 0, [&](int64_t i, int) { hits[i].fetch_add(1); });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}

TEST(ThreadPoolTest, WorkerIdsStayBelowTheThreadCap) {
  ThreadPool pool(4);
  for (int cap : {1, 2, 3, 4, 0}) {
    std::atomic<int> max_worker{0};
    pool.ParallelFor(256, cap, [&](int64_t, int worker) {
      int prev = max_worker.load();
      while (worker > prev && !max_worker.compare_exchange_weak(prev, worker)) {
      }
    });
    EXPECT_LT(max_worker.load(), cap <= 0 ? 4 : cap) << "cap " << cap;
  }
}

TEST(ThreadPoolTest, NestedCallRunsInlineWithoutDeadlock) {
  ThreadPool pool(3);
  std::atomic<int> inner{0};
  pool.ParallelFor(8, 0, [&](int64_t, int) {
    pool.ParallelFor(5, 0, [&](int64_t, int worker) {
      EXPECT_EQ(worker, 0);  // inline on the calling thread
      inner.fetch_add(1);
    });
  });
  EXPECT_EQ(inner.load(), 40);
}

TEST(ThreadPoolTest, ConcurrentCallersBothComplete) {
  ThreadPool pool(2);
  std::atomic<int64_t> sum{0};
  auto caller = [&] {
    for (int rep = 0; rep < 200; ++rep) {
      pool.ParallelFor(64, 0, [&](int64_t i, int) { sum.fetch_add(i); });
    }
  };
  std::thread a(caller), b(caller);
  a.join();
  b.join();
  EXPECT_EQ(sum.load(), 2 * 200 * (63 * 64 / 2));
}

TEST(ThreadPoolTest, BlockingWakeupNeverLosesAJob) {
  // spin_us = 0: every wait goes through the condition variables.
  ThreadPool pool(3, /*spin_us=*/0);
  for (int rep = 0; rep < 2000; ++rep) {
    std::atomic<int> count{0};
    pool.ParallelFor(3 + rep % 5, 0, [&](int64_t, int) { count.fetch_add(1); });
    ASSERT_EQ(count.load(), 3 + rep % 5) << "rep " << rep;
  }
}

TEST(ThreadPoolTest, SingleThreadPoolRunsInline) {
  ThreadPool pool(1);
  const std::thread::id self = std::this_thread::get_id();
  pool.ParallelFor(10, 0, [&](int64_t, int worker) {
    EXPECT_EQ(worker, 0);
    EXPECT_EQ(std::this_thread::get_id(), self);
  });
}

TEST(ThreadPoolTest, SharedPoolIsProcessWide) {
  EXPECT_EQ(&SharedThreadPool(), &SharedThreadPool());
  EXPECT_GE(SharedThreadPool().size(), 1);
}

}  // namespace
}  // namespace exl3serve::kernels::cpu
