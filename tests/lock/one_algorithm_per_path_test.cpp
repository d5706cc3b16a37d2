// Two keel algorithms on one path do not exclude each other (a memory_map holder and a
// byte_ranges locker of one file both got the lock): whichever opens second must refuse,
// naming the algorithm that has it open, and may open once that one has closed. byte_ranges
// and fcntl lock the same bytes, so they share a path and exclude each other.

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "keel/error.hpp"
#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using namespace std::chrono_literals;

using pair = std::pair<std::string, std::string>;

class OneAlgorithmPerPath : public ::testing::TestWithParam<pair> {};

// The first opens in another process and holds an entity; the second, here, must refuse.
TEST_P(OneAlgorithmPerPath, TheSecondRefusesNamingTheFirstThenOpensOnceItClosed) {
  const auto& [first, second] = GetParam();
  test::temp_dir dir;
  const std::string path = dir.file(uses_directory(first) ? "lockdir" : "lockfile");
  test::signal_pipe holding, release;
  const pid_t holder = test::fork_child([&] {
    auto m = open_mutex(first, path);
    if (!m) return 1;
    auto g = (*m)->lock({entity(1)}, 10s);
    if (!g) return 2;
    holding.notify('h');
    (void)release.wait();
    return 0;
  });
  test::killed_on_failure guard{holder};
  ASSERT_EQ(holding.wait(), 'h');
  auto m = open_mutex(second, path);
  ASSERT_FALSE(m) << second << " opened a path " << first << " holds: both would win";
  EXPECT_EQ(m.error(), make_error_code(errc::used_by_another_algorithm));
  EXPECT_EQ(m.error(), std::errc::device_or_resource_busy);
  const std::string why = m.error().message();
  EXPECT_NE(why.find(first == "fcntl" ? "byte_ranges or fcntl" : first), std::string::npos) << why;
  EXPECT_NE(why.find(second), std::string::npos) << why;
  EXPECT_NE(why.find(path), std::string::npos) << why;
  release.notify('r');
  EXPECT_EQ(test::wait_exit(holder), 0);
  guard.pid = 0;
  // Now the second may open. A file the first wrote (atomic_append's log, memory_map's
  // header) is then refused as not its own, and left untouched; and a lock_files directory
  // where flock made entity 1's file waits on that file (not a record of its): entity 2.
  auto later = open_mutex(second, path);
  if (!later) {
    EXPECT_EQ(later.error(), make_error_code(errc::not_keel_file)) << later.error().message();
  } else {
    auto g = (*later)->try_lock({entity(2)});
    EXPECT_TRUE(g) << g.error().message();
  }
  (void)remove_mutex_resources(second, path);
  (void)remove_mutex_resources(first, path);
}

INSTANTIATE_TEST_SUITE_P(
    Files, OneAlgorithmPerPath,
    ::testing::Values(pair{"memory_map", "byte_ranges"}, pair{"byte_ranges", "memory_map"},
                      pair{"fcntl", "atomic_append"}, pair{"atomic_append", "memory_map"},
                      pair{"sysv", "byte_ranges"}, pair{"memory_map", "sysv"},
                      pair{"lock_files", "flock"}, pair{"flock", "lock_files"}),
    [](const auto& param_info) {
      return param_info.param.first + "_then_" + param_info.param.second;
    });

// byte_ranges and fcntl are one family: both open one file and exclude each other.
TEST(OneAlgorithmPerPathFamily, ByteRangesAndFcntlShareAFileAndExclude) {
  test::temp_dir dir;
  const std::string path = dir.file("lockfile");
  auto a = open_mutex("byte_ranges", path);
  ASSERT_TRUE(a) << a.error().message();
  auto b = open_mutex("fcntl", path);
  ASSERT_TRUE(b) << b.error().message();
  auto g = (*a)->lock({entity(9)});
  ASSERT_TRUE(g);
  const pid_t other = test::fork_child([&] {
    auto c = open_mutex("fcntl", path);
    if (!c) return 1;
    auto t = (*c)->try_lock({entity(9)});
    return !t && t.error() == std::errc::operation_would_block ? 0 : 2;
  });
  EXPECT_EQ(test::wait_exit(other), 0) << "fcntl got an entity byte_ranges holds";
}

// The top entity values no longer reach the bytes that say which algorithm has the file open:
// an exclusive lock of the largest value does not block (nor is blocked by) an opener.
TEST(OneAlgorithmPerPathFamily, TheLargestEntityValuesDoNotTouchTheAlgorithmBytes) {
  test::temp_dir dir;
  const std::string path = dir.file("lockfile");
  auto a = open_mutex("byte_ranges", path);
  ASSERT_TRUE(a) << a.error().message();
  auto g = (*a)->lock({entity(entity::max_value), entity(entity::max_value - 20)});
  ASSERT_TRUE(g) << g.error().message();
  auto b = open_mutex("fcntl", path);
  ASSERT_TRUE(b) << b.error().message();
  auto c = open_mutex("memory_map", path);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error(), make_error_code(errc::used_by_another_algorithm));
}

}  // namespace
}  // namespace keel::lock
