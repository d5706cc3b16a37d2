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
  bool one_byte = false;  // [start, start]: how keel locks an entity
  std::string_view file;  // "MAJ:MIN:INO" as the kernel names the file (btrfs: not st_dev)
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
  k.one_byte = w[7] == w[6];
  k.file = w[5];
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
  // The lock file and its fallback as the kernel names them in lock lines ("MAJ:MIN:INO";
  // on btrfs not st_dev's numbers), learnt from the lines of descriptors open on them.
  std::map<std::string, role_of_file::kind> kernel_names;
  // Waiters in F_OFD_SETLKW, their entity told later from /proc/locks' blocked lines.
  std::vector<std::pair<lock_holder, role_of_file::kind>> byte_waiters;
  bool foreign_locks = false;  // locks keel does not take (POSIX, ranges, whole file)

  void add_user(std::uint32_t pid) {
    if (std::find(out.users.begin(), out.users.end(), pid) == out.users.end()) {
      out.users.push_back(pid);
    }
  }

  // One row per process and lock: descriptors duplicated within a process show it again.
  void holder(lock_holder h) {
    const bool seen = std::ranges::any_of(out.holders, [&](const lock_holder& o) {
      return o.what == h.what && o.pid == h.pid && o.algorithm == h.algorithm &&
             o.whole_file == h.whole_file && o.entity_known == h.entity_known &&
             o.entity == h.entity && o.exclusive == h.exclusive;
    });
    if (!seen) out.holders.push_back(std::move(h));
  }

  void look_at_descriptor(std::uint32_t pid, const std::string& fd, const role_of_file& r,
                          std::uint64_t started) {
    if (r.what != role_of_file::kind::fallback) add_user(pid);
    const std::string info = read_proc(fs, "/proc/" + std::to_string(pid) + "/fdinfo/" + fd);
    std::size_t at = 0;
    while (at < info.size()) {
      const auto end = std::min(info.find('\n', at), info.size());
      const auto k = parse_lock_line(std::string_view(info).substr(at, end - at));
      at = end + 1;
      if (!k) continue;
      if (r.what == role_of_file::kind::lock_file || r.what == role_of_file::kind::fallback) {
        kernel_names.emplace(std::string(k->file), r.what);
      }
      const auto start = static_cast<off_t>(k->start);
      const bool keel_byte = k->type == "OFDLCK" && k->one_byte;
      if (keel_byte && start >= detail::algorithm_bytes &&
          start < detail::algorithm_bytes + static_cast<off_t>(family_names.size())) {
        if (r.what != role_of_file::kind::fallback) {
          family_open[static_cast<std::size_t>(start - detail::algorithm_bytes)] = true;
        }
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
      } else if (!keel_byte) {
        foreign_locks = true;  // a POSIX lock, or a range: not an entity of keel's
        continue;
      } else if (r.what == role_of_file::kind::lock_file) {
        h.algorithm = "byte_ranges or fcntl";
        h.entity = k->start;
      } else if (r.what == role_of_file::kind::fallback) {
        h.algorithm = "memory_map (degraded)";
        h.entity = k->start;
      } else {
        continue;  // lock_files' .keel-break bytes: its holders are its records, below
      }
      holder(std::move(h));
    }
  }

  static constexpr long lock_nb_bit = 4;
  static constexpr long lock_ex_bit = 2;
  static constexpr long f_ofd_setlkw = 38;

  // A thread asleep in fcntl(fd, F_OFD_SETLKW) or a blocking flock(fd) on a file of the lock.
  void look_for_waiters(std::uint32_t pid, const std::map<int, role_of_file>& fds,
                        std::uint64_t started) {
    const std::string task = "/proc/" + std::to_string(pid) + "/task";
    for (const auto& tid : numeric_entries(fs, task)) {
      const std::string call = read_proc(fs, task + "/" + tid + "/syscall");
      const auto w = words(call);  // views into `call`
      if (w.size() < 3) continue;
      // -1 where a word is not a number: no syscall, fd or argument is -1 here. (Plain longs:
      // GCC's -O1 -Wmaybe-uninitialized misreads three optionals under TSan.)
      const long nr = number<long>(w[0]).value_or(-1);
      const long fd = w[1].starts_with("0x") ? number<long>(w[1].substr(2), 16).value_or(-1) : -1;
      const long arg = w[2].starts_with("0x") ? number<long>(w[2].substr(2), 16).value_or(-1) : -1;
      if (nr < 0 || fd < 0 || arg < 0) continue;
      const auto it = fds.find(static_cast<int>(fd));
      if (it == fds.end()) continue;
      lock_holder h;
      h.what = lock_holder::role::waits;
      h.pid = pid;
      h.host = host;
      h.process_started = started;
      if (nr == SYS_flock && (arg & lock_nb_bit) == 0) {
        h.exclusive = (arg & lock_ex_bit) != 0;
        if (it->second.what == role_of_file::kind::entity_file) {
          h.algorithm = "flock";
          h.entity = it->second.entity;
        } else if (it->second.what == role_of_file::kind::lock_file) {
          h.algorithm = "flock on the whole file";
          h.whole_file = true;
        } else {
          continue;
        }
        holder(std::move(h));
      } else if (nr == SYS_fcntl && arg == f_ofd_setlkw &&
                 (it->second.what == role_of_file::kind::lock_file ||
                  it->second.what == role_of_file::kind::fallback)) {
        h.algorithm = it->second.what == role_of_file::kind::fallback ? "memory_map (degraded)"
                                                                      : "byte_ranges or fcntl";
        byte_waiters.emplace_back(std::move(h), it->second.what);
      }
    }
  }

  // The entity a waiter in F_OFD_SETLKW waits for is told only by /proc/locks' blocked lines,
  // which name no process: known where one byte of its file is waited for, and its mode where
  // every blocked request on that byte asks the same.
  void tell_waiters() {
    std::map<role_of_file::kind, std::vector<std::pair<std::uint64_t, bool>>> blocked;
    const std::string locks = read_proc(fs, "/proc/locks");
    std::size_t at = 0;
    while (at < locks.size()) {
      const auto end = std::min(locks.find('\n', at), locks.size());
      const auto w = words(std::string_view(locks).substr(at, end - at));
      at = end + 1;
      // "2: -> OFDLCK ADVISORY WRITE -1 fe:00:123 5 5"
      if (w.size() < 9 || w[1] != "->" || w[2] != "OFDLCK") continue;
      const auto known = kernel_names.find(std::string(w[6]));
      if (known == kernel_names.end()) continue;
      const auto start = number<std::uint64_t>(w[7]);
      if (!start) continue;
      blocked[known->second].emplace_back(*start, w[4] == "WRITE");
    }
    for (auto& [h, kind] : byte_waiters) {
      const auto& lines = blocked[kind];
      const bool one_byte = !lines.empty() && std::ranges::all_of(lines, [&](const auto& l) {
        return l.first == lines[0].first;
      });
      h.entity_known = one_byte;
      h.entity = one_byte ? lines[0].first : 0;
      h.mode_known = one_byte && std::ranges::all_of(lines, [&](const auto& l) {
                       return l.second == lines[0].second;
                     });
      h.exclusive = h.mode_known && lines[0].second;
      holder(std::move(h));
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
      if (!value || e.type != io::entry_type::regular) continue;  // never open a FIFO
      auto f = io::file_handle::open_at(
          dir, e.name.c_str(),
          io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
      if (!f) continue;
      if (auto st = f->status(); !st || !st->is_regular()) continue;
      lf::owner_record rec{};
      auto n = f->read_at(0, std::as_writable_bytes(std::span(&rec, 1)));
      if (!n || *n != sizeof rec || std::memcmp(rec.magic, lf::record_magic, 8) != 0) continue;
      const base::process_identity who = lf::owner_of(rec);
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

bool is_open_with(const lock_state& st, std::string_view algorithm) noexcept {
  return std::find(st.open_with.begin(), st.open_with.end(), algorithm) != st.open_with.end();
}

}  // namespace

result<lock_state> inspect(const std::string& path, io::filesystem& fs) noexcept {
  // Through a final symlink, as flock(1) and `keel lock` with no NAME lock (keel's algorithms
  // refuse a link: their users are then not seen at the link, nor is anything lost).
  auto st = fs.stat_at(nullptr, path.c_str(), true);
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
    auto d = fs.open(nullptr, path.c_str(), io::open_flags::read | io::open_flags::directory, 0);
    if (!d) return std::unexpected(d.error().about(path));
    auto listed = fs.list_directory(*d);
    if (!listed) return std::unexpected(listed.error().about(path));
    entries = std::move(*listed);
    for (const auto& e : entries) {
      auto est = fs.stat_at(&*d, e.name.c_str(), false);
      if (!est || !est->is_regular()) continue;
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
    if (auto fb = fs.stat_at(nullptr, (path + ".fallback").c_str(), false);
        fb && fb->is_regular()) {
      s.files[{fb->device, fb->inode}] = {role_of_file::kind::fallback, 0};
    }
  }
  s.look_at_processes();
  s.tell_waiters();
  if (dir) s.read_records(*dir, entries, local);  // lock_files' holders are its records
  for (std::size_t k = 0; k < family_names.size(); ++k) {
    if (s.family_open[k]) s.out.open_with.emplace_back(family_names[k]);
  }
  // PATH.fallback is memory_map's only where memory_map has PATH open.
  if (!is_open_with(s.out, "memory_map")) {
    std::erase_if(s.out.holders,
                  [](const lock_holder& h) { return h.algorithm == "memory_map (degraded)"; });
  }
  // memory_map's and atomic_append's own bytes on their files are not entities.
  if (is_open_with(s.out, "memory_map") || is_open_with(s.out, "atomic_append")) {
    std::erase_if(s.out.holders,
                  [](const lock_holder& h) { return h.algorithm == "byte_ranges or fcntl"; });
  }
  const bool degraded = std::ranges::any_of(
      s.out.holders, [](const lock_holder& h) { return h.algorithm == "memory_map (degraded)"; });
  for (const std::string_view inside : {"atomic_append", "memory_map", "sysv"}) {
    if (!is_open_with(s.out, inside) || (inside == "memory_map" && degraded)) continue;
    s.out.not_shown.push_back(
        std::string(inside) + "'s holders: " +
        (inside == "atomic_append" ? std::string("they are records of its log")
         : inside == "memory_map"  ? std::string("they are slots of its shared map")
                                   : std::string("they are its semaphore set's counts")) +
        " (its users are shown)");
  }
  if (s.foreign_locks) {
    s.out.not_shown.push_back(
        "locks keel does not take (POSIX locks, or ranges of more than one byte) on the file");
  }
  s.out.not_shown.push_back(
      "waiters that poll (every wait on a network filesystem, and flock's timed waits)");
  std::sort(s.out.users.begin(), s.out.users.end());
  return s.out;
}

}  // namespace keel::lock
