// mlxserve: a small persistent thread pool for the attention kernel.
//
// parallel_for hands out task indices one at a time from an atomic counter, and
// the calling thread works too, so a worker the OS preempts delays the end of a
// call by at most the task it holds. The thread count is set from Python,
// following the OpenBLAS thread policy (mlx_backend/cpu/blas_threads.py): on a
// machine whose CPUs other processes keep busy, fewer threads finish sooner.

#pragma once

#include <atomic>
#include <cstdint>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace mlxserve {

class ThreadPool {
 public:
  using TaskFn = void (*)(void* ctx, int index);

  static ThreadPool& instance();

  // Threads a parallel_for may use, the caller included (at least 1).
  void set_threads(int n);
  int threads() const;

  // Runs fn(ctx, i) for every i in [0, n) and returns when all have run.
  // A second caller while one call runs (another MLX stream) runs inline.
  void parallel_for(int n, TaskFn fn, void* ctx);

  ~ThreadPool();

 private:
  struct Job {
    TaskFn fn;
    void* ctx;
    int n;
    int max_workers;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    int users{0};  // workers holding the job pointer, guarded by mutex_
  };

  ThreadPool();
  void worker(int index);
  static void drain(Job& job);

  std::atomic<int> threads_;
  std::mutex run_;  // one parallel_for at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable finished_;
  std::vector<std::thread> workers_;
  Job* job_{nullptr};
  unsigned generation_{0};
  bool stop_{false};
};

// Runs fn(i) for every i in [0, n): on the calling thread when n is 1, else on
// the pool (fn must outlive the call, which it does: the call waits for all).
template <typename Fn>
void parallel_blocks(int64_t n, const Fn& fn) {
  if (n == 1) {
    fn(0);
  } else if (n > 1) {
    ThreadPool::instance().parallel_for(
        static_cast<int>(n),
        [](void* ctx, int i) { (*static_cast<const Fn*>(ctx))(i); },
        const_cast<Fn*>(&fn));
  }
}

}  // namespace mlxserve
