// The first user's set-up and the last user's tear-down. The lock file carries byte-range
// markers held by a descriptor used for nothing else (so no unlock of ours can drop them):
// every instance holds *in use* shared, every instance on the map holds *map in use* shared,
// and openers and closers take turns on *init*. The first user (gets *in use* exclusively
// under *init*) creates the map and writes the header; the last one (gets it exclusively
// when closing) removes the map and zeroes the header.

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <optional>

#include "base/thread_rng.hpp"
#include "impl.hpp"
#include "io/process.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::lock {
namespace {

// Whether an open's try at the switch failed only for now: other users still hold slots of
// the map, or this thread does through another instance (then its lock calls report the
// deadlock). The switch is tried again by every lock call.
bool switch_later(const result<void>& s) noexcept {
  return detail::is_contention(s.error()) || s.error() == std::errc::resource_deadlock_would_occur;
}

// Whether `name` (in `dir`; a path when `dir` is null) still names the open file `f`: a
// remover may have removed the name since `f` was opened by it.
result<bool> still_named(io::filesystem& fs, const io::file_handle* dir, const char* name,
                         const io::file_handle& f) noexcept {
  auto opened = f.status();
  if (!opened) return std::unexpected(opened.error());
  auto named = fs.stat_at(dir, name, false);
  return named && named->same_file(*opened);
}

// Whether a lock file's first bytes (at most a page) are what a write of our header over the
// page of zeros a last user leaves, or of those zeros over our header, leaves when it fails
// part-way: each byte of the common header's place is either the header's or zero, and some
// are the header's. Anything else is not ours to set up, whatever follows.
bool lock_file_torn(std::span<const std::byte> bytes) noexcept {
  if (bytes.empty() || bytes.size() > memory_map_detail::lockfile_page) return false;
  const auto common = memory_map_detail::lockfile_format.header();
  const auto* c = reinterpret_cast<const std::byte*>(&common);
  bool ours = false;
  for (std::size_t i = 0; i < std::min(bytes.size(), sizeof common); ++i) {
    if (bytes[i] == c[i] && c[i] != std::byte{0}) {
      ours = true;
    } else if (bytes[i] != std::byte{0}) {
      return false;
    }
  }
  return ours;
}

// Creates a map file in `dir` with a fresh random name, its blocks reserved, holding its
// map_held_byte through `hold` from before its header is written.
result<io::mapped_file> create_map(io::filesystem& fs, const std::string& dir,
                                   std::string& path_out, io::file_handle& hold) noexcept {
  for (int attempt = 0; attempt < 16; ++attempt) {
    char name[64];
    std::snprintf(name, sizeof name, "/%.*s%08x%08x",
                  static_cast<int>(memory_map_detail::map_name_prefix.size()),
                  memory_map_detail::map_name_prefix.data(),
                  static_cast<unsigned>(base::thread_rng()()),
                  static_cast<unsigned>(base::thread_rng()()));
    const std::string p = dir + name;
    auto f = io::file_handle::open(
        fs, p.c_str(),
        io::open_flags::read_write | io::open_flags::create | io::open_flags::exclusive, 0644);
    if (!f) {
      if (f.error() == std::errc::file_exists) continue;
      return std::unexpected(f.error());
    }
    // Held before the header makes it a map: remove_orphan_maps never takes a map in the
    // making for one nobody uses. Before we hold it, it may take our file for one a maker
    // left (killed, or failed to remove it): then it holds the byte while it removes it, or
    // has removed it, and we make another.
    auto held = io::try_lock_extent(*f, memory_map_detail::map_held_byte, 1, io::lock_kind::shared);
    if (!held && detail::is_contention(held.error())) continue;
    if (held) {
      auto named = still_named(fs, nullptr, p.c_str(), *f);
      if (named && !*named) continue;
      if (!named) held = std::unexpected(named.error());
    }
    // Reserve the blocks before mapping: a full /dev/shm is an error here, never a SIGBUS.
    auto m = held ? io::allocate_and_map(*f, memory_map_detail::map_size)
                  : result<io::mapped_file>(std::unexpected(held.error()));
    if (!m) {
      (void)io::unlink(fs, p.c_str());
      return std::unexpected(m.error());
    }
    held->release();  // held through `hold` from now on
    const base::format_header h = memory_map_detail::map_format.header();
    std::memcpy(m->data(), &h, sizeof h);
    path_out = p;
    hold = std::move(*f);
    return m;
  }
  return errc_error(std::errc::file_exists);
}

}  // namespace

// Joins the lock's users through `marker`, under the init lock: as the first user (sets up
// the map, or the degraded header) or beside the others (maps theirs). Takes *in use* and, on
// the map, *map in use*. Whether the lock must degrade.
result<bool> memory_map::impl::join(io::deadline d) noexcept {
  const auto corrupt_here = [&](const error& e) {
    return std::unexpected(e.about(marker.shared_path()));
  };
  bool must_degrade = opts.force_fallback;
  // A first user whose set-up fails after it made the map removes it (1.4 MB of /dev/shm a
  // time otherwise); the next first user starts afresh.
  bool made_map = false;
  struct remove_map_on_failure {
    impl& p;
    bool& made;
    bool done = false;
    ~remove_map_on_failure() {
      if (!made || done) return;
      (void)io::unlink(*p.fs, p.map_path.c_str());
      p.map = io::mapped_file{};
      p.map_hold = io::file_handle{};
      p.map_path.clear();
    }
  };
  {
    // One opener or closer at a time: the first user's set-up and the last user's tear-down
    // never interleave with anyone reading the header.
    auto init =
        io::lock_extent(marker, memory_map_detail::init_byte, 1, io::lock_kind::exclusive, d);
    if (!init) return std::unexpected(init.error());
    remove_map_on_failure cleanup{*this, made_map};  // before the init lock is let go
    auto fsi = io::stat_fs(marker);
    const bool local = fsi && fsi->is_local;
    shared_filesystem.store(!local);
    if (!local) {
      // What this client cached of the file may be older than what another client wrote
      // (and synced) under the init lock: read what the server holds.
      if (auto dc = marker.drop_cached(); !dc) return std::unexpected(dc.error());
    }
    std::vector<std::byte> page(memory_map_detail::lockfile_page + 1);
    auto got = marker.read_at(0, page);
    if (!got) return std::unexpected(got.error());
    // Whatever the file holds, it must be a lock file of ours before we write to it: empty,
    // a header, or the page of zeros a last user leaves; or what a write of either, failed
    // part-way (EIO, ENOSPC, ENOMEM after a part), left of it over the other (lock_file_torn).
    // Such a set-up or reset never happened: if nobody uses the lock, the first user sets it
    // up afresh; a user meanwhile is refused, as for any damage.
    const auto read = std::span<const std::byte>(page).first(*got);
    auto old = memory_map_detail::parse_lock_file(read);
    const bool blank_with_more =
        old && old->blank && *got != 0 &&
        (*got != memory_map_detail::lockfile_page ||
         std::any_of(page.begin(), page.end(), [](std::byte b) { return b != std::byte{0}; }));
    std::optional<error> unreadable;
    if (!old || blank_with_more) {
      unreadable = old ? error(errc::not_keel_file) : old.error();
      if (!lock_file_torn(read)) return corrupt_here(*unreadable);
    }
    auto first =
        io::try_lock_extent(marker, memory_map_detail::in_use_byte, 1, io::lock_kind::exclusive);
    if (!first && !detail::is_contention(first.error())) return std::unexpected(first.error());
    if (unreadable) {
      if (!first) return corrupt_here(*unreadable);
      old = memory_map_detail::parse_lock_file({});  // blank: set up afresh
      if (!old) return corrupt_here(old.error());
    }
    if (first) {
      // Held until converted to shared below: should set-up fail, the guard unlocks it
      // before the init lock is let go, so the next opener is the first user again (and
      // never finds a lock in use but never set up).
      // Nobody uses this lock. If its last users died instead of closing, their map is
      // still named in the header and belongs to nobody: remove it, then start afresh.
      if (!old->blank && !old->map_path.empty() &&
          std::memcmp(old->boot_id.data(), io::self().boot_id.data(), 16) == 0 &&
          old->map_path.starts_with(opts.map_directory + "/") &&
          memory_map_detail::is_map_name(
              std::string_view(old->map_path).substr(opts.map_directory.size() + 1))) {
        (void)io::unlink(*fs, old->map_path.c_str());
      }
      memory_map_detail::lockfile_header h{};
      h.head = memory_map_detail::lockfile_format.header();
      std::memcpy(h.boot_id, io::self().boot_id.data(), sizeof h.boot_id);
      if (local && !opts.force_fallback) {
        // Maps left by users that died (of this lock or of any other, whose lock file may be
        // gone for good): 1.4 MB of memory each, kept until reboot otherwise.
        memory_map_detail::remove_orphan_maps(*fs, opts.map_directory);
        auto m = create_map(*fs, opts.map_directory, map_path, map_hold);
        if (!m) return std::unexpected(m.error());
        map = std::move(*m);
        made_map = true;
        if (map_path.size() >= sizeof h.map_path) {
          (void)io::unlink(*fs, map_path.c_str());
          return std::unexpected(
              error(std::make_error_code(std::errc::filename_too_long)).about(map_path));
        }
        std::memcpy(h.map_path, map_path.c_str(), map_path.size() + 1);
      } else {
        h.degraded = 1;
      }
      std::vector<std::byte> whole(memory_map_detail::lockfile_page);
      std::memcpy(whole.data(), &h, sizeof h);
      if (auto w = marker.write_at(0, whole); !w) return std::unexpected(w.error());
      // On a filesystem other machines may share, the client may hold the write back (in
      // GlusterFS's write-behind, say) past the init lock: the next opener, on another client,
      // would read a lock in use yet never set up. Sent to the server first.
      if (!local) {
        if (auto s = marker.sync_data(); !s) return std::unexpected(s.error());
      }
      // Converting our exclusive marker to shared keeps it held throughout.
      auto shared =
          io::lock_extent(marker, memory_map_detail::in_use_byte, 1, io::lock_kind::shared);
      if (!shared) return std::unexpected(shared.error());
      shared->release();
      first->release();  // converted: nothing of it left to unlock
    } else if (!local) {
      // Where other machines may share the file, what this client reads of it may be older
      // than what another client wrote and synced under the init lock (GlusterFS serves a
      // size and bytes up to a second old, whatever the locks and caches are told): a
      // header that looks blank, or that names a map, is never believed. The lock degrades;
      // what decides who holds what is then byte-range locks, which the server keeps.
      auto shared =
          io::lock_extent(marker, memory_map_detail::in_use_byte, 1, io::lock_kind::shared);
      if (!shared) return std::unexpected(shared.error());
      shared->release();
      must_degrade = true;
    } else {
      if (old->blank) return corrupt_here(error(errc::corrupt));  // in use, yet never set up
      auto shared =
          io::lock_extent(marker, memory_map_detail::in_use_byte, 1, io::lock_kind::shared);
      if (!shared) return std::unexpected(shared.error());
      shared->release();
      const bool same_boot = std::memcmp(old->boot_id.data(), io::self().boot_id.data(), 16) == 0;
      if (!old->degraded) {
        if (same_boot && !opts.force_fallback) {
          auto m = memory_map_detail::open_map(*fs, old->map_path, map_hold);
          if (m) {
            map = std::move(*m);
            map_path = old->map_path;
          } else if (memory_map_detail::map_not_ours(m.error())) {
            must_degrade = true;
          } else {
            return std::unexpected(m.error());
          }
        } else {
          must_degrade = true;
        }
      }
    }
    if (map.size() != 0) {
      table = memory_map_detail::slot_table(map.data());
      auto miu =
          io::lock_extent(marker, memory_map_detail::map_in_use_byte, 1, io::lock_kind::shared);
      if (!miu) return std::unexpected(miu.error());
      miu->release();
    }
    // The lock file's page, mapped to see the flag of a degrade on every lock call: only by
    // users of a map (the others are degraded already), and only where the size this
    // client sees is the file's (on a network filesystem it may lag: a page past it would
    // raise SIGBUS).
    if (local) {
      auto size = marker.size();
      if (!size) return std::unexpected(size.error());
      if (*size < static_cast<off_t>(memory_map_detail::lockfile_page)) {
        return corrupt_here(error(make_error_code(errc::corrupt), std::string_view{},
                                  static_cast<std::uint64_t>(*size)));
      }
      auto view = io::mapped_file::map(marker, io::map_access::read_only,
                                       memory_map_detail::lockfile_page, 0);
      if (!view) return std::unexpected(view.error());
      lock_view = std::move(*view);
    }
    if (must_degrade) {
      if (auto md = mark_degraded(); !md) return std::unexpected(md.error());
    }
    cleanup.done = true;
  }
  {
    const base::lock_guard lock(switch_mutex);
    map_in_use_released = map.size() == 0;
  }
  return must_degrade;
}

result<void> memory_map::impl::rejoin_after_fork(const io::countdown& cd) noexcept {
  const base::lock_guard lock(rejoin_mutex);
  const std::uint32_t me = io::self().pid;
  if (creator_pid.load() == me) return {};  // another thread of ours did it
  // Removed and made again since the parent opened it: another lock now (ESTALE).
  auto d = detail::reopen(*fs, path, io::open_flags::read_write, {dev, ino});
  if (!d) return std::unexpected(d.error());
  // Ours claims the path for memory_map too, before the parent's (which did) is closed: else
  // once the parent closed, another algorithm could open the path this child locks.
  if (auto c = detail::claim(*d, "memory_map", path); !c) return std::unexpected(c.error());
  // The parent's descriptor is closed only after ours holds the markers: until then it keeps
  // the parent's holds (if the parent is gone, this child's copy is their last reference).
  io::file_handle parents = std::move(marker);
  marker = std::move(*d);
  map = io::mapped_file{};
  // The same for the map's hold: if the parent is gone, this copy of its descriptor is the
  // last hold on the map its lock file names, which a remover would take for nobody's.
  io::file_handle parents_hold = std::move(map_hold);
  map_path.clear();
  table = memory_map_detail::slot_table();
  lock_view = io::mapped_file{};
  {
    const base::lock_guard sw(switch_mutex);
    my_users.clear();
  }
  fallback_ready.store(false);
  const io::deadline until = cd.is_infinite() ? io::deadline::never()
                             : cd.is_zero()   ? io::deadline::zero()
                                              : io::deadline(cd.expiry());
  auto must_degrade = join(until);
  if (!must_degrade) {
    // Not joined (timed out behind an opener, or failed): the parent's descriptors stay
    // ours, keeping their holds, and the next call tries again.
    marker = std::move(parents);
    map_hold = std::move(parents_hold);
    return std::unexpected(must_degrade.error());
  }
  creator_pid.store(me, std::memory_order_release);
  if (*must_degrade) {
    if (auto s = switch_to_fallback(io::deadline::zero().start(), false); !s && !switch_later(s)) {
      return std::unexpected(s.error());
    }
  }
  return {};
}

namespace memory_map_detail {

result<io::mapped_file> open_map(io::filesystem& fs, const std::string& p,
                                 io::file_handle& hold) noexcept {
  auto f = detail::open_lock_file(
      fs, nullptr, p.c_str(), p,
      io::open_flags::read_write | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) return std::unexpected(f.error());
  const auto gone = [&] {
    return std::unexpected(
        error(std::make_error_code(std::errc::no_such_file_or_directory)).about(f->shared_path()));
  };
  auto held = io::try_lock_extent(*f, memory_map_detail::map_held_byte, 1, io::lock_kind::shared);
  if (!held) {
    if (!detail::is_contention(held.error())) return std::unexpected(held.error());
    return gone();  // a remover holds it: the map has no user left, and its name is going
  }
  // Held now, so nobody removes it from here on; but a remover may have taken it and removed
  // its name between our open and the hold: then it is nobody's map (each thread registers
  // through the name).
  auto named = still_named(fs, nullptr, p.c_str(), *f);
  if (!named) return std::unexpected(named.error());
  if (!*named) return gone();
  auto size = f->size();
  if (!size) return std::unexpected(size.error());
  std::array<std::byte, sizeof(base::format_header)> head{};
  auto n = f->read_at(0, head);
  if (!n) return std::unexpected(n.error());
  if (auto c = memory_map_detail::check_map(std::span(head).first(*n)); !c) {
    return std::unexpected(c.error().about(f->shared_path(), 0));
  }
  if (*size < static_cast<off_t>(memory_map_detail::map_size)) {
    return std::unexpected(
        error(errc::corrupt).about(f->shared_path(), static_cast<std::uint64_t>(*size)));
  }
  auto m = io::mapped_file::map(*f, io::map_access::read_write, memory_map_detail::map_size, 0);
  if (!m) return std::unexpected(m.error());
  held->release();  // held through `hold` from now on
  hold = std::move(*f);
  return m;
}

void remove_orphan_maps(io::filesystem& fs, const std::string& dir) noexcept {
  auto d = io::file_handle::open_directory(fs, dir.c_str());
  if (!d) return;
  auto entries = fs.list_directory(*d);
  if (!entries) return;
  for (const io::directory_entry& e : *entries) {
    if (!is_map_name(e.name)) continue;
    // Only regular files are opened (a device node or a fifo of that name is not ours).
    auto st = fs.stat_at(&*d, e.name.c_str(), false);
    if (!st || !st->is_regular()) continue;
    auto f = io::file_handle::open_at(*d, e.name.c_str(),
                                      io::open_flags::read_write | io::open_flags::no_follow, 0);
    if (!f) continue;
    std::array<std::byte, sizeof(base::format_header)> head{};
    auto n = f->read_at(0, head);
    if (!n) continue;
    // A map, or one in the making that its maker left (killed, or failed to remove it): empty,
    // or of a map's size with no header yet. Anything else of that name is not one of ours.
    const bool blank = std::ranges::all_of(std::span(head).first(*n),
                                           [](std::byte b) { return b == std::byte{0}; });
    const bool left_by_maker = blank && (st->size == 0 || st->size == static_cast<off_t>(map_size));
    if (!left_by_maker && !check_map(std::span(head).first(*n))) continue;
    auto unused = io::try_lock_extent(*f, map_held_byte, 1, io::lock_kind::exclusive);
    if (!unused) continue;
    // Still the file probed (not one made under the name since): remove it while the byte is
    // held, so no opener can take it meanwhile.
    if (auto named = still_named(fs, &*d, e.name.c_str(), *f); named && *named) {
      (void)fs.unlink(&*d, e.name.c_str(), false);
    }
  }
}

bool map_not_ours(const error& e) noexcept {
  return e == std::errc::no_such_file_or_directory || e == std::errc::permission_denied ||
         e == std::errc::operation_not_permitted || e == std::errc::too_many_symbolic_link_levels ||
         e == std::errc::no_such_device || e == keel::errc::not_keel_file ||
         e == keel::errc::unsupported_version || e == keel::errc::corrupt;
}

}  // namespace memory_map_detail

memory_map::memory_map(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

result<std::unique_ptr<memory_map>> memory_map::open(const std::string& path,
                                                     options opts) noexcept {
  auto p = std::make_unique<impl>();
  p->path = path;
  p->opts = opts;
  if (opts.fs != nullptr) p->fs = opts.fs;
  io::filesystem& fs = *p->fs;
  p->fallback_path = path + ".fallback";
  auto fb = detail::identify_lock_file(fs, p->fallback_path);
  if (!fb) return std::unexpected(fb.error());
  p->fallback_id = *fb;
  auto mk = detail::open_claimed(fs, path, "memory_map");
  if (!mk) return std::unexpected(mk.error());
  p->marker = std::move(*mk);
  auto id = detail::identify(p->marker);
  if (!id) return std::unexpected(id.error());

  p->dev = id->dev;
  p->ino = id->ino;
  auto must_degrade = p->join();
  if (!must_degrade) return std::unexpected(must_degrade.error());
  p->creator_pid.store(io::self().pid);
  auto m = std::unique_ptr<memory_map>(new memory_map(id->dev, id->ino, std::move(p)));
  if (*must_degrade) {
    // Outside the init lock: users leaving the map must be able to close meanwhile. Only a
    // try: while others still hold slots on the map, the switch waits in `lock`, within the
    // caller's deadline (open has none: waiting here for an idle user would never end).
    if (auto s = m->impl_->switch_to_fallback(io::deadline::zero().start(), false);
        !s && !switch_later(s)) {
      return std::unexpected(s.error());
    }
  }
  return m;
}

memory_map::~memory_map() {
  impl& p = *impl_;
  // A child that never used it: the markers are the parent's, not ours to drop.
  if (io::self().pid != p.creator_pid.load()) return;
  // Leave the map first (so a degrader waiting for it is not held up by our init wait).
  {
    const base::lock_guard lock(p.switch_mutex);
    if (!p.map_in_use_released)
      (void)io::unlock_extent(p.marker, memory_map_detail::map_in_use_byte, 1);
  }
  // A destructor cannot fail, nor may it hang behind an opener stuck in its set-up: after
  // close_init_wait it leaves without the last user's clean-up, which the next first user
  // does instead (it removes a map of this boot that the lock file still names).
  auto init = io::lock_extent(p.marker, memory_map_detail::init_byte, 1, io::lock_kind::exclusive,
                              io::deadline(memory_map_detail::close_init_wait));
  (void)io::unlock_extent(p.marker, memory_map_detail::in_use_byte, 1);
  if (!init) return;
  auto last =
      io::try_lock_extent(p.marker, memory_map_detail::in_use_byte, 1, io::lock_kind::exclusive);
  if (last) {
    // The last user: remove the map and reset the lock file for the next first user. The
    // common header goes last, so that a write failed part-way leaves what the next first
    // user knows for a reset torn (lock_file_torn), never bytes it must refuse.
    if (!p.map_path.empty()) (void)io::unlink(*p.fs, p.map_path.c_str());
    const std::size_t common = sizeof(base::format_header);
    std::vector<std::byte> zeros(memory_map_detail::lockfile_page);
    if (p.marker.write_at(common, std::span(zeros).subspan(common))) {
      (void)p.marker.write_at(0, std::span(zeros).first(common));
    }
    // Where other clients read the file, the reset reaches the server before the init lock
    // is let go (see open). A destructor cannot report a failure: the next first user then
    // finds the header as it was, which it knows.
    if (p.shared_filesystem.load()) (void)p.marker.sync_data();
  }
}

bool memory_map::is_degraded() const noexcept {
  return impl_->fallback_ready.load(std::memory_order_acquire);
}

}  // namespace keel::lock
