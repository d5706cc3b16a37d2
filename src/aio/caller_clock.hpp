#pragma once
// Where a thread spends its time around one controller: inside its calls (submitting,
// waiting) or between them (computing). With submitter::adaptive, the io_uring engine starts
// the requests of a thread that is mostly inside on that thread's own ring: the thread
// would only wait meanwhile, and a hand-over to a worker and back costs two wake-ups. A
// thread that computes between its calls keeps handing requests to the workers, which run
// them while it computes.

#include <chrono>
#include <cstdint>

namespace keel::aio::detail {

//! A cheap count of time (the TSC on x86-64: only ratios of it are used). Not monotonic
//! across CPUs on every machine (a VM's vCPUs): see since().
inline std::uint64_t ticks() noexcept {
#if defined(__x86_64__)
  return __builtin_ia32_rdtsc();
#else
  return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

//! Ticks from `then` to `now`; 0 when the thread moved to a CPU whose count is behind.
inline std::uint64_t since(std::uint64_t then, std::uint64_t now) noexcept {
  return now > then ? now - then : 0;
}

//! The calling thread's time inside and outside the calls on the controller it used last
//! (named by an id never reused; another controller starts the count afresh), judged every `period`
//! calls and then halved, so that it follows what the thread does now.
struct caller_clock {
  static constexpr unsigned period = 32;
  std::uint64_t controller = 0;
  std::uint64_t entered = 0;
  std::uint64_t left = 0;  // when the last outermost call returned
  std::uint64_t inside = 0;
  std::uint64_t outside = 0;
  unsigned calls = 0;
  unsigned depth = 0;  // calls within calls (a completion's) count as the outer one
  //! At least two thirds of the time inside: the thread's requests start on its own ring.
  bool waiting_bound = false;

  void enter(std::uint64_t c) noexcept {
    if (depth++ != 0) return;
    const std::uint64_t now = ticks();
    if (controller != c) {
      *this = caller_clock{};
      controller = c;
      depth = 1;
    } else {
      outside += since(left, now);
    }
    entered = now;
  }
  void leave() noexcept {
    if (--depth != 0) return;
    left = ticks();
    inside += since(entered, left);
    if (++calls % period == 0) {
      waiting_bound = outside * 2 < inside;
      inside /= 2;
      outside /= 2;
    }
  }
};

inline thread_local caller_clock this_thread_clock;

//! Completions running on this thread (their callbacks may submit, and wait). A request
//! submitted from one is neither run nor reaped inside that submission, and a wait inside
//! one does not reap the thread's ring: a chain of callbacks that each submit the next
//! would otherwise recurse a level per request. Those go the long way round, by a worker.
inline thread_local unsigned completions_running = 0;

//! Counts the completions the calling thread runs for its lifetime.
class running_completions {
 public:
  running_completions() noexcept { ++completions_running; }
  running_completions(const running_completions&) = delete;
  running_completions& operator=(const running_completions&) = delete;
  ~running_completions() { --completions_running; }
};

//! Times one call of the calling thread on the controller of id `c` (0: none, untimed).
class timed_call {
 public:
  explicit timed_call(std::uint64_t c) noexcept : on_(c != 0) {
    if (on_) this_thread_clock.enter(c);
  }
  timed_call(const timed_call&) = delete;
  timed_call& operator=(const timed_call&) = delete;
  ~timed_call() {
    if (on_) this_thread_clock.leave();
  }

 private:
  bool on_;
};

//! Whether the calling thread spends most of its time in calls on the controller of id `c`.
inline bool waiting_bound(std::uint64_t c) noexcept {
  return this_thread_clock.controller == c && this_thread_clock.waiting_bound;
}

}  // namespace keel::aio::detail
