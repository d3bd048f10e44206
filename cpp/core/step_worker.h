// SPDX-License-Identifier: Apache-2.0
// One background thread that runs one job at a time for a host thread: the host submits the
// step's native work, goes on with its own (sampling the batch it just ran), and waits for the job
// before it touches anything the job touches (the token table, the batch layout).
//
//     host thread    submit(job) ── sampling, outputs ─────────── wait() ── results
//     worker                    └── job(): decide, table step ──┘ (done)
//
// The worker never touches Python objects; the binding keeps the job's buffers alive and waits
// with the GIL released. A job's exception is rethrown by wait(), on the host's thread.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

namespace vtoken {

class StepWorker {
 public:
  StepWorker() : thread_([this] { loop(); }) {}
  StepWorker(const StepWorker&) = delete;
  StepWorker& operator=(const StepWorker&) = delete;

  ~StepWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();  // a job in flight finishes first
  }

  // Runs `job` on the worker. std::logic_error if a job is in flight (wait() for it first).
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (pending_) throw std::logic_error("step worker: a job is in flight; wait for it first");
      job_ = std::move(job);
      pending_ = true;
      error_ = nullptr;
    }
    wake_.notify_all();
  }

  // Blocks until the job submitted last has finished (returns at once if none is in flight);
  // rethrows its exception.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return !pending_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [this] { return stop_ || (pending_ && job_); });
      if (!job_) return;  // stopping, nothing submitted
      std::function<void()> job = std::exchange(job_, nullptr);
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      error_ = error;
      pending_ = false;
      done_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::function<void()> job_;
  bool pending_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: it starts once the members it reads are built
};

}  // namespace vtoken
