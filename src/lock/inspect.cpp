// keel::lock::inspect: who holds a keel lock. Kernel locks are read where the kernel shows
// them with their process: /proc/PID/fdinfo of every descriptor open on the lock's files
// (/proc/locks names no pid for OFD locks, but shows every pid namespace's). Waiters asleep
// in the kernel are seen in /proc/PID/task/TID/syscall. lock_files' holders are its owner
// records; atomic_append's, memory_map's and sysv's are read by inspect_parts.hpp's readers.

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
#include <set>
#include <span>
#include <string_view>

#include "detail/common.hpp"
#include "inspect_parts.hpp"
#include "io/process.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"
#include "lock_files_format.hpp"
#include "memory_map/slot_table.hpp"
#include "sysv_key.hpp"

namespace keel::lock {
namespace {

// What a file of the lock is to it.
struct role_of_file {
  enum class kind : std::uint8_t { lock_file, fallback, claim, breaker, entity_file, map };
  kind what = kind::lock_file;
  std::uint64_t entity = 0;  // entity_file: its value
};

// The whole of a small /proc file, or nothing if it cannot be opened or a read fails (it may
// be gone, or not ours to read).
std::optional<std::string> read_proc_whole(io::filesystem& fs, const std::string& path) noexcept {
  auto f = io::file_handle::open(fs, path.c_str(), io::open_flags::read);
  if (!f) return std::nullopt;
  std::string out(4096, '\0');
  std::size_t have = 0;
  for (;;) {
    auto n = f->read_at(static_cast<off_t>(have),
                        std::as_writable_bytes(std::span(out.data() + have, out.size() - have)));
    if (!n) return std::nullopt;
    if (*n == 0) break;
    have += *n;
    if (have == out.size()) out.resize(out.size() * 2);
  }
  out.resize(have);
  return out;
}

// The same, empty on failure.
std::string read_proc(io::filesystem& fs, const std::string& path) noexcept {
  return read_proc_whole(fs, path).value_or(std::string());
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

std::string this_host() noexcept {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return {};
  return name;
}

constexpr std::array<std::string_view, 6> family_names = {
    "lock_files", "byte_ranges or fcntl", "atomic_append", "memory_map", "flock", "sysv"};

struct scan {
  explicit scan(inspecting::context& c) : ctx(c), fs(c.fs) {}
  inspecting::context& ctx;
  io::filesystem& fs;
  std::map<std::pair<std::uint64_t, std::uint64_t>, role_of_file> files;  // (dev, ino) →
  lock_state out;
  std::vector<bool> family_open = std::vector<bool>(family_names.size(), false);
  int semid = -1;  // sysv's semaphore set for the lock file, if there is one
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

  void look_at_descriptor(std::uint32_t pid, const std::string& fd,
                          std::pair<std::uint64_t, std::uint64_t> file, const role_of_file& r,
                          std::uint64_t started) {
    if (r.what != role_of_file::kind::fallback && r.what != role_of_file::kind::map) {
      add_user(pid);
    }
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
      ctx.names.emplace(file, std::string(k->file));
      if (k->type == "OFDLCK")
        ctx.lock_owner.emplace(std::pair(std::string(k->file), k->start), pid);
      if (r.what == role_of_file::kind::map) continue;  // memory_map's users: read_map
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
      h.host = ctx.host;
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

  static bool is_semaphore_wait(long nr) noexcept {
#ifdef SYS_semop
    if (nr == SYS_semop) return true;
#endif
#ifdef SYS_semtimedop
    if (nr == SYS_semtimedop) return true;
#endif
    return false;
  }

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
      lock_holder h;
      h.what = lock_holder::role::waits;
      h.pid = pid;
      h.host = ctx.host;
      h.process_started = started;
      if (semid >= 0 && fd == semid && is_semaphore_wait(nr)) {
        // Which semaphores it waits for is in its memory, not shown: any slot, either mode.
        h.algorithm = "sysv";
        h.entity_known = false;
        h.mode_known = false;
        holder(std::move(h));
        continue;
      }
      const auto it = fds.find(static_cast<int>(fd));
      if (it == fds.end()) continue;
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
    for (const auto& [name, kind] : kernel_names) {
      const auto it = ctx.kernel_locks.find(name);
      if (it == ctx.kernel_locks.end()) continue;
      for (const auto& r : it->second) {
        if (r.blocked && r.ofd) blocked[kind].emplace_back(r.start, r.exclusive);
      }
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

  // The "ino:" line of a descriptor's fdinfo (Linux 5.14 on), or nothing.
  std::optional<std::uint64_t> inode_in_fdinfo(const std::string& fdinfo) {
    const std::string info = read_proc(fs, fdinfo);
    const auto at = info.find("\nino:");
    if (at == std::string::npos) return std::nullopt;
    const auto w = words(std::string_view(info).substr(at + 5, info.find('\n', at + 5) - at - 5));
    if (w.empty()) return std::nullopt;
    return number<std::uint64_t>(w[0]);
  }

  // Whether fdinfo's inode numbers are stat's on the lock's filesystem (overlayfs, for one,
  // may show another): only then do they tell a descriptor is not of the lock.
  bool prefilter = false;
  void check_prefilter(const std::string& path, const io::file_status& st) {
    auto f = io::file_handle::open(
        fs, path.c_str(),
        io::open_flags::read | io::open_flags::non_blocking |
            (st.is_directory() ? io::open_flags::directory : io::open_flags::read));
    if (!f) return;
    const auto ino = inode_in_fdinfo("/proc/self/fdinfo/" + std::to_string(f->fd()));
    prefilter = ino && *ino == st.inode;
  }

  void look_at_processes() {
    std::set<std::uint64_t> inodes;
    for (const auto& [id, r] : files)
      inodes.insert(id.second);
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
      std::map<int, std::pair<std::pair<std::uint64_t, std::uint64_t>, role_of_file>> mine;
      for (const auto& e : *entries) {
        const auto fd = number<int>(e.name);
        if (!fd) continue;
        // Its inode from fdinfo first: a stat follows the link to the file, which on a mount
        // that no longer answers (a dead NFS or FUSE server) would hang this look for good.
        if (const auto ino =
                prefilter ? inode_in_fdinfo("/proc/" + p + "/fdinfo/" + e.name) : std::nullopt;
            ino && !inodes.contains(*ino)) {
          continue;
        }
        auto st = fs.stat_at(&*d, e.name.c_str(), true);
        if (!st) continue;
        const auto it = files.find({st->device, st->inode});
        if (it != files.end()) mine.emplace(*fd, std::pair(it->first, it->second));
      }
      if (mine.empty()) continue;
      const std::uint64_t started = ctx.started_at(io::start_time_of(static_cast<pid_t>(*pid), fs));
      std::map<int, role_of_file> roles;
      for (const auto& [fd, f] : mine) {
        look_at_descriptor(*pid, std::to_string(fd), f.first, f.second, started);
        roles.emplace(fd, f.second);
      }
      look_for_waiters(*pid, roles, started);
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
      const io::process_identity who = lf::owner_of(rec);
      const auto alive = io::check(
          who, local ? io::recorded_on::local_filesystem : io::recorded_on::shared_filesystem, fs);
      lock_holder h;
      h.what = alive == io::liveness::dead ? lock_holder::role::stale : lock_holder::role::holds;
      h.algorithm = "lock_files";
      h.pid = rec.pid;
      h.host.assign(rec.host, strnlen(rec.host, sizeof rec.host));
      const bool this_boot = std::memcmp(rec.boot_id, io::self().boot_id.data(), 16) == 0;
      h.process_started = this_boot ? ctx.started_at(rec.start_time) : 0;
      h.entity = *value;
      holder(std::move(h));
    }
  }
};

bool is_open_with(const lock_state& st, std::string_view algorithm) noexcept {
  return std::find(st.open_with.begin(), st.open_with.end(), algorithm) != st.open_with.end();
}

}  // namespace

namespace inspecting {

// /proc/locks: "1: OFDLCK ADVISORY WRITE -1 fe:00:123 5 5", blocked requests with "->" after
// the id.
void context::refresh_kernel_locks() {
  kernel_locks.clear();
  kernel_locks_read = false;
  const auto read = read_proc_whole(fs, "/proc/locks");
  if (!read) return;  // unread: no lock is judged absent from it
  const std::string& locks = *read;
  kernel_locks_read = true;
  std::size_t at = 0;
  while (at < locks.size()) {
    const auto end = std::min(locks.find('\n', at), locks.size());
    auto w = words(std::string_view(locks).substr(at, end - at));
    at = end + 1;
    kernel_range r;
    if (w.size() > 1 && w[1] == "->") {
      r.blocked = true;
      w.erase(w.begin() + 1);
    }
    if (w.size() < 8) continue;
    const auto start = number<std::uint64_t>(w[6]);
    if (!start) continue;
    r.start = *start;
    r.end = w[7] == "EOF" ? ~std::uint64_t{0} : number<std::uint64_t>(w[7]).value_or(r.start);
    r.exclusive = w[3] == "WRITE";
    r.ofd = w[1] == "OFDLCK";
    kernel_locks[std::string(w[5])].push_back(r);
  }
}

std::string context::kernel_name(std::uint64_t dev, std::uint64_t ino) const {
  if (const auto it = names.find({dev, ino}); it != names.end()) return it->second;
  char name[64];
  std::snprintf(name, sizeof name, "%02x:%02x:%llu", ::major(static_cast<dev_t>(dev)),
                ::minor(static_cast<dev_t>(dev)), static_cast<unsigned long long>(ino));
  return name;
}

bool context::locked(const std::string& name, std::uint64_t at) const {
  const auto it = kernel_locks.find(name);
  if (it == kernel_locks.end()) return false;
  return std::ranges::any_of(it->second, [&](const kernel_range& r) {
    return !r.blocked && r.start <= at && at <= r.end;
  });
}

std::uint64_t context::started_at(std::uint64_t ticks) const noexcept {
  if (ticks == 0 || booted == 0) return 0;
  const long hz = ::sysconf(_SC_CLK_TCK);
  return booted + ticks / static_cast<std::uint64_t>(hz > 0 ? hz : 100);
}

}  // namespace inspecting

bool lock_holder::could_be(std::uint64_t value) const noexcept {
  if (whole_file) return false;
  if (slot >= 0 && slots > 0) {
    const std::uint64_t s = algorithm == "sysv"
                                ? sysv_set::slot_of(value, slots)
                                : static_cast<std::uint64_t>(memory_map_detail::slot_of(value));
    return s == static_cast<std::uint64_t>(slot);
  }
  return !entity_known || entity == value;
}

result<lock_state> inspect(const std::string& path, io::filesystem& fs) noexcept {
  // Through a final symlink, as flock(1) and `keel lock` with no NAME lock (keel's algorithms
  // refuse a link: their users are then not seen at the link, nor is anything lost).
  auto st = fs.stat_at(nullptr, path.c_str(), true);
  if (!st) return std::unexpected(st.error().about(path));
  inspecting::context ctx(fs);
  ctx.booted = boot_time(fs);
  ctx.host = this_host();
  scan s(ctx);
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
  std::string map;  // memory_map's, named by the lock file
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
    // Only a regular file is opened: opening a FIFO would let its writer through.
    if (st->is_regular()) map = inspecting::map_of(fs, path);
    if (auto ms =
            map.empty() ? std::nullopt : std::optional(fs.stat_at(nullptr, map.c_str(), false));
        ms && *ms && (*ms)->is_regular()) {
      s.files[{(*ms)->device, (*ms)->inode}] = {role_of_file::kind::map, 0};
    } else {
      map.clear();  // gone (its users all left, or a reboot): nobody holds a slot of it
    }
    s.semid = inspecting::semaphore_set_of({st->device, st->inode});
  }
  if (st->is_regular() || st->is_directory()) s.check_prefilter(path, *st);
  s.look_at_processes();
  for (std::size_t k = 0; k < family_names.size(); ++k) {
    if (s.family_open[k]) s.out.open_with.emplace_back(family_names[k]);
  }
  // After the processes: a waiter seen asleep in their syscall and still waiting is here.
  ctx.refresh_kernel_locks();
  s.tell_waiters();
  if (dir) s.read_records(*dir, entries, local);  // lock_files' holders are its records
  if (st->is_regular()) {
    // A log's or a map's marks are shown whoever has the file open now (those of an earlier
    // use are stale); a semaphore set only while sysv has it open: another program's set may
    // have the same key.
    if (!inspecting::read_log(ctx, path, s.out) && is_open_with(s.out, "atomic_append")) {
      s.out.not_shown.push_back(
          "atomic_append's holders: the file has no atomic_append log header (damaged?)");
    }
    if (!map.empty()) {
      inspecting::read_map(ctx, map, s.out);
    } else if (is_open_with(s.out, "memory_map") &&
               !std::ranges::any_of(s.out.holders, [](const lock_holder& h) {
                 return h.algorithm == "memory_map (degraded)";
               })) {
      s.out.not_shown.push_back(
          "memory_map's holders: its lock file names no map that can be read");
    }
    if (s.semid >= 0 && is_open_with(s.out, "sysv")) {
      inspecting::read_semaphores(ctx, s.semid, s.out);
    }
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
  if (std::ranges::any_of(s.out.holders, [](const lock_holder& h) { return h.slot >= 0; })) {
    s.out.not_shown.push_back(
        "the entities of memory_map's and sysv's holders: they lock slots, which several "
        "entities share (the slot is shown, and the names given that fall in it)");
  }
  if (std::ranges::any_of(s.out.holders, [](const lock_holder& h) {
        return h.algorithm == "sysv" && h.slot >= 0 && !h.exclusive;
      })) {
    s.out.not_shown.push_back(
        "sysv's shared holders: the kernel counts them, and names none (pid 0)");
  }
  if (s.foreign_locks && !is_open_with(s.out, "memory_map") &&
      !is_open_with(s.out, "atomic_append")) {  // their own ranges on their files
    s.out.not_shown.push_back(
        "locks keel does not take (POSIX locks, or ranges of more than one byte) on the file");
  }
  s.out.not_shown.push_back(
      "waiters that poll (every wait on a network filesystem, and flock's timed waits)");
  std::sort(s.out.users.begin(), s.out.users.end());
  return s.out;
}

}  // namespace keel::lock
