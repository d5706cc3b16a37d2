#include "io/lock_wait.hpp"

#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include "keel/io/byte_lock.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::io {
namespace {

extern "C" void keel_deadline_signal_handler(int /*signo*/) {}

int install_deadline_signal() noexcept {
  const int signo = SIGRTMAX - 1;
  struct sigaction old {};
  if (::sigaction(signo, nullptr, &old) != 0) return 0;
  const bool is_default = (old.sa_flags & SA_SIGINFO) == 0 && old.sa_handler == SIG_DFL;
  if (!is_default) return 0;  // the application's signal: poll instead of taking it over
  struct sigaction sa {};
  sa.sa_handler = keel_deadline_signal_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: the point is to make the waiting request return EINTR
  if (::sigaction(signo, &sa, nullptr) != 0) return 0;
  return signo;
}

// Waits by polling with exponential backoff: the fallback when no timer signal can be used.
result<void> poll_until(const countdown& cd, detail::lock_attempt attempt, void* c) noexcept {
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    const auto left = cd.remaining();
    if (left <= left.zero()) return errc_error(std::errc::timed_out);
    std::this_thread::sleep_for(std::min<countdown::clock::duration>(pause, left));
    pause = std::min(pause * 2, std::chrono::microseconds(10'000));
    auto g = attempt(c, false);
    if (g || g.error() != std::errc::operation_would_block) return g;
  }
}

// Whether `file` is on a filesystem only this machine uses. Elsewhere a wait polls instead of
// sleeping in the kernel: on GlusterFS 10.3 (two clients, a few waiters) a waiter killed, or
// woken by its deadline's signal, in that sleep left the brick unanswering, both clients lost
// the volume and every waiter stayed in D state. Asked only when a lock must wait; a statfs
// that fails counts as "not known local".
bool known_local(const file_handle& f) noexcept {
  auto where = stat_fs(f);
  return where && where->is_local;
}

// Waits in the kernel until the lock is granted or a per-thread timer signal, armed for the
// expiry, interrupts it.
result<void> wait_with_timer(const countdown& cd, int signo, detail::lock_attempt attempt,
                             void* c) noexcept {
  sigevent sev{};
  sev.sigev_notify = SIGEV_THREAD_ID;
  sev.sigev_signo = signo;
  sev._sigev_un._tid = ::gettid();
  timer_t timer{};
  if (::timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) return poll_until(cd, attempt, c);

  sigset_t only{};
  sigset_t saved{};
  sigemptyset(&only);
  sigaddset(&only, signo);
  ::pthread_sigmask(SIG_UNBLOCK, &only, &saved);

  // The interval keeps re-firing after the first expiry: if that first signal arrives between
  // our deadline check and the thread entering the kernel's wait, the next one still wakes it.
  itimerspec spec{};
  spec.it_value = cd.monotonic_timespec();
  spec.it_interval = {.tv_sec = 0, .tv_nsec = 1'000'000};
  result<void> outcome;
  if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) {
    spec.it_value.tv_nsec = 1;  // zero would disarm the timer
  }
  if (::timer_settime(timer, TIMER_ABSTIME, &spec, nullptr) != 0) {
    outcome = poll_until(cd, attempt, c);
  } else {
    for (;;) {
      outcome = attempt(c, true);
      if (outcome || outcome.error() != std::errc::interrupted) break;
      if (cd.expired()) {
        outcome = errc_error(std::errc::timed_out);
        break;
      }
    }
  }
  ::timer_delete(timer);
  // A signal the timer queued before it was deleted is delivered (to the empty handler) on
  // the way back from timer_delete, while it is still unblocked; then the mask is restored.
  ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  return outcome;
}

}  // namespace

int deadline_signal() noexcept {
  static const int signo = install_deadline_signal();
  return signo;
}

result<void> detail::wait_for_lock(const file_handle& file, const countdown& cd,
                                   lock_attempt attempt, void* context) noexcept {
  if (cd.is_zero()) return errc_error(std::errc::operation_would_block);
  if (!known_local(file)) return poll_until(cd, attempt, context);
  if (cd.is_infinite()) {
    // A signal of the application's own interrupts the wait; the caller asked to wait forever.
    result<void> outcome;
    do {
      outcome = attempt(context, true);
    } while (!outcome && outcome.error() == std::errc::interrupted);
    return outcome;
  }
  if (cd.expired()) return errc_error(std::errc::timed_out);
  if (const int signo = deadline_signal(); signo != 0) {
    return wait_with_timer(cd, signo, attempt, context);
  }
  return poll_until(cd, attempt, context);
}

}  // namespace keel::io
