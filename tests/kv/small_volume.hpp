// Small volumes of their own for tests that fill a filesystem: a private tmpfs, or an ext4,
// xfs or btrfs loop image, mounted in a forked child's own mount namespace (it vanishes with
// the child), and the store filled on it.

#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>

#include "keel/kv/store.hpp"
#include "support/process.hpp"

namespace keel::kv::test_support {

// Why a btrfs loop volume cannot be made here ("" when it can be tried).
inline std::string why_no_btrfs() {
  if (::geteuid() != 0) return "mounting a loop device needs root";
  if (std::system("command -v mkfs.btrfs >/dev/null 2>&1") != 0) {
    return "no mkfs.btrfs (btrfs-progs) here";
  }
  return "";
}

inline std::string key_of(int i) {
  return "key-" + std::to_string(i);
}

// The segments a store at `path` has named (seg/ files of sixteen hex digits).
inline int segment_files(const std::string& path) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    const std::string name = e.path().filename().string();
    if (name.size() == 16 && name.find_first_not_of("0123456789abcdef") == std::string::npos) {
      ++n;
    }
  }
  return n;
}

// Two keys in three, 1, 2, 4, 5, 7, ...: the one after `i` (from 1). Erased so, no segment
// empties (compaction must move records), and tiny values' erase records outgrow the room
// puts leave (the deletes' room, and beside it the index's room for a segment of keys).
inline int two_in_three_after(int i) {
  return i % 3 == 1 ? i + 1 : i + 2;
}

// Puts values of `size` bytes (1 KiB by default) under key_of(from), key_of(from + 1), ...
// until one fails: the key after the last that succeeded, or -1 when the failure is not
// no_space.
inline int fill(store& s, int from, std::size_t size = 1024) {
  const std::string value(size, 'v');
  for (int i = from;; ++i) {
    auto r = s.put(key_of(i), value);
    if (!r) return r.error() == std::errc::no_space_on_device ? i : -1;
  }
}

// Runs `body(path)` in a child on a private tmpfs of `mib` MiB; its exit code (0: passed).
template <class F>
void on_small_volume(std::size_t mib, F&& body, const std::string& type = "tmpfs") {
  if (type != "tmpfs") {
    if (::geteuid() != 0) GTEST_SKIP() << "mounting a loop device needs root";
    if (std::system(("command -v mkfs." + type + " >/dev/null 2>&1").c_str()) != 0) {
      GTEST_SKIP() << "no mkfs." << type << " here";
    }
  }
  test::temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = test::fork_child([&] {
    const bool made =
        type == "tmpfs"
            ? test::mount_private_tmpfs(mnt, mib << 20)
            : test::mount_private_loop(type, dir.file(type + ".img"), mnt, mib << 20).empty();
    if (!made) return test::cannot_set_up;
    return body(mnt + "/s");
  });
  const int code = test::wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private " << type << " here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks (a signal: the store faulted)";
}

// As on_small_volume, for a body that counts what fitted: `body(path, count)` sets `count`
// and returns 0 (or a numbered check's failure). The count, or nothing when the child failed
// (the test then has failed) or the volume could not be made (the test is skipped).
template <class F>
std::optional<int> count_on_small_volume(std::size_t mib, F&& body,
                                         const std::string& type = "tmpfs") {
  test::temp_dir dir;
  const std::string file = dir.file("count");
  on_small_volume(
      mib,
      [&](const std::string& path) {
        int count = 0;
        if (const int code = body(path, count); code != 0) return code;
        std::FILE* f = std::fopen(file.c_str(), "w");
        if (f == nullptr) return 100;
        std::fprintf(f, "%d\n", count);
        std::fclose(f);
        return 0;
      },
      type);
  std::FILE* f = std::fopen(file.c_str(), "r");
  if (f == nullptr) return std::nullopt;
  int count = 0;
  const bool read = std::fscanf(f, "%d", &count) == 1;
  std::fclose(f);
  if (!read) return std::nullopt;
  return count;
}

}  // namespace keel::kv::test_support
