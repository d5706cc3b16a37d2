// memory_map's slot protocol over a table in memory: what must hold whatever another process
// left in the shared map (fuzz/mm_slot_table.cpp explores the rest).

#include "lock/memory_map/slot_table.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <map>
#include <memory>
#include <vector>

namespace keel::lock::memory_map_detail {
namespace {

using namespace std::chrono_literals;

// Regression (found by fuzz/mm_slot_table): the spin budget read from the shared map was
// believed whatever its value, so a damaged word (here an hour) made a locker with no
// deadline spin for that long instead of at most 200 µs before it sleeps.
TEST(SlotTable, ASpinBudgetDamagedInTheMapIsBounded) {
  const std::unique_ptr<std::byte[]> map(new std::byte[map_size]());
  const slot_table table(map.get());
  const slot_ref s = table.slot(3);
  s.writer().store(7 + 1);  // held by user 7
  s.spin_budget_ns().store(std::uint64_t{3600} * 1'000'000'000);
  slot_user me;
  me.index = 1;
  me.exclusive_holds.assign(slots, 0);
  me.shared_holds.assign(slots, 0);

  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(table.spin_for(me, {3, true}, io::deadline(10s).start()));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 1s);
  EXPECT_LE(s.spin_budget_ns().load(), 200'000u) << "the halved budget is written back bounded";
}

// The slots a lock call takes, each once, exclusive where any of its entities is, however
// many entities: a few merged one by one, many sorted and merged (each against all kept was
// quadratic, and a transaction of 65 536 keys spent most of its commit there).
TEST(SlotTable, ALockCallsSlotsAreEachCollectedOnceWithTheStrongestMode) {
  for (const std::size_t count : {2u, 16u, 17u, 1000u, 65536u}) {
    SCOPED_TRACE(count);
    std::vector<entity> set;
    for (std::size_t i = 0; i < count; ++i)
      set.emplace_back(i * 7, i % 3 == 0);
    std::ranges::sort(set, {}, [](const entity& e) { return e.value; });
    std::map<std::uint32_t, bool> want;  // slot -> exclusive
    for (const entity& e : set) {
      want[static_cast<std::uint32_t>(slot_of(e.value))] |= e.is_exclusive();
    }
    std::array<slot_request, 16> small{};
    std::vector<slot_request> big;
    std::map<std::uint32_t, bool> got;
    for (const slot_request& r : collect_slots(set, small, big)) {
      EXPECT_FALSE(got.contains(r.slot)) << "slot " << r.slot << " collected twice";
      got[r.slot] = r.exclusive;
    }
    EXPECT_EQ(got, want);
  }
}

// A table in memory and its users, each acting as memory_map's lock path does.
struct table_fixture {
  std::unique_ptr<std::byte[]> map{new std::byte[map_size]()};
  slot_table table{map.get()};
  std::array<slot_user, 3> users;
  table_fixture() {
    for (std::uint32_t u = 0; u < users.size(); ++u) {
      users[u].index = u;
      users[u].exclusive_holds.assign(slots, 0);
      users[u].shared_holds.assign(slots, 0);
      table.wants_word(u).store(no_slot);
    }
  }
  // wait_for's first steps: asleep on `slot` since long ago (due a grant) or just now.
  void sleep_on(std::uint32_t u, std::uint32_t slot, bool exclusive, bool long_ago) const {
    std::atomic_ref<std::uint64_t>(table.user(u)->waiting_since_ns)
        .store(long_ago ? 0 : monotonic_ns());
    table.wants_word(u).store(slot | (exclusive ? wants_exclusive : 0));
    table.slot(slot).waiters(u / 64).fetch_or(std::uint64_t{1} << (u % 64));
    table.slot(slot).maybe_waiters().store(1);
  }
  // wait_for's leave().
  void leave(std::uint32_t u, std::uint32_t slot) const {
    const slot_ref s = table.slot(slot);
    s.waiters(u / 64).fetch_and(~(std::uint64_t{1} << (u % 64)));
    table.wants_word(u).store(no_slot);
    std::uint64_t me = u + 1;
    s.woken().compare_exchange_strong(me, 0);
  }
};

// What the hook makes the target do inside hand_on (hooks are plain functions).
table_fixture* hooked = nullptr;
hand_on_point hook_at{};
bool target_collects = false;  // takes the slot, then leaves; else only leaves
int hook_calls = 0;

void act_in_hand_on(hand_on_point p, std::size_t slot, std::uint32_t target) {
  if (p != hook_at || hooked == nullptr) return;
  if (++hook_calls > 1) return;  // the first target only
  if (target_collects) {
    EXPECT_TRUE(
        hooked->table.take(hooked->users[target], {static_cast<std::uint32_t>(slot), true}));
  }
  hooked->leave(target, static_cast<std::uint32_t>(slot));
}

struct hook_scope {
  hook_scope(table_fixture& f, hand_on_point at, bool collects) {
    hooked = &f;
    hook_at = at;
    target_collects = collects;
    hook_calls = 0;
    test_hand_on_hook.store(&act_in_hand_on);
  }
  ~hook_scope() {
    test_hand_on_hook.store(nullptr);
    hooked = nullptr;
  }
  hook_scope(const hook_scope&) = delete;
  hook_scope& operator=(const hook_scope&) = delete;
};

// Review finding (issue 15 #1): hand_on granted the slot, then found the target's sleeper
// bit clear, because the target had meanwhile collected the grant and left, and withdrew
// what was by then a held lock: the slot looked free and a third user got in beside it.
TEST(SlotTable, AGrantItsTargetCollectedIsNeverWithdrawn) {
  table_fixture f;
  auto& [holder, target, third] = f.users;
  ASSERT_TRUE(f.table.take(holder, {5, true}));
  f.sleep_on(1, 5, true, /*long_ago=*/true);
  {
    const hook_scope hook(f, hand_on_point::made_grant, /*collects=*/true);
    f.table.give(holder, {5, true});
    EXPECT_EQ(hook_calls, 1) << "the release granted the slot to the sleeper";
  }
  EXPECT_EQ(target.exclusive_holds[5], 1u);
  EXPECT_EQ(f.table.slot(5).writer_user(), 1u) << "the target's lock was taken back";
  EXPECT_FALSE(f.table.take(third, {5, true})) << "two exclusive holders";
  EXPECT_FALSE(f.table.take(third, {5, false})) << "a reader beside an exclusive holder";
}

// The other half of the hand-over: a grant whose target gave up before collecting it is
// taken back and passed on, not left to block the slot.
TEST(SlotTable, AGrantNobodyCollectsIsPassedOn) {
  table_fixture f;
  auto& [holder, target, third] = f.users;
  ASSERT_TRUE(f.table.take(holder, {5, true}));
  f.sleep_on(1, 5, true, true);
  f.sleep_on(2, 5, true, true);
  {
    const hook_scope hook(f, hand_on_point::made_grant, /*collects=*/false);
    f.table.give(holder, {5, true});
    EXPECT_EQ(hook_calls, 2) << "granted to the first sleeper, then to the next";
  }
  EXPECT_EQ(target.exclusive_holds[5], 0u);
  EXPECT_EQ(f.table.slot(5).writer().load(), (2u + 1) | granted) << "passed on to the next";
  EXPECT_TRUE(f.table.take(third, {5, true}));
}

// Review finding (issue 15 #10a): the mark "a sleeper woken to compete is on its way" was set
// after its target had left, so nobody ever cleared it, and no release woke a sleeper of
// that slot again (they waited for their timers).
TEST(SlotTable, AWakeUpMarkForASleeperThatLeftIsNotLeftBehind) {
  table_fixture f;
  auto& [holder, leaver, sleeper] = f.users;
  ASSERT_TRUE(f.table.take(holder, {6, true}));
  f.sleep_on(1, 6, true, /*long_ago=*/false);
  {
    const hook_scope hook(f, hand_on_point::chose_exclusive_target, /*collects=*/false);
    f.table.give(holder, {6, true});
    EXPECT_EQ(hook_calls, 1);
  }
  EXPECT_EQ(f.table.slot(6).woken().load(), 0u);

  ASSERT_TRUE(f.table.take(holder, {6, true}));
  f.sleep_on(2, 6, true, false);
  const std::uint32_t before = f.table.wake_word(2).load();
  f.table.give(holder, {6, true});
  EXPECT_NE(f.table.wake_word(2).load(), before) << "the next sleeper was not woken";
  (void)leaver;
  (void)sleeper;
}

// Adversarial review of issue 15: a releaser killed between making a grant and taking it
// back (its target had stopped waiting) left the slot granted to a live user that never
// collects it: everyone else waited until that user happened to lock the slot again.
TEST(SlotTable, AGrantLeftToALiveUserThatStoppedWaitingIsTakenBack) {
  table_fixture f;
  auto& [holder, gone, sleeper] = f.users;
  f.table.slot(5).writer().store((1u + 1) | granted);  // the dead releaser's grant to user 1
  f.sleep_on(2, 5, true, /*long_ago=*/true);
  EXPECT_FALSE(f.table.take(holder, {5, true}));
  EXPECT_TRUE(f.table.drop_orphans(5));
  EXPECT_EQ(f.table.slot(5).writer().load(), (2u + 1) | granted) << "passed on to the sleeper";
  EXPECT_FALSE(f.table.drop_orphans(5)) << "a grant to a sleeper is no orphan";
  (void)gone;
  (void)sleeper;
}

// The same for a woken mark naming a user that no longer waits (set by a releaser killed
// before it took the mark back): no release woke a sleeper of the slot again.
TEST(SlotTable, AWokenMarkLeftToAUserThatStoppedWaitingIsTakenBack) {
  table_fixture f;
  auto& [holder, gone, sleeper] = f.users;
  f.table.slot(6).woken().store(1u + 1);
  ASSERT_TRUE(f.table.take(holder, {6, true}));
  f.sleep_on(2, 6, true, /*long_ago=*/false);
  std::uint32_t before = f.table.wake_word(2).load();
  f.table.give(holder, {6, true});
  ASSERT_EQ(f.table.wake_word(2).load(), before) << "the mark did not hold the wake-up back";
  EXPECT_TRUE(f.table.drop_orphans(6));
  EXPECT_EQ(f.table.slot(6).woken().load(), 2u + 1) << "the sleeper was not woken";
  EXPECT_NE(f.table.wake_word(2).load(), before);
  (void)gone;
  (void)sleeper;
}

// Review finding (issue 15 #10c): a reader that waits to become the writer (an upgrade)
// counted its own reader bit as "readers still in", so the last other reader's release
// neither woke it nor handed it the slot: it went on only at its timer.
TEST(SlotTable, AnUpgradingReaderIsWokenWhenTheLastOtherReaderLeaves) {
  for (const bool long_ago : {false, true}) {
    SCOPED_TRACE(long_ago ? "slept long: granted" : "slept briefly: woken to compete");
    table_fixture f;
    auto& [upgrader, reader, third] = f.users;
    ASSERT_TRUE(f.table.take(upgrader, {7, false}));
    ASSERT_TRUE(f.table.take(reader, {7, false}));
    EXPECT_FALSE(f.table.take(upgrader, {7, true}));
    f.sleep_on(0, 7, true, long_ago);
    const std::uint32_t before = f.table.wake_word(0).load();
    f.table.give(reader, {7, false});
    EXPECT_NE(f.table.wake_word(0).load(), before) << "the upgrader was not woken";
    EXPECT_TRUE(f.table.take(upgrader, {7, true}));
    f.leave(0, 7);
    EXPECT_FALSE(f.table.take(third, {7, false}));
    EXPECT_FALSE(f.table.take(third, {7, true}));
  }
}

}  // namespace
}  // namespace keel::lock::memory_map_detail
