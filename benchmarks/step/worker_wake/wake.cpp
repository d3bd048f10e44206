// What it costs a thread to hand a job to a worker thread that sleeps on a condition variable, as
// the step's worker did before it napped, against one that polls for it (spinning) and one that
// naps 100 us at a time between jobs, as the step's worker does now (cpp/core/step_worker.h; the
// host notifies it only once it blocks). The host thread works 1 ms (its own step), submits a
// 50 us job, works 300 us more (sampling), waits for the job.
//
//   g++ -O2 -pthread wake.cpp -o /tmp/wake && /tmp/wake sleep && /tmp/wake poll && /tmp/wake nap
//
// Prints per mode the p10/p50/p90 microseconds of: the submit on the host's thread, the host's
// wait for the finished job, and the latency from the submit to the job's start on the worker;
// and the worker thread's CPU time (the 400 jobs are 20 ms of it).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <ctime>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

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
  const bool naps = argc > 1 && std::strcmp(argv[1], "nap") == 0;
  std::mutex mutex;
  std::condition_variable wake, done;
  bool pending = false, stop = false, blocked = false;
  double worker_cpu_ms = 0;
  std::atomic<bool> queued{false};
  std::vector<double> submit, wait, latency;
  Clock::time_point submitted;
  std::thread worker([&] {
#if defined(__linux__)
    if (naps) prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
#endif
    std::unique_lock<std::mutex> lock(mutex);
    Clock::time_point last_done = Clock::now() - std::chrono::milliseconds(5);
    for (;;) {
      while (naps && !pending && !stop && Clock::now() - last_done < std::chrono::milliseconds(5)) {
        lock.unlock();  // naps 100 us at a time for up to 5 ms after its last job
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        lock.lock();
      }
      if (poll) {  // polls 2 ms for the next job (longer than the host's step): never sleeps here
        lock.unlock();
        const Clock::time_point start = Clock::now();
        while (!queued.load(std::memory_order_acquire) && us(start, Clock::now()) < 2000) {
        }
        lock.lock();
      }
      blocked = true;
      wake.wait(lock, [&] { return pending || stop; });
      blocked = false;
      if (stop) {
        timespec cpu;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &cpu);
        worker_cpu_ms = cpu.tv_sec * 1e3 + cpu.tv_nsec / 1e6;
        return;
      }
      latency.push_back(us(submitted, Clock::now()));
      lock.unlock();
      work(50);
      lock.lock();
      pending = false;
      last_done = Clock::now();
      queued.store(false);
      done.notify_all();
    }
  });
  for (int i = 0; i < 400; ++i) {
    work(1000);
    const Clock::time_point a = Clock::now();
    bool notify;
    {
      std::lock_guard<std::mutex> guard(mutex);
      pending = true;
      submitted = a;
      notify = !naps || blocked;
    }
    queued.store(true, std::memory_order_release);
    if (notify) wake.notify_all();
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
  std::printf("worker %s (400 jobs, us; worker CPU %.0f ms)\n",
              poll ? "polling" : naps ? "napping 100 us at a time" : "sleeping on a condition variable", worker_cpu_ms);
  report("submit, host's thread", submit);
  report("wait for the finished job", wait);
  report("submit -> job starts", latency);
}
