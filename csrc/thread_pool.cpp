// mlxserve: the attention kernel's persistent thread pool.

#include "thread_pool.h"

namespace mlxserve {

ThreadPool& ThreadPool::instance() {
  // Leaked on purpose: joining threads from a static destructor at interpreter
  // exit can deadlock; the OS reclaims them.
  static ThreadPool* pool = new ThreadPool();
  return *pool;
}

ThreadPool::ThreadPool() {
  unsigned hw = std::thread::hardware_concurrency();
  threads_.store(hw == 0 ? 1 : static_cast<int>(hw));
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) {
    t.join();
  }
}

void ThreadPool::set_threads(int n) {
  threads_.store(n < 1 ? 1 : n);
}

int ThreadPool::threads() const {
  return threads_.load();
}

void ThreadPool::drain(Job& job) {
  int i;
  while ((i = job.next.fetch_add(1)) < job.n) {
    job.fn(job.ctx, i);
    job.done.fetch_add(1);
  }
}

void ThreadPool::worker(int index) {
  unsigned seen = 0;
  for (;;) {
    Job* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) {
        return;
      }
      seen = generation_;
      job = job_;
      if (job == nullptr || index >= job->max_workers) {
        continue;
      }
      job->users += 1;
    }
    drain(*job);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job->users -= 1;
    }
    finished_.notify_all();
  }
}

void ThreadPool::parallel_for(int n, TaskFn fn, void* ctx) {
  const int workers = (threads_.load() < n ? threads_.load() : n) - 1;
  std::unique_lock<std::mutex> running(run_, std::try_to_lock);
  if (workers <= 0 || !running.owns_lock()) {
    for (int i = 0; i < n; ++i) {
      fn(ctx, i);
    }
    return;
  }
  Job job;
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.max_workers = workers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < workers) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { worker(index); });
    }
    job_ = &job;
    generation_ += 1;
  }
  wake_.notify_all();
  drain(job);
  std::unique_lock<std::mutex> lock(mutex_);
  job_ = nullptr;
  finished_.wait(lock, [&] { return job.done.load() == n && job.users == 0; });
}

}  // namespace mlxserve
