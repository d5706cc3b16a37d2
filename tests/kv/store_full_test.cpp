// A full volume: a put that finds no room fails with no_space before it is visible; deletes
// and compaction still work (they draw on the spare segment the store keeps made ahead), and
// puts work again once compaction has given room back. Each test runs in a child with a
// private tmpfs of its own, so that it can fill a real filesystem.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "io/map_guard.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/small_volume.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::count_on_small_volume;
using test_support::fill;
using test_support::key_of;
using test_support::manual_compaction;
using test_support::on_small_volume;
using test_support::small;
using test_support::two_in_three_after;
using test_support::why_no_btrfs;

// Values of a few hundred KB, over a quarter of a small store's segments: each that the
// rest of the tail's segment could not hold left that rest dead, which compaction could not
// take back (every segment held one live value). On an 8 MiB tmpfs, 140 KB values filled
// 43 % of it and left 2.9 MiB dead; now each such value has a segment of its own size.
TEST(KvFullVolume, ValuesOfAFewHundredKilobytesFillASmallVolumeLeavingNothingDead) {
  for (const std::size_t size : {100'000, 140'000, 200'000}) {
    SCOPED_TRACE(size);
    on_small_volume(8, [size](const std::string& path) {
      auto s = store::open(path);
      if (!s) return 2;
      const int n = fill(**s, 0, size);
      if (n < 0) return 3;
      auto st = (*s)->stats();
      if (!st) return 4;
      std::printf("%zu B values: %d fitted (%.1f %% of the volume), %llu bytes dead\n", size, n,
                  100.0 * static_cast<double>(n) * static_cast<double>(size) / (8 << 20),
                  static_cast<unsigned long long>(st->dead_bytes));
      std::fflush(stdout);
      if (st->dead_bytes > (std::uint64_t{512} << 10)) return 5;
      if (static_cast<double>(n) * static_cast<double>(size) < 0.65 * (8 << 20)) return 6;
      // Each value reads back.
      for (int i = 0; i < n; ++i) {
        auto v = (*s)->get(key_of(i));
        if (!v || v->size() != size) return 7;
      }
      return 0;
    });
  }
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
    // (Or one in the background, short of room, before it: some compaction removed some.)
    auto st = (*s)->stats();
    if (!c || !st || st->compactions == 0) return 5;
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

// Erases of small values on a full store of single puts: each writes an erase record of
// about the size it kills, so the deletes' room is spent long before a segment is much dead,
// and compaction must then copy segments that are nearly all live into less than their size.
// Each record was copied as a block of its own, a header apiece as each put had: a copy took
// a segment's size, no pass could take one, and every erase failed with no_space after about
// 2 600 (random order, 16-byte values, 6 to 32 MiB; and in key order beside a 700 KB blob,
// whose keys share its segment). Copies now share relocation blocks.
TEST(KvFullVolume, EveryEraseOfSmallValuesWorksInAnyOrderOnAFullVolume) {
  struct shape {
    std::size_t mib, value, blob;
    bool shuffled, background;
  };
  for (const auto& [mib, value, blob, shuffled, background] :
       {shape{16, 16, 0, true, false}, shape{24, 100, 0, true, true},
        shape{6, 16, 700'000, false, false}}) {
    SCOPED_TRACE(std::to_string(mib) + " MiB, values of " + std::to_string(value) +
                 " bytes, a blob of " + std::to_string(blob) + (shuffled ? ", random" : ""));
    on_small_volume(mib, [&](const std::string& path) {
      options o;
      if (!background) o.compact_dead_fraction = 0;
      auto opened = store::open(path, o);
      if (!opened) return 2;
      store& s = **opened;
      if (blob > 0 && !s.put("blob", std::string(blob, 'b'))) return 3;
      const int n = fill(s, 0, value);
      if (n < 10'000) return 4;
      std::vector<int> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(7));
      int done = 0;
      for (const int i : order) {
        if (auto e = s.erase(key_of(i)); !e) {
          std::fprintf(stderr, "erase %d of %d failed: %s\n", done + 1, n,
                       e.error().message().c_str());
          return 5;
        }
        ++done;
      }
      for (int i = 0; i < n; ++i) {
        auto g = s.get(key_of(i));
        if (g || g.error() != make_error_code(errc::not_found)) return 6;
      }
      if (blob > 0) {
        auto g = s.get("blob");
        if (!g || *g != std::string(blob, 'b')) return 7;
      }
      verify_report report;
      if (!s.verify(&report) || !report.damaged.empty()) return 8;
      // The room is back: nearly as many fit again. (Beside the blob, whose 1 MiB segment made
      // the spare as large, a refill with no compaction asked for stopped at half: the
      // compaction its first failing put ran left no room to make that spare again.)
      if (blob > 0 && !s.compact()) return 10;
      const int again = fill(s, n, value);
      std::fprintf(stderr, "%d keys, then %d more after erasing them\n", n, again - n);
      // (87.6 to 105 % of the first fill at 6 MiB over 30 runs, each store of its own hash
      // salt; 73 % was seen while the split estimate counted the entries of erased keys
      // compaction forgot as used, and held room back for splits they spared.)
      return again - n >= n * 4 / 5 ? 0 : 9;
    });
  }
}

// Erases committed in transactions on a full store: once the deletes' room was spent, such a
// commit failed with no_space, and, nothing else making room, so did every one after it
// (erase 4 951 of 29 156 on a 6 MiB tmpfs, one erase per transaction). It now makes room as
// store::erase does, letting its snapshot's slot go while compaction runs. One that read keys
// then returns conflict (a key it read could have been erased and forgotten meanwhile:
// judged from its snapshot, two such transactions erased two keys each had read as there),
// and its retry goes in.
TEST(KvFullVolume, EraseOnlyTransactionsWorkOnAFullVolume) {
  on_small_volume(6, [](const std::string& path) {
    const options o = manual_compaction(options{});
    auto opened = store::open(path, o);
    if (!opened) return 2;
    store& s = **opened;
    const int n = fill(s, 0, 16);
    if (n < 10'000) return 3;
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(11));
    int conflicts = 0;
    for (std::size_t i = 0; i < order.size(); i += 2) {
      const int first = order[i];
      const int last = order[std::min(i + 1, order.size() - 1)];
      // Every other one reads a key (one it does not erase) before it erases two.
      const bool reads = i % 4 == 0;
      for (int attempt = 0;; ++attempt) {
        auto t = s.begin();
        if (!t) return 4;
        if (reads) (void)t->get(key_of(last == order.back() ? order.front() : order.back()));
        if (!t->erase(key_of(first)) || !t->erase(key_of(last))) return 5;
        auto c = t->commit();
        if (c) break;
        if (c.error() == errc::conflict && reads && attempt == 0) {
          ++conflicts;
          continue;
        }
        std::fprintf(stderr, "commit %zu of %d failed: %s\n", i / 2 + 1, (n + 1) / 2,
                     c.error().message().c_str());
        return 6;
      }
    }
    if (conflicts == 0) return 9;  // (some compacted: the room ran out many times)
    for (int i = 0; i < n; ++i) {
      auto g = s.get(key_of(i));
      if (g || g.error() != make_error_code(errc::not_found)) return 7;
    }
    verify_report report;
    return s.verify(&report) && report.damaged.empty() ? 0 : 8;
  });
}

// Processes erasing a full store together, in random order: each compaction's room is taken
// by the others before the one that ran it tries again, and with four compactions an erase at
// most, a dozen of the erases failed with no_space (values of 16 to 200 bytes, 16 MiB, three
// processes). An erase now goes on while compactions make room.
TEST(KvFullVolume, ProcessesErasingAFullStoreTogetherNeverFail) {
  on_small_volume(16, [](const std::string& path) {
    auto opened = store::open(path, options{});
    if (!opened) return 2;
    std::mt19937 random(5);
    int n = 0;
    for (;; ++n) {
      auto r = (*opened)->put(key_of(n), std::string(16 + random() % 185, 'v'));
      if (!r) break;
    }
    if (n < 10'000) return 3;
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), random);
    constexpr int processes = 3;
    std::vector<pid_t> children;
    for (int p = 0; p < processes; ++p) {
      children.push_back(fork_child([&] {
        auto mine = store::open(path, options{});
        if (!mine) return 20;
        int failed = 0;
        for (std::size_t i = static_cast<std::size_t>(p); i < order.size(); i += processes) {
          if (auto e = (*mine)->erase(key_of(order[i])); !e && failed++ == 0) {
            std::fprintf(stderr, "erase of %s failed: %s\n", key_of(order[i]).c_str(),
                         e.error().message().c_str());
          }
        }
        return std::min(failed, 19);
      }));
    }
    int failed = 0;
    for (const pid_t c : children)
      failed += wait_exit(c) != 0 ? 1 : 0;
    if (failed != 0) return 4;
    for (int i = 0; i < n; ++i) {
      auto g = (*opened)->get(key_of(i));
      if (g || g.error() != make_error_code(errc::not_found)) return 5;
    }
    verify_report report;
    return (*opened)->verify(&report) && report.damaged.empty() ? 0 : 6;
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
      if (!c && c.error() != std::errc::no_space_on_device) return 9;  // a pass with no room
      if (c->segments_removed == 0) break;
    }
    if (fill(**s, n) <= n) return 10;
    for (int i = 1; i < n; i += 2) {
      if (!(*s)->get(key_of(i))) return 11;
    }
    return 0;
  });
}

// Puts stop with the deletes' room kept beside the spare: deletes go on into it, thousands of
// them, without a compaction, and without touching the spare.
// A transaction whose block can never fit one segment is too large, whatever room is left:
// the same answer on an empty volume and on a full one (it said no_space near full).
TEST(KvFullVolume, ATransactionLargerThanASegmentIsTooLargeFullOrNot) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    const auto too_big = [&]() -> std::error_code {
      auto t = (*s)->begin();
      if (!t) return t.error().code();
      // 1 500 values of 1 000 bytes, each below the blob threshold: one block of 1.5 MB.
      for (int i = 0; i < 1500; ++i) {
        if (!t->put("big-" + std::to_string(i), std::string(1000, 'b'))) return {};
      }
      auto c = t->commit();
      return c ? std::error_code{} : c.error().code();
    };
    if (too_big() != make_error_code(errc::too_large)) return 3;
    if (fill(**s, 0) < 1000) return 4;
    if (too_big() != make_error_code(errc::too_large)) return 5;
    // Nothing of either is there.
    if ((*s)->get("big-0")) return 6;
    return 0;
  });
}

// Puts fill the volume but for the deletes' room and the spare, both files (which another
// program on the volume cannot take): erases then go into a segment made of the deletes'
// room, and the spare stays compaction's.
TEST(KvFullVolume, PutsLeaveDeletesTheirRoomAndTheSpareToCompaction) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, manual_compaction());
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    const std::uint64_t segment = small().segment_size;
    if (std::filesystem::file_size(path + "/seg/deletes") != segment) return 4;
    auto free = io::os().statfs(path.c_str());
    if (!free || free->available_bytes >= segment) return 5;  // no segment more was left
    const auto before = (*s)->stats();
    if (!before) return 6;
    for (int i = 0; i < 5000; ++i) {
      if (!(*s)->erase(key_of(i))) return 7;
    }
    const auto after = (*s)->stats();
    if (!after || after->segments != before->segments + 1) return 8;  // the deletes' room
    if (std::filesystem::exists(path + "/seg/deletes")) return 9;
    if (std::filesystem::file_size(path + "/seg/spare") != segment) return 10;
    return 0;
  });
}

// The room puts leave is the deletes': once an erase has made a segment of it, a put does not
// write there (nor does it grow the index into it), and thousands of erases in transactions
// (which never compact by themselves) go in. With 1 KiB values, and with tiny ones, whose
// keys grow the index most.
TEST(KvFullVolume, PutsDoNotUseTheRoomKeptForDeletes) {
  for (const std::size_t size : {std::size_t{1024}, std::size_t{8}}) {
    SCOPED_TRACE(size);
    on_small_volume(12, [size](const std::string& path) {
      auto s = store::open(path, small());
      if (!s) return 2;
      const int n = fill(**s, 0, size);
      if (n < 2000) return 3;
      const auto erase_in_transaction = [&](int i) {
        auto t = (*s)->begin();
        return t && t->erase(key_of(i)) && t->commit();
      };
      const auto segments = [&]() -> std::uint64_t {
        auto st = (*s)->stats();
        return st ? st->segments : 0;
      };
      const std::uint64_t before = segments();
      if (!erase_in_transaction(0)) return 4;
      // The erase's record went into a new segment, of the deletes' room, where the tail now
      // is: no put goes in. Or into the tail's rest: puts may go on there (into pages with an
      // empty entry, or a retired page to split into), until a put needs a segment of its
      // own; none is made.
      const std::uint64_t after = segments();
      const std::uint64_t most =
          after > before ? 0 : small().segment_size / (96 + 16 + size);  // the tail's rest
      for (std::uint64_t k = 0;; ++k) {
        auto r = (*s)->put("more" + std::to_string(k), std::string(size, 'm'));
        if (r && k < most) continue;
        if (r || r.error() != std::errc::no_space_on_device) return 5;
        break;
      }
      if (segments() != after) return 7;
      for (int i = 1; i < 2000; ++i) {
        if (!erase_in_transaction(i)) return 6;
      }
      return 0;
    });
  }
}

// Deletes spread thinly (two keys in three, segment after segment), in transactions, past the
// room deletes have: compaction frees segments that are far from half dead, through the
// spare, and deletes and puts go on. (Transactions did not compact by themselves, and their
// commits failed with no_space once the room ran out; now they compact as store::erase does.)
TEST(KvFullVolume, ThinlySpreadDeletesStillLetCompactionFreeRoom) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    // Tiny values: many keys, whose erase records outgrow the room deletes have (the room
    // puts leave is one to two segments, and the index's room).
    const std::string value(8, 'v');
    int n = 0;
    for (;; ++n) {
      auto r = (*s)->put(key_of(n), value);
      if (!r) {
        if (r.error() != std::errc::no_space_on_device) return 3;
        break;
      }
    }
    int i = 1;
    for (; i < n / 2; i = two_in_three_after(i)) {
      auto t = (*s)->begin();
      if (!t || !t->erase(key_of(i))) return 4;
      if (auto r = t->commit(); !r) return 5;
    }
    // The deletes ran out of room, and a compaction (the commits', or one in the background,
    // short of room) removed some.
    auto c = (*s)->compact();
    auto st = (*s)->stats();
    if (!c || !st || st->compactions == 0) return 7;
    // Every delete goes in now (the store's erase compacts again when it must), and the
    // keys left are all there.
    for (; i < n; i = two_in_three_after(i)) {
      if (!(*s)->erase(key_of(i))) return 8;
    }
    for (int k = 0; k < n; ++k) {
      auto v = (*s)->get(key_of(k));
      if (k % 3 != 0 ? v || v.error() != errc::not_found : !v || *v != value) return 9;
    }
    for (int pass = 0; pass < 50; ++pass) {
      auto more = (*s)->compact();
      if (!more) return 10;
      if (more->segments_removed == 0) break;
    }
    if (!(*s)->put("after", value)) return 11;
    return 0;
  });
}

// With the segment size left to the store, a small volume fills: the room the store keeps
// for deletes and compaction is two segments, and 64 MiB segments (the old default) left a
// 64 MiB volume no room for one put and a 256 MiB one three quarters empty.
TEST(KvFullVolume, TheDefaultSegmentSizeFitsTheVolume) {
  for (const std::size_t mib : {64, 256}) {
    const auto stored = count_on_small_volume(mib, [](const std::string& path, int& count) {
      auto s = store::open(path, options{});
      if (!s) return 2;
      count = fill(**s, 0);
      return count < 0 ? 3 : 0;
    });
    ASSERT_TRUE(stored) << mib << " MiB";
    // 1 KiB values: at least 80 % of the volume (with 1 MiB segments, as chosen here; the
    // rest is records' headers and keys, the index, and the room kept).
    EXPECT_GE(*stored, static_cast<int>(mib * 1024 * 80 / 100)) << mib << " MiB";
  }
  // A 1024th of the volume, a power of two: 4 MiB segments on a 4 GiB volume (tmpfs takes
  // memory only for what is written), which segments grow to from 256 KiB.
  on_small_volume(4096, [](const std::string& path) {
    auto s = store::open(path, options{});
    if (!s || !(*s)->put("a", "1")) return 2;
    std::string file(4096, '\0');
    std::FILE* f = std::fopen((path + "/keel-kv").c_str(), "rb");
    if (f == nullptr) return 3;
    file.resize(std::fread(file.data(), 1, file.size(), f));
    std::fclose(f);
    auto params = disk::parse_store_file(std::as_bytes(std::span(file.data(), file.size())));
    if (!params || params->segment_size != (std::uint64_t{4} << 20)) return 4;
    std::uint64_t sizes = 0;
    for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
      if (e.file_size() != disk::min_first_segment_size) return 5;
      ++sizes;
    }
    return sizes == 0 ? 6 : 0;
  });
}

// A word of the index header of the store at `path` (UINT64_MAX: unread).
std::uint64_t header_word(const std::string& path, std::size_t offset) {
  const int fd = ::open((path + "/index").c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return UINT64_MAX;
  std::uint64_t word = UINT64_MAX;
  if (::pread(fd, &word, sizeof word, static_cast<off_t>(offset)) != sizeof word) {
    word = UINT64_MAX;
  }
  ::close(fd);
  return word;
}

// The compactions begun on the store at `path` so far (the index header's count).
std::uint64_t compaction_runs(const std::string& path) {
  return header_word(path, header::compaction_runs);
}

// A full store whose dead versions are spread thinly fails its puts fast: once compaction
// has taken what it could, the next puts do not walk the index again (tar's "keep banging on
// the full disk", at a gigabyte, took 0.3 s a put). But once enough has died in one place, a
// put compacts again and goes in. (Compaction short of room takes any segment whose copies
// take less than it, so the thinly spread dead here is taken while the store fills, until
// less than a segment is left dead; a put then runs none. Before, a segment had to be a
// sixteenth dead, none was, and the compaction's finding was kept in *fruitless below*: that
// mark now guards only stores of packed live segments with a segment's worth dead in total,
// spread over hundreds of them.)
TEST(KvFullVolume, APutOnAFullStoreCompactsAgainOnlyWhenEnoughHasDiedSince) {
  on_small_volume(100, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    // 1 KiB values; every 80th put overwrites the key put 80 before, so that about 1.25 %
    // of each segment dies.
    const std::string value(1024, 'v');
    int n = 0;
    for (;; ++n) {
      auto r = (*s)->put(key_of(n), value);
      if (r && n % 80 == 79) r = (*s)->put(key_of(n - 79), value);
      if (!r) {
        if (r.error() != std::errc::no_space_on_device) return 3;
        break;
      }
    }
    const std::uint64_t runs = compaction_runs(path);
    if (runs == 0 || runs == UINT64_MAX) return 5;  // compactions ran as it filled
    for (int k = 1; k <= 20; ++k) {
      auto r = (*s)->put(key_of(n + k), value);
      if (r || r.error() != std::errc::no_space_on_device) return 6;
    }
    if (compaction_runs(path) != runs) return 7;  // no put walked the index again
    // Two thousand keys erased together: two segments' worth dies where compaction can take
    // it whole, and a put has room for a segment again (the erases go into the room kept
    // for deletes).
    for (int i = 1000; i < 3000; ++i) {
      if (!(*s)->erase(key_of(i))) return 8;
    }
    if (!(*s)->put(key_of(n + 100), value)) return 9;
    if (compaction_runs(path) == runs) return 10;
    for (int i = 0; i < n; ++i) {
      auto v = (*s)->get(key_of(i));
      if (i >= 1000 && i < 3000 ? v || v.error() != errc::not_found : !v || *v != value) {
        return 11;
      }
    }
    return 0;
  });
}

// Holds the first rename of the spare into a segment until released.
class gated_rename final : public io::filesystem_wrapper {
 public:
  gated_rename() noexcept : io::filesystem_wrapper(io::os()) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    if (std::strcmp(from, "spare") == 0) {
      std::unique_lock l(m_);
      if (!done_) {
        held_ = true;
        cv_.notify_all();
        cv_.wait(l, [&] { return released_; });
        done_ = true;
      }
    }
    return io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
  }
  bool wait_held() {
    std::unique_lock l(m_);
    return cv_.wait_for(l, std::chrono::seconds(60), [&] { return held_; });
  }
  bool was_held() {
    std::lock_guard l(m_);
    return held_;
  }
  void release() {
    std::lock_guard l(m_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool held_ = false;
  bool released_ = false;
  bool done_ = false;
};

// A put that was already waiting to move on to the next segment while compaction (run by an
// erase that found no room) took the spare must not write into it.
TEST(KvFullVolume, APutWaitingWhileCompactionTakesTheSpareDoesNotWriteIntoIt) {
  on_small_volume(12, [](const std::string& path) {
    gated_rename fs;
    options o = small();
    o.fs = &fs;
    auto s = store::open(path, o);
    if (!s) return 2;
    // Tiny values: their erase records outgrow the room puts leave for deletes.
    const int n = fill(**s, 0, 8);
    if (n < 1000) return 3;
    int result = 0;
    std::thread eraser([&] {
      // Two keys in three: no segment empties, so compaction must move records, and once
      // the deletes' room is used up, into the spare.
      for (int i = 1; i < n; i = two_in_three_after(i)) {
        if (!(*s)->erase(key_of(i))) {
          result = 4;
          return;
        }
        if (fs.was_held()) return;
      }
      result = 5;  // never took the spare
    });
    if (!fs.wait_held()) {  // the eraser's compaction holds the segment lock, taking the spare
      eraser.join();
      return result != 0 ? result : 7;
    }
    std::thread putter([&] {
      // A transaction's commit, which does not compact and retry as store::put does: what it
      // finds once the lock is free is what this test is about.
      auto t = (*s)->begin();
      if (!t || !t->put("late", std::string(1024, 'p'))) {
        result = 8;
        return;
      }
      auto r = t->commit();
      if (r || r.error() != std::errc::no_space_on_device) result = 6;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the putter waits for the lock
    fs.release();
    eraser.join();
    putter.join();
    return result;
  });
}

// Ends the process once a room (seg/spare, or seg/deletes) has been renamed into a segment:
// at once (a taker killed between the segment's name and its entry in the table), or at the
// next sync, of seg/ (one killed after the entry, before the tail moves into the segment).
class dies_taking_the_spare final : public io::filesystem_wrapper {
 public:
  explicit dies_taking_the_spare(bool at_sync, const char* room = "spare") noexcept
      : io::filesystem_wrapper(io::os()), at_sync_(at_sync), room_(room) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    auto r = io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
    if (std::strcmp(from, room_) == 0) {
      if (!r) ::_exit(43);
      if (!at_sync_) ::_exit(42);
      renamed_ = true;
    }
    return r;
  }
  result<void> sync(const io::file_handle& file, io::sync_kind kind) noexcept override {
    if (renamed_) ::_exit(42);
    return io::filesystem_wrapper::sync(file, kind);
  }

 private:
  bool at_sync_;
  const char* room_;
  bool renamed_ = false;
};

// What such a taker left holds the spare's room. Deletes on the full volume work again, in a
// store opened alone afterwards (its opener removes a segment never entered) and one another
// process has open throughout (the next segment any writer needs is the one abandoned).
class KvSpareTakerKilled : public ::testing::TestWithParam<bool> {};

TEST_P(KvSpareTakerKilled, LeavesNothingThatHoldsTheRoomForGood) {
  const bool at_sync = GetParam();
  on_small_volume(12, [at_sync](const std::string& path) {
    auto opened = store::open(path, small());
    if (!opened) return 2;
    std::unique_ptr<store> s = std::move(*opened);
    const int n = fill(*s, 0, 8);
    if (n < 1000) return 3;
    // Entered but abandoned: the store stays open here meanwhile. Never entered: closed, so
    // that the next open is alone.
    if (!at_sync) s.reset();
    const pid_t taker = fork_child([&] {
      dies_taking_the_spare fs(at_sync);
      options o = small();
      o.fs = &fs;
      auto mine = store::open(path, o);
      if (!mine) return 2;
      for (int i = 1; i < n; i = two_in_three_after(i)) {  // (see above)
        if (!(*mine)->erase(key_of(i))) return 3;
      }
      return 4;
    });
    if (wait_exit(taker) != 42) return 4;
    if (!s) {
      auto again = store::open(path, small());
      if (!again) return 5;
      s = std::move(*again);
    }
    for (int i = 0; i < n; ++i) {
      auto r = s->erase(key_of(i));
      if (!r && r.error() != errc::not_found) return 6;
    }
    for (int pass = 0; pass < 50; ++pass) {
      auto c = s->compact();
      if (!c) return 7;
      if (c->segments_removed == 0) break;
    }
    if (fill(*s, n) <= n) return 8;
    return 0;
  });
}

// The same for an erase that took the deletes' room at the budget: until then the store
// counted that room by its word, which such a taker left set beside the segment it made. A
// store another process has open throughout counts the room once: its erases pass the
// budget check and take the segment left, and compaction then makes room for puts again.
class KvDeletesTakerKilled : public ::testing::TestWithParam<bool> {};

TEST_P(KvDeletesTakerKilled, LeavesTheBudgetCountedOnce) {
  const bool at_sync = GetParam();
  temp_dir dir;
  const std::string path = dir.file("s");
  options o = manual_compaction();
  o.max_bytes = std::uint64_t{8} << 20;
  auto s = test_support::open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string value(1024, 'v');
  int n = 0;
  for (;; ++n) {
    auto r = s->put(key_of(n), value);
    if (r) continue;
    ASSERT_EQ(r.error(), errc::budget_reached) << r.error().message();
    break;
  }
  ASSERT_GT(n, 1000);
  const pid_t taker = fork_child([&] {
    dies_taking_the_spare fs(at_sync, "deletes");
    options mine_o = o;
    mine_o.fs = &fs;
    auto mine = store::open(path, mine_o);
    if (!mine) return 2;
    for (int i = 0; i < n; ++i) {
      auto r = (*mine)->erase(key_of(i));
      if (!r) return 3;
    }
    return 4;  // never took the deletes' room
  });
  ASSERT_EQ(wait_exit(taker), 42);
  ASSERT_FALSE(std::filesystem::exists(path + "/seg/deletes"));
  for (int i = 0; i < n; ++i) {
    auto r = s->erase(key_of(i));
    ASSERT_TRUE(r || r.error() == errc::not_found) << i << ": " << r.error().message();
  }
  // These erases moved on to the segment left: the room's word says what seg/ holds.
  EXPECT_EQ(header_word(path, header::deletes_room), 0u) << "the room taken still counted";
  for (int pass = 0; pass < 50; ++pass) {
    auto c = s->compact();
    ASSERT_TRUE(c) << c.error().message();
    if (c->segments_removed == 0) break;
  }
  auto r = s->put("after", value);
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_EQ(*s->get("after"), value);
  ASSERT_TRUE(s->verify());
}

INSTANTIATE_TEST_SUITE_P(AtTheRenameOrAfterTheEntry, KvDeletesTakerKilled, ::testing::Bool());

// Refuses, for room, to rename anything over the manifest: its slots cannot grow.
class manifest_cannot_grow final : public io::filesystem_wrapper {
 public:
  manifest_cannot_grow() noexcept : io::filesystem_wrapper(io::os()) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    if (std::strcmp(to, "manifest") == 0) {
      return std::unexpected(error(std::make_error_code(std::errc::no_space_on_device)));
    }
    return io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
  }
};

// The manifest's slots grow a few segments early, while a put makes one (so that a full
// volume's erases and compaction list theirs in place); refused then, a put that makes a
// segment the slots still hold lists it in place, and goes on.
TEST(KvManifest, SlotsThatCannotGrowEarlyStillTakeWhatTheyHold) {
  temp_dir dir;
  const std::string path = dir.file("s");
  manifest_cannot_grow fs;
  options o = small();
  o.fs = &fs;
  auto s = test_support::open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string value(4096, 'v');
  int n = 0;
  // Up to what the first slots hold (167): a put may make two segments (its value's, then
  // its commit's), so it stops one short of that.
  while (test_support::segment_files(path) < 166) {
    auto r = s->put(key_of(n), value);
    ASSERT_TRUE(r) << n << ": " << r.error().message();
    ++n;
  }
  EXPECT_EQ(std::filesystem::file_size(path + "/manifest"), 8192u);
  s.reset();
  auto again = test_support::open_ok(path, small());
  ASSERT_TRUE(again);
  for (int i = 0; i < n; i += 7)
    ASSERT_EQ(*again->get(key_of(i)), value) << i;
  // Allowed to grow, it does at the next segment made.
  for (int i = n; test_support::segment_files(path) < 168; ++i)
    ASSERT_TRUE(again->put(key_of(i), value));
  EXPECT_GT(std::filesystem::file_size(path + "/manifest"), 8192u);
}

// Fails, with EIO, the first sync after a rename over the manifest: the sync of the directory
// that makes a grown manifest's name durable.
class manifest_directory_sync_fails final : public io::filesystem_wrapper {
 public:
  manifest_directory_sync_fails() noexcept : io::filesystem_wrapper(io::os()) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    auto r = io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
    if (r && std::strcmp(to, "manifest") == 0) renamed_ = true;
    return r;
  }
  result<void> sync(const io::file_handle& file, io::sync_kind kind) noexcept override {
    if (renamed_) {
      renamed_ = false;
      failed_ = true;
      return std::unexpected(error(std::make_error_code(std::errc::io_error)));
    }
    return io::filesystem_wrapper::sync(file, kind);
  }
  [[nodiscard]] bool failed() const noexcept { return failed_; }

 private:
  bool renamed_ = false;
  bool failed_ = false;
};

// A grown manifest renamed into place whose directory then failed to sync: the change is in
// place, so the segment it lists stays (undone, it left the manifest naming a segment that
// was gone: the next open said corrupt). The failed sync is reported, never retried: later
// commits fail with sync_failed naming the manifest, and the store opened again alone has
// every value it acknowledged.
TEST(KvManifest, AGrownManifestWhoseDirectoryFailedToSyncStaysAsItIs) {
  temp_dir dir;
  const std::string path = dir.file("s");
  manifest_directory_sync_fails fs;
  options o = manual_compaction();
  o.fs = &fs;
  auto s = test_support::open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string value(4096, 'v');
  int n = 0;
  result<void> r;
  while (n < 100000) {
    r = s->put(key_of(n), value);
    if (!r) break;
    ++n;
  }
  ASSERT_TRUE(fs.failed()) << "the manifest never grew";
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), errc::sync_failed) << r.error().message();
  EXPECT_NE(r.error().message().find("manifest"), std::string::npos) << r.error().message();
  s.reset();
  auto again = test_support::open_ok(path, small());
  ASSERT_TRUE(again);
  for (int i = 0; i < n; ++i)
    ASSERT_EQ(*again->get(key_of(i)), value) << i;
  verify_report report;
  ASSERT_TRUE(again->verify(&report));
  EXPECT_TRUE(report.damaged.empty());
}

// A checkpoint is a copy of the index that only speeds up an open after every user crashed:
// a put the volume has no room for, with nothing dead to compact, takes the checkpoint's room
// first. So a store with a checkpoint fills its volume as far as one without (but for the
// ledger's worst case of one put), and still opens (replaying its log) with every value it
// acknowledged.
// On tmpfs, and on btrfs, whose statfs shows the room an unlink frees only once its
// transaction commits.
class KvCheckpointRoom : public ::testing::TestWithParam<std::pair<const char*, std::size_t>> {};

TEST_P(KvCheckpointRoom, APutWithNoRoomLeftTakesTheCheckpointsRoom) {
  const auto [type, mib] = GetParam();
  int fitted[2] = {0, 0};
  for (const bool with_checkpoint : {true, false}) {
    const auto stored = count_on_small_volume(
        mib,
        [&](const std::string& path, int& count) {
          const std::string checkpoint = path + "/checkpoint";
          int n = 0;
          {
            auto s = store::open(path, small());
            if (!s) return 2;
            // Small values: the index, and so its copy, is a large part of what the store takes.
            const std::string value(8, 'v');
            for (; n < 40000; ++n) {
              if (!(*s)->put(key_of(n), value)) return 3;
            }
            if (with_checkpoint) {
              if (!(*s)->checkpoint()) return 4;
              if (!std::filesystem::exists(checkpoint)) return 5;
            }
            n = fill(**s, n, 8);
            if (n < 40000) return 6;
            if (std::filesystem::exists(checkpoint)) return 7;  // puts stopped beside it
          }
          auto s = store::open(path, small());
          if (!s) return 8;
          for (int i = 0; i < n; ++i) {
            auto v = (*s)->get(key_of(i));
            if (!v || v->size() != 8) return 9;
          }
          count = n;
          return 0;
        },
        type);
    if (!stored) return;
    fitted[with_checkpoint ? 0 : 1] = *stored;
  }
  // The ledger's worst case of one put; on btrfs also what its own allocations take, which
  // varies from run to run by a few dozen KiB (a lost checkpoint here is 10 %).
  const int slack = std::string_view(type) == "tmpfs" ? 16 : fitted[1] / 100;
  EXPECT_GE(fitted[0], fitted[1] - slack)
      << "with a checkpoint " << fitted[0] << ", without " << fitted[1];
}

INSTANTIATE_TEST_SUITE_P(Volumes, KvCheckpointRoom,
                         ::testing::Values(std::pair<const char*, std::size_t>{"tmpfs", 16},
                                           std::pair<const char*, std::size_t>{"btrfs", 128}),
                         [](const auto& p) { return std::string(p.param.first); });

// A filesystem that refuses allocations with no_space while it has the room, until it is
// synced (btrfs does when the space it reserves for dirty ranges of shared maps runs out):
// once armed and `allowed` more have been made, `refusals` allocations in seg/ are refused
// before a sync of the whole filesystem, or for good with `refusals` < 0; `sync_error`, if
// not 0, is what that sync fails with.
class refuses_until_synced final : public io::filesystem_wrapper {
 public:
  refuses_until_synced() noexcept : io::filesystem_wrapper(io::os()) {}
  result<void> allocate(const io::file_handle& file, off_t offset, off_t length,
                        bool keep_size) noexcept override {
    if (armed && !synced && refusals != 0 && file.path().find("/seg/") != std::string::npos) {
      if (allowed > 0) {
        --allowed;
        return io::filesystem_wrapper::allocate(file, offset, length, keep_size);
      }
      if (refusals > 0) --refusals;
      ++refused;
      return std::unexpected(std::make_error_code(std::errc::no_space_on_device));
    }
    return io::filesystem_wrapper::allocate(file, offset, length, keep_size);
  }
  result<void> sync(const io::file_handle& file, io::sync_kind kind) noexcept override {
    if (kind == io::sync_kind::filesystem) {
      ++filesystem_syncs;
      if (sync_error != 0)
        return std::unexpected(std::error_code(sync_error, std::generic_category()));
      if (refusals >= 0) synced = true;
    }
    return io::filesystem_wrapper::sync(file, kind);
  }
  bool armed = false;
  bool synced = false;
  int allowed = 0;
  int refusals = 1;
  int sync_error = 0;
  int refused = 0;
  int filesystem_syncs = 0;
};

// Puts 1 KiB values into a store on `fs` until one needs a new segment with `fs` armed: that
// put's result, the number of puts that succeeded, and whether a reopen reads them all back.
struct armed_put {
  result<void> last;
  int stored = 0;
  bool reads_back = false;
};
armed_put put_into_a_new_segment(const std::string& path, refuses_until_synced& fs) {
  armed_put out;
  options o = small();
  o.fs = &fs;
  auto s = store::open(path, o);
  if (!s) {
    out.last = std::unexpected(s.error());
    return out;
  }
  const std::string value(1024, 'v');
  for (int i = 0; i < 300; ++i) {  // well inside the first 1 MiB segment
    if (!(*s)->put(key_of(i), value)) return out;
    ++out.stored;
  }
  fs.armed = true;
  for (int i = out.stored;; ++i) {
    out.last = (*s)->put(key_of(i), value);
    if (!out.last || fs.refused != 0) break;
    ++out.stored;
    if (i > 5000) break;
  }
  if (out.last) ++out.stored;
  s->reset();
  auto again = store::open(path, small());
  if (!again) return out;
  out.reads_back = true;
  for (int i = 0; i < out.stored; ++i) {
    auto v = (*again)->get(key_of(i));
    if (!v || *v != value) out.reads_back = false;
  }
  auto past = (*again)->get(key_of(out.stored));
  if (past || past.error() != errc::not_found) out.reads_back = false;
  return out;
}

TEST(KvFullVolume, AnAllocationRefusedWithRoomOnTheVolumeIsTriedOnceMoreAfterASync) {
  temp_dir dir;
  refuses_until_synced fs;
  const armed_put p = put_into_a_new_segment(dir.file("s"), fs);
  ASSERT_TRUE(p.last) << p.last.error().message();
  EXPECT_EQ(fs.refused, 1);
  EXPECT_EQ(fs.filesystem_syncs, 1);
  EXPECT_TRUE(p.reads_back);
}

TEST(KvFullVolume, AnAllocationStillRefusedAfterTheSyncIsNoSpaceWithNothingVisible) {
  temp_dir dir;
  refuses_until_synced fs;
  fs.refusals = -1;
  const armed_put p = put_into_a_new_segment(dir.file("s"), fs);
  ASSERT_FALSE(p.last);
  EXPECT_EQ(p.last.error(), std::errc::no_space_on_device) << p.last.error().message();
  EXPECT_EQ(fs.filesystem_syncs, 1) << "one sync per refused allocation, not a loop";
  EXPECT_EQ(fs.refused, 2);
  EXPECT_TRUE(p.reads_back);
}

TEST(KvFullVolume, ASyncThatFailsIsReportedNotTakenForNoSpace) {
  temp_dir dir;
  refuses_until_synced fs;
  fs.sync_error = EIO;
  const armed_put p = put_into_a_new_segment(dir.file("s"), fs);
  ASSERT_FALSE(p.last);
  EXPECT_EQ(p.last.error(), std::errc::io_error) << p.last.error().message();
  EXPECT_EQ(fs.filesystem_syncs, 1);
  EXPECT_TRUE(p.reads_back);
}

// A compaction whose victims' copies need more segments than the volume then allocates
// (btrfs near full shows room its metadata takes first): the victims it emptied before the
// room ran out still go, the rest stay whole, and nothing is lost. Before, the pass failed
// with no_space, freeing nothing, after copying up to its room.
TEST(KvFullVolume, ACompactionThatRunsOutOfRoomStillRemovesTheVictimsItEmptied) {
  temp_dir dir;
  const std::string path = dir.file("s");
  refuses_until_synced fs;
  fs.refusals = -1;
  fs.allowed = 1;  // one new segment, then the spare, then no more
  options o = manual_compaction();
  o.fs = &fs;
  auto s = test_support::open_ok(path, o);
  ASSERT_TRUE(s);
  const std::string value(1024, 'v');
  constexpr int n = 9000;  // about ten segments
  for (int i = 0; i < n; ++i)
    ASSERT_TRUE(s->put(key_of(i), value)) << i;
  for (int i = 0; i < n; ++i) {
    if (i % 3 != 0) {
      ASSERT_TRUE(s->erase(key_of(i))) << i;
    }
  }
  const auto before = s->stats();
  ASSERT_TRUE(before);
  fs.armed = true;
  auto c = s->compact();
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_GE(c->segments_removed, 1u);
  EXPECT_GE(fs.refused, 1) << "the room ran out during the pass";
  const auto check = [&](store& st, const char* when) {
    for (int i = 0; i < n; ++i) {
      auto v = st.get(key_of(i));
      if (i % 3 == 0) {
        ASSERT_TRUE(v) << when << ": " << i << ": " << v.error().message();
        ASSERT_EQ(*v, value) << when << ": " << i;
      } else {
        ASSERT_FALSE(v) << when << ": " << i;
      }
    }
    auto st_stats = st.stats();
    ASSERT_TRUE(st_stats);
    EXPECT_EQ(st_stats->records, static_cast<std::uint64_t>((n + 2) / 3)) << when;
  };
  check(*s, "after the pass");
  auto verified = s->verify();
  ASSERT_TRUE(verified) << verified.error().message();
  // With room again, the rest goes.
  fs.armed = false;
  auto rest = s->compact();
  ASSERT_TRUE(rest) << rest.error().message();
  EXPECT_GE(rest->segments_removed, 1u);
  check(*s, "after a pass with room");
  s.reset();
  auto again = test_support::open_ok(path);
  ASSERT_TRUE(again);
  check(*again, "reopened");
}

// Tux3's "blurt" translated: many processes at once each put 40 values of 1 KiB, round after
// round, and later rounds rewrite what earlier ones wrote. The log written (30 MiB of values)
// is more than the volume holds, but what is live (6 MiB of values) stays far from filling
// it, beside the index, its checkpoint copy and the segments kept for deletes and compaction
// (on 24 MiB, about 1 run in 12 under ASan found those full: the store's overhead on a tiny
// volume, which spacebench measures): no put may fail (the store makes room from the dead
// versions itself), and every key reads back its last value.
TEST(KvFullVolume, BlurtRewritesFromManyProcessesNeverFailWhileFarFromFull) {
  on_small_volume(32, [](const std::string& path) {
    constexpr int tasks = 50;
    constexpr int steps = 40;
    constexpr int dirs = 3;
    constexpr int passes = 5;
    {
      auto s = store::open(path, small());
      if (!s) return 2;
    }
    const auto value = [](int pass, int dir, int task, int step) {
      std::string v(1024, 'x');
      const std::string tag = std::to_string(pass) + "/" + std::to_string(dir) + "/" +
                              std::to_string(task) + "/" + std::to_string(step);
      v.replace(0, tag.size(), tag);
      return v;
    };
    const auto key = [](int dir, int task, int step) {
      return "d" + std::to_string(dir) + "/f" + std::to_string(task) + "/" + std::to_string(step);
    };
    for (int pass = 0; pass < passes; ++pass) {
      for (int dir = 0; dir < dirs; ++dir) {
        std::vector<pid_t> children;
        for (int task = 0; task < tasks; ++task) {
          children.push_back(fork_child([&] {
            auto s = store::open(path, small());
            if (!s) return 1;
            for (int step = 0; step < steps; ++step) {
              auto r = (*s)->put(key(dir, task, step), value(pass, dir, task, step));
              if (!r) {
                std::fprintf(stderr, "pass %d dir %d task %d step %d: %s\n", pass, dir, task, step,
                             r.error().message().c_str());
                return 1;
              }
            }
            return 0;
          }));
        }
        int failed = 0;
        for (const pid_t c : children)
          failed += wait_exit(c) != 0 ? 1 : 0;
        if (failed != 0) return 3;
      }
    }
    auto s = store::open(path, small());
    if (!s) return 4;
    for (int dir = 0; dir < dirs; ++dir) {
      for (int task = 0; task < tasks; ++task) {
        for (int step = 0; step < steps; ++step) {
          auto v = (*s)->get(key(dir, task, step));
          if (!v || *v != value(passes - 1, dir, task, step)) return 5;
        }
      }
    }
    return 0;
  });
}

// The space ledger charges each put before anything of it is written and closes deltas as
// the volume fills; it must not stop puts early: the same fill fits the same number of values
// with it on and off, but for the last commit's worst case.
// Full is full for every key: once a put finds the volume full, puts of fresh keys find it
// full too. The index's pages come from the volume, not from the rest of the tail's segment:
// a put that made the last segment with the volume's last room left none for the pages its
// keys then split into, and the first key whose page was full failed (no_space) while the
// next ones, whose pages had room, went on (spacebench, about 1 run in 8 under load). Over a
// segment's width of volume sizes, so that one of them ends where the last segment just fits.
TEST(KvFullVolume, OnceAPutFindsTheVolumeFullFreshKeysFindItFullToo) {
  constexpr std::size_t step = 8 << 10;
  for (std::size_t bytes = std::size_t{12} << 20; bytes < (std::size_t{12} << 20) + (256 << 10);
       bytes += step) {
    test::temp_dir dir;
    const std::string mnt = dir.file("mnt");
    std::filesystem::create_directory(mnt);
    const pid_t child = test::fork_child([&] {
      if (!test::mount_private_tmpfs(mnt, bytes)) return test::cannot_set_up;
      auto s = store::open(mnt + "/s");
      if (!s) return 2;
      const int stored = fill(**s, 0);
      if (stored < 1000) return 3;
      const std::string value(1024, 'v');
      for (int i = 1; i <= 20; ++i) {
        auto r = (*s)->put(key_of(stored + i), value);
        if (r) {
          std::fprintf(stderr, "after %d puts, put %d of a fresh key went in\n", stored, i);
          return 4;
        }
        if (r.error() != std::errc::no_space_on_device) return 5;
      }
      return 0;
    });
    const int code = test::wait_exit(child);
    if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
    EXPECT_EQ(code, 0) << "a volume of " << bytes << " bytes";
  }
}

TEST(KvLedger, AStoreFillsAsFarWithTheLedgerAsWithout) {
  int fitted[2] = {0, 0};
  for (const bool on : {true, false}) {
    const auto n = count_on_small_volume(12, [&](const std::string& path, int& count) {
      options o = small();
      o.ledger = on;
      auto s = store::open(path, o);
      if (!s) return 2;
      count = fill(**s, 0);
      if (count < 1000) return 3;
      return 0;
    });
    if (!n) return;
    fitted[on ? 0 : 1] = *n;
  }
  // The last put's worst case (its block twice and two pages) and the directory's next
  // doubling (about 14 KiB here) can be refused where the value itself (1.1 KiB) would still
  // fit.
  EXPECT_GE(fitted[0], fitted[1] - 16)
      << "with the ledger " << fitted[0] << ", without " << fitted[1];
}

// A writer killed while its charge is in a delta leaves its pin set: the back end, which
// must wait until nobody is inside the delta before it reuses its words (and, near full,
// before it corrects the next one's budget), finds the user dead and clears the pin. Without
// that, a store nearly full would stall every put on it until timed_out.
TEST(KvLedger, AWriterKilledWhileChargedDoesNotHoldTheNextDeltaBack) {
  on_small_volume(12, [](const std::string& path) {
    options o = small();
    o.lock_timeout = std::chrono::milliseconds(3000);
    auto s = store::open(path, o);
    if (!s) return 2;
    if (!(*s)->put("before", "1")) return 3;
    const pid_t victim = fork_child([&] {
      auto mine = store::open(path, o);
      if (!mine) return 2;
      commit_hook = [](commit_step at) noexcept {
        if (at == commit_step::locked) ::raise(SIGKILL);  // charged, pinned, nothing written
      };
      (void)(*mine)->put("victim", "1");
      return 3;  // not killed
    });
    if (wait_exit(victim) != 128 + SIGKILL) return 4;
    // Filling needs deltas closed past the victim's (and, near full, that one quiet).
    const int n = fill(**s, 0);
    if (n < 1000) return 5;
    auto again = (*s)->put("more", std::string(1024, 'm'));
    if (again || again.error() != std::errc::no_space_on_device) return 6;
    return 0;
  });
}

// A writer killed while it closes a delta leaves its mark in the closer's word: the others,
// waiting for the delta to be closed, find it dead and one of them closes it instead.
// (Taken over at once, not after the lock timeout: a timeout far longer than any load makes
// a put take, and the put must end well within it. With 3 s and a bound of 2 s, a put on a
// machine running two test suites at once took 2.7 s.)
TEST(KvLedger, AWriterKilledWhileClosingADeltaIsTakenOverFrom) {
  temp_dir dir;
  options o = small();
  o.lock_timeout = std::chrono::seconds(120);
  auto s = test_support::open_ok(dir.file("s"), o);
  ASSERT_TRUE(s);
  // The store is new: its first charge finds no delta open, and its writer closes delta 0.
  const pid_t victim = fork_child([&] {
    auto mine = store::open(dir.file("s"), o);
    if (!mine) return 2;
    ledger_close_hook = [] noexcept { ::raise(SIGKILL); };
    (void)(*mine)->put("victim", "1");
    return 3;  // not killed
  });
  ASSERT_EQ(wait_exit(victim), 128 + SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  auto r = s->put("after", "1");
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, o.lock_timeout / 2);
  EXPECT_EQ(*s->get("after"), "1");
}

INSTANTIATE_TEST_SUITE_P(AtTheRenameOrAfterTheEntry, KvSpareTakerKilled, ::testing::Bool());

// Far from full, a delta is given a quarter of the room, so the next one opens with room of
// its own: the writer that closes a delta, and those waiting for it, go on at once, without
// waiting for every commit still charging the closed delta to end. (They used to wait: with
// a thousand writers slowed by btrfs's page-fault reservations, past their 30 s timeout.)
namespace stalled_writer {
int ready_fd = -1;
int go_fd = -1;
int closes = 0;
}  // namespace stalled_writer

TEST(KvLedger, ADeltaClosesWithoutWaitingForTheCommitsStillInIt) {
  temp_dir dir;
  options o = small();
  o.max_bytes = std::uint64_t{32} << 20;  // the room the ledger shares out: about 28 MiB
  o.lock_timeout = std::chrono::milliseconds(2000);
  auto s = test_support::open_ok(dir.file("s"), o);
  ASSERT_TRUE(s);
  int ready[2];
  int go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  // A writer charged and pinned in the first delta, that does not go on until told.
  const pid_t slow = fork_child([&] {
    auto mine = store::open(dir.file("s"), o);
    if (!mine) return 2;
    stalled_writer::ready_fd = ready[1];
    stalled_writer::go_fd = go[0];
    commit_hook = [](commit_step at) noexcept {
      if (at != commit_step::charged) return;
      char c = 0;
      (void)!::write(stalled_writer::ready_fd, &c, 1);
      (void)!::read(stalled_writer::go_fd, &c, 1);
    };
    auto r = (*mine)->put("slow", "1");
    return r ? 0 : 3;
  });
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  // Puts until this process has closed the slow writer's delta, and a few more.
  ledger_close_hook = [] noexcept { ++stalled_writer::closes; };
  int after = 0;
  for (int i = 0; i < 100000 && after < 20; ++i) {
    auto r = s->put(key_of(i), std::string(1024, 'v'));
    if (!r) {
      ledger_close_hook = nullptr;
      (void)!::write(go[1], &c, 1);
      (void)wait_exit(slow);
      FAIL() << "put " << i << " after " << stalled_writer::closes
             << " closes: " << r.error().message();
    }
    if (stalled_writer::closes >= 1) ++after;
  }
  ledger_close_hook = nullptr;
  EXPECT_GE(stalled_writer::closes, 1) << "no delta was closed: the test proves nothing";
  ASSERT_EQ(::write(go[1], &c, 1), 1);
  EXPECT_EQ(wait_exit(slow), 0);
  EXPECT_EQ(*s->get("slow"), "1");
  for (const int fd : {ready[0], ready[1], go[0], go[1]})
    ::close(fd);
}

// btrfs reserves room for every write fault on a shared map and raises SIGBUS when it cannot
// at once: the seed's blurt (1000 processes of 40 puts) on a small btrfs killed hundreds of
// writers so, with the volume 40 % used. With keel's maps guarded no process dies of a
// signal; one that fails says no_space (btrfs refuses plain write(2)s there too), and every
// put that returned reads back.
TEST(KvFullVolume, ManyProcessesOnASmallBtrfsDieOfNoSignal) {
  if (const std::string why = why_no_btrfs(); !why.empty()) GTEST_SKIP() << why;
  constexpr int tasks = 1000;
  constexpr int puts = 40;
  constexpr int other_error = 200;  // exit code of a task that failed with something else
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_loop("btrfs", dir.file("btrfs.img"), mnt, std::size_t{128} << 20)
             .empty()) {
      return test::cannot_set_up;
    }
    const std::string path = mnt + "/s";
    options o;
    o.segment_size = std::size_t{1} << 20;
    // A thousand processes on two busy cores may queue past the default lock timeout: what
    // is tested here is how they fail for room, not how long they wait.
    o.lock_timeout = std::chrono::minutes(10);
    {
      auto made = store::open(path, o);
      if (!made) return 2;
      if (!io::map_guard::installed()) return test::cannot_set_up + 1;
    }
    const std::string value(1024, 'b');
    std::vector<pid_t> pids;
    for (int t = 0; t < tasks; ++t) {
      const pid_t pid = fork_child([&] {
        auto s = store::open(path, o);
        if (!s && s.error() != std::errc::no_space_on_device) {
          std::fprintf(stderr, "task %d: open: %s\n", t, s.error().message().c_str());
        }
        if (!s) return s.error() == std::errc::no_space_on_device ? 0 : other_error;
        for (int i = 0; i < puts; ++i) {
          auto r = (*s)->put(std::to_string(t) + "/" + std::to_string(i), value);
          if (!r && r.error() != std::errc::no_space_on_device) {
            std::fprintf(stderr, "task %d: put %d: %s\n", t, i, r.error().message().c_str());
          }
          if (!r) return r.error() == std::errc::no_space_on_device ? i : other_error;
        }
        return puts;
      });
      pids.push_back(pid);
    }
    int signalled = 0;
    int others = 0;
    std::vector<int> done(tasks, 0);
    for (int t = 0; t < tasks; ++t) {
      const int status = test::wait_status(pids[static_cast<std::size_t>(t)]);
      if (WIFSIGNALED(status)) {
        ++signalled;
      } else if (WEXITSTATUS(status) == other_error) {
        ++others;
      } else {
        done[static_cast<std::size_t>(t)] = WEXITSTATUS(status);
      }
    }
    std::fprintf(stderr, "tasks killed by a signal: %d, failed with another error: %d\n", signalled,
                 others);
    if (signalled != 0) return 3;
    if (others != 0) return 4;
    auto s = store::open(path, o);
    if (!s) return 5;
    for (int t = 0; t < tasks; ++t) {
      for (int i = 0; i < done[static_cast<std::size_t>(t)]; ++i) {
        auto v = (*s)->get(std::to_string(t) + "/" + std::to_string(i));
        if (!v || *v != value) return 6;
      }
    }
    return (*s)->verify() ? 0 : 7;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a btrfs loop volume here";
  if (code == test::cannot_set_up + 1) {
    GTEST_SKIP() << "SIGBUS already had a handler (a sanitizer's), so keel's guard stays out";
  }
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

// btrfs copies a changed block to new room, which fallocate did not reserve: a store written
// through maps would meet a full volume in a page fault (SIGBUS). The store turns
// copy-on-write off for its files, and a btrfs volume fills to no_space with no signal; then
// deletes, compaction and puts work as on any other volume.
TEST(KvFullVolume, BtrfsFillsToNoSpaceWithoutASignal) {
  if (const std::string why = why_no_btrfs(); !why.empty()) GTEST_SKIP() << why;
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_loop("btrfs", dir.file("btrfs.img"), mnt, std::size_t{128} << 20)
             .empty()) {
      return test::cannot_set_up;
    }
    const std::string path = mnt + "/s";
    auto s = store::open(path, small());
    if (!s) return 2;
    for (const std::string& f : {path + "/index", path + "/seg"}) {
      const int fd = ::open(f.c_str(), O_RDONLY);
      int flags = 0;
      if (fd < 0 || ::ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0) return 3;
      ::close(fd);
      if ((flags & FS_NOCOW_FL) == 0) return 4;
    }
    const int n = fill(**s, 0);
    if (n < 1000) return 5;
    for (int i = 0; i < n; i += 2) {
      if (!(*s)->erase(key_of(i))) return 6;
    }
    auto c = (*s)->compact();
    // (Or one in the background, short of room, before it: some compaction removed some.)
    auto st = (*s)->stats();
    if (!c || !st || st->compactions == 0) return 7;
    for (int i = 1; i < n; i += 2) {
      if (!(*s)->get(key_of(i))) return 8;
    }
    // The room compaction freed shows (btrfs frees an unlinked file's blocks when its
    // transaction commits): later passes and puts use it.
    for (int pass = 0; pass < 100 && c && c->segments_removed != 0; ++pass)
      c = (*s)->compact();
    if (!c && c.error() != std::errc::no_space_on_device) return 9;  // a pass with no room
    if (fill(**s, n) < n + n / 4) return 10;
    return 0;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a btrfs loop volume here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks (a signal: the store faulted)";
}

}  // namespace
}  // namespace keel::kv
