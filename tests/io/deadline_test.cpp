#include "keel/io/deadline.hpp"

#include <gtest/gtest.h>

#include <thread>

namespace keel::io {

using namespace std::chrono_literals;

TEST(Deadline, DefaultWaitsForever) {
  const auto cd = deadline{}.start();
  EXPECT_TRUE(cd.is_infinite());
  EXPECT_FALSE(cd.is_zero());
  EXPECT_FALSE(cd.expired());
  EXPECT_EQ(cd.remaining(), deadline::clock::duration::max());
  EXPECT_TRUE(deadline::never().is_infinite());
}

TEST(Deadline, ZeroMeansTryOnce) {
  for (const deadline d : {deadline::zero(), deadline(0s), deadline(-5ms)}) {
    EXPECT_TRUE(d.is_zero());
    const auto cd = d.start();
    EXPECT_TRUE(cd.is_zero());
    EXPECT_TRUE(cd.expired());
    EXPECT_EQ(cd.remaining(), deadline::clock::duration::zero());
  }
}

TEST(Deadline, RelativeCountsFromStart) {
  const deadline d(60ms);
  std::this_thread::sleep_for(30ms);  // time before start() does not count
  const auto cd = d.start();
  EXPECT_FALSE(cd.expired());
  EXPECT_GT(cd.remaining(), 40ms);
  EXPECT_LE(cd.remaining(), 60ms);
  std::this_thread::sleep_for(70ms);
  EXPECT_TRUE(cd.expired());
  EXPECT_EQ(cd.remaining(), deadline::clock::duration::zero());
  const timespec left = cd.remaining_timespec();
  EXPECT_EQ(left.tv_sec, 0);
  EXPECT_EQ(left.tv_nsec, 0);
}

TEST(Deadline, AbsoluteInThePastIsExpiredButNotZero) {
  const auto cd = deadline(deadline::clock::now() - 1s).start();
  EXPECT_FALSE(cd.is_zero());
  EXPECT_TRUE(cd.expired());
  const auto wall = deadline(std::chrono::system_clock::now() - 1h).start();
  EXPECT_TRUE(wall.expired());
}

TEST(Deadline, AbsoluteWallClockBecomesSteady) {
  const auto cd = deadline(std::chrono::system_clock::now() + 500ms).start();
  EXPECT_FALSE(cd.expired());
  EXPECT_GT(cd.remaining(), 400ms);
  EXPECT_LE(cd.remaining(), 500ms);
}

TEST(Deadline, MonotonicTimespecMatchesClock) {
  const auto cd = deadline(2s).start();
  timespec now{};
  ASSERT_EQ(::clock_gettime(CLOCK_MONOTONIC, &now), 0);
  const timespec at = cd.monotonic_timespec();
  const long long diff_ms =
      (at.tv_sec - now.tv_sec) * 1000LL + (at.tv_nsec - now.tv_nsec) / 1'000'000LL;
  EXPECT_GE(diff_ms, 1900);
  EXPECT_LE(diff_ms, 2000);
}

TEST(Deadline, HugeDurationsDoNotOverflow) {
  const auto cd = deadline(std::chrono::hours::max()).start();
  EXPECT_FALSE(cd.expired());
  EXPECT_GT(cd.remaining(), std::chrono::hours(24 * 365 * 100));
  EXPECT_FALSE(deadline(std::chrono::nanoseconds::max()).start().expired());
}

}  // namespace keel::io
