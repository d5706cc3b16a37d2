#include "io/map_guard.hpp"

#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace keel::io::map_guard {
namespace {

// A range is published by its end first, then its start (a reader that sees the start sees
// the end), and withdrawn by its start. Only `add` and `remove` write; the handler reads.
struct range {
  std::atomic<std::uintptr_t> begin{0};
  std::atomic<std::uintptr_t> end{0};
};
constexpr std::size_t capacity = 65536;  // a store maps each segment: 4 TiB of 64 MiB ones
std::array<range, capacity> table;
std::atomic<std::size_t> high_water{0};  // no range at or past this index
std::atomic<std::uint64_t> retries{0};
std::atomic<bool> handler_in{false};

constexpr std::int64_t first_pause_ns = 1'000'000;
constexpr std::int64_t longest_pause_ns = 50'000'000;
std::atomic<std::int64_t> give_up_ns{20'000'000'000};  // under the 30 s default lock_timeout

// One thread's current fault: the address, when it first and last faulted there, the next
// pause. A fault at another address, or one more than a pause and some scheduling after the
// last, is a new one (the store went through in between: a hot word faults again after each
// write-back, and those faults must not add up to the give-up time). initial-exec: reading
// it from a signal handler must not allocate.
struct fault_state {
  std::uintptr_t addr;
  std::int64_t since_ns;
  std::int64_t last_ns;
  std::int64_t pause_ns;
};
constexpr std::int64_t new_fault_after_ns = 250'000'000;
// How long a fault is retried before an escape, even past the call's deadline: a refusal
// for the moment btrfs flushes its reservations goes through within it.
constexpr std::int64_t escape_floor_ns = 100'000'000;
__attribute__((tls_model("initial-exec"))) thread_local fault_state current{0, 0, 0, 0};

// This thread's escape (arm): where to, from when, and how many no_escape scopes are open.
struct escape_state {
  escape* to;
  std::int64_t deadline_ns;
  unsigned held_back;
};
__attribute__((tls_model("initial-exec"))) thread_local escape_state way_out{nullptr, 0, 0};
std::atomic<std::uint64_t> escapes{0};

std::int64_t now_ns() noexcept {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return std::int64_t{t.tv_sec} * 1'000'000'000 + t.tv_nsec;
}

bool guarded(std::uintptr_t a) noexcept {
  const std::size_t n = high_water.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uintptr_t b = table[i].begin.load(std::memory_order_acquire);
    if (b <= 1 || a < b) continue;  // 0: free, 1: being filled in
    const std::uintptr_t e = table[i].end.load(std::memory_order_acquire);
    // The same begin after the end was read: the end is that range's, not a later one's.
    if (a < e && table[i].begin.load(std::memory_order_acquire) == b) return true;
  }
  return false;
}

// What SIGBUS would have done without the guard: the default action, on this signal (raised
// again: it is blocked in the handler, so it arrives as the handler returns, even when it was
// sent, not a fault that returning would repeat).
void to_default() noexcept {
  struct sigaction sa {};
  sa.sa_handler = SIG_DFL;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
  ::raise(SIGBUS);
}

extern "C" void keel_map_guard_handler(int /*signo*/, siginfo_t* info, void* /*context*/) {
  const int saved_errno = errno;
  const auto a = reinterpret_cast<std::uintptr_t>(info->si_addr);
  if (info->si_code != BUS_ADRERR || !guarded(a)) {
    to_default();  // not a refusal in one of our maps
    errno = saved_errno;
    return;
  }
  const std::int64_t now = now_ns();
  if (current.addr != a || now - current.last_ns > new_fault_after_ns) {
    current = {a, now, now, first_pause_ns};
  }
  const std::int64_t lasted = now - current.since_ns;
  const bool given_up = lasted > give_up_ns.load(std::memory_order_relaxed);
  const bool can_escape = way_out.to != nullptr && way_out.held_back == 0;
  // Past the call's deadline (or the give-up time), and refused for a while, not for the
  // moment btrfs takes to flush its reservations: back to where the call armed, SIGBUS
  // unblocked (it is blocked in here, and the jump does not restore the mask).
  if (can_escape && (now >= way_out.deadline_ns || given_up) && lasted >= escape_floor_ns) {
    escape* const to = way_out.to;
    way_out.to = nullptr;
    current = {0, 0, 0, 0};
    escapes.fetch_add(1, std::memory_order_relaxed);
    sigset_t bus;
    sigemptyset(&bus);
    sigaddset(&bus, SIGBUS);
    ::pthread_sigmask(SIG_UNBLOCK, &bus, nullptr);
    errno = saved_errno;
    ::siglongjmp(to->at, 1);
  }
  if (!can_escape && given_up) {
    to_default();  // refused for a minute: not a moment's shortage
    errno = saved_errno;
    return;
  }
  retries.fetch_add(1, std::memory_order_relaxed);
  std::int64_t pause_ns = current.pause_ns;
  if (can_escape) {
    const std::int64_t until =
        std::max(way_out.deadline_ns, current.since_ns + escape_floor_ns) - now;
    pause_ns = std::clamp<std::int64_t>(until, 1, pause_ns);
  }
  const timespec pause{0, pause_ns};
  ::nanosleep(&pause, nullptr);
  current.pause_ns = std::min(current.pause_ns * 2, longest_pause_ns);
  current.last_ns = now_ns();
  errno = saved_errno;
}

bool install() noexcept {
  static std::once_flag once;
  std::call_once(once, [] {
    if (const char* e = std::getenv("KEEL_MAP_GUARD"); e != nullptr && std::strcmp(e, "0") == 0) {
      return;
    }
    struct sigaction old {};
    if (::sigaction(SIGBUS, nullptr, &old) != 0) return;
    if ((old.sa_flags & SA_SIGINFO) != 0 || old.sa_handler != SIG_DFL) return;  // the app's
    struct sigaction sa {};
    sa.sa_sigaction = keel_map_guard_handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    if (::sigaction(SIGBUS, &sa, nullptr) == 0) handler_in.store(true);
  });
  return handler_in.load();
}

}  // namespace

void add(void* addr, std::size_t length) noexcept {
  if (addr == nullptr || length == 0 || !install()) return;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  for (std::size_t i = 0; i < capacity; ++i) {
    std::uintptr_t expected = 0;
    if (table[i].begin.load(std::memory_order_relaxed) != 0) continue;
    // Claim the slot with a begin no address reaches (1), then publish the end and begin.
    if (!table[i].begin.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) continue;
    std::size_t hw = high_water.load();
    while (hw < i + 1 && !high_water.compare_exchange_weak(hw, i + 1)) {
    }
    table[i].end.store(b + length, std::memory_order_release);
    table[i].begin.store(b, std::memory_order_release);
    return;
  }
}

void remove(void* addr) noexcept {
  if (addr == nullptr) return;
  const auto b = reinterpret_cast<std::uintptr_t>(addr);
  const std::size_t n = high_water.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < n; ++i) {
    std::uintptr_t expected = b;
    if (table[i].begin.compare_exchange_strong(expected, 0, std::memory_order_acq_rel)) return;
  }
}

void arm(escape& e, std::chrono::steady_clock::time_point deadline) noexcept {
  way_out.deadline_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the deadline before the way
  way_out.to = &e;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void disarm() noexcept {
  way_out.to = nullptr;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

no_escape::no_escape() noexcept {
  ++way_out.held_back;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

no_escape::~no_escape() {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  --way_out.held_back;
}

detail::escape_saved detail::set_aside() noexcept {
  const escape_saved was{way_out.to, way_out.deadline_ns, way_out.held_back};
  way_out.to = nullptr;  // first: the handler never sees a way out with another's state
  std::atomic_signal_fence(std::memory_order_seq_cst);
  way_out.held_back = 0;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  return was;
}

void detail::put_back(const escape_saved& was) noexcept {
  way_out.to = nullptr;
  std::atomic_signal_fence(std::memory_order_seq_cst);
  way_out.held_back = was.held_back;
  way_out.deadline_ns = was.deadline_ns;
  std::atomic_signal_fence(std::memory_order_seq_cst);  // the rest before the way
  way_out.to = was.to;
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

bool escape_in_force() noexcept {
  return way_out.to != nullptr || way_out.held_back != 0;
}

std::uint64_t escaped() noexcept {
  return escapes.load(std::memory_order_relaxed);
}

std::uint64_t retried() noexcept {
  return retries.load(std::memory_order_relaxed);
}

bool installed() noexcept {
  return handler_in.load();
}

void set_give_up(std::chrono::nanoseconds after) noexcept {
  give_up_ns.store(after.count());
}

}  // namespace keel::io::map_guard
