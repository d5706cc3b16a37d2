// inspect, for memory_map: the slots of the shared map its lock file names. A slot's writer
// word names the user that holds it exclusively (or was handed it), its reader set the users
// that hold it shared, its waiter set those asleep on it; the user table says which process
// each user is. A user lives while it holds its liveness byte of the map (an OFD lock: the
// kernel drops it when the process dies), so the kernel's lock table tells the stale.

#include <vector>

#include "inspect_parts.hpp"
#include "keel/io/file_handle.hpp"
#include "memory_map/format.hpp"
#include "memory_map/slot_table.hpp"

namespace keel::lock::inspecting {

std::string map_of(io::filesystem& fs, const std::string& path) noexcept {
  auto f = io::file_handle::open(
      fs, path.c_str(),
      io::open_flags::read | io::open_flags::non_blocking);  // through a link, as inspect
  if (!f) return {};
  std::vector<std::byte> page(memory_map_detail::lockfile_page);
  auto n = f->read_at(0, page);
  if (!n) return {};
  auto state = memory_map_detail::parse_lock_file(std::span(page).first(*n));
  if (!state || state->blank || state->degraded) return {};
  return state->map_path;
}

void read_map(context& ctx, const std::string& map, lock_state& out) noexcept {
  const auto cannot = [&](const std::string& why) {
    out.not_shown.push_back("memory_map's holders: " + why);
  };
  auto f = io::file_handle::open(
      ctx.fs, map.c_str(),
      io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) return cannot("its map " + map + " cannot be opened: " + f.error().message());
  auto st = f->status();
  if (!st) return cannot("its map cannot be read: " + st.error().message());
  // A copy, read while users change it: each word is as one moment saw it.
  std::vector<std::uint64_t> words(memory_map_detail::map_size / sizeof(std::uint64_t));
  auto n = f->read_at(0, std::as_writable_bytes(std::span(words)));
  if (!n) return cannot("its map cannot be read: " + n.error().message());
  const auto bytes = std::as_bytes(std::span(words)).first(*n);
  if (*n != memory_map_detail::map_size || !memory_map_detail::check_map(bytes)) {
    return cannot("its map " + map + " is truncated, or not a memory_map map of this version");
  }
  const memory_map_detail::slot_table table(reinterpret_cast<std::byte*>(words.data()));
  if (table.degraded_word().load() != 0) return;  // its holders are the fallback's byte locks

  ctx.refresh_kernel_locks();  // after the copy: a user alive now holds its liveness byte
  const std::string name = ctx.kernel_name(st->device, st->inode);
  const auto add = [&](std::size_t slot, std::uint32_t u, lock_holder::role what, bool exclusive,
                       bool mode_known) {
    if (u >= memory_map_detail::max_users) return;
    const memory_map_detail::user_entry* e = table.user(u);
    const auto byte = static_cast<std::uint64_t>(memory_map_detail::liveness_base) + u;
    const bool alive = !ctx.kernel_locks_read || ctx.locked(name, byte);
    const auto seen = ctx.lock_owner.find({name, byte});
    lock_holder h;
    h.what = alive ? what : lock_holder::role::stale;
    h.algorithm = "memory_map";
    h.pid = seen != ctx.lock_owner.end() ? seen->second : e->pid;
    h.host = ctx.host;
    h.process_started = ctx.started_at(e->start_time);  // a map is of this boot (tmpfs)
    h.entity_known = false;
    h.exclusive = exclusive;
    h.mode_known = mode_known;
    h.slot = static_cast<std::int64_t>(slot);
    h.slots = memory_map_detail::slots;
    out.holders.push_back(std::move(h));
  };
  const auto each_bit = [](std::uint64_t bits, std::size_t word, auto&& visit) {
    while (bits != 0) {
      const auto b = static_cast<std::uint32_t>(__builtin_ctzll(bits));
      bits &= bits - 1;
      visit(static_cast<std::uint32_t>(word * 64 + b));
    }
  };
  for (std::size_t i = 0; i < memory_map_detail::slots; ++i) {
    const memory_map_detail::slot_ref s = table.slot(i);
    if (const std::uint32_t w = s.writer_user(); w != memory_map_detail::no_slot) {
      add(i, w, lock_holder::role::holds, true, true);  // held, or handed to it
    }
    for (std::size_t word = 0; word < memory_map_detail::bitset_words; ++word) {
      each_bit(s.readers(word).load(), word,
               [&](std::uint32_t u) { add(i, u, lock_holder::role::holds, false, true); });
      each_bit(s.waiters(word).load(), word, [&](std::uint32_t u) {
        const std::uint32_t wants = table.user(u)->wants;
        const bool known =
            u < memory_map_detail::max_users && (wants & ~memory_map_detail::wants_exclusive) == i;
        add(i, u, lock_holder::role::waits,
            known && (wants & memory_map_detail::wants_exclusive) != 0, known);
      });
    }
  }
}

}  // namespace keel::lock::inspecting
