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
#include "inspect_parts.hpp"
#include "io/process.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::lock::inspecting {
namespace {

using namespace atomic_append_detail;

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

// The log from a start to `end`, read in large pieces: each byte is read about once.
class log_window {
 public:
  log_window(const io::file_handle& f, off_t end) : f_(f), end_(end) {}

  //! The record at `at`; false where the file ends before it (a reset truncated it).
  result<bool> get(off_t at, record& out) {
    if (at < start_ || at + record_size > start_ + static_cast<off_t>(bytes_.size())) {
      bytes_.resize(static_cast<std::size_t>(std::min<off_t>(end_ - at, off_t{1} << 20)));
      auto n = f_.read_at(at, bytes_);
      if (!n) return std::unexpected(n.error());
      bytes_.resize(*n);
      start_ = at;
      if (*n < static_cast<std::size_t>(record_size)) return false;
    }
    std::memcpy(&out, bytes_.data() + (at - start_), sizeof out);
    return true;
  }

 private:
  const io::file_handle& f_;
  off_t end_;
  off_t start_ = 0;
  std::vector<std::byte> bytes_;
};

}  // namespace

bool read_log(context& ctx, const std::string& path, lock_state& out) noexcept {
  bool is_log = false;
  const auto cannot = [&](const std::string& why) {
    if (is_log) out.not_shown.push_back("atomic_append's holders: " + why);
    return is_log;
  };
  auto f = io::file_handle::open(
      ctx.fs, path.c_str(),
      io::open_flags::read | io::open_flags::non_blocking);  // through a link, as inspect
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
  // The log is read once, through a window; a chunk is parsed only once its records' headers
  // follow on (a step over a record that claims a long chunk costs as far as it follows on,
  // and the records it claimed then do not start chunks: the scan stays linear).
  log_window win(*f, to);
  std::vector<chunk_view> live;
  std::vector<record> buf;
  std::uint64_t damaged = 0;  // records stepped over that are not zeros
  off_t at = from;
  const auto step = [&](const record& r) {
    if (std::any_of(reinterpret_cast<const std::byte*>(&r),
                    reinterpret_cast<const std::byte*>(&r) + sizeof r,
                    [](std::byte b) { return b != std::byte{0}; })) {
      ++damaged;
    }
    at += record_size;
  };
  while (at + record_size <= to) {
    if (const off_t torn = torn_at(page, at); torn > 0) {
      at += torn;
      continue;
    }
    record first{};
    auto got = win.get(at, first);
    if (!got) return cannot("the log cannot be read: " + got.error().message());
    if (!*got) break;
    if (first.magic != record_magic || first.index != 0 || first.count == 0) {
      step(first);
      continue;
    }
    std::uint16_t follow = 1;
    for (record next{}; follow < first.count; ++follow) {
      const off_t there = at + follow * record_size;
      if (there + record_size > to) break;
      auto r = win.get(there, next);
      if (!r) return cannot("the log cannot be read: " + r.error().message());
      if (!*r || next.magic != record_magic || next.index != follow || next.count != first.count)
        break;
    }
    if (follow < first.count) {
      step(first);
      continue;
    }
    buf.resize(first.count);
    bool whole = true;
    for (std::uint16_t k = 0; k < first.count && whole; ++k) {
      auto r = win.get(at + k * record_size, buf[k]);
      if (!r) return cannot("the log cannot be read: " + r.error().message());
      whole = *r;
    }
    if (!whole) break;
    auto c = parse_chunk(at, buf);
    if (!c) {
      step(first);
      continue;
    }
    at += c->length;
    if (!c->released) live.push_back(std::move(*c));
  }
  if (damaged != 0) {
    cannot(std::to_string(damaged) +
           " records of the log that do not parse (damaged, or torn by a full disk and not "
           "noted): their owners, if any, are not shown");
  }

  ctx.refresh_kernel_locks();  // after the copy: an owner alive now has its chunk locked
  const std::string name = ctx.kernel_name(st->device, st->inode);
  const auto& me = io::self();
  std::vector<const chunk_view*> granted_or_waiting;
  for (const chunk_view& c : live) {
    // Its owner locks its first byte from just after the append (an instant) until it
    // unlocks: unlocked and not alive, it is abandoned.
    const bool locked = ctx.locked(name, static_cast<std::uint64_t>(c.offset));
    const auto alive = io::check(c.owner, io::recorded_on::local_filesystem, ctx.fs);
    const bool stale = !locked && (alive == io::liveness::dead ||
                                   (ctx.kernel_locks_read && alive != io::liveness::alive));
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
