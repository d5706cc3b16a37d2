#include "keel/lock/atomic_append.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>
#include <vector>

#include "atomic_append_format.hpp"
#include "base/planted.hpp"
#include "base/spin.hpp"
#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/mapped_file.hpp"

namespace keel::lock {
namespace {

// The format is atomic_append_format.hpp's; these are the protocol's own numbers.
using namespace atomic_append_detail;
constexpr off_t truncate_above = 256 * 1024;
constexpr off_t punch_every = 1 << 20;
constexpr std::uint64_t stale_after_ns = 1'000'000'000;

// Corruption of the log at `offset`.
std::unexpected<error> corrupt_at(const io::file_handle& f, off_t offset) noexcept {
  return std::unexpected(
      error(errc::corrupt).about(f.shared_path(), static_cast<std::uint64_t>(offset)));
}

// The records one lock call of `entities` entities appends (its chunk).
constexpr std::size_t records_for(std::size_t entities) noexcept {
  return (entities + atomic_append::entities_per_record - 1) / atomic_append::entities_per_record;
}

struct thread_log final : base::thread_state {
  io::file_handle append;  // O_APPEND: records go here
  io::file_handle rw;      // reads, released flags and record locks (pwrite ignores the
                           // offset on an O_APPEND descriptor, hence two)
  // Records this thread unlocked but could not mark released (the write failed): their
  // byte stays locked, so to everyone else they are held, as the unlock's error said. This
  // thread knows better: it skips them, and marks them again when it meets them. It never
  // probes them through its own descriptor (that would convert or drop its own lock).
  std::vector<off_t> stuck;
  // The chunks this thread holds. Their byte is locked through `rw`, so a probe through `rw`
  // would succeed, convert the lock to shared and, unlocking, drop it: never probe them.
  std::vector<off_t> held;
  // How long to watch the first-live hint for the chunk ahead's unlock before sleeping in
  // the kernel (base::next_spin_budget: follows what watching achieves).
  std::uint64_t watch_ns = 50'000;

  void close_in_child() noexcept override {
    detail::close_in_child(append);
    detail::close_in_child(rw);
  }

  [[nodiscard]] bool is_stuck(off_t chunk) const noexcept {
    return std::find(stuck.begin(), stuck.end(), chunk) != stuck.end();
  }
  [[nodiscard]] bool is_mine(off_t chunk) const noexcept {
    return is_stuck(chunk) || std::find(held.begin(), held.end(), chunk) != held.end();
  }
};

}  // namespace

struct atomic_append::impl {
  std::string path;
  detail::file_id id;  // a thread reopens `path`: it must still be this file
  io::filesystem* fs = &io::os();
  io::file_handle file;  // owns the header map's descriptor
  io::mapped_file header_map;
  base::per_thread_states threads;

  live_hint first_live() noexcept {
    return live_hint(reinterpret_cast<std::uint64_t*>(header_map.data() + first_live_at));
  }
  live_hint punched_to() noexcept {
    return live_hint(reinterpret_cast<std::uint64_t*>(header_map.data() + punched_to_at));
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> torn_word(std::size_t note, int field) noexcept {
    return std::atomic_ref<std::uint64_t>(*reinterpret_cast<std::uint64_t*>(
        header_map.data() + torn_notes_at + note * 16 + static_cast<std::size_t>(field) * 8));
  }
  //! Notes that `length` bytes at `offset` are a torn append (under the shared header lock,
  //! before letting go of it). A note is taken from free ones, or from ones wholly below
  //! the first-live hint (never scanned again). Whether there was room.
  bool note_torn(off_t offset, std::uint64_t length) noexcept {
    constexpr std::uint64_t claimed = 1;  // a raw word no note has (its check fails)
    const auto live = first_live().load();
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t k = 0; k < torn_notes; ++k) {
        std::uint64_t was = torn_word(k, 0).load();
        const auto at = live_hint::checked(was);
        const auto len = live_hint::checked(torn_word(k, 1).load());
        const bool reusable = pass == 1 && at && *at != 0 && len && *at + *len <= live;
        if (was != 0 && !reusable) continue;
        if (!torn_word(k, 0).compare_exchange_strong(was, claimed)) continue;
        // Each word self-checked as the hints are: a damaged note is no note (the log then
        // reads as corrupt there), never a skip over records. The offset is published last.
        torn_word(k, 1).store(live_hint::encode(length));
        torn_word(k, 0).store(live_hint::encode(static_cast<std::uint64_t>(offset)));
        return true;
      }
    }
    return false;
  }
  //! The length of the torn append noted at `offset`, or 0.
  std::uint64_t torn_at(off_t offset) noexcept {
    for (std::size_t k = 0; k < torn_notes; ++k) {
      const auto at = live_hint::checked(torn_word(k, 0).load());
      if (!at || *at != static_cast<std::uint64_t>(offset)) continue;
      return live_hint::checked(torn_word(k, 1).load()).value_or(0);
    }
    return 0;
  }
  //! Forgets every note (the log was truncated: under the exclusive header lock).
  void clear_torn() noexcept {
    for (std::size_t k = 0; k < torn_notes; ++k)
      torn_word(k, 0).store(0);
  }

  //! Moves the first-live hint from `from` to `to` (everything before `to` is released for
  //! good) if it is still at `from`; else loads it into `from`. Gives back the space of the
  //! released prefix now and then (the log only shrinks for real when it is truncated in a
  //! quiet moment); its end is recorded first, so that zeros below it are known for what
  //! they are even after the hint is reset.
  bool advance_live(const io::file_handle& rw, std::uint64_t& from, off_t to) noexcept {
    if (!first_live().compare_exchange(from, static_cast<std::uint64_t>(to),
                                       std::memory_order_acq_rel)) {
      return false;
    }
    if (to / punch_every > static_cast<off_t>(from) / punch_every) {
      auto punched = punched_to();
      auto was = punched.load();
      while (was < static_cast<std::uint64_t>(to) &&
             !punched.compare_exchange(was, static_cast<std::uint64_t>(to))) {
      }
      (void)rw.punch_hole(header_size, to - header_size);
    }
    return true;
  }

  result<thread_log*> mine() noexcept {
    return threads.get<thread_log>([&]() -> result<std::unique_ptr<thread_log>> {
      auto a = detail::reopen(*fs, path, io::open_flags::write | io::open_flags::append, id);
      if (!a) return std::unexpected(a.error());
      auto rw = detail::reopen(*fs, path, io::open_flags::read_write, id);
      if (!rw) return std::unexpected(rw.error());
      auto s = std::make_unique<thread_log>();
      s->append = std::move(*a);
      s->rw = std::move(*rw);
      return s;
    });
  }
};

atomic_append::atomic_append(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

atomic_append::~atomic_append() = default;

result<std::unique_ptr<atomic_append>> atomic_append::open(const std::string& path,
                                                           io::filesystem& fs) noexcept {
  // It needs appends that are atomic for every user, and every user reading what the others
  // appended at once: neither holds across the clients of a network filesystem.
  if (auto here = detail::refuse_unless_local(fs, path, "atomic_append"); !here) {
    return std::unexpected(here.error());
  }
  auto f = detail::open_claimed(fs, path, "atomic_append");
  if (!f) return std::unexpected(f.error());
  auto id = detail::identify(*f);
  if (!id) return std::unexpected(id.error());
  // Openers take turns under the exclusive header lock (appenders hold it shared for an
  // instant): an initialiser writes the whole header before anyone reads it, and a first
  // user resets the log before anyone appends.
  auto g = io::lock_extent(*f, header_lock_byte, 1, io::lock_kind::exclusive);
  if (!g) return std::unexpected(g.error());
  std::vector<std::byte> page(header_size);
  auto n = f->read_at(0, page);
  if (!n) return std::unexpected(n.error());
  auto size = f->size();
  if (!size) return std::unexpected(size.error());
  auto state = base::check_header(std::span(page).first(*n), log_format);
  if (!state) return std::unexpected(state.error().about(f->shared_path(), 0));
  if (*state == base::header_state::blank) {
    // Only an empty file is taken, or one of zeros no longer than a header (a power cut
    // between the creation of a log and its header's fsync): one with content that is not a
    // log is refused, never written.
    if (*size > header_size ||
        std::any_of(page.begin(), page.end(), [](std::byte b) { return b != std::byte{0}; })) {
      return std::unexpected(error(errc::not_keel_file).about(f->shared_path(), 0));
    }
    const base::format_header h = log_format.header();
    std::memcpy(page.data(), &h, sizeof h);
    const std::uint64_t first = live_hint::encode(header_size);
    std::memcpy(page.data() + first_live_at, &first, sizeof first);
    if (auto w = f->write_at(0, page); !w) return std::unexpected(w.error());
    // Durable before any record follows it: a power cut must not leave records behind a
    // header of zeros (a file nobody could tell from a stranger's).
    if (!base::is_planted(base::planted_bug::atomic_append_skips_header_sync)) {
      if (auto s = f->sync_data(); !s) return std::unexpected(s.error());
    }
    size = header_size;
  } else if (*size < header_size) {
    return std::unexpected(
        error(errc::corrupt).about(f->shared_path(), static_cast<std::uint64_t>(*size)));
  }
  // Every instance holds the in-use byte shared while it lives (through the descriptor it
  // keeps, which a forked child shares). Getting it exclusively proves there is no other:
  // every record in the log is then a dead process's (after a crash or a power cut, torn
  // ones too), so the log starts afresh instead of being scanned, or refused, forever.
  auto first = io::try_lock_extent(*f, in_use_byte, 1, io::lock_kind::exclusive);
  if (!first && !detail::is_contention(first.error())) return std::unexpected(first.error());
  if (first) {
    // Also when the log is no longer than its header: a reset killed after its truncation
    // leaves the hints and torn notes of the log it removed.
    const std::uint64_t from = live_hint::encode(header_size);
    if (auto w = f->write_at(first_live_at, std::as_bytes(std::span(&from, 1))); !w) {
      return std::unexpected(w.error());
    }
    if (auto t = f->truncate(header_size); !t) return std::unexpected(t.error());
    if (auto w = f->write_at(punched_to_at, std::as_bytes(std::span(&from, 1))); !w) {
      return std::unexpected(w.error());
    }
    const std::array<std::uint64_t, torn_notes * 2> no_notes{};
    if (auto w = f->write_at(torn_notes_at, std::as_bytes(std::span(no_notes))); !w) {
      return std::unexpected(w.error());
    }
  }
  auto in_use = io::lock_extent(*f, in_use_byte, 1, io::lock_kind::shared);  // converts ours
  if (!in_use) return std::unexpected(in_use.error());
  in_use->release();
  if (first) first->release();  // the conversion replaced it
  if (auto u = g->unlock(); !u) return std::unexpected(u.error());
  auto map = io::mapped_file::map(*f, io::map_access::read_write, header_size, 0);
  if (!map) return std::unexpected(map.error());
  auto p = std::make_unique<impl>();
  p->path = path;
  p->id = *id;
  p->fs = &fs;
  p->file = std::move(*f);
  p->header_map = std::move(*map);
  return std::unique_ptr<atomic_append>(new atomic_append(id->dev, id->ino, std::move(p)));
}

namespace {

result<void> mark_released(const io::file_handle& rw, off_t chunk, std::uint32_t mark) noexcept {
  return rw.write_at(chunk + released_at, std::as_bytes(std::span(&mark, 1)));
}

// Reads every chunk in [from, to) of the log and calls `visit(chunk)` for each, in order;
// stops early when `visit` returns false. Returns the offset it stopped at. Records before
// `first_live` may be punched out (zeros) under a slow reader's feet, and the punched prefix
// ends at `punched_to` (recorded before the punch, reset after the truncation that removes
// it, so a hint reset by a truncation that then failed, or was killed, still finds it):
// where what is read does not parse, a reader that finds either past that point jumps to
// it. Else `heal(at)` is asked: the end of a torn append noted at `at` (a full disk took
// part of it), or 0: then it is corruption.
template <class Visit, class Heal>
result<off_t> scan(const io::file_handle& rw, live_hint first_live, live_hint punched_to,
                   off_t from, off_t to, Visit&& visit, Heal&& heal) {
  std::vector<record> buf;
  off_t at = from;
  const auto skip_or_fail = [&]() -> bool {
    const auto live = static_cast<off_t>(first_live.load(std::memory_order_acquire));
    const auto punched = static_cast<off_t>(punched_to.load(std::memory_order_acquire));
    const off_t past = std::max(live, punched);
    if (past > at) {
      at = past;
      return true;
    }
    return false;
  };
  // Whether `at` moved past what did not parse there; an error if it is corruption.
  const auto step_over = [&]() -> result<void> {
    if (skip_or_fail()) return {};
    auto end = heal(at);
    if (!end) return std::unexpected(end.error());
    if (*end > at) {
      at = *end;
      return {};
    }
    return corrupt_at(rw, at);
  };
  while (at < to) {
    const auto want = static_cast<std::size_t>(std::min<off_t>(to - at, 64 * record_size));
    buf.resize(want / record_size);
    auto n = rw.read_at(at, std::as_writable_bytes(std::span(buf)));
    if (!n) return std::unexpected(n.error());
    if (*n < static_cast<std::size_t>(record_size)) {
      if (auto s = step_over(); !s) return std::unexpected(s.error());
      continue;
    }
    std::size_t have = *n / record_size;
    std::size_t k = 0;
    bool reread = false;
    while (k < have) {
      if (buf[k].count > have - k) {
        if (k == 0) {
          // A chunk larger than the buffer: read it whole.
          buf.resize(buf[0].count);
          auto m = rw.read_at(at, std::as_writable_bytes(std::span(buf)));
          if (!m) return std::unexpected(m.error());
          have = *m / record_size;
          if (buf[0].count > have) {
            if (auto s = step_over(); !s) return std::unexpected(s.error());
            reread = true;
            break;
          }
          continue;
        }
        break;
      }
      auto c = parse_chunk(at, std::span(buf).subspan(k, have - k));
      if (!c) {
        if (auto s = step_over(); !s) return std::unexpected(s.error());
        reread = true;
        break;
      }
      const off_t len = static_cast<off_t>(buf[k].count) * record_size;
      auto go_on = visit(*c);
      if (!go_on) return std::unexpected(go_on.error());
      if (!*go_on) return at;
      k += buf[k].count;
      at += len;
    }
    (void)reread;
  }
  return at;
}

// Whether the chunk at `offset` (another thread's), found unlocked while its flag says held,
// is abandoned (its owner died) rather than between its append and its lock. Appenders hold
// the header lock shared across both steps, so under the header lock held exclusively, a
// chunk still unlocked has no owner that will ever lock it: a proof that needs no /proc.
result<bool> is_abandoned(const thread_log& t, off_t offset) noexcept {
  auto h = io::try_lock_extent(t.rw, header_lock_byte, 1, io::lock_kind::exclusive);
  if (!h) {
    if (detail::is_contention(h.error())) return false;  // appenders at work: later
    return std::unexpected(h.error());
  }
  auto probe = io::try_lock_extent(t.rw, offset, 1, io::lock_kind::shared);
  if (!probe) {
    if (detail::is_contention(probe.error())) return false;  // locked: its owner lives
    return std::unexpected(probe.error());
  }
  return true;
}

// How a chunk waited for was released, and what that says of the chunks before it.
enum class released_as : std::uint8_t {
  given_up,     // withdrawn or abandoned (RSLD): nothing
  passed_on,    // PASS: every earlier chunk that conflicts with it is released
  behind_hint,  // the first-live hint is past it: every earlier chunk is released
};

// Waits until the chunk at `offset` (another's, conflicting with ours) is released, within
// `cd`; a try (zero countdown) makes one look.
result<released_as> wait_out(thread_log& t, live_hint first_live, off_t offset,
                             const io::countdown& cd, bool spin) noexcept {
  const auto passed = [&] {
    return first_live.load(std::memory_order_acquire) > static_cast<std::uint64_t>(offset);
  };
  if (passed()) return released_as::behind_hint;
  if (!cd.is_zero() &&
      first_live.load(std::memory_order_relaxed) == static_cast<std::uint64_t>(offset)) {
    // The chunk ahead is the first live one: its owner holds it (or is about to), and its
    // unlock moves the hint past it. A kernel sleep and wake-up cost more than a short hold.
    constexpr std::uint64_t least = 1'000, most = 200'000;
    const std::uint64_t budget = std::clamp(t.watch_ns, least, most);
    const bool won = base::spin_until(passed, std::chrono::nanoseconds(budget));
    t.watch_ns = base::next_spin_budget(budget, won, least, most);
    if (won) return released_as::behind_hint;
  }
  for (;;) {
    if (!cd.is_zero() && !cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
    const io::deadline d = spin || cd.is_zero() ? io::deadline::zero() : detail::rest_of(cd);
    if (!d.is_zero()) detail::reached("atomic_append.sleeps");
    auto g = io::lock_extent(t.rw, offset, 1, io::lock_kind::shared, d);
    if (!g) {
      if (!detail::is_contention(g.error())) return std::unexpected(g.error());
      if (!spin || cd.is_zero() || cd.expired()) return detail::contention_error(cd);
      std::this_thread::yield();
      continue;
    }
    (void)g->unlock();
    // Its lock was free: released, dead, or its owner is between append and lock.
    std::uint32_t flag = 0;
    auto rd = t.rw.read_at(offset + released_at, std::as_writable_bytes(std::span(&flag, 1)));
    if (!rd) return std::unexpected(rd.error());
    if (flag == passed_mark) return released_as::passed_on;
    if (flag == released_mark) return released_as::given_up;
    if (flag != 0) return corrupt_at(t.rw, offset + released_at);
    auto gone = is_abandoned(t, offset);
    if (!gone) return std::unexpected(gone.error());
    if (*gone) {
      (void)mark_released(t.rw, offset, released_mark);  // spare the next reader the check
      return released_as::given_up;
    }
    if (cd.is_zero()) return detail::contention_error(cd);  // between append and lock: held
    std::this_thread::yield();
  }
}

}  // namespace

result<std::uint64_t> atomic_append::do_lock(std::span<const entity> sorted,
                                             const io::countdown& cd, bool spin) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  thread_log& t = **state;

  // Build the chunk: ceil(n / 24) records, entities in sorted order.
  const std::size_t n_records = records_for(sorted.size());
  if (n_records > 0xffff) return errc_error(std::errc::argument_list_too_long);
  std::vector<record> chunk(n_records);
  const auto& me = io::self();
  const auto now_ns =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  for (std::size_t k = 0; k < n_records; ++k) {
    record& r = chunk[k];
    r.magic = record_magic;
    r.index = static_cast<std::uint16_t>(k);
    r.count = static_cast<std::uint16_t>(n_records);
    r.pid = me.pid;
    r.pid_ns = me.pid_ns;
    r.start_time = me.start_time;
    r.time_ns = now_ns;
    std::memcpy(r.boot_id, me.boot_id.data(), sizeof r.boot_id);
    const std::size_t first = k * entities_per_record;
    r.entities_here =
        static_cast<std::uint32_t>(std::min(entities_per_record, sorted.size() - first));
    for (std::size_t j = 0; j < r.entities_here; ++j)
      r.entities[j] = pack(sorted[first + j]);
    r.checksum = checksum_of(r);
  }
  const std::size_t bytes = chunk.size() * sizeof(record);

  // Append under the shared header lock, so a truncation cannot drop a record that is not
  // yet locked; then lock the record and let truncators in again.
  // Neither step waits past the deadline: openers and truncators hold the header lock
  // exclusively for an instant, and a waiter our record's byte shared, but a stopped process
  // could hold either for good. A try gets a few milliseconds for them.
  const io::countdown steps =
      cd.is_zero() ? io::deadline(std::chrono::milliseconds(10)).start() : cd;
  off_t mine_at = 0;
  {
    auto h =
        io::lock_extent(t.rw, header_lock_byte, 1, io::lock_kind::shared, detail::rest_of(steps));
    if (!h) {
      if (detail::is_contention(h.error())) return detail::contention_error(cd);
      return std::unexpected(h.error());
    }
    auto w = t.append.append(std::as_bytes(std::span(chunk)));
    if (!w) {
      if (base::is_planted(base::planted_bug::atomic_append_ignores_failed_append)) return 0;
      return std::unexpected(w.error());
    }
    mine_at = w->offset;
    if (w->length != bytes) {
      // The filesystem took part of the chunk (full disk). Noted before the header lock is
      // let go, so readers step over it rather than find the log corrupt from here on (and
      // one that finds it first waits for the header lock, then for this note).
      if (!impl_->note_torn(mine_at, w->length) && w->length >= sizeof(record)) {
        (void)mark_released(t.rw, mine_at, released_mark);  // no room for a note: harmless at least
      }
      return std::unexpected(
          error(std::make_error_code(std::errc::no_space_on_device))
              .about(t.append.shared_path(), static_cast<std::uint64_t>(mine_at)));
    }
    detail::reached("atomic_append.appended");
    // A waiter may hold our record's byte shared for an instant while it finds the record
    // not yet locked: retry until ours.
    for (;;) {
      auto g = io::try_lock_extent(t.rw, mine_at, 1, io::lock_kind::exclusive);
      if (g) {
        g->release();
        break;
      }
      if (!detail::is_contention(g.error())) {
        (void)mark_released(t.rw, mine_at, released_mark);
        return std::unexpected(g.error());
      }
      if (!steps.is_infinite() && steps.expired()) {
        (void)mark_released(t.rw, mine_at, released_mark);
        return detail::contention_error(cd);
      }
      std::this_thread::yield();
    }
  }
  const auto withdraw = [&](const error& ec) -> result<std::uint64_t> {
    if (mark_released(t.rw, mine_at, released_mark)) {
      (void)io::unlock_extent(t.rw, mine_at, 1);
    } else {
      t.stuck.push_back(mine_at);  // held to the others until marked (see thread_log)
    }
    return std::unexpected(ec);
  };

  // Find the earlier live chunks that conflict with ours, then wait them out nearest first:
  // one that its owner passed on (held, then unlocked) was granted only after every chunk
  // before it that conflicts with it was released, so those need no look of their own. With
  // one entity, a waiter sleeps on the one chunk ahead of it, and each unlock wakes one
  // waiter.
  // A hint past our own chunk cannot be true: a reset of the log was killed between its
  // truncation and the reset of the hint. Believed, the first-live hint would skip live
  // chunks, and the punched end would make a reader that meets zeros jump past them. Every
  // locker mends both before it scans, so none scans with them.
  const auto believed = [&](live_hint h) {
    auto v = h.load(std::memory_order_acquire);
    if (v <= static_cast<std::uint64_t>(mine_at)) return v;
    h.compare_exchange(v, static_cast<std::uint64_t>(header_size), std::memory_order_acq_rel);
    return static_cast<std::uint64_t>(header_size);
  };
  auto first_live = impl_->first_live();
  const auto hint = believed(first_live);
  (void)believed(impl_->punched_to());
  const auto from = std::max(static_cast<off_t>(hint), header_size);
  std::vector<std::uint64_t> want(sorted.size());
  std::transform(sorted.begin(), sorted.end(), want.begin(), pack);
  std::vector<chunk_view> ahead;  // conflicting and live, in log order
  off_t released_prefix = from;   // every chunk before it is released
  std::optional<off_t> blocker;   // the first live chunk we do not wait for
  error failure;
  // A torn append (noted by its appender before it lets go of the shared header lock):
  // once the header lock is ours exclusively, every torn append is noted.
  const auto heal = [&](off_t at) -> result<off_t> {
    if (const std::uint64_t n = impl_->torn_at(at); n != 0) return at + static_cast<off_t>(n);
    auto h = io::lock_extent(t.rw, header_lock_byte, 1, io::lock_kind::exclusive,
                             detail::rest_of(steps));
    if (!h) return std::unexpected(h.error());
    return at + static_cast<off_t>(impl_->torn_at(at));
  };
  auto scanned = scan(
      t.rw, first_live, impl_->punched_to(), from, mine_at,
      [&](chunk_view& c) -> result<bool> {
        if (c.released) {
          if (!blocker && ahead.empty()) released_prefix = c.offset + c.length;
          return true;
        }
        if (t.is_stuck(c.offset)) {
          // Ours, released but not marked: try the mark again; free it for us anyway.
          if (mark_released(t.rw, c.offset, released_mark)) {
            (void)io::unlock_extent(t.rw, c.offset, 1);
            std::erase(t.stuck, c.offset);
          }
          if (!blocker) blocker = c.offset;  // to the others it is held until marked
          return true;
        }
        if (conflicts(c.entities, want)) {
          // Held by this thread through a guard it released: it stays locked until the
          // process exits, and a probe through our own descriptor would drop it.
          if (t.is_mine(c.offset)) {
            failure = error(std::make_error_code(std::errc::resource_deadlock_would_occur));
            return false;
          }
          ahead.push_back(std::move(c));
          return true;
        }
        if (!blocker && now_ns > c.time_ns + stale_after_ns && !t.is_mine(c.offset)) {
          // An old live record holds back the hint: if its owner died, it is released. (Only
          // old ones are checked: a look for every live record would cost too much.)
          auto gone = is_abandoned(t, c.offset);
          if (gone && *gone) {
            (void)mark_released(t.rw, c.offset, released_mark);
            if (ahead.empty()) released_prefix = c.offset + c.length;
            return true;
          }
        }
        if (!blocker) blocker = c.offset;
        return true;
      },
      heal);
  if (!scanned) return withdraw(scanned.error());
  if (failure) return withdraw(failure);
  while (!ahead.empty()) {
    const chunk_view q = std::move(ahead.back());
    ahead.pop_back();
    auto how = wait_out(t, first_live, q.offset, cd, spin);
    if (!how) return withdraw(how.error());
    if (*how == released_as::behind_hint) {
      ahead.clear();
    } else if (*how == released_as::passed_on) {
      std::erase_if(ahead, [&](const chunk_view& c) { return conflicts(c.entities, q.entities); });
    }
  }
  // Every chunk we waited for is released now.
  released_prefix = std::max(released_prefix, blocker.value_or(mine_at));

  // Everything before `released_prefix` is released for good: later scans may skip it.
  auto expected = first_live.load(std::memory_order_relaxed);
  while (expected < static_cast<std::uint64_t>(released_prefix) &&
         !impl_->advance_live(t.rw, expected, released_prefix)) {
  }
  try {
    t.held.push_back(mine_at);
  } catch (const std::bad_alloc&) {
    return withdraw(error(std::make_error_code(std::errc::not_enough_memory)));
  }
  return static_cast<std::uint64_t>(mine_at);
}

result<void> atomic_append::do_unlock(std::span<const entity> sorted,
                                      std::uint64_t token) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  thread_log& t = **state;
  const auto at = static_cast<off_t>(token);
  std::erase(t.held, at);
  // Released first, then the lock: a waiter woken by the unlock already sees the flag (and
  // a reset, which waits for every chunk byte to be free, for our hint move and punch). If
  // the flag cannot be written, the lock stays held (a free lock on a record that says held,
  // with its owner alive, is a state nobody could tell from an owner about to lock it).
  if (auto r = mark_released(t.rw, at, passed_mark); !r) {
    t.stuck.push_back(at);
    return r;
  }
  // Ours was the first live chunk: now the hint may pass it. The waiter next in line
  // watches the hint (shared memory) before it sleeps on our chunk's lock.
  const off_t end = at + static_cast<off_t>(records_for(sorted.size())) * record_size;
  std::uint64_t head = static_cast<std::uint64_t>(at);
  (void)impl_->advance_live(t.rw, head, end);
  if (auto u = io::unlock_extent(t.rw, at, 1); !u) return u;

  // Reset the log when it has grown and nobody holds or waits: under the exclusive header
  // lock no append is in flight, and every record found released stays released. A live
  // chunk right after ours (a waiter, under contention) ends it with one read: a look per
  // unlock would stall appenders for nothing.
  auto size = t.rw.size();
  if (!size || *size < truncate_above) return {};
  if (*size > end) {
    record next{};
    auto n = t.rw.read_at(end, std::as_writable_bytes(std::span(&next, 1)));
    if (n && *n == sizeof next && next.magic == record_magic && next.released == 0) return {};
  }
  auto h = io::try_lock_extent(t.rw, header_lock_byte, 1, io::lock_kind::exclusive);
  if (!h) return {};  // appenders at work: someone else will do it later
  // The size again, now that no append can be in flight: records appended since the first
  // look must be scanned too, or a live one would be truncated away.
  size = t.rw.size();
  if (!size) return {};
  // Nor an unlock: an unlocker marks its chunk released, then moves the hint past it and
  // punches the released prefix, and only then unlocks its chunk's byte. A reset between the
  // two (the scan below takes a marked chunk for released, and starts past it once the hint
  // moved) would meet those late steps in the new log: a punch of the old prefix zeroes the
  // records appended since, and a compare-and-swap from the old offset can move the hint
  // past a live chunk that sits there now. Every held chunk's byte is locked too, so one look
  // at the whole range (F_OFD_GETLK: our own locks do not count, the scan stops at them)
  // tells whether anyone is at work in the log.
  if (*size > header_size) {
    auto quiet = io::extent_is_free(t.rw, header_size, *size - header_size, io::lock_kind::shared);
    if (!quiet || !*quiet) return {};
  }
  const off_t from = std::max<off_t>(header_size, static_cast<off_t>(impl_->first_live().load()));
  bool all_released = true;
  auto scanned = scan(
      t.rw, impl_->first_live(), impl_->punched_to(), from, *size,
      [&](const chunk_view& c) -> result<bool> {
        if (c.released) return true;
        if (t.is_mine(c.offset)) {
          all_released = false;
          return false;
        }
        // Under the exclusive header lock no append is in flight: an unlocked chunk
        // whose flag says held was abandoned by a dead owner.
        auto probe = io::try_lock_extent(t.rw, c.offset, 1, io::lock_kind::shared);
        if (probe) return true;
        all_released = false;
        return false;
      },
      [&](off_t torn) -> result<off_t> {  // the header lock is ours: every note is in
        return torn + static_cast<off_t>(impl_->torn_at(torn));
      });
  if (scanned && all_released) {
    // The hint first: a process killed between the two steps leaves a hint that is merely
    // too low (a longer scan), never one past records that are live.
    impl_->first_live().store(header_size, std::memory_order_release);
    // Housekeeping: the unlock itself succeeded, and a log that could not shrink is still
    // whole (every record in it released, its punched prefix still recorded), so a failure
    // here is not the unlock's.
    if (t.rw.truncate(header_size)) {
      impl_->punched_to().store(header_size);
      impl_->clear_torn();
    }
  }
  return {};
}

}  // namespace keel::lock
