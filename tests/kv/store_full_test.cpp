// A full volume: a put that finds no room fails with no_space before it is visible; deletes
// and compaction still work (they draw on the spare segment the store keeps made ahead), and
// puts work again once compaction has given room back. Each test runs in a child with a
// private tmpfs of its own, so that it can fill a real filesystem.

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::small;

std::string key_of(int i) {
  return "key-" + std::to_string(i);
}

// Puts 1 KiB values under key_of(from), key_of(from + 1), ... until one fails: the key
// after the last that succeeded, or -1 when the failure is not no_space.
int fill(store& s, int from) {
  const std::string value(1024, 'v');
  for (int i = from;; ++i) {
    auto r = s.put(key_of(i), value);
    if (!r) return r.error() == std::errc::no_space_on_device ? i : -1;
  }
}

// Runs `body(path)` in a child on a private tmpfs of `mib` MiB; its exit code (0: passed).
template <class F>
void on_small_volume(std::size_t mib, F&& body) {
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_tmpfs(mnt, mib << 20)) return test::cannot_set_up;
    return body(mnt + "/s");
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

TEST(KvFullVolume, DeletesAndCompactionWorkAndMakeRoomAgain) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    // Full: erasing nearly everything works.
    for (int i = 0; i < n - 10; ++i) {
      if (!(*s)->erase(key_of(i))) return 4;
    }
    auto c = (*s)->compact();
    if (!c || c->segments_removed == 0) return 5;
    // Room again: about as many puts fit as before.
    const int again = fill(**s, n);
    if (again < 0) return 6;
    if (again - n < n / 2) return 7;
    for (int i = n - 10; i < n; ++i) {
      if (!(*s)->get(key_of(i))) return 8;
    }
    return 0;
  });
}

// The spare is made ahead and kept: a put that finds the volume full fails even though the
// spare's room would hold it, and a store reopened when full still deletes and compacts.
TEST(KvFullVolume, PutsNeverTakeTheSpareAndAReopenedFullStoreStillFreesRoom) {
  on_small_volume(12, [](const std::string& path) {
    int n = 0;
    {
      auto s = store::open(path, small());
      if (!s) return 2;
      n = fill(**s, 0);
      if (n < 1000) return 3;
      if (!std::filesystem::exists(path + "/seg/spare")) return 4;
      // Again and again: still no_space, and nothing of the spare is used.
      for (int k = 0; k < 20; ++k) {
        auto r = (*s)->put("more", std::string(1024, 'm'));
        if (r || r.error() != std::errc::no_space_on_device) return 5;
      }
      if (std::filesystem::file_size(path + "/seg/spare") != small().segment_size) return 6;
    }
    auto s = store::open(path, small());
    if (!s) return 7;
    for (int i = 0; i < n; i += 2) {
      if (!(*s)->erase(key_of(i))) return 8;
    }
    for (int pass = 0; pass < 10; ++pass) {
      auto c = (*s)->compact();
      if (!c) return 9;
      if (c->segments_removed == 0) break;
    }
    if (fill(**s, n) <= n) return 10;
    for (int i = 1; i < n; i += 2) {
      if (!(*s)->get(key_of(i))) return 11;
    }
    return 0;
  });
}

// Once deletes have taken the spare, puts do not write into it: they wait for room for a new
// spare (else the next deletes would find neither room nor spare).
TEST(KvFullVolume, PutsDoNotUseTheRoomDeletesTook) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    int erased = 0;
    while (std::filesystem::exists(path + "/seg/spare")) {
      if (erased >= n || !(*s)->erase(key_of(erased))) return 4;
      ++erased;
    }
    // The spare is the active segment now, with room left in it: not for puts.
    auto r = (*s)->put("more", std::string(1024, 'm'));
    if (r || r.error() != std::errc::no_space_on_device) return 5;
    // Deletes go on (erase records are small: the taken spare holds thousands).
    for (int i = erased; i < erased + 2000 && i < n; ++i) {
      if (!(*s)->erase(key_of(i))) return 6;
    }
    return 0;
  });
}

}  // namespace
}  // namespace keel::kv
