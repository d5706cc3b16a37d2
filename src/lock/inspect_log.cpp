// inspect, for atomic_append: the live chunks of its log. A chunk is its owner's request for
// every entity in it; the owner holds an exclusive OFD lock on the chunk's first byte from
// just after its append until it unlocks, and marks the chunk released then. A chunk is
// granted when no earlier live chunk conflicts with it: so the log itself says who holds
// and who waits, in order.

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "atomic_append_format.hpp"
#include "base/format_header.hpp"
#include "base/process.hpp"
#include "inspect_parts.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::lock::inspecting {
namespace {

using namespace aa;

// Bytes of log read at most: a log that is never quiet grows, and a look must end.
constexpr off_t most_scanned = off_t{256} << 20;

std::uint64_t word_at(std::span<const std::byte> page, std::size_t at) noexcept {
  std::uint64_t w = 0;
  std::memcpy(&w, page.data() + at, sizeof w);
  return w;
}

// The length of the torn append noted at `offset` in the header, or 0 (notes are checked
// words, as the hints: a damaged one is no note).
off_t torn_at(std::span<const std::byte> page, off_t offset) noexcept {
  for (std::size_t k = 0; k < torn_notes; ++k) {
    const auto at = live_hint::checked(word_at(page, torn_notes_at + k * 16));
    if (!at || *at != static_cast<std::uint64_t>(offset)) continue;
    return static_cast<off_t>(
        live_hint::checked(word_at(page, torn_notes_at + k * 16 + 8)).value_or(0));
  }
  return 0;
}

}  // namespace

bool read_log(context& ctx, const std::string& path, lock_state& out) noexcept {
  bool is_log = false;
  const auto cannot = [&](const std::string& why) {
    if (is_log) out.not_shown.push_back("atomic_append's holders: " + why);
    return is_log;
  };
  auto f = io::file_handle::open(
      ctx.fs, path.c_str(),
      io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) return false;
  auto st = f->status();
  if (!st) return false;
  std::vector<std::byte> page(header_size);
  auto n = f->read_at(0, page);
  if (!n) return false;
  auto state = base::check_header(std::span(page).first(*n), log_format);
  if (!state || *state != base::header_state::ours) return false;
  is_log = true;
  const auto size = static_cast<off_t>(st->size);
  // Records before the first-live hint are released for good. A hint past the end is not
  // true (a reset killed between its truncation and the hint's): the whole log is read.
  auto from = static_cast<off_t>(live_hint::decode(word_at(page, first_live_at)));
  if (from > size) from = header_size;
  const off_t to = std::min(size, from + most_scanned);
  if (to < size) cannot("those past the first 256 MiB of live log (not read)");

  // Each record at `at`: the start of a chunk that parses is taken whole; anything else
  // (zeros of the punched prefix, a torn append, damage) is stepped over a record at a time.
  std::vector<chunk_view> live;
  std::vector<record> buf;
  off_t at = from;
  while (at + record_size <= to) {
    if (const off_t torn = torn_at(page, at); torn > 0) {
      at += torn;
      continue;
    }
    record first{};
    auto r = f->read_at(at, std::as_writable_bytes(std::span(&first, 1)));
    if (!r) return cannot("the log cannot be read: " + r.error().message());
    if (*r < sizeof first) break;
    if (first.magic != record_magic || first.index != 0 || first.count == 0) {
      at += record_size;
      continue;
    }
    buf.resize(first.count);
    auto m = f->read_at(at, std::as_writable_bytes(std::span(buf)));
    if (!m) return cannot("the log cannot be read: " + m.error().message());
    auto c = parse_chunk(at, std::span(buf).first(*m / sizeof(record)));
    if (!c) {
      at += record_size;
      continue;
    }
    at += c->length;
    if (!c->released) live.push_back(std::move(*c));
  }

  ctx.refresh_kernel_locks();  // after the copy: an owner alive now has its chunk locked
  const std::string name = ctx.kernel_name(st->device, st->inode);
  const auto& me = base::self();
  std::vector<const chunk_view*> granted_or_waiting;
  for (const chunk_view& c : live) {
    // Its owner locks its first byte from just after the append (an instant) until it
    // unlocks: unlocked and not alive, it is abandoned.
    const bool locked = ctx.locked(name, static_cast<std::uint64_t>(c.offset));
    const auto alive = base::check(c.owner, base::recorded_on::local_filesystem, ctx.fs);
    const bool stale = !locked && (alive == base::liveness::dead ||
                                   (ctx.kernel_locks_read && alive != base::liveness::alive));
    const bool waits =
        !stale && std::ranges::any_of(granted_or_waiting, [&](const chunk_view* earlier) {
          return conflicts(earlier->entities, c.entities);
        });
    if (!stale) granted_or_waiting.push_back(&c);
    const auto seen = ctx.lock_owner.find({name, static_cast<std::uint64_t>(c.offset)});
    for (const std::uint64_t e : c.entities) {
      lock_holder h;
      h.what = stale   ? lock_holder::role::stale
               : waits ? lock_holder::role::waits
                       : lock_holder::role::holds;
      h.algorithm = "atomic_append";
      h.pid = seen != ctx.lock_owner.end() ? seen->second : c.owner.pid;
      h.host = ctx.host;
      h.process_started = c.owner.boot_id == me.boot_id ? ctx.started_at(c.owner.start_time) : 0;
      h.entity = e & ~exclusive_bit;
      h.exclusive = (e & exclusive_bit) != 0;
      out.holders.push_back(std::move(h));
    }
  }
  return true;
}

}  // namespace keel::lock::inspecting
