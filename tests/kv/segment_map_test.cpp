// The process's map of segments (segment_map.hpp): a segment is mapped once however many
// threads ask for it at once, a failed map leaves nothing behind, and what is forgotten is
// unmapped while its object stays, once per generation of compactions unless asked always.

#include "kv/segment_map.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <string>
#include <thread>
#include <vector>

#include "keel/io/file_handle.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

class SegmentMap : public ::testing::Test {
 protected:
  // What find_or_map calls: a segment `number` mapped from a page-long file of its own.
  result<std::unique_ptr<segment>> make(std::uint64_t number) {
    ++made;
    const std::string path = dir.file("seg" + std::to_string(number));
    auto f = io::file_handle::open(io::os(), path.c_str(),
                                   io::open_flags::read_write | io::open_flags::create);
    if (!f) return std::unexpected(f.error());
    if (auto t = f->truncate(4096); !t) return std::unexpected(t.error());
    auto m = io::mapped_file::map(*f, io::map_access::read_only, 4096);
    if (!m) return std::unexpected(m.error());
    auto s = std::make_unique<segment>();
    s->number = number;
    s->size = 4096;
    s->map = std::move(*m);
    return s;
  }
  test::temp_dir dir;
  std::atomic<int> made{0};
  segment_map segments;
};

TEST_F(SegmentMap, ASegmentIsMappedOnceAndFoundWithoutMappingAgain) {
  EXPECT_EQ(segments.find(7), nullptr);
  auto first = segments.find_or_map(7, [&] { return make(7); });
  ASSERT_TRUE(first);
  auto again = segments.find_or_map(7, [&] { return make(7); });
  ASSERT_TRUE(again);
  EXPECT_EQ(*first, *again);
  EXPECT_EQ(segments.find(7), *first);
  EXPECT_EQ(made.load(), 1);
  // Numbers that share a chunk, and numbers in other chunks, are other segments.
  for (const std::uint64_t n :
       {std::uint64_t{8}, std::uint64_t{4096 + 7}, std::uint64_t{(1u << 24) - 1}}) {
    auto s = segments.find_or_map(n, [&] { return make(n); });
    ASSERT_TRUE(s);
    EXPECT_NE(*s, *first);
    EXPECT_EQ((*s)->number, n);
  }
  segment* const seven = segments.find(7);
  ASSERT_NE(seven, nullptr);
  EXPECT_EQ(seven->number, 7u);
}

TEST_F(SegmentMap, ThreadsAskingAtOnceMapItOnce) {
  constexpr int threads = 8;
  std::barrier start(threads);
  std::vector<segment*> got(threads, nullptr);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      start.arrive_and_wait();
      auto s = segments.find_or_map(42, [&] { return make(42); });
      if (s) got[t] = *s;
    });
  }
  for (auto& th : pool)
    th.join();
  EXPECT_EQ(made.load(), 1);
  for (segment* s : got)
    EXPECT_EQ(s, got[0]);
  EXPECT_NE(got[0], nullptr);
}

TEST_F(SegmentMap, AFailedMapLeavesNothingAndTheNextAskMapsAgain) {
  auto failed = segments.find_or_map(
      3, []() -> result<std::unique_ptr<segment>> { return errc_error(std::errc::io_error); });
  ASSERT_FALSE(failed);
  EXPECT_EQ(failed.error(), std::errc::io_error);
  EXPECT_EQ(segments.find(3), nullptr);
  auto s = segments.find_or_map(3, [&] { return make(3); });
  ASSERT_TRUE(s);
  EXPECT_EQ(made.load(), 1);
}

TEST_F(SegmentMap, AForgottenSegmentIsUnmappedAndItsObjectStays) {
  auto s = segments.find_or_map(5, [&] { return make(5); });
  ASSERT_TRUE(s);
  segment* const kept = *s;
  segments.forget(5);
  EXPECT_EQ(segments.find(5), nullptr);
  EXPECT_EQ(kept->map.data(), nullptr);  // unmapped, and still an object to look at
  EXPECT_EQ(kept->number, 5u);
  segments.forget(5);    // again: nothing
  segments.forget(999);  // never mapped: nothing
  auto back = segments.find_or_map(5, [&] { return make(5); });
  ASSERT_TRUE(back);
  EXPECT_NE((*back)->map.data(), nullptr);
  EXPECT_EQ(made.load(), 2);
}

TEST_F(SegmentMap, RemovedSegmentsAreSweptOncePerGenerationUnlessAlways) {
  for (const std::uint64_t n : {1, 2, 3}) {
    ASSERT_TRUE(segments.find_or_map(n, [&] { return make(n); }));
  }
  std::vector<std::uint64_t> gone{2};
  const auto removed = [&](const segment& s) {
    return std::find(gone.begin(), gone.end(), s.number) != gone.end();
  };
  segments.forget_removed(1, false, removed);
  EXPECT_NE(segments.find(1), nullptr);
  EXPECT_EQ(segments.find(2), nullptr);
  EXPECT_NE(segments.find(3), nullptr);
  // The same generation again: not looked at (nothing was removed since).
  gone = {3};
  segments.forget_removed(1, false, removed);
  EXPECT_NE(segments.find(3), nullptr);
  // Asked always, or a generation on: swept.
  segments.forget_removed(1, true, removed);
  EXPECT_EQ(segments.find(3), nullptr);
  gone = {1};
  segments.forget_removed(2, false, removed);
  EXPECT_EQ(segments.find(1), nullptr);
}

}  // namespace
}  // namespace keel::kv
