#include "epmoe/thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <chrono>

namespace epmoe {
namespace {

// How long a thread polls before it sleeps: a worker for the next task, the caller for the
// workers to finish. Waking a sleeping thread through the condition variable took 30 - 60 us per
// RunOnAll here (a virtual machine), against 10 - 100 us of work in many of a layer step's phases
// (quantizing rows, decode with few experts), and the phases of a step follow each other within
// microseconds. Polling longer only burns a core that may have other work.
constexpr auto kPollFor = std::chrono::microseconds(100);

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls `done` for up to kPollFor; whether it came true.
template <class Done>
bool PollBriefly(const Done& done) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      CpuRelax();
    }
    if (std::chrono::steady_clock::now() - start > kPollFor) return done();
  }
}

}  // namespace

std::vector<int> UsableCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  return cpus;
}

int UsableCores() {
  const std::vector<int> cpus = UsableCpus();
  if (!cpus.empty()) return static_cast<int>(cpus.size());
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

ThreadPool::ThreadPool(int threads) {
  // All the cores this process may run on: under mpirun's --bind-to socket or a container's cpuset,
  // hardware_concurrency() counts the whole machine, and a rank would run more threads than cores.
  if (threads <= 0) threads = UsableCores();
  // Polling only helps while every thread has a core of its own.
  poll_ = threads <= UsableCores();
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
    // A worker that sees the next task while polling takes it without the mutex: with many
    // workers, each taking the mutex in turn queued them behind one another at every task.
    if (!poll_ || !PollBriefly([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_ready_.wait(lock, [&] { return stopping_ || generation_.load(std::memory_order_relaxed) != seen; });
      if (stopping_) return;
    }
    seen = generation_.load(std::memory_order_acquire);
    // The caller publishes task_ before the generation and changes it only after every worker has
    // finished this one.
    (*task_.load(std::memory_order_relaxed))(index);
    // The caller may be polling pending_ rather than waiting on work_done_: count down first,
    // then notify under the mutex, so that a caller that checked pending_ under it is woken.
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      work_done_.notify_one();
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
    task_.store(&body, std::memory_order_relaxed);
    pending_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_ready_.notify_all();
  body(0);
  auto all_done = [&] { return pending_.load(std::memory_order_acquire) == 0; };
  if (!poll_ || !PollBriefly(all_done)) {
    std::unique_lock<std::mutex> lock(mutex_);
    work_done_.wait(lock, all_done);
  }
}

void ThreadPool::ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(1, grain);
  if (workers_.empty() || n <= grain) {
    if (!between_) {
      body(0, n);
      return;
    }
    for (int64_t begin = 0; begin < n; begin += grain) {
      body(begin, std::min(n, begin + grain));
      ChunkDone(0);
    }
    return;
  }
  std::atomic<int64_t> next{0};
  RunOnAll([&](int thread) {
    while (true) {
      const int64_t begin = next.fetch_add(grain, std::memory_order_relaxed);
      if (begin >= n) return;
      body(begin, std::min(n, begin + grain));
      ChunkDone(thread);
    }
  });
}

void ParallelFor(ThreadPool* pool, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
  if (pool != nullptr) {
    pool->ParallelFor(n, grain, body);
  } else {
    body(0, n);
  }
}

}  // namespace epmoe
