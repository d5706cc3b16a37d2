#include "base/fork.hpp"

#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "base/thread_safety.hpp"

namespace keel::base {
namespace {

// The gate: makers hold it shared, a fork exclusively. glibc's default rwlock prefers
// readers, so a maker may nest (a thread state made while another is), never waiting on a
// fork that waits on it.
pthread_rwlock_t gate = PTHREAD_RWLOCK_INITIALIZER;

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
  (void)::pthread_rwlock_wrlock(&gate);
  the_noted().m.lock();
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->prepare();
}

void after_fork_in_parent() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->parent();
  the_noted().m.unlock();
  (void)::pthread_rwlock_unlock(&gate);
}

void after_fork_in_child() KEEL_NO_THREAD_SAFETY_ANALYSIS {
  detail::fork_count.fetch_add(1, std::memory_order_relaxed);
  if (auto* h = hooks.load(std::memory_order_acquire); h != nullptr) h->child();
  auto& n = the_noted();
  for (const int fd : n.fds)
    ::close(fd);  // (not through the io seam: base is below it, and only this thread runs)
  n.fds.clear();
  n.m.unlock();
  // Made afresh, not unlocked: glibc knows a write lock's holder by its thread id, which is
  // another in the child (an unlock there would be taken for a reader's).
  (void)::pthread_rwlock_init(&gate, nullptr);
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
  (void)::pthread_rwlock_rdlock(&gate);
}
making_descriptors::~making_descriptors() {
  (void)::pthread_rwlock_unlock(&gate);
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
