// Small when small: a store made with the segment size left to it starts with small log
// segments and small rooms, which grow with the log up to the size chosen for the volume
// (doc/kv-format.md, "Segments"). What it holds survives every size it passed through: a
// reopen, a rebuild of the index, compaction of segments of mixed sizes, a full volume.

#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

#include "keel/kv/store.hpp"
#include "kv/format.hpp"
#include "kv/kv_support.hpp"
#include "kv/small_volume.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using namespace test_support;

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = kib * kib;

// Bytes the files under `path` take on their volume (their blocks, as du counts them).
std::uint64_t allocated_under(const std::string& path) {
  std::uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0)
      total += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

// seg/'s log and blob segments, by number: their sizes.
std::map<std::uint64_t, std::uint64_t> segment_sizes(const std::string& path) {
  std::map<std::uint64_t, std::uint64_t> out;
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    const std::string name = e.path().filename().string();
    if (name.size() != 16 || name.find_first_not_of("0123456789abcdef") != std::string::npos) {
      continue;
    }
    out[std::stoull(name, nullptr, 16)] = std::filesystem::file_size(e.path());
  }
  return out;
}

std::uint64_t size_of(const std::string& file) {
  std::error_code ec;
  const auto n = std::filesystem::file_size(file, ec);
  return ec ? 0 : n;
}

bool power_of_two(std::uint64_t n) {
  return n != 0 && (n & (n - 1)) == 0;
}

std::string value_of(int i, std::size_t size) {
  std::string v(size, static_cast<char>('a' + i % 26));
  v.replace(0, std::min(v.size(), std::to_string(i).size()), std::to_string(i));
  return v;
}

// Issue 42: a one-key store took 194 MiB on a large disk (three 64 MiB files: a segment and
// the two rooms, plus a 1.5 MiB index).
TEST(KvGrowth, ANewStoreWithOneKeyTakesAtMostTwoMiBOnALargeVolume) {
  on_small_volume(64 * 1024, [](const std::string& path) {
    // (A 64 GiB tmpfs: the segment size chosen for it is the largest, 64 MiB.)
    {
      auto s = store::open(path);
      if (!s) return 1;
      if (!(*s)->put("k", "v")) return 2;
    }
    const std::string file = test::slurp(path + "/keel-kv");
    auto params = fmt::parse_store_file(std::as_bytes(std::span(file.data(), file.size())));
    if (!params || params->segment_size != fmt::default_segment_size) return 3;
    if (params->first_segment_size != fmt::min_first_segment_size) return 4;
    const std::uint64_t used = allocated_under(path);
    std::fprintf(stderr, "a one-key store takes %llu bytes\n",
                 static_cast<unsigned long long>(used));
    if (used > 2 * mib) return 5;
    auto again = store::open(path);
    if (!again) return 6;
    auto v = (*again)->get("k");
    return v && *v == "v" ? 0 : 7;
  });
}

TEST(KvGrowth, SegmentsAndRoomsGrowWithTheLogAndHoldEverythingThroughRebuildAndCompaction) {
  on_small_volume(8 * 1024, [](const std::string& path) {
    // An 8 GiB tmpfs: segments grow from 256 KiB up to 8 MiB. 48 MiB of 4 KiB values takes
    // them to 2 MiB (a sixteenth of the log).
    constexpr int n = 12'000;
    constexpr std::size_t value = 4 * kib;
    {
      options o;
      o.compact_dead_fraction = 0;  // the compaction below is the test's
      auto s = store::open(path, o);
      if (!s) return 1;
      for (int i = 0; i < n; ++i) {
        if (!(*s)->put(key_of(i), value_of(i, value))) return 2;
      }
    }
    const auto sizes = segment_sizes(path);
    if (sizes.size() < 8) return 3;
    std::uint64_t last = 0;
    for (const auto& [number, size] : sizes) {
      // The log's segments grow, each a power of two from the first size up.
      if (!power_of_two(size) || size < fmt::min_first_segment_size || size < last) return 4;
      last = size;
    }
    if (sizes.begin()->second != fmt::min_first_segment_size || last < 2 * mib) return 5;
    // The rooms grew with them.
    if (size_of(path + "/seg/spare") < last / 2 || size_of(path + "/seg/deletes") < last / 2) {
      return 6;
    }
    const auto check = [&](int from, int step) {
      options o;
      o.compact_dead_fraction = 0;
      auto s = store::open(path, o);
      if (!s) return false;
      for (int i = from; i < n; i += step) {
        auto v = (*s)->get(key_of(i));
        if (!v || *v != value_of(i, value)) {
          std::fprintf(stderr, "key %d: %s\n", i,
                       v ? "another value" : v.error().message().c_str());
          return false;
        }
      }
      return static_cast<bool>((*s)->verify());
    };
    if (!check(0, 1)) return 7;
    // The index rebuilt from the segments alone, of every size.
    std::filesystem::remove(path + "/index");
    std::filesystem::remove(path + "/checkpoint");
    if (!check(0, 1)) return 8;
    {
      options o;
      o.compact_dead_fraction = 0;
      auto s = store::open(path, o);
      if (!s) return 9;
      for (int i = 0; i < n; ++i) {
        if (i % 4 != 3 && !(*s)->erase(key_of(i))) return 10;
      }
      auto c = (*s)->compact();
      if (!c || c->segments_removed == 0) return 11;
      std::fprintf(stderr, "compaction removed %llu segments of %zu\n",
                   static_cast<unsigned long long>(c->segments_removed), sizes.size());
    }
    if (!check(3, 4)) return 12;
    std::filesystem::remove(path + "/index");
    std::filesystem::remove(path + "/checkpoint");
    return check(3, 4) ? 0 : 13;
  });
}

// A store that grows on a small volume: it still fills it, every delete works when it is
// full, and compaction gives the room back to puts.
TEST(KvGrowth, AGrowingStoreFillsASmallVolumeAndDeletesWorkWhenFull) {
  on_small_volume(32, [](const std::string& path) {
    auto s = store::open(path);
    if (!s) return 1;
    const int n = fill(**s, 0);
    if (n <= 0) return 2;
    std::fprintf(stderr, "32 MiB tmpfs: %d keys of 1 KiB before full (%.1f %% of the volume)\n", n,
                 100.0 * n * 1024 / (32.0 * mib));
    for (int i = 0; i < n; ++i) {
      if (auto r = (*s)->erase(key_of(i)); !r) {
        std::fprintf(stderr, "erase %d of %d: %s\n", i, n, r.error().message().c_str());
        return 3;
      }
    }
    if (!(*s)->compact()) return 4;
    const int again = fill(**s, n);
    std::fprintf(stderr, "after erasing all and compacting: %d put again\n", again - n);
    if (again - n < n * 8 / 10) return 5;
    return (*s)->verify() ? 0 : 6;
  });
}

}  // namespace
}  // namespace keel::kv
