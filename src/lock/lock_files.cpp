#include "keel/lock/lock_files.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/fs_info.hpp"
#include "lock_files_format.hpp"

namespace keel::lock {
namespace {

using lf::breaker_name;
using lf::owner_record;
using lf::record_magic;

owner_record my_record() noexcept {
  owner_record r{};
  std::memcpy(r.magic, record_magic, sizeof r.magic);
  const auto& me = io::self();
  r.pid = me.pid;
  r.pid_ns = me.pid_ns;
  r.start_time = me.start_time;
  std::memcpy(r.boot_id, me.boot_id.data(), sizeof r.boot_id);
  std::memcpy(r.machine_id, me.machine_id.data(), sizeof r.machine_id);
  ::gethostname(r.host, sizeof r.host - 1);
  return r;
}

void name_of(entity e, char (&name)[17]) noexcept {
  std::snprintf(name, sizeof name, "%016llx", static_cast<unsigned long long>(e.value));
}

// The breakers' file (.keel-break) is the one place where holders and breakers meet: byte v
// of it is held shared by whoever holds (or is linking) entity v's name, and exclusively by a
// breaker while it judges and removes that name. A breaker therefore never judges the file of
// a live holder, whatever its view of the directory: on a network filesystem a client's
// cached name may still show an earlier owner's file (dead, or gone), and the unlink, which
// the server applies to whatever file has the name, would remove the live holder's.
struct thread_files final : base::thread_state {
  io::file_handle dir;
  io::file_handle breaker;
  void close_in_child() noexcept override {
    detail::close_in_child(dir);
    detail::close_in_child(breaker);
  }
};

}  // namespace

struct lock_files::impl {
  std::string dir;
  // Threads open the directory and the breakers' file by name: they must still be these
  // (else threads of one instance would lock, or take turns, in different places).
  detail::file_id dir_id;
  detail::file_id breaker_id;
  io::filesystem* fs = &io::os();
  io::file_handle claimed;  // the directory's claim file, marked as lock_files' while open
  //! Where owner records are: only on a local filesystem is another boot of this machine id
  //! this machine's (unknown counts as shared).
  io::recorded_on records = io::recorded_on::shared_filesystem;
  base::per_thread_states threads;

  result<thread_files*> mine() noexcept {
    return threads.get<thread_files>([&]() -> result<std::unique_ptr<thread_files>> {
      auto d = detail::open_lock_directory(*fs, dir);
      if (!d) return std::unexpected(d.error());
      if (auto same = detail::check_same_file(*d, dir_id, dir); !same) {
        return std::unexpected(same.error());
      }
      auto b = detail::open_lock_file(
          *fs, &*d, breaker_name, dir + "/" + breaker_name,
          io::open_flags::read_write | io::open_flags::no_follow | io::open_flags::non_blocking);
      if (!b) return std::unexpected(b.error());
      if (auto same = detail::check_same_file(*b, breaker_id, dir + "/" + breaker_name); !same) {
        return std::unexpected(same.error());
      }
      auto s = std::make_unique<thread_files>();
      s->dir = std::move(*d);
      s->breaker = std::move(*b);
      return s;
    });
  }
};

lock_files::lock_files(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

lock_files::~lock_files() = default;

result<std::unique_ptr<lock_files>> lock_files::open(const std::string& dir,
                                                     io::filesystem& fs) noexcept {
  auto id = detail::identify_lock_directory(fs, dir);
  if (!id) return std::unexpected(id.error());
  auto p = std::make_unique<impl>();
  p->dir = dir;
  p->dir_id = *id;
  p->fs = &fs;
  auto d = detail::open_lock_directory(fs, dir);
  if (!d) return std::unexpected(d.error());
  if (auto same = detail::check_same_file(*d, *id, dir); !same)
    return std::unexpected(same.error());
  auto claimed = detail::claim_directory(*d, dir, "lock_files");
  if (!claimed) return std::unexpected(claimed.error());
  p->claimed = std::move(*claimed);
  auto b = detail::open_lock_file(fs, &*d, breaker_name, dir + "/" + breaker_name);
  if (!b) return std::unexpected(b.error());
  auto bid = detail::identify(*b);
  if (!bid) return std::unexpected(bid.error());
  p->breaker_id = *bid;
  if (auto where = fs.statfs(*d); where && where->is_local) {
    p->records = io::recorded_on::local_filesystem;
  }
  return std::unique_ptr<lock_files>(new lock_files(id->dev, id->ino, std::move(p)));
}

namespace {

// A file holding this thread's owner record, to be hard-linked under each entity's name.
// Anonymous where the filesystem allows, else a named temporary removed later.
result<io::temp_file> make_owner_file(const io::file_handle& dir) noexcept {
  const owner_record rec = my_record();
  auto of = io::make_temp_file(dir, ".keel-owner.", io::open_flags::write, 0644);
  if (!of) return std::unexpected(of.error());
  if (auto w = of->file.write_at(0, std::as_bytes(std::span(&rec, 1))); !w) {
    (void)of->remove_name(dir);
    return std::unexpected(w.error());
  }
  return of;
}

// Removes `name` if its owner is provably dead. Returns true if it was removed (or is gone).
result<bool> break_if_stale(thread_files& t, entity e, const char* name,
                            io::recorded_on records) noexcept {
  // Byte e exclusively: no live user holds the name or is linking it (each holds the byte
  // shared), and breakers of one entity take turns, so the file judged stale is the file
  // removed: nobody else unlinks a dead owner's file, and nobody can create the name while
  // it exists.
  auto turn = io::try_lock_extent(t.breaker, detail::entity_offset(e), 1, io::lock_kind::exclusive);
  if (!turn) {
    if (detail::is_contention(turn.error())) return false;  // a live holder, or a breaker
    return std::unexpected(turn.error());
  }
  // A name that vanished under the look (ENOENT), or that this client still maps to a file
  // the server no longer has (ESTALE, on a network filesystem): the file is gone; link again.
  const auto gone = [](const error& err) {
    return err == std::errc::no_such_file_or_directory ||
           err == std::error_code(ESTALE, std::system_category());
  };
  // Without following a link or blocking on a FIFO someone made at the name: what is not a
  // regular file is not a lock file, and is never judged (nor removed): the name is taken.
  // A FIFO, socket or device is not even opened (a FIFO's blocked writer would go through).
  if (auto st = t.dir.fs().stat_at(&t.dir, name, false);
      st && !st->is_regular() && !st->is_directory() && (st->mode & S_IFMT) != S_IFLNK) {
    return false;
  }
  auto f = io::file_handle::open_at(
      t.dir, name, io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) {
    if (gone(f.error())) return true;
    // A symlink, or a socket (ENXIO): not a lock file, never judged.
    if (f.error() == std::errc::too_many_symbolic_link_levels ||
        f.error() == std::errc::no_such_device_or_address) {
      return false;
    }
    return std::unexpected(f.error());
  }
  if (auto st = f->status(); !st || !st->is_regular()) {
    if (!st) return gone(st.error()) ? result<bool>(true) : std::unexpected(st.error());
    return false;
  }
  owner_record rec{};
  auto n = f->read_at(0, std::as_writable_bytes(std::span(&rec, 1)));
  if (!n) return gone(n.error()) ? result<bool>(true) : std::unexpected(n.error());
  if (*n != sizeof rec || std::memcmp(rec.magic, record_magic, sizeof rec.magic) != 0) {
    return false;  // not a record we understand: never guess
  }
  const io::process_identity who = lf::owner_of(rec);
  // Only a proven death breaks a lock: an owner we cannot judge (another machine, another
  // pid namespace, /proc unreadable) is alive.
  if (io::check(who, records, t.dir.fs()) != io::liveness::dead) return false;
  detail::reached("lock_files.judged_stale");
  // Remove only the file judged: the name may have been made again since (by a breaker that
  // did not take turns with us, or an owner judged dead wrongly). Between this look and the
  // unlink nobody else removes the dead owner's name, so the file looked at is the one removed.
  auto judged = f->status();
  if (!judged) return gone(judged.error()) ? result<bool>(true) : std::unexpected(judged.error());
  auto there = t.dir.fs().stat_at(&t.dir, name, false);
  if (!there) {
    if (gone(there.error())) return true;
    return std::unexpected(there.error());
  }
  if (!there->same_file(*judged)) return false;
  if (auto u = io::unlink_at(t.dir, name);
      !u && u.error() != std::errc::no_such_file_or_directory) {
    return std::unexpected(u.error());
  }
  return true;
}

}  // namespace

result<std::uint64_t> lock_files::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                          bool spin) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  thread_files& t = **state;
  auto of = make_owner_file(t.dir);
  if (!of) return std::unexpected(of.error());
  const auto done = [&] { (void)of->remove_name(t.dir); };

  std::vector<std::uint32_t> order(sorted.size());
  std::iota(order.begin(), order.end(), 0u);
  // Lets go of the first `taken` entities of `order`: the name, then the holder's byte.
  const auto let_go = [&](std::size_t taken) {
    for (std::size_t j = 0; j < taken; ++j) {
      char n2[17];
      name_of(sorted[order[j]], n2);
      (void)io::unlink_at(t.dir, n2);
      (void)io::unlock_extent(t.breaker, detail::entity_offset(sorted[order[j]]), 1);
    }
  };
  detail::backoff pause(spin);
  auto last_stale_check = std::chrono::steady_clock::time_point{};
  for (;;) {
    std::size_t taken = 0;
    std::size_t contended = sorted.size();
    char name[17];
    for (; taken < sorted.size(); ++taken) {
      const entity e = sorted[order[taken]];
      name_of(e, name);
      // The holder's byte first (see thread_files): a breaker judging the name now holds it
      // exclusively, and the entity counts as contended.
      auto mark =
          io::try_lock_extent(t.breaker, detail::entity_offset(e), 1, io::lock_kind::shared);
      if (!mark) {
        if (detail::is_contention(mark.error())) {
          contended = taken;
          break;
        }
        let_go(taken);
        done();
        return std::unexpected(mark.error());
      }
      mark->release();  // held until the name is let go (do_unlock, or let_go)
      auto r = of->link_as(t.dir, name);
      if (r) continue;
      (void)io::unlock_extent(t.breaker, detail::entity_offset(e), 1);
      if (r.error() != std::errc::file_exists) {
        let_go(taken);
        done();
        return std::unexpected(r.error());
      }
      contended = taken;
      break;
    }
    if (contended == sorted.size()) {
      done();
      return 0;
    }
    let_go(taken);
    if (taken > 0 && of->name.empty()) {
      // An anonymous file that was linked and then unlinked again cannot be linked anew
      // (the kernel allows relinking only files that never had a name): take a fresh one.
      auto fresh = make_owner_file(t.dir);
      if (!fresh) return std::unexpected(fresh.error());
      *of = std::move(*fresh);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now - last_stale_check >= stale_check_interval) {
      last_stale_check = now;
      auto broken = break_if_stale(t, sorted[order[contended]], name, impl_->records);
      if (!broken) {
        done();
        return std::unexpected(broken.error());
      }
      if (*broken) continue;  // try again at once
    }
    if (cd.is_zero()) {
      done();
      return errc_error(std::errc::operation_would_block);
    }
    detail::contended_first(order, contended);
    if (!pause.pause(cd)) {
      done();
      return detail::contention_error(cd);
    }
  }
}

result<void> lock_files::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  result<void> r;
  char name[17];
  for (const entity e : sorted) {
    name_of(e, name);
    auto u = io::unlink_at((*state)->dir, name);
    if (!u && r) r = u;
    // After the name: a breaker that gets the byte finds the name gone, never ours.
    if (auto b = io::unlock_extent((*state)->breaker, detail::entity_offset(e), 1); !b && r) r = b;
  }
  return r;
}

}  // namespace keel::lock
