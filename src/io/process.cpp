#include "process.hpp"

#include <signal.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "base/per_thread.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::io {
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

// 32 hex digits (machine-id and boot_id, with or without dashes) as 16 bytes; zero if short.
std::array<std::uint8_t, 16> id_of_hex(const char* text, std::size_t n) noexcept {
  std::array<std::uint8_t, 16> id{};
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
  if (k < 32) return {};
  return id;
}

std::array<std::uint8_t, 16> read_id(const char* path) noexcept {
  std::array<char, 64> text{};
  const std::size_t n = read_small(io::os(), path, text);
  return id_of_hex(text.data(), n);
}

std::uint32_t read_pid_ns() noexcept {
  auto st = io::os().stat_at(nullptr, "/proc/self/ns/pid", true);
  return st ? static_cast<std::uint32_t>(st->inode) : 0;
}

bool is_zero(const std::array<std::uint8_t, 16>& id) noexcept {
  for (const std::uint8_t b : id)
    if (b != 0) return false;
  return true;
}

// The boottime offset of this process's time namespace, in clock ticks: the start times in
// /proc/PID/stat are shifted by the reader's offset, so two readers in different time
// namespaces see different start times for one process. 0 where the kernel has no time
// namespaces (no such file); nullopt when it cannot be read.
std::optional<std::int64_t> boottime_offset_ticks(io::filesystem& fs) noexcept {
  auto f = io::file_handle::open(fs, "/proc/self/timens_offsets", io::open_flags::read);
  if (!f) {
    if (f.error() == std::errc::no_such_file_or_directory) return 0;
    return std::nullopt;
  }
  std::array<char, 512> text{};
  auto n = f->read_at(0, std::as_writable_bytes(std::span(text.data(), text.size() - 1)));
  if (!n) return std::nullopt;
  text[*n] = '\0';
  const char* line = std::strstr(text.data(), "boottime");
  if (line == nullptr) return std::nullopt;
  long long secs = 0;
  long long nanos = 0;
  if (std::sscanf(line, "boottime %lld %lld", &secs, &nanos) != 2) return std::nullopt;
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return std::nullopt;
  return static_cast<std::int64_t>(secs * ticks + nanos * ticks / 1'000'000'000);
}

// Whether /proc is this process's pid namespace's: /proc/self names the pid getpid() gives.
// A /proc of an ancestor namespace numbers processes otherwise, and /proc/PID there is
// another process than the pid recorded (or none).
bool proc_is_ours() noexcept {
  std::array<char, 128> stat{};
  if (read_small(io::os(), "/proc/self/stat", stat) == 0) return false;
  return std::strtol(stat.data(), nullptr, 10) == static_cast<long>(::getpid());
}

}  // namespace

std::uint64_t start_time_of(pid_t pid, io::filesystem& fs) noexcept {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", static_cast<int>(pid));
  std::array<char, 1024> buf{};
  if (read_small(fs, path, buf) == 0) return 0;
  const auto offset = boottime_offset_ticks(fs);
  if (!offset) return 0;
  // The command name (field 2) may hold spaces and parentheses: count fields after the last ')'.
  const char* p = std::strrchr(buf.data(), ')');
  if (p == nullptr) return 0;
  int field = 2;
  for (; *p != '\0' && field < 22; ++p) {
    if (*p == ' ') ++field;
  }
  // As the initial time namespace sees it: the same for every reader.
  const auto seen = static_cast<std::int64_t>(std::strtoull(p, nullptr, 10));
  return seen > *offset ? static_cast<std::uint64_t>(seen - *offset) : 0;
}

const process_identity& self() noexcept {
  static thread_local process_identity me;
  static thread_local std::uint64_t generation = ~std::uint64_t{0};
  const std::uint64_t gen = base::fork_generation();
  if (generation != gen || me.pid == 0) {
    static const auto boot = read_id("/proc/sys/kernel/random/boot_id");
    static const auto machine = read_id("/etc/machine-id");
    me.pid = static_cast<std::uint32_t>(::getpid());
    // Again after fork: the child may be in a new namespace. A /proc that is not of our
    // namespace tells nothing about our pids: unknown, for us and for everyone we judge.
    const bool ours = proc_is_ours();
    me.pid_ns = ours ? read_pid_ns() : 0;
    me.start_time = ours ? start_time_of(::getpid()) : 0;
    me.boot_id = boot;
    me.machine_id = machine;
    generation = gen;
  }
  return me;
}

liveness check(const process_identity& who, recorded_on where, io::filesystem& fs) noexcept {
  const process_identity& me = self();
  if (is_zero(who.boot_id) || is_zero(me.boot_id)) return liveness::unknown;
  if (who.boot_id != me.boot_id) {
    // Another boot: of this machine, then everything of that boot is gone; of another
    // machine (a shared network filesystem), nothing can be told from here. Only a local
    // filesystem proves it is this machine: on a shared one, a clone of this machine's image
    // has our machine id and may run now.
    const bool same_machine = where == recorded_on::local_filesystem && !is_zero(me.machine_id) &&
                              who.machine_id == me.machine_id;
    return same_machine ? liveness::dead : liveness::unknown;
  }
  if (who.pid == 0 || who.pid_ns == 0 || who.pid_ns != me.pid_ns) return liveness::unknown;
  if (::kill(static_cast<pid_t>(who.pid), 0) != 0 && errno == ESRCH) return liveness::dead;
  // It exists (perhaps another user's: EPERM). The same process, or a recycled pid?
  const std::uint64_t started = start_time_of(static_cast<pid_t>(who.pid), fs);
  if (started == 0 || who.start_time == 0) return liveness::unknown;
  return started == who.start_time ? liveness::alive : liveness::dead;
}

}  // namespace keel::io
