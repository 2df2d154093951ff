// Helper threads the native products own, which wait for the next product by spinning a short
// while and then sleeping. A decode step runs one small product after another (SmolLM-135M's
// are 12-40 us), a few microseconds of other work apart; waking a thread of XLA's pool for each
// costs about as much as the thread saves (benchmarks/RESULTS.md, `threads` and
// `kernel-stream`), while a helper still spinning from the last product starts within a
// microsecond. A helper that has had no work for the spin time sleeps on a condition variable,
// so an idle process spends no CPU.
//
// A caller posts a task to helpers whose slot is free, runs its share, and takes back the
// posts no helper picked up (Retract): it never waits for a helper to start, and a helper that
// picks up a task late finds no work left in it. Tasks are reference counted, so the last of
// the caller and the helpers to let go frees it. Several callers at once each get the free
// slots they find (one helper runs one task at a time). A forked child starts with no helpers
// and creates its own.

#ifndef Q8RULES_HELPER_THREADS_H_
#define Q8RULES_HELPER_THREADS_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#endif

#include "simd.h"

namespace q8helpers {
namespace {

// Work helpers share with a caller. Run may be called by any number of helpers (each once),
// concurrently with the caller, and must return at once when no work is left.
class Task {
 public:
  virtual ~Task() = default;
  virtual void Run() = 0;
  void Hold() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Release() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  std::atomic<int> refs_{1};  // the creator's
};

// How long a helper spins for its next task before it sleeps, in microseconds (0: it sleeps
// at once). Q8SetSpinMicroseconds: $Q8RULES_SPIN_US (q8rules/kernels/native/settings.py).
inline std::atomic<int64_t> g_spin_us{200};

class Helpers {
 public:
  // The process's helpers (none started until a caller asks for them).
  static Helpers& Get() {
    static std::once_flag once;
    std::call_once(once, [] {
#if defined(__linux__)
      pthread_atfork(nullptr, nullptr, [] { Current() = new Helpers; });
#endif
    });
    return *Current();
  }

  // Posts task to up to n helpers, starting helpers until there are n; returns how many took
  // a post (each holds a reference on task until it has run it or the post is retracted).
  int Post(Task* task, int n) {
    Grow(n);
    int posted = 0;
    for (size_t i = 0; i < count_.load(std::memory_order_acquire) && posted < n; ++i) {
      Slot& s = *slots_[i];
      if (s.task.load(std::memory_order_relaxed) != nullptr) continue;  // busy: no locked op
      Task* empty = nullptr;
      task->Hold();
      if (!s.task.compare_exchange_strong(empty, task, std::memory_order_seq_cst)) {
        task->Release();  // busy with another caller's task
        continue;
      }
      ++posted;
      if (s.sleeping.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.wake.notify_one();
      }
    }
    return posted;
  }

  // Takes back the posts of task that no helper has picked up (dropping their references).
  void Retract(Task* task) {
    for (size_t i = 0; i < count_.load(std::memory_order_acquire); ++i) {
      std::atomic<Task*>& slot = slots_[i]->task;
      Task* posted = task;
      // A plain load first: a failed compare-exchange is still a locked write to a line the
      // slot's helper is spinning on, and most slots hold another task or none.
      if (slot.load(std::memory_order_relaxed) != task) continue;
      if (slot.compare_exchange_strong(posted, nullptr, std::memory_order_acq_rel)) {
        task->Release();
      }
    }
  }

 private:
  static constexpr size_t kMaxHelpers = 256;

  struct alignas(64) Slot {
    std::atomic<Task*> task{nullptr};  // posted, Taken() while a helper runs it, or none
    std::atomic<int> sleeping{0};
    std::mutex mutex;
    std::condition_variable wake;
  };

  static Helpers*& Current() {
    static Helpers* helpers = new Helpers;  // never freed: helpers outlive static destructors
    return helpers;
  }

  static Task* Taken() { return reinterpret_cast<Task*>(alignof(Task)); }

  Helpers() : slots_(kMaxHelpers) {}

  void Grow(int n) {
    const size_t want = std::min<size_t>(static_cast<size_t>(std::max(n, 0)), kMaxHelpers);
    if (count_.load(std::memory_order_acquire) >= want) return;
    std::lock_guard<std::mutex> lock(grow_);
    for (size_t i = count_.load(std::memory_order_relaxed); i < want; ++i) {
      slots_[i] = std::make_unique<Slot>();
      try {
        std::thread(&Helpers::Loop, slots_[i].get()).detach();
      } catch (const std::system_error&) {  // no more threads: the callers run with fewer
        slots_[i].reset();
        return;
      }
      count_.store(i + 1, std::memory_order_release);
    }
  }

  static void Loop(Slot* s) {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "q8rules-helper");
#endif
    using Clock = std::chrono::steady_clock;
    auto last = Clock::now();
    for (uint64_t spins = 0;; ++spins) {
      Task* task = s->task.load(std::memory_order_acquire);
      if (task != nullptr && task != Taken()) {
        if (s->task.compare_exchange_strong(task, Taken(), std::memory_order_acq_rel)) {
          task->Run();
          task->Release();
          s->task.store(nullptr, std::memory_order_release);
          last = Clock::now();
        }
        continue;
      }
#if Q8_X86 || Q8_ARM
      q8simd::Pause();
#else
      std::this_thread::yield();
#endif
      if (spins % 256 != 0) continue;
      const auto spin = std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
      if (Clock::now() - last < spin) continue;
      std::unique_lock<std::mutex> lock(s->mutex);
      s->sleeping.store(1, std::memory_order_seq_cst);
      s->wake.wait(lock, [s] { return s->task.load(std::memory_order_seq_cst) != nullptr; });
      s->sleeping.store(0, std::memory_order_relaxed);
      last = Clock::now();
    }
  }

  std::vector<std::unique_ptr<Slot>> slots_;
  std::atomic<size_t> count_{0};
  std::mutex grow_;
};

// Waits until `done` reaches `count` (the units a caller posted, of which its helpers still run
// at most one each): spinning a while, then yielding the core.
inline void WaitFor(const std::atomic<int64_t>& done, int64_t count) {
  for (int spins = 0; done.load(std::memory_order_acquire) < count; ++spins) {
#if Q8_X86 || Q8_ARM
    if (spins < 4096) {
      q8simd::Pause();
      continue;
    }
#endif
    std::this_thread::yield();
  }
}

}  // namespace
}  // namespace q8helpers

#endif  // Q8RULES_HELPER_THREADS_H_
