// The count of requests in flight (base/sharded_count.hpp): threads add on their own shards
// and other threads take, as workers finish the requests callers submitted; a waiter that
// set its flag returns from wait_for_zero only after the last take.

#include "base/sharded_count.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace keel::base {
namespace {

using namespace std::chrono_literals;

TEST(ShardedCount, ThreadsStartedInTurnAddOnDifferentShards) {
  unsigned a = 0;
  unsigned b = 0;
  std::thread([&] { a = sharded_count::shard_of_this_thread(); }).join();
  std::thread([&] { b = sharded_count::shard_of_this_thread(); }).join();
  EXPECT_NE(a, b);
  EXPECT_LT(a, sharded_count::shards);
  EXPECT_LT(b, sharded_count::shards);
  EXPECT_EQ(sharded_count::shard_of_this_thread(), sharded_count::shard_of_this_thread());
}

// Adders on four threads, takers on two others, each take from the shard its add went to: no
// sum ever read exceeds what was added (a shard below zero would wrap it), and all of it is
// taken in the end.
TEST(ShardedCount, TakesOnOtherThreadsBalanceTheAdds) {
  sharded_count c;
  constexpr unsigned adders = 4;
  constexpr unsigned each = 20000;
  std::mutex m;
  std::deque<unsigned> handed;  // the shard of each add not yet taken
  std::atomic<unsigned> taken{0};
  std::atomic<bool> too_big{false};
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < adders; ++t) {
    threads.emplace_back([&] {
      const unsigned s = sharded_count::shard_of_this_thread();
      for (unsigned i = 0; i < each; ++i) {
        c.add(s, 1);
        const std::lock_guard g(m);
        handed.push_back(s);
      }
    });
  }
  for (unsigned t = 0; t < 2; ++t) {
    threads.emplace_back([&] {
      while (taken.load() < adders * each) {
        unsigned s = 0;
        {
          const std::lock_guard g(m);
          if (handed.empty()) continue;
          s = handed.front();
          handed.pop_front();
        }
        (void)c.take(s, 1);
        taken.fetch_add(1);
        if (c.sum() > adders * each) too_big.store(true);
      }
    });
  }
  for (auto& t : threads)
    t.join();
  EXPECT_FALSE(too_big.load()) << "a shard went below zero";
  EXPECT_EQ(c.sum(), 0u);
}

// The waiter returns only once the last of three takes is done, each on another thread and
// the last one followed by a wake, as finish() does.
TEST(ShardedCount, WaitForZeroWaitsForTheLastTake) {
  sharded_count c;
  const unsigned s = sharded_count::shard_of_this_thread();
  c.add(s, 3);
  std::atomic<int> left{3};
  std::thread taker([&] {
    for (int i = 0; i < 3; ++i) {
      std::this_thread::sleep_for(30ms);
      left.fetch_sub(1);
      const bool emptied = c.take(s, 1);
      EXPECT_EQ(emptied, i == 2) << "only the last take empties the shard";
      if (emptied) c.wake();  // as finish() does, the waiter's flag being set
    }
  });
  c.wait_for_zero();
  EXPECT_EQ(left.load(), 0) << "returned before the last take";
  EXPECT_EQ(c.sum(), 0u);
  taker.join();
}

}  // namespace
}  // namespace keel::base
