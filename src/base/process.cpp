#include "process.hpp"

#include <sys/random.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "keel/io/file_handle.hpp"
#include "per_thread.hpp"

namespace keel::base {
namespace {

// The whole of a small /proc file, NUL-terminated; empty on any failure.
template <std::size_t N>
std::size_t read_small(io::filesystem& fs, const char* path, std::array<char, N>& buf) noexcept {
  auto f = io::file_handle::open(fs, path, io::open_flags::read);
  if (!f) return 0;
  auto n = f->read_at(0, std::as_writable_bytes(std::span(buf.data(), N - 1)));
  if (!n) return 0;
  buf[*n] = '\0';
  return *n;
}

std::array<std::uint8_t, 16> read_boot_id() noexcept {
  std::array<std::uint8_t, 16> id{};
  std::array<char, 64> text{};
  const std::size_t n = read_small(io::os(), "/proc/sys/kernel/random/boot_id", text);
  std::size_t k = 0;
  for (std::size_t i = 0; i < n && k < 32; ++i) {
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

std::uint64_t start_time_of(pid_t pid, io::filesystem& fs) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  std::array<char, 1024> buf{};
  if (read_small(fs, path, buf) == 0) return 0;
  // The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
  const char* p = std::strrchr(buf.data(), ')');
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

liveness check(const process_identity& who, io::filesystem& fs) noexcept {
  if (who.boot_id != self().boot_id) return liveness::unknown;
  const std::uint64_t started = start_time_of(static_cast<pid_t>(who.pid), fs);
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

}  // namespace keel::base
