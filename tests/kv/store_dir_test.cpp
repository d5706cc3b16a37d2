// Opening and making a store's directory: a store exists whole or not at all (a power cut at
// any step of its making, racing creators), and nothing that is not a store is touched.

#include "kv/store_dir.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "keel/io/fault_filesystem.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::slurp;
using test::temp_dir;
using test::wait_exit;

TEST(KvStoreDir, MakesAStoreThenOpensTheSameOne) {
  temp_dir dir;
  const std::string path = dir.file("store");
  auto made = open_store_dir(path, {});
  ASSERT_TRUE(made) << made.error().message();
  EXPECT_TRUE(made->created);
  EXPECT_NE(made->params.salt, 0u);
  EXPECT_TRUE(std::filesystem::is_directory(path + "/seg"));
  auto again = open_store_dir(path, {});
  ASSERT_TRUE(again) << again.error().message();
  EXPECT_FALSE(again->created);
  EXPECT_EQ(again->params, made->params);
  auto other = open_store_dir(dir.file("other"), {});
  ASSERT_TRUE(other);
  EXPECT_NE(other->params.id, made->params.id) << "each store has its own id";
  EXPECT_NE(other->params.salt, made->params.salt);
}

TEST(KvStoreDir, ADirectoryHoldingSomethingElseIsRefusedAndLeftAlone) {
  temp_dir dir;
  const std::string path = dir.file("photos");
  std::filesystem::create_directory(path);
  std::ofstream(path + "/holiday.jpg") << "not a store";
  auto r = open_store_dir(path, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), errc::not_keel_file);
  EXPECT_EQ(r.error().path(), path);
  EXPECT_FALSE(std::filesystem::exists(path + "/keel-kv"));
  EXPECT_FALSE(std::filesystem::exists(path + "/seg"));
  EXPECT_EQ(slurp(path + "/holiday.jpg"), "not a store");
}

TEST(KvStoreDir, WhatIsAtTheStoreFilesNameDecides) {
  temp_dir dir;
  const std::string path = dir.file("store");
  ASSERT_TRUE(open_store_dir(path, {}));
  const std::string file = path + "/keel-kv";
  const std::string good = slurp(file);

  std::ofstream(file, std::ios::binary | std::ios::trunc) << std::string(4096, 'x');
  auto foreign = open_store_dir(path, {});
  ASSERT_FALSE(foreign);
  EXPECT_EQ(foreign.error(), errc::not_keel_file);

  std::string newer = good;
  newer[8] = 4;  // version 4
  std::ofstream(file, std::ios::binary | std::ios::trunc) << newer;
  auto v4 = open_store_dir(path, {});
  ASSERT_FALSE(v4);
  EXPECT_EQ(v4.error(), errc::unsupported_version);

  std::string damaged = good;
  damaged[50] ^= 1;  // the segment size
  std::ofstream(file, std::ios::binary | std::ios::trunc) << damaged;
  auto bad = open_store_dir(path, {});
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error(), errc::corrupt);
  EXPECT_EQ(bad.error().path(), file);
  EXPECT_TRUE(bad.error().has_offset());
  EXPECT_EQ(slurp(file), damaged) << "a damaged store file is never rewritten";
}

TEST(KvStoreDir, OptionsSayWhetherToMakeOrOnlyOpen) {
  temp_dir dir;
  const std::string path = dir.file("store");
  store_dir_options only_open;
  only_open.create_if_missing = false;
  auto none = open_store_dir(path, only_open);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error(), std::errc::no_such_file_or_directory);
  EXPECT_FALSE(std::filesystem::exists(path)) << "nothing made";

  ASSERT_TRUE(open_store_dir(path, {}));
  store_dir_options fresh;
  fresh.error_if_exists = true;
  auto exists = open_store_dir(path, fresh);
  ASSERT_FALSE(exists);
  EXPECT_EQ(exists.error(), std::errc::file_exists);

  store_dir_options odd;
  odd.segment_size = 3 << 20;
  EXPECT_EQ(open_store_dir(dir.file("odd"), odd).error(), std::errc::invalid_argument);

  std::ofstream(dir.file("a-file")) << "x";
  auto file = open_store_dir(dir.file("a-file"), {});
  ASSERT_FALSE(file);
  EXPECT_EQ(file.error(), std::errc::not_a_directory);
}

// Processes racing to make one store all end up in the same one.
TEST(KvStoreDir, RacingCreatorsOpenOneStore) {
  temp_dir dir;
  const std::string path = dir.file("store");
  const std::string ids = dir.file("ids");
  std::vector<pid_t> kids;
  for (int i = 0; i < 8; ++i) {
    kids.push_back(fork_child([&, i] {
      auto s = open_store_dir(path, {});
      if (!s) {
        std::fprintf(stderr, "creator %d: %s\n", i, s.error().message().c_str());
        return 2;
      }
      std::ofstream(ids + std::to_string(i), std::ios::binary)
          .write(reinterpret_cast<const char*>(s->params.id.data()), 16);
      return 0;
    }));
  }
  // Every one waited for before any assertion (the directory goes with the test). One once
  // took the `seg` a racing creator had made, listed before its store file, for a user's.
  std::vector<int> codes;
  for (const pid_t k : kids)
    codes.push_back(wait_exit(k));
  for (int i = 0; i < 8; ++i)
    ASSERT_EQ(codes[i], 0) << "creator " << i;
  const std::string first = slurp(ids + "0");
  ASSERT_EQ(first.size(), 16u);
  for (int i = 1; i < 8; ++i)
    EXPECT_EQ(slurp(ids + std::to_string(i)), first) << "creator " << i;
}

// The maker dies before each mutating step of making a store in turn, by SIGKILL (what it
// wrote stays, as the page cache has it) or by a power cut (the fault seam's model, torn
// writes included, rebuilds what would survive): afterwards the directory holds no store,
// and opening makes one, or a whole store that opens. Never a half-made one that fails.
class KvStoreDirCrash : public ::testing::TestWithParam<bool> {};

TEST_P(KvStoreDirCrash, WhileMakingAStoreLeavesNoneOrAWholeOne) {
  const bool power_cut = GetParam();
  bool finished = false;
  for (std::uint64_t nth = 1; !finished && nth < 40; ++nth) {
    temp_dir base;
    const std::string root = base.file("root"), shadow = base.file("shadow");
    std::filesystem::create_directory(root);
    const std::string path = root + "/store";
    const pid_t child = fork_child([&] {
      io::fault_filesystem fs;
      if (!fs.track(root, shadow)) return 1;
      fs.inject({.on = io::fs_ops::mutating(), .nth = nth, .crash = true});
      store_dir_options o;
      o.fs = &fs;
      return open_store_dir(path, o) ? 0 : 2;
    });
    const int code = wait_exit(child);
    if (code == 0) {
      finished = true;  // made without reaching the nth step
      continue;
    }
    ASSERT_EQ(code, 128 + SIGKILL) << "step " << nth;
    if (power_cut) {
      ASSERT_TRUE(io::fault_filesystem::restore(root, shadow, {.torn = true, .seed = nth}))
          << "step " << nth;
    }
    auto after = open_store_dir(path, {});
    ASSERT_TRUE(after) << "after " << (power_cut ? "a power cut" : "SIGKILL") << " at step " << nth
                       << ": " << after.error().message();
    auto again = open_store_dir(path, {});
    ASSERT_TRUE(again);
    EXPECT_EQ(again->params, after->params) << "step " << nth;
  }
  EXPECT_TRUE(finished) << "making a store took 40 steps or more";
}

INSTANTIATE_TEST_SUITE_P(Both, KvStoreDirCrash, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "PowerCut" : "Kill"; });

}  // namespace
}  // namespace keel::kv
