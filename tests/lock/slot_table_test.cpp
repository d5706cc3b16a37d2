// memory_map's slot protocol over a table in memory: what must hold whatever another process
// left in the shared map (fuzz/mm_slot_table.cpp explores the rest).

#include "lock/memory_map/slot_table.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

namespace keel::lock::mm {
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

}  // namespace
}  // namespace keel::lock::mm
