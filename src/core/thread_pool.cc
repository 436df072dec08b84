#include "epmoe/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace epmoe {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { WorkerLoop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int)>* task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      task = task_;
    }
    (*task)(index);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) work_done_.notify_one();
    }
  }
}

void ThreadPool::RunOnAll(const std::function<void(int)>& body) {
  if (workers_.empty()) {
    body(0);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &body;
    pending_ = static_cast<int>(workers_.size());
    ++generation_;
  }
  work_ready_.notify_all();
  body(0);
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return pending_ == 0; });
  task_ = nullptr;
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    body(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  RunOnAll([&](int) {
    while (true) {
      const int64_t begin = next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      body(begin, std::min(n, begin + grain));
    }
  });
}

}  // namespace epmoe
