// The write-back cache's radix tree against a std::map model: random insertions, removals,
// lookups and range walks, with the thesis's node sizes (16 EB / 1 GB / 2 MB / 4 KB) and with
// small widths that make every level branch.

#include "aio/radix_tree.hpp"

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <random>
#include <vector>

namespace keel::aio::detail {
namespace {

struct leaf {
  std::uint64_t tag = 0;
};

template <class Tree>
void check_against_model(std::uint64_t max_offset, std::uint64_t seed) {
  Tree t;
  std::map<std::uint64_t, std::uint64_t> model;  // leaf offset -> tag
  std::mt19937_64 rng(seed);
  const auto leaf_of = [](std::uint64_t off) { return off / Tree::leaf_span * Tree::leaf_span; };
  for (int step = 0; step < 20000; ++step) {
    const std::uint64_t off = rng() % max_offset;
    switch (rng() % 4) {
      case 0:
      case 1: {
        const std::uint64_t tag = rng();
        bool made = false;
        leaf& l = t.get_or_make(off, [&] {
          made = true;
          return std::make_unique<leaf>(leaf{tag});
        });
        const bool existed = model.contains(leaf_of(off));
        ASSERT_EQ(made, !existed);
        if (made) model[leaf_of(off)] = tag;
        ASSERT_EQ(l.tag, model[leaf_of(off)]);
        break;
      }
      case 2:
        t.erase(off);
        model.erase(leaf_of(off));
        break;
      default: {
        const leaf* l = t.find(off);
        auto it = model.find(leaf_of(off));
        ASSERT_EQ(l != nullptr, it != model.end());
        if (l != nullptr) {
          ASSERT_EQ(l->tag, it->second);
        }
      }
    }
    ASSERT_EQ(t.size(), model.size());
    if (step % 500 == 0) {
      const std::uint64_t from = rng() % max_offset;
      const std::uint64_t to = from + rng() % (max_offset / 4 + 1);
      std::vector<std::pair<std::uint64_t, std::uint64_t>> seen, expected;
      t.for_each(from, to, [&](std::uint64_t at, const leaf& l) { seen.emplace_back(at, l.tag); });
      for (auto it = model.lower_bound(leaf_of(from)); it != model.end() && it->first < to; ++it)
        expected.emplace_back(it->first, it->second);
      ASSERT_EQ(seen, expected) << "walk of [" << from << ", " << to << ")";
    }
  }
  for (const auto& [off, tag] : model)
    t.erase(off);
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(t.find(0), nullptr);
}

TEST(RadixTree, ThesisNodeSizesMatchAMapModel) {
  using tree = radix_tree<leaf, 34, 9, 9, 12>;
  static_assert(tree::leaf_span == 4096);
  check_against_model<tree>(std::uint64_t{1} << 34, 1);  // several top-level entries
  check_against_model<tree>(std::uint64_t{1} << 22, 2);  // dense: leaves share nodes
}

TEST(RadixTree, SmallWidthsBranchAtEveryLevel) {
  using tree = radix_tree<leaf, 52, 4, 4, 4>;
  static_assert(tree::leaf_span == 16);
  check_against_model<tree>(std::uint64_t{1} << 14, 3);
}

TEST(RadixTree, OffsetsNearTheLargestFileOffset) {
  radix_tree<leaf, 34, 9, 9, 12> t;
  const std::uint64_t top = (std::uint64_t{1} << 63) - 4096;
  t.get_or_make(top, [] { return std::make_unique<leaf>(leaf{7}); });
  ASSERT_NE(t.find(top + 4095), nullptr);
  int n = 0;
  t.for_each(top - 8192, top + 4096, [&](std::uint64_t at, const leaf& l) {
    EXPECT_EQ(at, top);
    EXPECT_EQ(l.tag, 7u);
    ++n;
  });
  EXPECT_EQ(n, 1);
}

// take() hands the leaf over and frees the nodes; a visitor returning false stops the walk.
TEST(RadixTree, TakeHandsTheLeafOverAndVisitsCanStop) {
  radix_tree<leaf, 34, 9, 9, 12> t;
  for (std::uint64_t i = 0; i < 10; ++i)
    t.get_or_make(i << 21, [i] { return std::make_unique<leaf>(leaf{static_cast<unsigned>(i)}); });
  int visited = 0;
  t.for_each(0, std::uint64_t{1} << 40, [&](std::uint64_t, const leaf&) { return ++visited < 3; });
  EXPECT_EQ(visited, 3);
  auto taken = t.take(5 << 21);
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(taken->tag, 5u);
  EXPECT_EQ(t.find(5 << 21), nullptr);
  EXPECT_EQ(t.take(5 << 21), nullptr);
  EXPECT_EQ(t.size(), 9u);
}

}  // namespace
}  // namespace keel::aio::detail
