#include "base/fork.hpp"

#include <pthread.h>
#include <unistd.h>

#include <cstdint>

#include <algorithm>
#include <vector>

#include "base/futex.hpp"
#include "base/thread_safety.hpp"

namespace keel::base {
namespace {

// The gate: makers hold it shared, a fork exclusively. A word: the makers inside, and
// `forking` while a fork waits for them to leave or is under way (new makers sleep on the word
// until it ends). Not a pthread rwlock: a child could neither unlock one (glibc knows a writer
// by its thread id, another in the child) nor make it afresh without the sanitizers taking it
// for still held. A thread's nested makers count once (`depth`). A thread that forks inside
// its own maker (keel never does) leaves the gate for the fork (`lent`) and comes back after:
// its fork waits neither for itself nor, taking turns on `forker`, does another fork wait for
// it (both deadlocked, a reviewer's program: each fork waited on the other).
constexpr std::uint32_t forking = 1U << 31;
std::atomic<std::uint32_t> gate{0};
thread_local std::uint32_t depth = 0;
thread_local bool lent = false;
base::mutex forker;
// The process whose fork set `forking`: a child whose handlers have not yet run (an atfork
// child handler registered before keel's, making a descriptor) finds the gate open as the
// parent left it, closed for its fork, and must not sleep on it.
std::atomic<pid_t> forking_in{0};

void leave_gate() noexcept {
  const std::uint32_t s = gate.fetch_sub(1, std::memory_order_release) - 1;
  if ((s & forking) != 0) futex_wake(gate);  // (a fork waits for the last maker)
}

void close_gate() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  lent = depth > 0;
  if (lent) leave_gate();
  forker.lock();
  forking_in.store(::getpid(), std::memory_order_relaxed);
  gate.fetch_or(forking, std::memory_order_acq_rel);
  for (;;) {
    const std::uint32_t s = gate.load(std::memory_order_acquire);
    if ((s & ~forking) == 0) return;
    futex_wait(gate, s, nullptr);
  }
}

// The descriptors noted with close_in_children, and the thread states' hooks. Never destroyed:
// forks may come while statics go.
struct noted {
  base::mutex m;
  std::vector<int> fds KEEL_GUARDED_BY(m);
};
noted& the_noted() noexcept {
  static noted* const it = new noted;
  return *it;
}
std::atomic<fork_hooks*> hooks{nullptr};

void before_fork() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  close_gate();
  the_noted().m.lock();
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->prepare();
}

void after_fork_in_parent() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->parent();
  the_noted().m.unlock();
  gate.fetch_add(lent ? 1 : 0, std::memory_order_relaxed);  // (the maker it left: it holds)
  gate.fetch_and(~forking, std::memory_order_release);
  futex_wake(gate);
  forker.unlock();
}

void after_fork_in_child() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  detail::fork_count.fetch_add(1, std::memory_order_relaxed);
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->child();
  auto& n = the_noted();
  for (const int fd : n.fds)
    ::close(fd);  // (not through the io seam: base is below it, and only this thread runs)
  n.fds.clear();
  n.m.unlock();
  gate.store(lent ? 1 : 0, std::memory_order_release);  // (the only thread left)
  forker.unlock();
}

// Registered while the program starts, before any thread can fork: every later fork counts.
const bool registered = [] {
  (void)the_noted();
  ::pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child);
  return true;
}();

}  // namespace

std::atomic<std::uint64_t> detail::fork_count{0};

making_descriptors::making_descriptors() noexcept {
  if (depth++ > 0) return;
  for (;;) {
    std::uint32_t s = gate.load(std::memory_order_acquire);
    if ((s & forking) != 0) {
      if (forking_in.load(std::memory_order_relaxed) != ::getpid()) {
        // A child before its handler: the parent's fork is not under way here.
        if (gate.compare_exchange_weak(s, (s & ~forking) + 1, std::memory_order_acquire)) return;
        continue;
      }
      futex_wait(gate, s, nullptr);
    } else if (gate.compare_exchange_weak(s, s + 1, std::memory_order_acquire)) {
      return;
    }
  }
}
making_descriptors::~making_descriptors() {
  if (--depth == 0) leave_gate();
}

void close_in_children(int fd) noexcept {
  auto& n = the_noted();
  const base::lock_guard g(n.m);
  try {
    n.fds.push_back(fd);
  } catch (...) {  // no room to note it: a child keeps its copy, as without this
  }
}

void keep_in_children(int fd) noexcept {
  auto& n = the_noted();
  const base::lock_guard g(n.m);
  if (auto at = std::ranges::find(n.fds, fd); at != n.fds.end()) n.fds.erase(at);
}

void set_thread_state_fork_hooks(fork_hooks h) noexcept {
  static fork_hooks kept;  // (set once, before any fork)
  kept = h;
  hooks.store(&kept, std::memory_order_release);
}

}  // namespace keel::base
