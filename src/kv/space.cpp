// The space ledger in the store (doc/kv-format.md, "Space"): every commit that puts charges
// its worst-case room to the front delta before anything of it is written; the back end
// closes deltas and gives each the room puts may still take.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "base/futex.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

store::impl::put_room store::impl::room_for_puts() const noexcept {
  const std::uint64_t seg_size = next_segment_size();
  const std::uint64_t tail = h64(header::tail).load(std::memory_order_acquire);
  put_room r;
  // The rest of the tail's segment, unless puts keep off it (the ledger offered none of the
  // deletes' segment once puts went on in it: at the least budget, a store erased whole and
  // compacted refused every put for good).
  if (tail != 0 && !puts_keep_off(tail)) {
    r.bytes = log_segment_size_at(tail) - disk::offset_of(tail);
  }
  // Whole segments: a put makes one only with the spare and the deletes' room made, and
  // what check_headroom keeps free left; under a budget, the same of the budget. The index
  // keeps its headroom and the pages a segment's keys may need (put_needs: a put makes the
  // last segment only with them beside it); the pages of puts in the segments before are in
  // their charges (two pages each), and a blob's own segment needs none. In a store whose
  // segments grow, what is left below a segment of this size still takes smaller ones
  // (next_active_segment makes them near full), down to the first size.
  const std::uint64_t each = seg_size - disk::segment_header_size;
  const std::uint64_t first = dir.params.first_segment_size;
  // (What a segment of this size needs beside it: smaller ones hold fewer keys.)
  const std::uint64_t index_room = put_needs(seg_size) - seg_size;
  constexpr std::uint64_t unbounded = UINT64_MAX;
  const auto usable = [&](std::uint64_t bytes) {
    bytes = bytes > index_room ? bytes - index_room : 0;
    std::uint64_t out = bytes / seg_size >= unbounded / each ? unbounded : bytes / seg_size * each;
    std::uint64_t rest = bytes % seg_size;
    for (std::uint64_t size = seg_size / 2; first != 0 && size >= first && out != unbounded;
         size /= 2) {
      if (rest >= size) {
        out += size - disk::segment_header_size;
        rest -= size;
      }
    }
    return out;
  };
  std::uint64_t by_volume = unbounded;
  if (auto free = fs->statfs(dir.segments)) {
    std::uint64_t avail = free->available_bytes;
    if (!has_room(spare_room)) avail = avail > seg_size ? avail - seg_size : 0;
    const std::uint64_t kept = kept_free(*free);
    avail = avail > kept ? avail - kept : 0;
    by_volume = usable(avail);
  }
  const std::uint64_t by_budget =
      opts.max_bytes == 0 ? unbounded : usable(budget_left(room_for::put));
  std::uint64_t made = std::min(by_volume, by_budget);
  r.why = made == by_budget && opts.max_bytes != 0
              ? error(make_error_code(errc::budget_reached))
              : error(std::make_error_code(std::errc::no_space_on_device)).about(path + "/seg");
  // One made and abandoned is the next segment, whoever asks.
  if (abandoned_segment() != 0 && made != unbounded) made += std::min(each, unbounded - made - 1);
  const auto cap = static_cast<std::uint64_t>(space::ledger::max_amount);
  r.bytes = made >= cap ? cap : std::min(cap, r.bytes + made);
  // Less the pages of the directory doubled once: a split of any commit in the delta may
  // double it (commits are charged their own splits' pages only).
  const std::uint64_t doubling = index::directory_pages(table->depth() + 1) * disk::page_size;
  r.bytes = r.bytes == cap ? cap : r.bytes - std::min(r.bytes, doubling);
  // Less what evicted writers may still use (space::ledger::evict).
  if (ledger && r.bytes != cap) {
    r.bytes -= std::min(r.bytes, static_cast<std::uint64_t>(ledger->written_off()));
  }
  return r;
}

result<space::charge> store::impl::charge(slot_lease& lease, std::int64_t cost,
                                          const io::countdown& cd) noexcept {
  if (cost > space::ledger::max_amount) return keel_error(errc::too_large);
  for (;;) {
    const std::uint64_t seen = ledger->front();
    // The ledger's words and our pin live in the index, whose pages the volume may refuse
    // (btrfs at a qgroup's limit): refused past the deadline, the charge ends where it
    // stood, which is where a writer killed there leaves it (its pin set, its cost perhaps
    // charged: space/ledger.hpp). The slot is given up, so that every user settles it so.
    result<std::optional<space::charge>> c = std::optional<space::charge>{};
    if (!stored_escapably(cd, [&] { c = ledger->try_charge(lease.index, cost); })) {
      forsake_slot(lease);
      return std::unexpected(index_write_refusal());
    }
    if (!c) return std::unexpected(c.error());
    if (*c) return **c;
    if (auto r = after_failed_charge(lease, seen, cost, cd); !r) {
      return std::unexpected(r.error());
    }
  }
}

result<void> store::impl::after_failed_charge(slot_lease& lease, std::uint64_t seen,
                                              std::int64_t cost, const io::countdown& cd) noexcept {
  const std::uint32_t who = lease.index;
  // The mark: the slot in the high half, the pid in the low half (the futex word), so that a
  // new user of a dead closer's slot, closing in turn, never has its mark taken for the dead
  // one's (and waiters see the futex word change).
  auto closer = h64(header::ledger_closer);
  auto* word = futex_word(header::ledger_closer);
  const std::uint64_t me = (std::uint64_t{who} + 1) << 32 | static_cast<std::uint32_t>(::getpid());
  auto interval = std::chrono::milliseconds(8);
  auto last_check = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point late_since{};
  // Half the timeout again (at least 50 ms): a closer starved of CPU rather than stopped
  // gets that long to run once nothing holds it.
  const auto late_grace =
      std::max<std::chrono::milliseconds>(std::chrono::milliseconds(50), opts.lock_timeout / 2);
  for (;;) {
    if (ledger->front() != seen) return {};  // closed by another: try the next delta
    std::uint64_t was = closer.load(std::memory_order_seq_cst);
    // (The closer's word is in the index's header page, which the volume may refuse: a mark
    // that cannot be made fails the charge; one that cannot be cleared is a dead closer's,
    // its slot given up, which the others take over from.)
    bool taken = false;
    if (was == 0 && !stored_escapably(cd, [&] {
          taken = closer.compare_exchange_strong(was, me, std::memory_order_seq_cst);
        })) {
      return std::unexpected(index_write_refusal());
    }
    if (taken) {
      auto r = close_delta(seen, cost, cd);
      if (!stored_escapably(cd, [&] { closer.store(0, std::memory_order_seq_cst); })) {
        forsake_slot(lease);
        if (r) r = std::unexpected(index_write_refusal());
      }
      base::futex_wake(word, INT_MAX, base::futex_scope::shared);
      return r;
    }
    if (was == 0) continue;
    // Another closes it: wait for the word to change, then charge again (the delta it opened,
    // once corrected, may hold us: closing it at once would give the next one nothing again).
    // Now and then check the closer lives (one killed while closing would hold every writer
    // back). Past our deadline the closer may still be waiting, to its own far deadline, for
    // the delta before to go quiet, held by a writer stopped inside it: we evict that writer
    // ourselves (as the closer would, see wait_quiet), then give the closer a moment to move
    // the front on. A closer that does not (itself stopped, or starved) fails us.
    if (cd.expired()) {
      if (late_since == std::chrono::steady_clock::time_point{}) {
        late_since = std::chrono::steady_clock::now();
        if (seen >= 2) evict_live_pins(seen - 1, cd);
      } else if (std::chrono::steady_clock::now() - late_since >= late_grace) {
        return errc_error(std::errc::timed_out);
      }
      interval = std::chrono::milliseconds(1);
    }
    base::futex_wait(word, static_cast<std::uint32_t>(was), interval, base::futex_scope::shared);
    if (closer.load(std::memory_order_seq_cst) != was) return {};
    if (std::chrono::steady_clock::now() - last_check >= interval) {
      last_check = std::chrono::steady_clock::now();
      const std::uint64_t slot_of = (was >> 32) - 1;
      if (slot_of < max_slots && slot_owner_dead(static_cast<std::uint32_t>(slot_of))) {
        if (!stored_escapably(
                cd, [&] { closer.compare_exchange_strong(was, 0, std::memory_order_seq_cst); })) {
          return std::unexpected(index_write_refusal());
        }
        base::futex_wake(word, INT_MAX, base::futex_scope::shared);
      } else {
        interval = std::min<std::chrono::milliseconds>(2 * interval, std::chrono::milliseconds(32));
      }
    }
  }
}

result<void> store::impl::close_delta(std::uint64_t seen, std::int64_t cost,
                                      const io::countdown& cd) noexcept {
  // The closer alone: no lock, which a writer inside the delta might need (the segment
  // lock, to make a segment) while the back end waits for it to leave.
  if (ledger->front() != seen) return {};  // closed by another: try the next one
  if (ledger_close_hook != nullptr) ledger_close_hook();
  // An evicted writer that died never leaves: its cost would stay written off for good.
  if (ledger->written_off() != 0) free_dead_pins(0, cd);
  std::int64_t provisional = 0;
  for (;;) {
    // The delta before `seen` lends its words to the next: it must be quiet. (A writer that
    // read the front before it moved may pin it again for a moment: then wait again.)
    if (seen >= 2) {
      if (auto q = wait_quiet(seen - 1, cd); !q) return q;
    }
    // Assume the worst of the delta being closed: writers inside it may charge it until it
    // is quiet, up to its whole budget, and use all of it (what they used already is then
    // counted twice, which only errs low).
    const put_room room = room_for_puts();
    provisional =
        std::max<std::int64_t>(0, static_cast<std::int64_t>(room.bytes) - ledger->budget_of(seen));
    provisional = std::min(provisional, share(room.bytes, cost));
    // (Refused past the deadline, a transition half made is none: d + 1's words are the
    // quiet d − 1's until the front moves, its last store.)
    result<std::uint64_t> next = 0;
    if (!stored_escapably(cd, [&] { next = ledger->transition(provisional); })) {
      return std::unexpected(index_write_refusal());
    }
    if (next) break;
    if (next.error() != std::errc::resource_unavailable_try_again) {
      return std::unexpected(next.error());
    }
  }
  // A delta given a share of the room leaves the rest to the next one, which therefore
  // opens with room of its own: the writers waiting for this close charge it at once,
  // without waiting for every commit of the closed delta to end (which, with a thousand
  // writers slowed by btrfs's page-fault reservations, took over 30 s). The correction is
  // then not needed: the next close measures the room afresh.
  if (provisional >= cost) return {};
  // Tux3's correction: once the closed delta is quiet its charges are final, and the room
  // measured then is at least what the new one should have had since its transition (its
  // own commits since used some of it): the correction only raises its budget.
  if (auto q = wait_quiet(seen, cd); !q) return q;
  const put_room exact = room_for_puts();
  const std::int64_t corrected = share(exact.bytes, cost);
  if (corrected > provisional) {
    // (Refused between its two stores, the balance is left short: safe, see ledger::correct.)
    result<void> c;
    if (!stored_escapably(cd, [&] { c = ledger->correct(corrected); })) {
      return std::unexpected(index_write_refusal());
    }
    if (!c) return c;
  }
  if (static_cast<std::int64_t>(exact.bytes) < cost) return std::unexpected(exact.why);
  return {};
}

std::int64_t store::impl::share(std::uint64_t room, std::int64_t cost) const noexcept {
  // A quarter: the next delta, given the room less this one's whole budget, then starts with
  // room of its own (at least an eighth of what this one saw, its use counted twice at
  // worst). The wait for a delta's commits is not gone, only put off to the close after the
  // next (which needs this one quiet), and deltas close four times as often. Near full (a few
  // segments left), or for a commit larger than a sixteenth, the whole room: the store must not
  // say full while the room still holds the commit, nor leave a large commit to compete for
  // quarters that small ones fill first.
  const auto whole = static_cast<std::int64_t>(room);
  const std::int64_t quarter = whole / 4;
  if (room <= 4 * next_segment_size() || quarter / 4 < cost) return whole;
  return quarter;
}

result<void> store::impl::wait_quiet(std::uint64_t d, const io::countdown& cd) noexcept {
  // Writers leave a delta within their commit, which waits for nothing of ours.
  int late_rounds = 0;
  for (int round = 0;; ++round) {
    if (ledger->quiet(d)) return {};
    if (round >= 64) {
      // A pin left by a dead user (cleared when its slot is next taken) would hold it
      // forever. Past the deadline, so would one of a user alive and stopped (SIGSTOP, a
      // debugger) or starved of CPU: it is evicted (its cost written off until it leaves),
      // and the delta no longer waits for it. It goes on unharmed when it runs again.
      free_dead_pins(d, cd);
      const bool late = cd.expired();
      if (late) evict_live_pins(d, cd);
      if (ledger->quiet(d)) return {};
      if (late) {
        // A writer that read the old front pins it for a moment: a few more looks.
        if (++late_rounds > 64) return errc_error(std::errc::timed_out);
        std::this_thread::yield();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    } else {
      std::this_thread::yield();
    }
  }
}

void store::impl::evict_live_pins(std::uint64_t d, const io::countdown& cd) noexcept {
  // Safe from any user, closing or not, and from several at once: the cost is written off
  // before the mark (space::ledger::evict), so whoever measures the room once the delta reads
  // quiet counts it. Where the volume may refuse the pages (the header's, the slot's), they
  // are made writable first, and an eviction refused all the same is given up: between its
  // stores, it leaves the cost written off until the ledger is next reset (room held back,
  // never room given twice).
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    if (slot(u).ledger_pin().load(std::memory_order_acquire) != d) continue;
    if (!slot_write_ready(u, false)) continue;
    (void)stored_escapably(cd, [&] { (void)ledger->evict(u, d); });
  }
}

void store::impl::free_dead_pins(std::uint64_t d, const io::countdown& cd) noexcept {
  for (std::uint32_t u = 0; u < max_slots; ++u) {
    const std::uint64_t pin = slot(u).ledger_pin().load(std::memory_order_acquire);
    if ((pin != d || d == 0) && (pin & space::ledger::evicted) == 0) continue;
    if (!slot_owner_dead(u)) continue;
    // Its pin is the dead user's (a new user clears it when it takes the slot, under the
    // byte too); an evicted one's cost comes off what is written off. (The pages asked for
    // under the byte, and the leave escapable: refused, the pin stays, as it was.)
    as_dead_users_byte(u, [&] {
      if (slot(u).ledger_pin().load(std::memory_order_seq_cst) != pin) return;
      if (!slot_write_ready(u, false)) return;
      (void)stored_escapably(cd, [&] { ledger->leave(u); });
    });
  }
}

void store::impl::reset_ledger() noexcept {
  std::memset(base() + header::ledger, 0, sizeof(space::ledger_words));
  h64(header::ledger_closer).store(0);
  for (std::uint32_t u = 0; u < max_slots; ++u)
    slot(u).ledger_pin().store(0);
}

}  // namespace keel::kv
