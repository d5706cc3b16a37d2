#include <sys/file.h>
#include <sys/stat.h>

#include <cstdio>
#include <unordered_map>

#include "detail/common.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/lock/baselines.hpp"

namespace keel::lock {
namespace {

constexpr std::size_t kept_files = 64;  // idle entity files a thread keeps open

struct thread_files final : base::thread_state {
  io::file_handle dir;
  std::unordered_map<std::uint64_t, io::file_handle> files;  // kept open: flock is per open
  void close_in_child() noexcept override {
    detail::close_in_child(dir);
    for (auto& [entity, f] : files)
      detail::close_in_child(f);
  }
};

}  // namespace

struct flock_files::impl {
  std::string dir;
  detail::file_id dir_id;  // threads open `dir` by name: it must still be this directory
  io::filesystem* fs = &io::os();
  io::file_handle claimed;  // the directory's claim file, marked as flock's while open
  bool local = true;        // else never sleep in the kernel for a lock (io/byte_lock.hpp says why)
  base::per_thread_states threads;

  result<thread_files*> mine() noexcept {
    return threads.get<thread_files>([&]() -> result<std::unique_ptr<thread_files>> {
      auto d = detail::open_lock_directory(*fs, dir);
      if (!d) return std::unexpected(d.error());
      if (auto same = detail::check_same_file(*d, dir_id, dir); !same) {
        return std::unexpected(same.error());
      }
      auto s = std::make_unique<thread_files>();
      s->dir = std::move(*d);
      return s;
    });
  }
};

namespace {

result<int> file_of(thread_files& t, entity e) noexcept {
  const std::uint64_t value = e.value;
  auto it = t.files.find(value);
  if (it != t.files.end()) return it->second.fd();
  char name[17];
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(e.value));
  // Opened and kept in the thread's state as one step to a fork (close_in_child finds it).
  const base::making_descriptors making;
  auto f = detail::open_lock_file(t.dir.fs(), &t.dir, name, name);
  if (!f) return std::unexpected(f.error());
  const int fd = f->fd();
  t.files.emplace(value, std::move(*f));
  return fd;
}

// flock(2) is this baseline's point: the kernel primitive measured as it is, beside the
// seam (which offers byte-range locks, not BSD locks). The one raw call of this file.
int bsd_lock(int fd, int op) noexcept {
  return ::flock(fd, op);  // outside the seam on purpose (above)
}

void unlock_fd(int fd) noexcept {
  (void)bsd_lock(fd, LOCK_UN);
}

}  // namespace

flock_files::flock_files(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

flock_files::~flock_files() = default;

result<std::unique_ptr<flock_files>> flock_files::open(const std::string& dir,
                                                       io::filesystem& fs) noexcept {
  auto id = detail::identify_lock_directory(fs, dir);
  if (!id) return std::unexpected(id.error());
  auto d = detail::open_lock_directory(fs, dir);
  if (!d) return std::unexpected(d.error());
  if (auto same = detail::check_same_file(*d, *id, dir); !same) {
    return std::unexpected(same.error());
  }
  auto claimed = detail::claim_directory(*d, dir, "flock");
  if (!claimed) return std::unexpected(claimed.error());
  auto p = std::make_unique<impl>();
  p->claimed = std::move(*claimed);
  p->dir = dir;
  p->dir_id = *id;
  p->fs = &fs;
  auto where = io::stat_fs(fs, dir.c_str());
  p->local = where && where->is_local;
  return std::unique_ptr<flock_files>(new flock_files(id->dev, id->ino, std::move(p)));
}

result<std::uint64_t> flock_files::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                           bool spin) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  std::size_t taken = 0;
  const auto fail = [&](std::unexpected<error> e) -> result<std::uint64_t> {
    for (std::size_t j = 0; j < taken; ++j)
      unlock_fd(*file_of(**state, sorted[j]));
    return e;
  };
  for (; taken < sorted.size(); ++taken) {
    const entity e = sorted[taken];
    auto fd = file_of(**state, e);
    if (!fd) return fail(std::unexpected(fd.error()));
    const int op = e.is_exclusive() ? LOCK_EX : LOCK_SH;
    if (cd.is_infinite() && !spin && impl_->local) {
      while (bsd_lock(*fd, op) != 0) {
        if (errno != EINTR) return fail(last_errno_error());
      }
      continue;
    }
    detail::backoff pause(spin);
    for (;;) {
      if (bsd_lock(*fd, op | LOCK_NB) == 0) break;
      if (errno == EINTR) continue;
      if (errno != EWOULDBLOCK) return fail(last_errno_error());
      if (!pause.pause(cd)) return fail(detail::contention_error(cd));
    }
  }
  return 0;
}

result<void> flock_files::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  result<void> r;
  for (const entity e : sorted) {
    auto fd = file_of(**state, e);
    if (!fd) {
      if (r) r = std::unexpected(fd.error());
      continue;
    }
    if (bsd_lock(*fd, LOCK_UN) != 0 && r) r = last_errno_error();
    // Kept open for the next lock of the entity, but not without bound: past `kept_files`
    // idle ones, the file just unlocked is closed (a held entity's never is: closing it
    // would release its lock). Otherwise a thread locking many entities ran out of
    // descriptors (EMFILE), and everything after it failed.
    if ((*state)->files.size() > kept_files) (*state)->files.erase(e.value);
  }
  return r;
}

}  // namespace keel::lock
