#include "process.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "per_thread.hpp"

namespace keel::lock::detail {
namespace {

std::array<std::uint8_t, 16> read_boot_id() noexcept {
  std::array<std::uint8_t, 16> id{};
  char text[64] = {};
  const int fd = ::open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return id;
  const ssize_t n = ::read(fd, text, sizeof text - 1);
  ::close(fd);
  if (n <= 0) return id;
  std::size_t k = 0;
  for (ssize_t i = 0; i < n && k < 32; ++i) {
    const char c = text[i];
    int v = -1;
    if (c >= '0' && c <= '9') v = c - '0';
    if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    if (v < 0) continue;
    id[k / 2] = static_cast<std::uint8_t>(id[k / 2] | (k % 2 == 0 ? v << 4 : v));
    ++k;
  }
  return id;
}

}  // namespace

std::uint64_t start_time_of(pid_t pid) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  // The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
  const char* p = std::strrchr(buf, ')');
  if (p == nullptr) return 0;
  int field = 2;
  for (; *p != '\0' && field < 22; ++p) {
    if (*p == ' ') ++field;
  }
  return std::strtoull(p, nullptr, 10);
}

const process_identity& self() noexcept {
  static thread_local process_identity me;
  static thread_local std::uint64_t generation = ~std::uint64_t{0};
  const std::uint64_t gen = fork_generation();
  if (generation != gen || me.pid == 0) {
    static const auto boot = read_boot_id();
    me.pid = static_cast<std::uint32_t>(::getpid());
    me.start_time = start_time_of(::getpid());
    me.boot_id = boot;
    generation = gen;
  }
  return me;
}

liveness check(const process_identity& who) noexcept {
  if (who.boot_id != self().boot_id) return liveness::unknown;
  const std::uint64_t started = start_time_of(static_cast<pid_t>(who.pid));
  if (started == 0) return liveness::dead;  // no such process on this machine now
  return started == who.start_time ? liveness::alive : liveness::dead;
}

std::minstd_rand& thread_rng() noexcept {
  static thread_local std::minstd_rand rng = [] {
    std::uint32_t seed = 0;
    if (::getrandom(&seed, sizeof seed, GRND_NONBLOCK) != sizeof seed) {
      seed =
          static_cast<std::uint32_t>(::getpid()) ^
          static_cast<std::uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    }
    return std::minstd_rand(seed | 1);
  }();
  return rng;
}

bool backoff::pause(const io::countdown& cd) noexcept {
  if (cd.is_zero()) return false;
  if (cd.expired()) return false;
  if (spin_) {
    std::this_thread::yield();
    return true;
  }
  // Jitter in [next/2, next) so waiters that collided do not collide again in step.
  const auto base = next_.count();
  const auto jitter =
      static_cast<std::int64_t>(thread_rng()() % static_cast<std::uint64_t>(base / 2 + 1));
  auto wait = std::chrono::nanoseconds(base / 2 + jitter);
  wait = std::min<std::chrono::nanoseconds>(wait, cd.remaining());
  std::this_thread::sleep_for(wait);
  next_ = std::min<std::chrono::nanoseconds>(next_ * 2, cap_);
  return true;  // one more attempt after every sleep, even the one that reaches the deadline
}

}  // namespace keel::lock::detail
