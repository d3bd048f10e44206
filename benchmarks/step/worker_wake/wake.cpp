// What it costs a thread to hand a job to a worker thread that sleeps on a condition variable, as
// the step's worker does (cpp/core/step_worker.h), against one that polls for it. The host thread
// works 1 ms (its own step), submits a 50 us job, works 300 us more (sampling), waits for the job.
//
//   g++ -O2 -pthread wake.cpp -o /tmp/wake && /tmp/wake sleep && /tmp/wake poll
//
// Prints per mode the p10/p50/p90 microseconds of: the submit on the host's thread, the host's
// wait for the finished job, and the latency from the submit to the job's start on the worker.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;

static double us(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

static void work(double microseconds) {
  const Clock::time_point start = Clock::now();
  volatile double x = 0;
  while (us(start, Clock::now()) < microseconds) x = x + 1;
}

static void report(const char* name, std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  std::printf("  %-26s p10 %6.1f  p50 %6.1f  p90 %6.1f\n", name, v[v.size() / 10], v[v.size() / 2],
              v[v.size() * 9 / 10]);
}

int main(int argc, char** argv) {
  const bool poll = argc > 1 && std::strcmp(argv[1], "poll") == 0;
  std::mutex mutex;
  std::condition_variable wake, done;
  bool pending = false, stop = false;
  std::atomic<bool> queued{false};
  std::vector<double> submit, wait, latency;
  Clock::time_point submitted;
  std::thread worker([&] {
    std::unique_lock<std::mutex> lock(mutex);
    for (;;) {
      if (poll) {  // polls 2 ms for the next job (longer than the host's step): never sleeps here
        lock.unlock();
        const Clock::time_point start = Clock::now();
        while (!queued.load(std::memory_order_acquire) && us(start, Clock::now()) < 2000) {
        }
        lock.lock();
      }
      wake.wait(lock, [&] { return pending || stop; });
      if (stop) return;
      latency.push_back(us(submitted, Clock::now()));
      lock.unlock();
      work(50);
      lock.lock();
      pending = false;
      queued.store(false);
      done.notify_all();
    }
  });
  for (int i = 0; i < 400; ++i) {
    work(1000);
    const Clock::time_point a = Clock::now();
    {
      std::lock_guard<std::mutex> guard(mutex);
      pending = true;
      submitted = a;
    }
    queued.store(true, std::memory_order_release);
    wake.notify_all();
    const Clock::time_point b = Clock::now();
    work(300);
    const Clock::time_point c = Clock::now();
    {
      std::unique_lock<std::mutex> lock(mutex);
      done.wait(lock, [&] { return !pending; });
    }
    submit.push_back(us(a, b));
    wait.push_back(us(c, Clock::now()));
  }
  {
    std::lock_guard<std::mutex> guard(mutex);
    stop = true;
  }
  wake.notify_all();
  worker.join();
  std::printf("worker %s (400 jobs, us)\n", poll ? "polling" : "sleeping on a condition variable");
  report("submit, host's thread", submit);
  report("wait for the finished job", wait);
  report("submit -> job starts", latency);
}
