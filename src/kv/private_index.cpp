// A reader that may not write the store's files (a read-only filesystem, a directory and files
// it may only read) cannot register in the shared index nor take the store's locks. It builds
// an index of its own instead, from the log (as a lone opener rebuilds one), in an unnamed
// file in memory, and reads the store as it was when it opened.
//
// What keeps that view true: the build needs a log nobody moves, so the reader opens only
// while no other user has the store open (open_byte, on the index), and an opener that would
// write waits while one builds (private_opening_byte, on the store file, which every store
// has from its first moment). Once built, its index points only at blocks that were whole;
// writers that come later append past them and never rewrite them, and compaction, which
// would zero or truncate the segments it gives back, only unlinks them while such a reader
// lives (private_reading_byte): the reader's maps keep what they held.

#include <cerrno>
#include <cstdlib>
#include <optional>
#include <string>

#include "base/per_thread.hpp"
#include "keel/io/file_handle.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

result<void> store::impl::open_private_index() noexcept {
  const io::file_handle& named = dir.store_file;
  if (auto r = fs->lock(named, private_opening_byte, 1, io::lock_request::shared, false); !r) {
    return r;
  }
  // Asked after the opening byte is held: a user that comes from now on waits for the build;
  // one that came before holds the open byte of the index (made before the byte is taken),
  // and this reader stands aside; so it does for one that waits for another reader's build.
  auto waiting = fs->lock_is_free(named, opener_waiting_byte, 1, io::lock_request::exclusive);
  if (!waiting) return std::unexpected(waiting.error());
  if (!*waiting) return errc_error(std::errc::device_or_resource_busy);
  auto index =
      io::file_handle::open_at(dir.dir, "index", io::open_flags::read | io::open_flags::no_follow);
  if (index) {
    auto nobody = fs->lock_is_free(*index, open_byte, 1, io::lock_request::exclusive);
    if (!nobody) return std::unexpected(nobody.error());
    if (!*nobody) return errc_error(std::errc::device_or_resource_busy);
  } else if (index.error() != std::errc::no_such_file_or_directory) {
    return std::unexpected(index.error());
  }
  // (Nor while a user goes on through an index removed from the path, or replaced.)
  if (user_of_another_index()) return errc_error(std::errc::device_or_resource_busy);
  if (auto r = fs->lock(named, private_reading_byte, 1, io::lock_request::shared, false); !r) {
    return r;
  }

  // In memory: /dev/shm, else the temporary directory (also when /dev/shm is too small).
  std::optional<error> first_error;
  const char* tmpdir = std::getenv("TMPDIR");
  for (const char* where : {"/dev/shm", tmpdir, "/tmp"}) {
    if (where == nullptr || *where == '\0') continue;
    bool place_failed = false;
    auto built = build_private_index(where, place_failed);
    if (built) break;
    if (!place_failed) return built;
    if (!first_error) first_error = built.error();
  }
  if (!index_file.is_open()) return std::unexpected(*first_error);
  return fs->lock(named, private_opening_byte, 1, io::lock_request::unlock, false);
}

result<void> store::impl::build_private_index(const char* where, bool& place_failed) noexcept {
  index_map = {};
  table.reset();
  ledger.reset();
  (void)index_file.close();  // (an earlier place's, whose room ran out)
  auto f = fs->open(nullptr, where, io::open_flags::read_write | io::open_flags::temporary, 0600);
  if (!f) {
    place_failed = true;
    return std::unexpected(f.error().about(where));
  }
  index_file = std::move(*f);
  const auto fail = [&](const error& e) -> result<void> {
    index_map = {};
    table.reset();
    ledger.reset();
    (void)index_file.close();
    return std::unexpected(e);
  };
  if (auto m = map_index(); !m) return fail(m.error());
  if (auto r = rebuild(); !r) {
    // (Out of room where the index grows, not in the store: the next place may have it.)
    const std::error_code e = r.error().code();
    place_failed =
        e == std::errc::no_space_on_device || e == std::error_code(EDQUOT, std::system_category());
    return fail(r.error());
  }
  reset_ledger();
  // Its liveness descriptor now, while /proc and this process's rights allow reopening the
  // unnamed file (a forked child reopens it the same way, at its first call).
  base::lock_guard g(users.mutex);
  const std::string reopened = "/proc/self/fd/" + std::to_string(index_file.fd());
  auto l = fs->open(nullptr, reopened.c_str(), io::open_flags::read_write, 0600);
  if (!l) return fail(l.error().about(reopened));
  users.adopt(std::move(*l), {});
  return {};
}

bool store::impl::private_readers_present() const noexcept {
  // (An error asking: assumed present, which only costs the room a segment could have kept.)
  auto free =
      fs->lock_is_free(dir.store_file, private_reading_byte, 1, io::lock_request::exclusive);
  return !free || !*free;
}

}  // namespace keel::kv
