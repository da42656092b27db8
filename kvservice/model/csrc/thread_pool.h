// A persistent thread pool for the decode kernels' parallel loops.
//
// Why not at::parallel_for (OpenMP): a server runs its engine step in a thread of its own
// (the event loop holds the main thread), and libgomp gave a parallel region started from
// such a thread about 50-70 us more than one started from the main thread (a SmolLM2 decode
// step: ~150 regions, 17.6 ms from the main thread, 28.5 ms from another). These workers are
// created once and wait for work by spinning briefly, then sleeping on a condition variable.
//
// parallel_for(n, grain, fn) calls fn(begin, end) over [0, n) in chunks of at least `grain`,
// on up to at::get_num_threads() threads, the calling one included, and returns when all
// chunks are done. One job at a time (a mutex serialises callers); not reentrant from fn.
//
// parallel_for_balanced(n, fn) calls fn(task, next, first) for every task in [0, n): each
// thread takes its own contiguous range front to back, then the tasks the others have not
// started from their ranges' backs. So a thread whose range runs slower (its memory, or its
// core taken a moment) hands its last tasks over. `next` is the task this thread takes next if
// no other thread takes it first (-1: none left in the range: what it computes next is
// unknown), `first` the first task of the range the task came from: fn can prefetch for them.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KVSERVICE_CPU_RELAX() _mm_pause()
#else
#define KVSERVICE_CPU_RELAX() std::this_thread::yield()
#endif

namespace kvservice {

class ThreadPool {
 public:
  static ThreadPool& instance() {
    static ThreadPool* pool = new ThreadPool();  // never destroyed: workers may outlive static destructors
    return *pool;
  }

  void parallel_for_balanced(int64_t n, const std::function<void(int64_t, int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    const int64_t ranges = std::min<int64_t>(std::max<int64_t>(1, at::get_num_threads()), std::min<int64_t>(n, kMaxRanges));
    // Front (low 32 bits) and back (high 32 bits) of each range, each taken by compare-and-swap;
    // a cache line each, or every take by one thread would steal the line from the other.
    struct alignas(64) Bounds {
      std::atomic<uint64_t> value;
    };
    std::array<Bounds, kMaxRanges> bounds;
    std::array<int64_t, kMaxRanges> firsts{};
    for (int64_t r = 0; r < ranges; ++r) {
      firsts[r] = n * r / ranges;
      bounds[r].value.store(static_cast<uint64_t>(firsts[r]) | static_cast<uint64_t>(n * (r + 1) / ranges) << 32,
                            std::memory_order_relaxed);
    }
    parallel_for(ranges, 1, [&](int64_t begin, int64_t end) {
      for (int64_t own = begin; own < end; ++own) {
        for (int64_t task, next; take(bounds[own].value, true, task, next);) fn(task, next, firsts[own]);
      }
      for (int64_t other = 0; other < ranges; ++other) {
        for (int64_t task, next; take(bounds[other].value, false, task, next);) fn(task, next, firsts[other]);
      }
    });
  }

  void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    if (n <= 0) return;
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t chunks = std::min<int64_t>(threads, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    if (chunks <= 1) {
      fn(0, n);
      return;
    }
    std::lock_guard<std::mutex> one_job(job_mutex_);
    ensure_workers(chunks - 1);
    Job job{&fn, n, chunks};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    run_chunks(job);
    while (job.done.load(std::memory_order_acquire) < chunks) KVSERVICE_CPU_RELAX();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = nullptr;  // no worker joins it from now on
    }
    while (job.active.load(std::memory_order_acquire) > 0) KVSERVICE_CPU_RELAX();
  }

 private:
  static constexpr int64_t kMaxRanges = 64;

  // The next task of a range packed as front | back << 32: its front (or its back, for a thief),
  // and the one after it from the same end (-1 if none); false once the range is empty.
  static bool take(std::atomic<uint64_t>& range, bool front, int64_t& task, int64_t& next) {
    uint64_t bounds = range.load(std::memory_order_acquire);
    while (true) {
      const uint64_t lo = bounds & 0xffffffffu, hi = bounds >> 32;
      if (lo >= hi) return false;
      const uint64_t updated = front ? (lo + 1) | hi << 32 : lo | (hi - 1) << 32;
      if (range.compare_exchange_weak(bounds, updated, std::memory_order_acq_rel, std::memory_order_acquire)) {
        task = static_cast<int64_t>(front ? lo : hi - 1);
        next = hi - lo < 2 ? -1 : static_cast<int64_t>(front ? lo + 1 : hi - 2);
        return true;
      }
    }
  }

  struct Job {
    const std::function<void(int64_t, int64_t)>* fn;
    int64_t n;
    int64_t chunks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<int64_t> active{0};
  };

  static void run_chunks(Job& job) {
    for (int64_t c = job.next.fetch_add(1); c < job.chunks; c = job.next.fetch_add(1)) {
      const int64_t begin = job.n * c / job.chunks, end = job.n * (c + 1) / job.chunks;
      (*job.fn)(begin, end);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void ensure_workers(int64_t count) {
    while (static_cast<int64_t>(workers_.size()) < count) {
      workers_.emplace_back([this] { work(); });
#if defined(__linux__)
      // Named by its creator, so the name is there when the job that started it ends: per-thread
      // tools (top -H, perf, scripts/sched_trace.py) see it even for a worker that has not run yet.
      pthread_setname_np(workers_.back().native_handle(), "kvs-pool");
#endif
    }
  }

  void work() {
    uint64_t seen = generation_.load(std::memory_order_acquire);
    while (true) {
      // Spin for a while (a decode step's jobs come microseconds apart), then sleep.
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(100);
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        KVSERVICE_CPU_RELAX();
        if (++spins % 64 == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        if (job != nullptr) job->active.fetch_add(1, std::memory_order_acq_rel);
      }
      if (job == nullptr) continue;  // that job had already ended
      run_chunks(*job);
      job->active.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex job_mutex_;  // one caller's job at a time
  std::mutex mutex_;      // guards job_ and the sleepers' wake-up
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  Job* job_ = nullptr;
  std::vector<std::thread> workers_;
};

inline void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  ThreadPool::instance().parallel_for(n, grain, fn);
}

inline void parallel_for_balanced(int64_t n, const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  ThreadPool::instance().parallel_for_balanced(n, fn);
}

}  // namespace kvservice
