#include "keel/io/byte_lock.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <thread>

namespace keel::io {
namespace {

constexpr off_t max_offset = std::numeric_limits<off_t>::max();

struct flock make_flock(short type, off_t offset, off_t length) noexcept {
  struct flock fl {};
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = offset;
  fl.l_len = length;
  fl.l_pid = 0;  // F_OFD_* require 0
  return fl;
}

bool valid_extent(off_t offset, off_t length) noexcept {
  return offset >= 0 && length > 0 && length <= max_offset - offset;
}

bool is_contention(int e) noexcept {
  return e == EAGAIN || e == EACCES;
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

// Waits by polling F_OFD_SETLK with exponential backoff: the fallback when no timer signal
// can be used. Returns 0 or the errno that ended it.
int poll_until(int fd, struct flock& fl, const countdown& cd) noexcept {
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    const auto left = cd.remaining();
    if (left <= left.zero()) return ETIMEDOUT;
    std::this_thread::sleep_for(std::min<countdown::clock::duration>(pause, left));
    pause = std::min(pause * 2, std::chrono::microseconds(10'000));
    if (::fcntl(fd, F_OFD_SETLK, &fl) == 0) return 0;
    if (errno != EINTR && !is_contention(errno)) return errno;
  }
}

// Waits in F_OFD_SETLKW until the lock is granted or a per-thread timer signal, armed for the
// expiry, interrupts it. Returns 0 or the errno that ended it.
int wait_with_timer(int fd, struct flock& fl, const countdown& cd, int signo) noexcept {
  sigevent sev{};
  sev.sigev_notify = SIGEV_THREAD_ID;
  sev.sigev_signo = signo;
  sev._sigev_un._tid = ::gettid();
  timer_t timer{};
  if (::timer_create(CLOCK_MONOTONIC, &sev, &timer) != 0) return poll_until(fd, fl, cd);

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
  int result = 0;
  if (spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0) {
    spec.it_value.tv_nsec = 1;  // zero would disarm the timer
  }
  if (::timer_settime(timer, TIMER_ABSTIME, &spec, nullptr) != 0) {
    result = poll_until(fd, fl, cd);
  } else {
    for (;;) {
      if (::fcntl(fd, F_OFD_SETLKW, &fl) == 0) break;
      if (errno != EINTR) {
        result = errno;
        break;
      }
      if (cd.expired()) {
        result = ETIMEDOUT;
        break;
      }
    }
  }
  ::timer_delete(timer);
  // A signal the timer queued before it was deleted is delivered (to the empty handler) on
  // the way back from timer_delete, while it is still unblocked; then the mask is restored.
  ::pthread_sigmask(SIG_SETMASK, &saved, nullptr);
  return result;
}

}  // namespace

int deadline_signal() noexcept {
  static const int signo = install_deadline_signal();
  return signo;
}

extent_guard::extent_guard(extent_guard&& other) noexcept
    : fd_(other.fd_), offset_(other.offset_), length_(other.length_), kind_(other.kind_) {
  other.fd_ = -1;
}

extent_guard& extent_guard::operator=(extent_guard&& other) noexcept {
  if (this != &other) {
    (void)unlock();
    fd_ = other.fd_;
    offset_ = other.offset_;
    length_ = other.length_;
    kind_ = other.kind_;
    other.fd_ = -1;
  }
  return *this;
}

result<void> extent_guard::unlock() noexcept {
  if (fd_ < 0) return {};
  const int fd = fd_;
  fd_ = -1;
  struct flock fl = make_flock(F_UNLCK, offset_, length_);
  if (::fcntl(fd, F_OFD_SETLK, &fl) != 0) return last_errno_error();
  return {};
}

result<extent_guard> lock_extent(const file_handle& file, off_t offset, off_t length,
                                 lock_kind kind, deadline d) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  const int fd = file.fd();
  struct flock fl = make_flock(kind == lock_kind::shared ? F_RDLCK : F_WRLCK, offset, length);

  // The uncontended path is one syscall, whatever the deadline.
  for (;;) {
    if (::fcntl(fd, F_OFD_SETLK, &fl) == 0) return extent_guard(fd, offset, length, kind);
    if (errno == EINTR) continue;
    if (!is_contention(errno)) return last_errno_error();
    break;
  }
  const countdown cd = d.start();
  if (cd.is_zero()) return errc_error(std::errc::operation_would_block);

  int e = 0;
  if (cd.is_infinite()) {
    // A signal of the application's own interrupts the wait; the caller asked to wait forever.
    while (::fcntl(fd, F_OFD_SETLKW, &fl) != 0) {
      if (errno != EINTR) {
        e = errno;
        break;
      }
    }
  } else if (cd.expired()) {
    e = ETIMEDOUT;
  } else if (const int signo = deadline_signal(); signo != 0) {
    e = wait_with_timer(fd, fl, cd, signo);
  } else {
    e = poll_until(fd, fl, cd);
  }
  if (e != 0) return errno_error(e);
  return extent_guard(fd, offset, length, kind);
}

result<void> unlock_extent(const file_handle& file, off_t offset, off_t length) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  struct flock fl = make_flock(F_UNLCK, offset, length);
  if (::fcntl(file.fd(), F_OFD_SETLK, &fl) != 0) return last_errno_error();
  return {};
}

result<bool> extent_is_free(const file_handle& file, off_t offset, off_t length,
                            lock_kind kind) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  struct flock fl = make_flock(kind == lock_kind::shared ? F_RDLCK : F_WRLCK, offset, length);
  if (::fcntl(file.fd(), F_OFD_GETLK, &fl) != 0) return last_errno_error();
  return fl.l_type == F_UNLCK;
}

}  // namespace keel::io
