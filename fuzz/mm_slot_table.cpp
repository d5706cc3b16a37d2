// memory_map's slot protocol over a shared table that others may have scribbled on or died
// halfway through writing. The input first writes into a zeroed map (user entries, slot
// words, reader, sleeper and writer marks of users that are not ours), then registers 1 to 4
// users of our own as memory_map does (clearing what earlier users of their indexes left),
// then runs operations on them and on the others: take, give, sleep and give up as wait_for
// does, spin, hand on, withdraw a grant, clear a dead user, die and be recovered, next_waiter,
// and more scribbling on what belongs to others. Users and slots come from small sets that
// include the table's edges (user 1023, slot 4095, the 64-bit word boundaries).
//
// Asserts, whatever the table held: no access outside the map (ASan); next_waiter names a
// sleeper other than the one asking, or no_slot; a user of ours that holds a slot
// exclusively is its writer and no other user reads it; one that holds it shared has its
// reader bit set and no other writer; the writer word names one of ours as holder only while
// it holds the slot, and as grantee only while it sleeps on it for exclusive use (a grant
// withdrawn late by anyone never takes a held lock away); sleeper bits of ours are set
// exactly while sleeping; and a user of ours that holds nothing (after giving everything
// back, giving up its sleep, or dying and being cleared) has no mark in any slot.

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz.hpp"
#include "lock/memory_map/slot_table.hpp"

namespace {

using namespace keel;
namespace memory_map_detail = keel::lock::memory_map_detail;

// Slots and users the operations use: few, so that they meet, and the table's edges.
constexpr std::array<std::uint32_t, 8> slot_choice{0,
                                                   1,
                                                   2,
                                                   3,
                                                   memory_map_detail::slots - 4,
                                                   memory_map_detail::slots - 3,
                                                   memory_map_detail::slots - 2,
                                                   memory_map_detail::slots - 1};
constexpr std::array<std::uint32_t, 16> user_choice{
    0,   1,   2,    3,    62,   63,   64,   65,
    511, 512, 1018, 1019, 1020, 1021, 1022, memory_map_detail::max_users - 1};
static_assert(memory_map_detail::max_users == 1024);
constexpr std::size_t slot_words = memory_map_detail::slot_size / 8;

struct ours {
  memory_map_detail::slot_user su;
  bool waiting = false;
  memory_map_detail::slot_request want{};
};

class harness {
 public:
  explicit harness(fuzz::input& in) : in_(in), table_(map()) {
    // Only these are ever written (scribbles and operations use no other user or slot), so
    // zeroing them gives each input the zeroed map of the first, at a fraction of the cost.
    std::memset(map(), 0, memory_map_detail::users_at);
    for (std::uint32_t u : user_choice)
      std::memset(table_.user(u), 0, memory_map_detail::user_size);
    for (std::uint32_t i : slot_choice)
      std::memset(table_.slot(i).base, 0, memory_map_detail::slot_size);
  }

  void run() {
    choose_ours();
    for (int n = in_.byte() % 32; n > 0 && !in_.empty(); --n)
      scribble(in_.byte() % 8);
    for (ours& o : ours_)
      register_user(o);
    while (!in_.empty()) {
      operate();
      check();
    }
    for (ours& o : ours_) {
      if (o.waiting) give_up(o);
      give_everything(o);
    }
    check();
    KEEL_FUZZ_CHECK(!table_.marks_of(indexes()));
  }

 private:
  std::uint32_t slot() { return slot_choice[in_.byte() % slot_choice.size()]; }
  std::uint32_t user() { return user_choice[in_.byte() % user_choice.size()]; }
  bool is_ours(std::uint32_t u) const {
    return std::any_of(ours_.begin(), ours_.end(), [&](const ours& o) { return o.su.index == u; });
  }
  // A user that is not ours (there is always one: at most 4 of 16 are ours).
  std::uint32_t other() {
    std::size_t k = in_.byte() % user_choice.size();
    while (is_ours(user_choice[k]))
      k = (k + 1) % user_choice.size();
    return user_choice[k];
  }
  ours& one_of_ours() { return ours_[in_.byte() % ours_.size()]; }
  std::vector<std::uint32_t> indexes() const {
    std::vector<std::uint32_t> v;
    for (const ours& o : ours_)
      v.push_back(o.su.index);
    return v;
  }
  std::uint64_t bit(std::uint32_t u) const { return std::uint64_t{1} << (u % 64); }

  void choose_ours() {
    const std::size_t n = 1 + in_.byte() % 4;
    while (ours_.size() < n) {
      // A user taken already: the next free one in user_choice order.
      std::size_t k = in_.byte() % user_choice.size();
      while (is_ours(user_choice[k]))
        k = (k + 1) % user_choice.size();
      ours_.emplace_back();
      ours_.back().su.index = user_choice[k];
    }
  }

  // What other processes may have left anywhere in the map, ours included (before we
  // register: the previous users of our indexes may have died holding slots).
  void scribble(int kind) {
    switch (kind) {
      case 0: {  // a user entry, whole or in part
        const auto b = in_.bytes(memory_map_detail::user_size);
        std::memcpy(table_.user(user()), b.data(), b.size());
        break;
      }
      case 1: {  // any word of a slot
        const memory_map_detail::slot_ref s = table_.slot(slot());
        const std::size_t w = in_.byte() % slot_words;
        std::atomic_ref<std::uint64_t>(s.base[w]).store(in_.take<std::uint64_t>());
        break;
      }
      case 2:
        table_.slot(slot()).writer().store(user() + 1);
        break;
      case 3: {
        const std::uint32_t u = user();
        table_.slot(slot()).readers(u / 64).fetch_or(bit(u));
        break;
      }
      default:
        scribble_others(kind);
    }
  }

  // What live processes other than ours may do while ours run: sleep on a slot, be woken,
  // spin. Never the writer word or the reader set: those would break exclusion for real.
  void scribble_others(int kind) {
    const std::uint32_t u = other();
    const std::uint32_t i = slot();
    const memory_map_detail::slot_ref s = table_.slot(i);
    switch (kind % 4) {
      case 0:
        s.waiters(u / 64).fetch_or(bit(u));
        if ((in_.byte() & 1) != 0) s.maybe_waiters().store(1);  // else: killed between the two
        break;
      case 1: {
        const std::uint8_t how = in_.byte();
        table_.wants_word(u).store(
            (how & 1) != 0 ? memory_map_detail::no_slot
                           : i | ((how & 2) != 0 ? memory_map_detail::wants_exclusive : 0));
        std::atomic_ref<std::uint64_t>(table_.user(u)->waiting_since_ns)
            .store((how & 4) != 0 ? 0 : memory_map_detail::monotonic_ns());
        break;
      }
      case 2:
        s.woken().store(u + 1);
        break;
      default:
        s.spinner().store(in_.byte() % 2 == 0 ? 0 : u + 1);
        s.spin_budget_ns().store(in_.take<std::uint64_t>());
    }
  }

  // As memory_map's register_user: clear what a previous user of the index left, then no wish.
  void register_user(ours& o) {
    for (std::uint32_t i : slot_choice)
      table_.clear_user_in(i, o.su.index);
    table_.wants_word(o.su.index).store(memory_map_detail::no_slot);
    o.su.exclusive_holds.assign(memory_map_detail::slots, 0);
    o.su.shared_holds.assign(memory_map_detail::slots, 0);
    o.waiting = false;
  }

  bool holds(const ours& o, std::uint32_t i) const {
    return o.su.exclusive_holds[i] != 0 || o.su.shared_holds[i] != 0;
  }

  // wait_for's first steps, then its `leave`.
  void sleep_on(ours& o, const memory_map_detail::slot_request& r, bool long_ago) {
    const std::uint32_t u = o.su.index;
    std::atomic_ref<std::uint64_t>(table_.user(u)->waiting_since_ns)
        .store(long_ago ? 0 : memory_map_detail::monotonic_ns());
    table_.wants_word(u).store(r.slot | (r.exclusive ? memory_map_detail::wants_exclusive : 0));
    table_.slot(r.slot).waiters(u / 64).fetch_or(bit(u));
    table_.slot(r.slot).maybe_waiters().store(1);
    o.waiting = true;
    o.want = r;
  }
  void leave(ours& o) {
    const std::uint32_t u = o.su.index;
    const memory_map_detail::slot_ref s = table_.slot(o.want.slot);
    s.waiters(u / 64).fetch_and(~bit(u));
    table_.wants_word(u).store(memory_map_detail::no_slot);
    std::uint64_t me_woken = u + 1;
    s.woken().compare_exchange_strong(me_woken, 0);
    o.waiting = false;
  }
  void give_up(ours& o) {
    leave(o);
    if (o.want.exclusive && o.su.exclusive_holds[o.want.slot] == 0) {
      table_.withdraw_grant(o.want.slot, o.su.index);
    }
  }
  void give_everything(ours& o) {
    for (std::uint32_t i : slot_choice) {
      while (o.su.shared_holds[i] != 0)
        table_.give(o.su, {i, false});
      while (o.su.exclusive_holds[i] != 0)
        table_.give(o.su, {i, true});
    }
    // No mark left: check() sees to it after the operation (marks_of, which reads every
    // slot, runs at the end and after a death only: it would cost most of the time).
  }

  void operate() {
    ours& o = one_of_ours();
    const std::uint8_t op = in_.byte();
    const memory_map_detail::slot_request r{slot(), (op & 0x80) != 0};
    switch ((op & 0x3f) % 12) {  // the top bits are flags
      case 0:                    // take (a sleeper retries its own slot, and leaves when it got it)
        if (o.waiting) {
          if (table_.take(o.su, o.want)) leave(o);
        } else {
          (void)table_.take(o.su, r);
        }
        break;
      case 1:  // give back one hold
        if (o.waiting) break;
        if (r.exclusive ? o.su.exclusive_holds[r.slot] != 0 : o.su.shared_holds[r.slot] != 0) {
          table_.give(o.su, r);
        }
        break;
      case 2:  // sleep on a slot it does not hold
        if (!o.waiting && !holds(o, r.slot)) sleep_on(o, r, (op & 0x40) != 0);
        break;
      case 3:  // a sleeper gives up (deadline)
        if (o.waiting) give_up(o);
        break;
      case 4:
        table_.hand_on(r.slot, user());
        break;
      case 5:  // a releaser withdraws a grant it made, late: to anyone, ours too
        table_.withdraw_grant(r.slot, user());
        break;
      case 6:  // a dead user is cleared (by a waiter that found its liveness byte free)
        table_.clear_user_in(r.slot, other());
        break;
      case 7: {
        const std::uint32_t from = user();
        const std::uint32_t w =
            memory_map_detail::slot_table::next_waiter(table_.slot(r.slot), from);
        if (w != memory_map_detail::no_slot) {
          KEEL_FUZZ_CHECK(w < memory_map_detail::max_users && w != from);
          KEEL_FUZZ_CHECK((table_.slot(r.slot).waiters(w / 64).load() & bit(w)) != 0);
        }
        break;
      }
      case 8: {  // ours dies; the next user of its index clears its marks
        const std::uint32_t u = o.su.index;
        o = ours{};
        o.su.index = u;
        register_user(o);
        KEEL_FUZZ_CHECK(!table_.marks_of(std::span(&o.su.index, 1)));
        break;
      }
      case 9:  // spin, with no deadline: the budget alone must end it
        if (!o.waiting) (void)table_.spin_for(o.su, r, io::deadline::never().start());
        break;
      case 10:
        scribble_others(in_.byte());
        break;
      default:  // give everything back
        if (!o.waiting) give_everything(o);
    }
  }

  void check() const {
    for (const ours& o : ours_) {
      const std::uint32_t u = o.su.index;
      for (std::uint32_t i : slot_choice) {
        const memory_map_detail::slot_ref s = table_.slot(i);
        const std::uint64_t w = s.writer().load();
        const bool ex = o.su.exclusive_holds[i] != 0;
        const bool sh = o.su.shared_holds[i] != 0;
        const bool reader = (s.readers(u / 64).load() & bit(u)) != 0;
        const bool sleeper = (s.waiters(u / 64).load() & bit(u)) != 0;
        const bool grant = w == ((u + 1) | memory_map_detail::granted);
        if (ex) KEEL_FUZZ_CHECK(w == u + 1 && !s.other_readers(u));
        if (sh) KEEL_FUZZ_CHECK(reader && (w == 0 || (w == u + 1 && ex) || grant));
        KEEL_FUZZ_CHECK(reader == sh);
        KEEL_FUZZ_CHECK(w != u + 1 || ex);  // named as holder only while it holds
        if (grant) KEEL_FUZZ_CHECK(o.waiting && o.want.slot == i && o.want.exclusive);
        KEEL_FUZZ_CHECK(sleeper == (o.waiting && o.want.slot == i));
      }
    }
  }

  // One map for the process, of exactly map_size bytes, so ASan sees any access past it.
  static std::byte* map() {
    static const std::unique_ptr<std::byte[]> bytes(new std::byte[memory_map_detail::map_size]());
    return bytes.get();
  }

  fuzz::input& in_;
  memory_map_detail::slot_table table_;
  std::vector<ours> ours_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  harness(in).run();
  return 0;
}
