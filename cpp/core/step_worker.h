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
//
// Between jobs the worker naps: it sleeps kNap at a time (a timed sleep, no spinning), looking
// for the next job after each, for up to kNapWindow after its last one; only then does it block
// until woken. A host that submits while the worker naps makes no system call: waking a thread
// blocked on a condition variable costs the waking thread a futex call, and on a VM the idle
// core's wake-up too, where a nap notices the job within kNap. A decode loop that starts a call
// every few milliseconds at most always finds the worker napping. After a slower host's call (a
// forward of hundreds of milliseconds) the worker naps 5 ms and then blocks. The naps cost the
// worker's core a timed wake-up every kNap while a decode loop runs, and nothing once it blocks.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

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
    bool blocked;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (pending_) throw std::logic_error("step worker: a job is in flight; wait for it first");
      job_ = std::move(job);
      pending_ = true;
      error_ = nullptr;
      blocked = blocked_;
    }
    if (blocked) wake_.notify_all();  // napping, it finds the job itself
  }

  // Blocks until the job submitted last has finished (returns at once if none is in flight);
  // rethrows its exception.
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return !pending_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  // Naps (kNap at a time) while no job came and its last one ended less than kNapWindow ago.
  void nap(std::unique_lock<std::mutex>& lock, std::chrono::steady_clock::time_point last_done) {
    while (!stop_ && !pending_ && std::chrono::steady_clock::now() - last_done < kNapWindow) {
      lock.unlock();
      std::this_thread::sleep_for(kNap);
      lock.lock();
    }
  }

  void loop() {
#if defined(__linux__)
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);  // naps of kNap, not kNap + the default 50 us slack
#endif
    std::unique_lock<std::mutex> lock(mutex_);
    auto last_done = std::chrono::steady_clock::now() - kNapWindow;  // none yet: block at once
    for (;;) {
      nap(lock, last_done);
      blocked_ = true;
      wake_.wait(lock, [this] { return stop_ || (pending_ && job_); });
      blocked_ = false;
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
      last_done = std::chrono::steady_clock::now();
      done_.notify_all();
    }
  }

  static constexpr std::chrono::microseconds kNap{100};
  static constexpr std::chrono::milliseconds kNapWindow{5};

  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::function<void()> job_;
  bool pending_ = false, stop_ = false;
  bool blocked_ = false;  // the worker waits on wake_: a submit must notify it
  std::exception_ptr error_;
  std::thread thread_;  // last: it starts once the members it reads are built
};

}  // namespace vtoken
