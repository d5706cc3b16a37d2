// log_distance's memo (segment_sum_memo.hpp): a sum is found only under the key it was kept
// for, the entry written longest ago makes way, and readers racing writers never see one
// key's sum under another.

#include "kv/segment_sum_memo.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace keel::kv {
namespace {

using key = segment_sum_memo::key;

TEST(SegmentSumMemo, FindsASumOnlyUnderItsOwnKey) {
  segment_sum_memo m;
  EXPECT_FALSE(m.find({}).has_value()) << "an entry never written was found";
  m.keep({3, 9, 0}, 1234);
  EXPECT_EQ(m.find({3, 9, 0}), std::optional<std::uint64_t>{1234});
  EXPECT_FALSE(m.find({3, 10, 0}).has_value()) << "the tail moved on";
  EXPECT_FALSE(m.find({4, 9, 0}).has_value()) << "a checkpoint moved the start";
  EXPECT_FALSE(m.find({3, 9, 1}).has_value()) << "a compaction removed segments since";
}

TEST(SegmentSumMemo, KeepsTwoAndTheOldestMakesWay) {
  segment_sum_memo m;
  m.keep({1, 5, 0}, 10);
  m.keep({2, 5, 0}, 20);
  EXPECT_EQ(m.find({1, 5, 0}), std::optional<std::uint64_t>{10});
  EXPECT_EQ(m.find({2, 5, 0}), std::optional<std::uint64_t>{20});
  m.keep({1, 6, 0}, 30);
  EXPECT_FALSE(m.find({1, 5, 0}).has_value());
  EXPECT_EQ(m.find({2, 5, 0}), std::optional<std::uint64_t>{20});
  EXPECT_EQ(m.find({1, 6, 0}), std::optional<std::uint64_t>{30});
}

TEST(SegmentSumMemo, ReadersNeverSeeASumUnderAnotherKey) {
  // Each key's sum is a function of it: a reader that found a sum not its key's read an
  // entry while it was rewritten.
  const auto sum_of = [](const key& k) { return k.first * 1'000'003 + k.last * 7 + k.compactions; };
  segment_sum_memo m;
  std::atomic<bool> stop{false}, started{false};
  std::atomic<std::uint64_t> found{0}, wrong{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      for (std::uint64_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
        const key k{i % 5, i % 5 + 1 + static_cast<std::uint64_t>(w), i % 3};
        m.keep(k, sum_of(k));
        started.store(true, std::memory_order_release);
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&] {
      while (!started.load(std::memory_order_acquire))
        std::this_thread::yield();
      for (std::uint64_t i = 0; i < 2'000'000; ++i) {
        const key k{i % 5, i % 5 + 1 + i % 2, i % 3};
        if (const auto s = m.find(k)) {
          found.fetch_add(1, std::memory_order_relaxed);
          if (*s != sum_of(k)) wrong.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  }
  threads[2].join();
  threads[3].join();
  stop = true;
  threads[0].join();
  threads[1].join();
  EXPECT_GT(found.load(), 0U);
  EXPECT_EQ(wrong.load(), 0U) << "of " << found.load() << " found";
}

}  // namespace
}  // namespace keel::kv
