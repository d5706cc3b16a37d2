#include "keel/io/byte_lock.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <thread>

#include "keel/io/fs_info.hpp"

namespace keel::io {
namespace {

constexpr off_t max_offset = std::numeric_limits<off_t>::max();

bool valid_extent(off_t offset, off_t length) noexcept {
  return offset >= 0 && length > 0 && length <= max_offset - offset;
}

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
  sa.sa_flags = 0;  // no SA_RESTART: the point is to make F_OFD_SETLKW return EINTR
  if (::sigaction(signo, &sa, nullptr) != 0) return 0;
  return signo;
}

// One attempt through the seam; interrupted attempts are repeated.
result<void> try_once(const file_handle& f, off_t offset, off_t length, lock_request r) noexcept {
  for (;;) {
    auto g = f.fs().lock(f, offset, length, r, false);
    if (g || g.error() != std::errc::interrupted) return g;
  }
}

// Waits by polling with exponential backoff: the fallback when no timer signal can be used.
result<void> poll_until(const file_handle& f, off_t offset, off_t length, lock_request r,
                        const countdown& cd) noexcept {
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    const auto left = cd.remaining();
    if (left <= left.zero()) return errc_error(std::errc::timed_out);
    std::this_thread::sleep_for(std::min<countdown::clock::duration>(pause, left));
    pause = std::min(pause * 2, std::chrono::microseconds(10'000));
    auto g = try_once(f, offset, length, r);
    if (g || g.error() != std::errc::operation_would_block) return g;
  }
}

// Whether `file` is on a filesystem only this machine uses. Elsewhere a wait polls instead of
// sleeping in F_OFD_SETLKW: on GlusterFS 10.3 (two clients, a few waiters) a waiter killed,
// or woken by its deadline's signal, in that sleep left the brick unanswering, both clients
// lost the volume and every waiter stayed in D state. Asked only when a lock must wait; a
// statfs that fails counts as "not known local".
bool known_local(const file_handle& f) noexcept {
  auto where = stat_fs(f);
  return where && where->is_local;
}

// Waits in F_OFD_SETLKW until the lock is granted or a per-thread timer signal, armed for the
// expiry, interrupts it.
result<void> wait_with_timer(const file_handle& f, off_t offset, off_t length, lock_request r,
                             const countdown& cd, int signo) noexcept {
  sigevent sev{};
  sev.sigev_notify = SIGEV_THREAD_ID;
  sev.sigev_signo = signo;
  sev._sigev_un._tid = ::gettid();
  timer_t timer{};
  if (::timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) {
    return poll_until(f, offset, length, r, cd);
  }

  sigset_t only{};
  sigset_t saved{};
  sigemptyset(&only);
  sigaddset(&only, signo);
  ::pthread_sigmask(SIG_UNBLOCK, &only, &saved);

  // The interval keeps re-firing after the first expiry: if that first signal arrives between
  // our deadline check and the thread entering F_OFD_SETLKW, the next one still wakes it.
  itimerspec spec{};
  spec.it_value = cd.monotonic_timespec();
  spec.it_interval = {.tv_sec = 0, .tv_nsec = 1'000'000};
  result<void> outcome;
  if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) {
    spec.it_value.tv_nsec = 1;  // zero would disarm the timer
  }
  if (::timer_settime(timer, TIMER_ABSTIME, &spec, nullptr) != 0) {
    outcome = poll_until(f, offset, length, r, cd);
  } else {
    for (;;) {
      outcome = f.fs().lock(f, offset, length, r, true);
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

extent_guard::extent_guard(extent_guard&& other) noexcept
    : fd_(other.fd_),
      offset_(other.offset_),
      length_(other.length_),
      kind_(other.kind_),
      fs_(other.fs_) {
  other.fd_ = -1;
}

extent_guard& extent_guard::operator=(extent_guard&& other) noexcept {
  if (this != &other) {
    (void)unlock();
    fd_ = other.fd_;
    offset_ = other.offset_;
    length_ = other.length_;
    kind_ = other.kind_;
    fs_ = other.fs_;
    other.fd_ = -1;
  }
  return *this;
}

result<void> extent_guard::unlock() noexcept {
  if (fd_ < 0) return {};
  // A handle that borrows the descriptor for the call: the guard keeps the number only.
  file_handle borrowed(fd_, fs_, {});
  fd_ = -1;
  auto r = try_once(borrowed, offset_, length_, lock_request::unlock);
  (void)borrowed.release();
  return r;
}

result<extent_guard> lock_extent(const file_handle& file, off_t offset, off_t length,
                                 lock_kind kind, deadline d) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  const lock_request r = kind == lock_kind::shared ? lock_request::shared : lock_request::exclusive;
  const auto granted = [&] { return extent_guard(file, offset, length, kind); };

  // The uncontended path is one syscall, whatever the deadline.
  auto first = try_once(file, offset, length, r);
  if (first) return granted();
  if (first.error() != std::errc::operation_would_block) return std::unexpected(first.error());
  const countdown cd = d.start();
  if (cd.is_zero()) return errc_error(std::errc::operation_would_block);

  result<void> outcome;
  if (!known_local(file)) {
    outcome = poll_until(file, offset, length, r, cd);
  } else if (cd.is_infinite()) {
    // A signal of the application's own interrupts the wait; the caller asked to wait forever.
    do {
      outcome = file.fs().lock(file, offset, length, r, true);
    } while (!outcome && outcome.error() == std::errc::interrupted);
  } else if (cd.expired()) {
    outcome = errc_error(std::errc::timed_out);
  } else if (const int signo = deadline_signal(); signo != 0) {
    outcome = wait_with_timer(file, offset, length, r, cd, signo);
  } else {
    outcome = poll_until(file, offset, length, r, cd);
  }
  if (!outcome) return std::unexpected(outcome.error());
  return granted();
}

result<void> unlock_extent(const file_handle& file, off_t offset, off_t length) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  return try_once(file, offset, length, lock_request::unlock);
}

result<bool> extent_is_free(const file_handle& file, off_t offset, off_t length,
                            lock_kind kind) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  return file.fs().lock_is_free(
      file, offset, length,
      kind == lock_kind::shared ? lock_request::shared : lock_request::exclusive);
}

}  // namespace keel::io
