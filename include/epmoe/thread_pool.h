// ThreadPool: a fixed set of worker threads for data-parallel loops.
//
// ParallelFor is called from one thread at a time (the pool is not reentrant: do not call it from
// inside a task); tasks run on the workers and on the calling thread. With threads = 1 everything
// runs inline on the caller. While the pool has no more threads than the process may run on
// (UsableCores), its threads poll for up to 0.1 ms before they sleep (a worker for the next task,
// the caller for the workers to finish), so that back-to-back loops do not pay a thread wake-up
// each.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace epmoe {

// The CPUs this process may run on (its affinity mask, which mpirun's binding narrows), by number;
// empty when the mask cannot be read.
std::vector<int> UsableCpus();
// How many there are; the machine's count when the mask cannot be read; at least 1.
int UsableCores();

class ThreadPool {
 public:
  // threads <= 0 means UsableCores(): the cores of this process's affinity mask.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs body(begin, end) over [0, n) in chunks of `grain` items handed out dynamically, so uneven
  // work (experts with different row counts) still spreads over all threads. Returns when all
  // chunks are done.
  void ParallelFor(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

  // Runs body(thread_index) once on each of the size() threads.
  void RunOnAll(const std::function<void(int)>& body);

  // While set, the calling thread of ParallelFor runs `between` after each chunk it takes (chunk
  // by chunk even when it runs the loop alone), e.g. to drive a transport's progress while it
  // computes. Set and cleared between loops; nullptr clears it.
  void set_between_chunks(std::function<void()> between) { between_ = std::move(between); }
  // Called by a loop on thread `thread` after each chunk: runs the hook on the calling thread (0).
  void ChunkDone(int thread) const {
    if (thread == 0 && between_) between_();
  }

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::atomic<const std::function<void(int)>*> task_{nullptr};  // set under mutex_, read without it
  std::atomic<uint64_t> generation_{0};             // changed under mutex_, polled without it
  std::atomic<int> pending_{0};                     // workers still running the task
  bool stopping_ = false;                           // under mutex_
  bool poll_ = false;                               // threads <= cores
  std::function<void()> between_;                   // see set_between_chunks
};

// pool->ParallelFor(n, grain, body) when a pool is given, else body(0, n) on the calling thread:
// for the functions whose pool is optional.
void ParallelFor(ThreadPool* pool, int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

}  // namespace epmoe
