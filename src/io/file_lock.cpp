#include "keel/io/file_lock.hpp"

#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <vector>

#include "base/fork.hpp"
#include "io/lock_wait.hpp"
#include "keel/io/filesystem.hpp"

namespace keel::io {
namespace {

// One flock(2), EINTR asked again unless it may wait (then the caller's loop decides).
result<void> flock_once(int fd, int how, bool wait) noexcept {
  for (;;) {
    if (::flock(fd, how | (wait ? 0 : LOCK_NB)) == 0) return {};
    if (errno == EINTR && !wait) continue;
    return last_errno_error();
  }
}

// The descriptors of this process's lock_file_at calls under way, and of the locks taken by
// lock_file_privately and still held, are noted in base/fork.hpp: a child forked meanwhile
// closes its copies of them. The thread using one is not in the child, and the copy shares
// its open file description, hence the lock that thread has or gets next in the parent: held
// by the child's copy, it would outlive the parent's death.

// Noted while it lives, or for good once kept (then unlock_private_file forgets it: a lock
// taken privately goes from the wait to its holder with no moment unnoted). Made under a
// base::making_descriptors, with the open before it when the open is ours.
class tracked {
 public:
  explicit tracked(int fd) noexcept : fd_(fd) { base::close_in_children(fd); }
  ~tracked() {
    if (!kept_) base::keep_in_children(fd_);
  }
  tracked(const tracked&) = delete;
  tracked& operator=(const tracked&) = delete;
  void keep() noexcept { kept_ = true; }

 private:
  int fd_;
  bool kept_ = false;
};

// As flock(1): read and write, made if missing; read only where that is refused.
result<file_handle> open_lock_file(const std::string& path) noexcept {
  auto f = file_handle::open(path.c_str(), open_flags::read_write | open_flags::create, 0666);
  if (f) return f;
  const error why = f.error();
  if (why == std::errc::is_a_directory || why == std::errc::permission_denied ||
      why == std::errc::read_only_file_system) {
    auto ro = file_handle::open(path.c_str(), open_flags::read, 0);
    if (ro) return ro;
    // Missing: what matters is why it could not be made.
    if (ro.error() != std::errc::no_such_file_or_directory) return ro;
  }
  return std::unexpected(why);
}

}  // namespace

result<void> lock_file(const file_handle& file, lock_kind kind, deadline d) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  const int how = kind == lock_kind::shared ? LOCK_SH : LOCK_EX;
  // The uncontended path is one syscall, whatever the deadline.
  auto first = flock_once(file.fd(), how, false);
  if (first || first.error() != std::errc::operation_would_block) return first;
  auto attempt = [&](bool wait) noexcept { return flock_once(file.fd(), how, wait); };
  return detail::wait_for_lock(file, d.start(), attempt);
}

result<void> unlock_file(const file_handle& file) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  return flock_once(file.fd(), LOCK_UN, false);
}

namespace {

result<void> lock_at(file_handle& file, const std::string& path, lock_kind kind, deadline d,
                     bool keep_noted) noexcept {
  // One countdown for every round: a path replaced again and again still ends at `d`.
  const countdown cd = d.start();
  const deadline until = cd.is_infinite() ? deadline::never()
                         : cd.is_zero()   ? deadline::zero()
                                          : deadline(countdown::clock::now() + cd.remaining());
  for (;;) {
    std::optional<tracked> during;
    {
      const base::making_descriptors making;  // (no fork between the open and the note)
      if (!file.is_open()) {
        auto f = open_lock_file(path);
        if (!f) return std::unexpected(f.error());
        file = std::move(*f);
      }
      during.emplace(file.fd());
    }
    {
      if (auto locked = lock_file(file, kind, until); !locked) return locked;
      // Whoever removed or replaced the file meanwhile holds no lock this one excludes.
      auto held = file.status();
      auto named = os().stat_at(nullptr, path.c_str(), true);
      if (held && named && held->same_file(*named)) {
        if (keep_noted) during->keep();
        return {};
      }
      (void)unlock_file(file);
      if (!held) return std::unexpected(held.error());
      if (!named && named.error() != std::errc::no_such_file_or_directory) {
        return std::unexpected(named.error());
      }
    }
    // Forgotten and closed as one step to a fork: a child keeps neither the copy nor,
    // forgotten too early, a number another open may reuse.
    const base::making_descriptors making;
    during.reset();
    (void)file.close();
  }
}

}  // namespace

result<void> lock_file_at(file_handle& file, const std::string& path, lock_kind kind,
                          deadline d) noexcept {
  return lock_at(file, path, kind, d, false);
}

result<file_handle> open_and_lock_file(const std::string& path, lock_kind kind,
                                       deadline d) noexcept {
  file_handle f;
  if (auto r = lock_at(f, path, kind, d, false); !r) return std::unexpected(r.error());
  return f;
}

result<file_handle> lock_file_privately(const std::string& path, lock_kind kind,
                                        deadline d) noexcept {
  file_handle f;
  if (auto r = lock_at(f, path, kind, d, true); !r) return std::unexpected(r.error());
  return f;
}

result<void> unlock_private_file(file_handle& file) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  // Unlocked first (a descriptor dup()ed meanwhile holds nothing), then forgotten and closed.
  auto unlocked = unlock_file(file);
  const base::making_descriptors making;  // (forgotten and closed as one step to a fork)
  base::keep_in_children(file.fd());
  auto closed = file.close();
  if (!unlocked) return unlocked;
  return closed;
}

}  // namespace keel::io
