#include <sys/ipc.h>
#include <sys/sem.h>

#include <vector>

#include "detail/common.hpp"
#include "keel/lock/baselines.hpp"
#include "sysv_key.hpp"

namespace keel::lock {
namespace {

struct slot_op {
  unsigned short slot;
  bool exclusive;
};

// The slots of a set, each once (exclusive wins when two entities share a slot): one semop
// must not both wait for a semaphore to be zero and raise it twice.
std::vector<slot_op> slots_of(std::span<const entity> sorted, int slots) {
  std::vector<slot_op> out;
  out.reserve(sorted.size());
  for (const entity e : sorted) {
    const auto s =
        static_cast<unsigned short>(sysv_set::slot_of(e.value, static_cast<std::uint64_t>(slots)));
    bool merged = false;
    for (auto& o : out) {
      if (o.slot == s) {
        o.exclusive |= e.is_exclusive();
        merged = true;
      }
    }
    if (!merged) out.push_back({s, e.is_exclusive()});
  }
  return out;
}

}  // namespace

sysv::sysv(std::uint64_t dev, std::uint64_t ino, int semid, int slots,
           io::file_handle claimed) noexcept
    : shared_fs_mutex(dev, ino), semid_(semid), slots_(slots), claimed_(std::move(claimed)) {}

sysv::~sysv() = default;

result<std::unique_ptr<sysv>> sysv::open(const std::string& path, int slots,
                                         io::filesystem& fs) noexcept {
  if (slots <= 0 || slots > 16000) return errc_error(std::errc::invalid_argument);
  // A semaphore of this kernel, found by the file's device and inode: users on other
  // machines (or through another mount) would each have their own.
  if (auto here = detail::refuse_unless_local(fs, path, "sysv"); !here) {
    return std::unexpected(here.error());
  }
  auto claimed = detail::open_claimed(fs, path, "sysv");
  if (!claimed) return std::unexpected(claimed.error());
  auto id = detail::identify(*claimed);
  if (!id) return std::unexpected(id.error());
  // Linux creates the semaphores zeroed, which is "free" here.
  const int semid = ::semget(sysv_set::key_of(*id), 2 * slots, IPC_CREAT | 0600);
  if (semid < 0) return last_errno_error();
  return std::unique_ptr<sysv>(new sysv(id->dev, id->ino, semid, slots, std::move(*claimed)));
}

result<void> sysv::remove(const std::string& path) noexcept {
  auto id = detail::identify_lock_file(io::os(), path);
  if (!id) return std::unexpected(id.error());
  const int semid = ::semget(sysv_set::key_of(*id), 0, 0);
  if (semid < 0) return last_errno_error();
  if (::semctl(semid, 0, IPC_RMID) != 0) return last_errno_error();
  return {};
}

result<std::uint64_t> sysv::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                    bool) noexcept {
  const auto slots = slots_of(sorted, slots_);
  std::vector<sembuf> ops;
  ops.reserve(slots.size() * 3);
  const short flags = SEM_UNDO | (cd.is_zero() ? IPC_NOWAIT : 0);
  for (const auto& s : slots) {
    const auto w = sysv_set::writer_sem(s.slot);
    const auto r = sysv_set::readers_sem(s.slot);
    ops.push_back({w, 0, flags});  // no writer
    if (s.exclusive) {
      ops.push_back({r, 0, flags});  // no readers
      ops.push_back({w, 1, flags});
    } else {
      ops.push_back({r, 1, flags});
    }
  }
  for (;;) {
    int rc = 0;
    if (cd.is_infinite() || cd.is_zero()) {
      rc = ::semop(semid_, ops.data(), ops.size());
    } else {
      const timespec left = cd.remaining_timespec();
      if (left.tv_sec == 0 && left.tv_nsec == 0) return errc_error(std::errc::timed_out);
      rc = ::semtimedop(semid_, ops.data(), ops.size(), &left);
    }
    if (rc == 0) return 0;
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return detail::contention_error(cd);
    return last_errno_error();
  }
}

result<void> sysv::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  const auto slots = slots_of(sorted, slots_);
  std::vector<sembuf> ops;
  ops.reserve(slots.size());
  for (const auto& s : slots) {
    const auto sem = s.exclusive ? sysv_set::writer_sem(s.slot) : sysv_set::readers_sem(s.slot);
    ops.push_back({sem, -1, SEM_UNDO});
  }
  while (::semop(semid_, ops.data(), ops.size()) != 0) {
    if (errno != EINTR) return last_errno_error();
  }
  return {};
}

}  // namespace keel::lock
