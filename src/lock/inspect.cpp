// keel::lock::inspect: who holds a keel lock. Kernel locks are read where the kernel shows
// them with their process: /proc/PID/fdinfo of every descriptor open on the lock's files
// (/proc/locks names no pid for OFD locks). Waiters asleep in the kernel are seen in
// /proc/PID/task/TID/syscall. lock_files' holders are its owner records.

#include "keel/lock/inspect.hpp"

#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string_view>

#include "base/process.hpp"
#include "detail/common.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"
#include "lock_files_format.hpp"

namespace keel::lock {
namespace {

// What a file of the lock is to it.
struct role_of_file {
  enum class kind : std::uint8_t { lock_file, fallback, claim, breaker, entity_file };
  kind what = kind::lock_file;
  std::uint64_t entity = 0;  // entity_file: its value
};

// The whole of a small /proc file (empty on failure: it may be gone, or not ours to read).
std::string read_proc(io::filesystem& fs, const std::string& path) noexcept {
  auto f = io::file_handle::open(fs, path.c_str(), io::open_flags::read);
  if (!f) return {};
  std::string out(4096, '\0');
  std::size_t have = 0;
  for (;;) {
    auto n = f->read_at(static_cast<off_t>(have),
                        std::as_writable_bytes(std::span(out.data() + have, out.size() - have)));
    if (!n || *n == 0) break;
    have += *n;
    if (have == out.size()) out.resize(out.size() * 2);
  }
  out.resize(have);
  return out;
}

std::vector<std::string> numeric_entries(io::filesystem& fs, const std::string& dir) noexcept {
  std::vector<std::string> names;
  auto d = fs.open(nullptr, dir.c_str(), io::open_flags::read | io::open_flags::directory, 0);
  if (!d) return names;
  auto entries = fs.list_directory(*d);
  if (!entries) return names;
  for (auto& e : *entries) {
    if (!e.name.empty() &&
        std::all_of(e.name.begin(), e.name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      names.push_back(std::move(e.name));
    }
  }
  return names;
}

template <class T>
std::optional<T> number(std::string_view s, int base = 10) noexcept {
  T v{};
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v, base);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

std::vector<std::string_view> words(std::string_view line) noexcept {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t'))
      ++i;
    const std::size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t')
      ++i;
    if (i > start) out.push_back(line.substr(start, i - start));
  }
  return out;
}

// One "lock:" line of fdinfo: "lock:\t1: OFDLCK ADVISORY  WRITE -1 fe:00:123 5 5".
struct kernel_lock {
  std::string_view type;  // OFDLCK, POSIX, FLOCK
  bool exclusive = false;
  std::uint64_t start = 0;
  bool to_eof = false;
};

std::optional<kernel_lock> parse_lock_line(std::string_view line) noexcept {
  if (!line.starts_with("lock:")) return std::nullopt;
  const auto w = words(line.substr(5));
  // id: TYPE MODE RW PID DEV START END
  if (w.size() < 8) return std::nullopt;
  kernel_lock k;
  k.type = w[1];
  k.exclusive = w[3] == "WRITE";
  const auto start = number<std::uint64_t>(w[6]);
  if (!start) return std::nullopt;
  k.start = *start;
  k.to_eof = w[7] == "EOF";
  return k;
}

// This machine's boot time, seconds since the epoch (0: unknown).
std::uint64_t boot_time(io::filesystem& fs) noexcept {
  const std::string stat = read_proc(fs, "/proc/stat");
  const auto at = stat.find("\nbtime ");
  if (at == std::string::npos) return 0;
  const auto end = stat.find('\n', at + 7);
  return number<std::uint64_t>(std::string_view(stat).substr(at + 7, end - at - 7)).value_or(0);
}

std::uint64_t started_at(std::uint64_t ticks, std::uint64_t booted) noexcept {
  if (ticks == 0 || booted == 0) return 0;
  const long hz = ::sysconf(_SC_CLK_TCK);
  return booted + ticks / static_cast<std::uint64_t>(hz > 0 ? hz : 100);
}

std::string this_host() noexcept {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return {};
  return name;
}

constexpr std::array<std::string_view, 6> family_names = {
    "lock_files", "byte_ranges or fcntl", "atomic_append", "memory_map", "flock", "sysv"};

struct scan {
  explicit scan(io::filesystem& f) : fs(f) {}
  io::filesystem& fs;
  std::map<std::pair<std::uint64_t, std::uint64_t>, role_of_file> files;  // (dev, ino) →
  lock_state out;
  std::vector<bool> family_open = std::vector<bool>(family_names.size(), false);
  std::uint64_t booted = 0;
  std::string host;
  // Entity bytes waited for, from /proc/locks ("->" lines) on the lock file.
  std::vector<kernel_lock> blocked;
  std::uint64_t lock_dev = 0, lock_ino = 0;

  void add_user(std::uint32_t pid) {
    if (std::find(out.users.begin(), out.users.end(), pid) == out.users.end()) {
      out.users.push_back(pid);
    }
  }

  void holder(lock_holder h) { out.holders.push_back(std::move(h)); }

  void look_at_descriptor(std::uint32_t pid, const std::string& fd, const role_of_file& r,
                          std::uint64_t started) {
    add_user(pid);
    const std::string info = read_proc(fs, "/proc/" + std::to_string(pid) + "/fdinfo/" + fd);
    std::size_t at = 0;
    while (at < info.size()) {
      const auto end = std::min(info.find('\n', at), info.size());
      const auto k = parse_lock_line(std::string_view(info).substr(at, end - at));
      at = end + 1;
      if (!k) continue;
      const auto start = static_cast<off_t>(k->start);
      if (start >= detail::algorithm_bytes &&
          start < detail::algorithm_bytes + static_cast<off_t>(family_names.size())) {
        family_open[static_cast<std::size_t>(start - detail::algorithm_bytes)] = true;
        continue;
      }
      lock_holder h;
      h.pid = pid;
      h.host = host;
      h.process_started = started;
      h.exclusive = k->exclusive;
      if (k->type == "FLOCK") {
        if (r.what == role_of_file::kind::entity_file) {
          h.algorithm = "flock";
          h.entity = r.entity;
        } else if (r.what == role_of_file::kind::lock_file) {
          h.algorithm = "flock on the whole file";
          h.whole_file = true;
        } else {
          continue;
        }
      } else if (r.what == role_of_file::kind::lock_file) {
        h.algorithm = "byte_ranges or fcntl";
        h.entity = k->start;
      } else if (r.what == role_of_file::kind::fallback) {
        h.algorithm = "memory_map (degraded)";
        h.entity = k->start;
      } else if (r.what == role_of_file::kind::breaker && !k->exclusive) {
        continue;  // lock_files' holders: from their records, below
      } else {
        continue;
      }
      holder(std::move(h));
    }
  }

  // A thread asleep in fcntl(fd, F_OFD_SETLKW) or a blocking flock(fd) on a file of the lock.
  void look_for_waiters(std::uint32_t pid, const std::map<int, role_of_file>& fds,
                        std::uint64_t started) {
    const std::string task = "/proc/" + std::to_string(pid) + "/task";
    for (const auto& tid : numeric_entries(fs, task)) {
      const std::string call = read_proc(fs, task + "/" + tid + "/syscall");
      const auto w = words(call);  // views into `call`
      if (w.size() < 3) continue;
      const auto nr = number<long>(w[0]);
      const auto fd = w[1].starts_with("0x") ? number<long>(w[1].substr(2), 16) : std::nullopt;
      const auto arg = w[2].starts_with("0x") ? number<long>(w[2].substr(2), 16) : std::nullopt;
      if (!nr || !fd || !arg) continue;
      const auto it = fds.find(static_cast<int>(*fd));
      if (it == fds.end()) continue;
      lock_holder h;
      h.what = lock_holder::role::waits;
      h.pid = pid;
      h.host = host;
      h.process_started = started;
      if (*nr == SYS_flock && (*arg & LOCK_NB_BIT) == 0) {
        h.exclusive = (*arg & 2) != 0;  // LOCK_EX
        if (it->second.what == role_of_file::kind::entity_file) {
          h.algorithm = "flock";
          h.entity = it->second.entity;
        } else {
          h.algorithm = "flock on the whole file";
          h.whole_file = true;
        }
        holder(std::move(h));
      } else if (*nr == SYS_fcntl && *arg == F_OFD_SETLKW_CMD) {
        h.algorithm = it->second.what == role_of_file::kind::fallback ? "memory_map (degraded)"
                                                                      : "byte_ranges or fcntl";
        // Which byte: told by /proc/locks when one byte of this file is waited for.
        if (blocked.size() == 1) {
          h.entity = blocked[0].start;
          h.exclusive = blocked[0].exclusive;
        } else {
          h.entity_known = false;
        }
        holder(std::move(h));
      }
    }
  }

  static constexpr long LOCK_NB_BIT = 4;
  static constexpr long F_OFD_SETLKW_CMD = 38;

  void read_blocked() {
    const std::string locks = read_proc(fs, "/proc/locks");
    std::size_t at = 0;
    while (at < locks.size()) {
      const auto end = std::min(locks.find('\n', at), locks.size());
      const auto w = words(std::string_view(locks).substr(at, end - at));
      at = end + 1;
      // "2: -> OFDLCK ADVISORY WRITE -1 fe:00:123 5 5"
      if (w.size() < 9 || w[1] != "->" || w[2] != "OFDLCK") continue;
      const auto dev_ino = w[6];
      const auto c1 = dev_ino.find(':'), c2 = dev_ino.rfind(':');
      if (c1 == std::string_view::npos || c1 == c2) continue;
      const auto maj = number<unsigned>(dev_ino.substr(0, c1), 16);
      const auto min = number<unsigned>(dev_ino.substr(c1 + 1, c2 - c1 - 1), 16);
      const auto ino = number<std::uint64_t>(dev_ino.substr(c2 + 1));
      const auto start = number<std::uint64_t>(w[7]);
      if (!maj || !min || !ino || !start) continue;
      if (::makedev(*maj, *min) != lock_dev || *ino != lock_ino) continue;
      kernel_lock k;
      k.exclusive = w[4] == "WRITE";
      k.start = *start;
      if (std::none_of(blocked.begin(), blocked.end(),
                       [&](const kernel_lock& b) { return b.start == k.start; })) {
        blocked.push_back(k);
      }
    }
  }

  void look_at_processes() {
    const auto pids = numeric_entries(fs, "/proc");
    bool unreadable = false;
    for (const auto& p : pids) {
      const auto pid = number<std::uint32_t>(p);
      if (!pid) continue;
      const std::string fd_dir = "/proc/" + p + "/fd";
      auto d =
          fs.open(nullptr, fd_dir.c_str(), io::open_flags::read | io::open_flags::directory, 0);
      if (!d) {
        if (d.error() == std::errc::permission_denied) unreadable = true;
        continue;
      }
      auto entries = fs.list_directory(*d);
      if (!entries) continue;
      std::map<int, role_of_file> mine;
      for (const auto& e : *entries) {
        const auto fd = number<int>(e.name);
        if (!fd) continue;
        auto st = fs.stat_at(&*d, e.name.c_str(), true);
        if (!st) continue;
        const auto it = files.find({st->device, st->inode});
        if (it != files.end()) mine.emplace(*fd, it->second);
      }
      if (mine.empty()) continue;
      const std::uint64_t started =
          started_at(base::start_time_of(static_cast<pid_t>(*pid), fs), booted);
      for (const auto& [fd, r] : mine)
        look_at_descriptor(*pid, std::to_string(fd), r, started);
      look_for_waiters(*pid, mine, started);
    }
    if (unreadable) {
      out.not_shown.push_back(
          "processes of other users: their /proc/PID/fd is not readable (run as root)");
    }
  }

  void read_records(const io::file_handle& dir, const std::vector<io::directory_entry>& entries,
                    bool local) {
    for (const auto& e : entries) {
      const auto value = e.name.size() == 16 ? number<std::uint64_t>(e.name, 16) : std::nullopt;
      if (!value) continue;
      auto f = io::file_handle::open_at(
          dir, e.name.c_str(),
          io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
      if (!f) continue;
      lf::owner_record rec{};
      auto n = f->read_at(0, std::as_writable_bytes(std::span(&rec, 1)));
      if (!n || *n != sizeof rec || std::memcmp(rec.magic, lf::record_magic, 8) != 0) continue;
      base::process_identity who;
      who.pid = rec.pid;
      who.pid_ns = rec.pid_ns;
      who.start_time = rec.start_time;
      std::memcpy(who.boot_id.data(), rec.boot_id, sizeof rec.boot_id);
      std::memcpy(who.machine_id.data(), rec.machine_id, sizeof rec.machine_id);
      const auto alive = base::check(
          who, local ? base::recorded_on::local_filesystem : base::recorded_on::shared_filesystem,
          fs);
      lock_holder h;
      h.what = alive == base::liveness::dead ? lock_holder::role::stale : lock_holder::role::holds;
      h.algorithm = "lock_files";
      h.pid = rec.pid;
      h.host.assign(rec.host, strnlen(rec.host, sizeof rec.host));
      const bool this_boot = std::memcmp(rec.boot_id, base::self().boot_id.data(), 16) == 0;
      h.process_started = this_boot ? started_at(rec.start_time, booted) : 0;
      h.entity = *value;
      holder(std::move(h));
    }
  }
};

}  // namespace

result<lock_state> inspect(const std::string& path, io::filesystem& fs) noexcept {
  auto st = fs.stat_at(nullptr, path.c_str(), false);
  if (!st) return std::unexpected(st.error().about(path));
  scan s(fs);
  s.booted = boot_time(fs);
  s.host = this_host();
  s.out.directory = st->is_directory();
  const auto where = io::stat_fs(fs, path.c_str());
  const bool local = where && where->is_local;
  if (!local) {
    s.out.not_shown.push_back(
        "processes of other machines: the filesystem may be shared, and only lock_files "
        "records its holders in files");
  }
  std::optional<io::file_handle> dir;
  std::vector<io::directory_entry> entries;
  if (s.out.directory) {
    auto d =
        fs.open(nullptr, path.c_str(),
                io::open_flags::read | io::open_flags::directory | io::open_flags::no_follow, 0);
    if (!d) return std::unexpected(d.error().about(path));
    auto listed = fs.list_directory(*d);
    if (!listed) return std::unexpected(listed.error().about(path));
    entries = std::move(*listed);
    for (const auto& e : entries) {
      auto est = fs.stat_at(&*d, e.name.c_str(), false);
      if (!est) continue;
      role_of_file r;
      if (e.name == ".keel-algorithm") {
        r.what = role_of_file::kind::claim;
      } else if (e.name == lf::breaker_name) {
        r.what = role_of_file::kind::breaker;
      } else if (const auto v =
                     e.name.size() == 16 ? number<std::uint64_t>(e.name, 16) : std::nullopt) {
        r.what = role_of_file::kind::entity_file;
        r.entity = *v;
      } else {
        continue;
      }
      s.files[{est->device, est->inode}] = r;
    }
    dir = std::move(*d);
  } else {
    s.files[{st->device, st->inode}] = {role_of_file::kind::lock_file, 0};
    s.lock_dev = st->device;
    s.lock_ino = st->inode;
    if (auto fb = fs.stat_at(nullptr, (path + ".fallback").c_str(), false); fb) {
      s.files[{fb->device, fb->inode}] = {role_of_file::kind::fallback, 0};
    }
    s.read_blocked();
  }
  s.look_at_processes();
  if (dir) {
    // lock_files' holders are its records; without them the names are flock's files.
    s.read_records(*dir, entries, local);
  }
  for (std::size_t k = 0; k < family_names.size(); ++k) {
    if (s.family_open[k]) s.out.open_with.emplace_back(family_names[k]);
  }
  for (const std::string_view inside : {"atomic_append", "memory_map", "sysv"}) {
    if (std::find(s.out.open_with.begin(), s.out.open_with.end(), inside) ==
        s.out.open_with.end()) {
      continue;
    }
    s.out.not_shown.push_back(
        std::string(inside) + "'s holders: " +
        (inside == "atomic_append" ? std::string("they are records of its log")
         : inside == "memory_map"  ? std::string("they are slots of its shared map")
                                   : std::string("they are its semaphore set's counts")) +
        " (its users are shown)");
  }
  // Memory_map's own bytes on its lock file are not entities.
  if (std::find(s.out.open_with.begin(), s.out.open_with.end(), "memory_map") !=
      s.out.open_with.end()) {
    std::erase_if(s.out.holders,
                  [](const lock_holder& h) { return h.algorithm == "byte_ranges or fcntl"; });
  }
  if (std::find(s.out.open_with.begin(), s.out.open_with.end(), "atomic_append") !=
      s.out.open_with.end()) {
    std::erase_if(s.out.holders,
                  [](const lock_holder& h) { return h.algorithm == "byte_ranges or fcntl"; });
  }
  std::sort(s.out.users.begin(), s.out.users.end());
  return s.out;
}

}  // namespace keel::lock
