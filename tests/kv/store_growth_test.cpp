// Small when small: a store made with the segment size left to it starts with small log
// segments and small rooms, which grow with the log up to the size chosen for the volume
// (doc/kv-format.md, "Segments"). What it holds survives every size it passed through: a
// reopen, a rebuild of the index, compaction of segments of mixed sizes, a full volume.

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "keel/kv/store.hpp"
#include "kv/format.hpp"
#include "kv/index_file.hpp"
#include "kv/kv_support.hpp"
#include "kv/small_volume.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace keel::kv {
namespace {

using namespace test_support;

constexpr std::uint64_t kib = 1024;
constexpr std::uint64_t mib = kib * kib;

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
    auto params = disk::parse_store_file(std::as_bytes(std::span(file.data(), file.size())));
    if (!params || params->segment_size != disk::default_segment_size) return 3;
    if (params->first_segment_size != disk::min_first_segment_size) return 4;
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

// Issue 42 asks for stores that fill volumes up to 1 TiB. The segment table holds 8064
// segments, and a store made on a volume of 1 TiB or more chose 64 MiB segments: 504 GiB,
// and then every put that needed a segment failed with file_too_large. The segment size
// chosen now lets half the table hold the volume (tmpfs may be mounted larger than memory:
// nothing is written beyond a small store).
TEST(KvGrowth, TheSegmentsChosenForAVolumeOfTerabytesLetHalfTheSegmentTableHoldIt) {
  for (const std::uint64_t tib : {1, 2, 3}) {
    SCOPED_TRACE(tib);
    on_small_volume(tib << 20, [tib](const std::string& path) {
      {
        auto s = store::open(path);
        if (!s || !(*s)->put("k", "v")) return 1;
      }
      const std::string file = test::slurp(path + "/keel-kv");
      auto params = disk::parse_store_file(std::as_bytes(std::span(file.data(), file.size())));
      if (!params) return 2;
      std::fprintf(stderr, "%llu TiB: segments up to %llu MiB\n",
                   static_cast<unsigned long long>(tib),
                   static_cast<unsigned long long>(params->segment_size >> 20));
      if (params->segment_size * (segtab_entries / 2) < (tib << 40)) return 3;
      // No larger than that needs: the spare grows as large, and a sixteenth of the log too.
      if (params->segment_size / 2 * (segtab_entries / 2) >= (tib << 40)) return 4;
      if (allocated_under(path) > 2 * mib) return 5;
      // A small budget on such a volume still opens, and its segments stay within it (past
      // the first size they grow to a 256th of the budget): a budget is judged by the
      // segments it will get.
      options o;
      o.max_bytes = 16 * mib;
      auto budgeted = store::open(path + "/budgeted", o);
      if (!budgeted) {
        std::fprintf(stderr, "a 16 MiB budget: %s\n", budgeted.error().message().c_str());
        return 6;
      }
      for (int i = 0; i < 2000; ++i) {
        if (!(*budgeted)->put(key_of(i), std::string(1000, 'v'))) return 7;
      }
      for (const auto& [number, size] : segment_sizes(path + "/budgeted")) {
        if (size > disk::min_first_segment_size) return 8;
      }
      return 0;
    });
  }
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
      if (!power_of_two(size) || size < disk::min_first_segment_size || size < last) return 4;
      last = size;
    }
    if (sizes.begin()->second != disk::min_first_segment_size || last < 2 * mib) return 5;
    // The spare grew with them, never smaller than the largest; the deletes' room did not.
    if (size_of(path + "/seg/spare") < last ||
        size_of(path + "/seg/deletes") != disk::min_first_segment_size) {
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
    // Values alone, 1 KiB each (their record headers and index entries take 13 % more): 81 %
    // when smaller segments fill what is left near full, 78.9 % before; fixed 1 MiB
    // segments took 78.7 %.
    if (n < 80 * 32 * 1024 / 100) return 7;
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

// Issue 42: a store fills >= 99 % of its volume. On a 64 MiB tmpfs it filled 95.8 % (values,
// record headers and 32 bytes of index per key counted), the spare grown to 1 MiB (a
// sixteenth of the log) and 66 index pages allocated ahead while the volume had room. The
// segments, and so the spare, now stay at a 256th of the volume, and the index grows ahead
// by at most a 256th of the free room near full: 96.8 %.
TEST(KvGrowth, OnASmallVolumeTheSpareAndTheIndexHoldBackLittle) {
  on_small_volume(64, [](const std::string& path) {
    auto s = store::open(path);
    if (!s) return 1;
    const int n = fill(**s, 0);
    if (n <= 0) return 2;
    std::uint64_t records = 0;
    for (int i = 0; i < n; ++i) {
      records += (48 + 48 + key_of(i).size() + 1024 + 7) / 8 * 8 + 32;
    }
    const double fill_pct = 100.0 * static_cast<double>(records) / (64.0 * mib);
    std::fprintf(stderr, "64 MiB tmpfs: %d keys, %.1f %% with headers and index entries\n", n,
                 fill_pct);
    for (const auto& [number, size] : segment_sizes(path)) {
      if (size > 64 * mib / 256) return 3;
    }
    if (size_of(path + "/seg/spare") > 64 * mib / 256) return 4;
    return fill_pct >= 96.5 ? 0 : 5;
  });
}

// Review of the first growing store: its deletes' room (256 KiB) was smaller than a block a
// commit that only erases may write (up to a segment, 1 MiB here), and on a full volume
// such a commit took the room, did not fit, and failed with no_space. One that cannot fit the
// room must be refused with too_large before it takes anything, saying the bound; what fits
// still works, and so does every delete after.
TEST(KvGrowth, AnEraseOnlyCommitLargerThanTheDeletesRoomOnAFullVolumeIsTooLargeAndTakesNothing) {
  on_small_volume(16, [](const std::string& path) {
    options o;
    o.compact_dead_fraction = 0;  // nothing compacts behind the test's back
    auto s = store::open(path, o);
    if (!s) return 1;
    const int n = fill(**s, 0, 128);
    if (n < 20'000) return 2;
    // About 700 KiB of erase records: more than the deletes' room of a 16 MiB store.
    auto t = (*s)->begin();
    if (!t) return 3;
    for (int i = 0; i < 10'000; ++i) {
      if (!t->erase(key_of(i))) return 4;
    }
    auto big = t->commit();
    if (big) {
      std::fprintf(stderr, "the large erase-only commit went through\n");
    } else {
      std::fprintf(stderr, "the large erase-only commit: %s\n", big.error().message().c_str());
      if (big.error() != errc::too_large) return 5;
      // It took nothing: the keys are there.
      auto v = (*s)->get(key_of(0));
      if (!v) return 6;
    }
    // Every delete still works, one at a time.
    for (int i = 0; i < n; ++i) {
      if (auto r = (*s)->erase(key_of(i));
          !r && r.error() != std::errc::no_such_file_or_directory) {
        std::fprintf(stderr, "erase %d of %d: %s\n", i, n, r.error().message().c_str());
        return 7;
      }
    }
    return (*s)->verify() ? 0 : 8;
  });
}

// Review of the first growing store: compaction kept a 256 KiB victim as the spare while
// larger segments held live records, and then could take none of them (their copies did not
// fit the spare): 2.6 MB stayed dead and puts failed. Erasing every other key of a full store
// and compacting must give about half the volume back to puts.
TEST(KvGrowth, AFullGrowingStoreGivesBackHalfWhenHalfIsErased) {
  on_small_volume(16, [](const std::string& path) {
    options o;
    o.compact_dead_fraction = 0;
    auto s = store::open(path, o);
    if (!s) return 1;
    const int n = fill(**s, 0);
    if (n <= 0) return 2;
    // The first quarter (the log's first, smallest segments) all, the rest every other key.
    for (int i = 0; i < n; ++i) {
      if ((i < n / 4 || i % 2 == 0) && !(*s)->erase(key_of(i))) return 3;
    }
    for (int pass = 0; pass < 64; ++pass) {
      auto c = (*s)->compact();
      if (!c) {
        std::fprintf(stderr, "compaction pass %d: %s\n", pass, c.error().message().c_str());
        return 4;
      }
      // The spare holds any log segment's copies: it is never smaller than the largest.
      std::uint64_t largest = 0;
      for (const auto& [number, size] : segment_sizes(path)) {
        if (size <= mib) largest = std::max(largest, size);
      }
      const std::uint64_t spare = size_of(path + "/seg/spare");
      if (spare != 0 && spare < largest) {
        std::fprintf(stderr, "after pass %d: a spare of %llu bytes beside a segment of %llu\n",
                     pass, static_cast<unsigned long long>(spare),
                     static_cast<unsigned long long>(largest));
        return 9;
      }
      if (c->segments_removed == 0) break;
    }
    auto st = (*s)->stats();
    if (!st) return 5;
    const int again = fill(**s, n);
    std::fprintf(stderr,
                 "%d keys filled the volume; %d erased; %llu dead bytes after compaction; "
                 "%d put again\n",
                 n, n / 4 + (n - n / 4) / 2, static_cast<unsigned long long>(st->dead_bytes),
                 again - n);
    if (again < 0 || again - n < n / 2) return 6;
    for (int i = n / 4; i < n; ++i) {
      if (i % 2 == 0) continue;
      auto v = (*s)->get(key_of(i));
      if (!v || v->size() != 1024) return 7;
    }
    return (*s)->verify() ? 0 : 8;
  });
}

// Whether seg/spare is at least as large as every log segment (those of a power of two up to
// 1 MiB: a blob's segment of its own never is one), saying both sizes when it is not.
bool spare_as_large_as_every_log_segment(const std::string& path) {
  std::uint64_t largest = 0;
  for (const auto& [number, size] : segment_sizes(path)) {
    if (size <= mib && (size & (size - 1)) == 0) largest = std::max(largest, size);
  }
  const std::uint64_t spare = size_of(path + "/seg/spare");
  if (spare >= largest) return true;
  std::fprintf(stderr, "a spare of %llu bytes beside a segment of %llu\n",
               static_cast<unsigned long long>(spare), static_cast<unsigned long long>(largest));
  return false;
}

// Review of the growing store, again: a value just under 1 MiB made a 1 MiB segment and so a
// 1 MiB spare (it now gets a segment of its own: see
// `KvGrowth.ABlobLargerThanTheSegmentsMadeNowGetsASegmentOfItsOwn`); 1 KiB values then filled
// a 6 MiB tmpfs in 256 KiB segments. A compaction of a
// few erases took the spare for the copies of one 256 KiB victim, could keep none of its
// victims as a spare that large, and the volume had no room to make one: every erase after
// failed with no_space, for good (a reopen too). A pass that may take the spare frees at least
// as much, or keeps its largest victim as the spare, smaller until the room is back (a pass
// that never took the spare left erases failing where no segment died whole:
// KvSharedVolumeGrowing.DeletesWorkBesideALiveBlobWhileAForeignWriterKeepsTheVolumeFull).
TEST(KvGrowth, ACompactionThatTakesTheSpareLeavesOneAsLargeOnAFullVolume) {
  for (const int erased : {1, 10, 40, 100, 200}) {
    SCOPED_TRACE(erased);
    on_small_volume(6, [erased](const std::string& path) {
      options o;
      o.compact_dead_fraction = 0;
      auto s = store::open(path, o);
      if (!s) return 1;
      if (!(*s)->put("big", std::string(1000 * kib, 'b'))) return 2;
      const int n = fill(**s, 0);
      if (n < erased * 2) return 3;
      for (int i = 0; i < erased; ++i) {
        if (!(*s)->erase(key_of(i))) return 4;
      }
      if (auto c = (*s)->compact(); !c) {
        std::fprintf(stderr, "compact: %s\n", c.error().message().c_str());
        return 5;
      }
      // Every other key can be erased.
      for (int i = erased; i < n; ++i) {
        if (auto r = (*s)->erase(key_of(i)); !r) {
          std::fprintf(stderr, "%d erased, then erase %d of %d: %s\n", erased, i, n,
                       r.error().message().c_str());
          return 7;
        }
      }
      auto big = (*s)->get("big");
      if (!big || big->size() != 1000 * kib) return 8;
      if (!(*s)->verify()) return 9;
      // The room back, a spare at least as large as every log segment (one kept smaller
      // while the volume was full grows again).
      if (!(*s)->compact()) return 5;
      return spare_as_large_as_every_log_segment(path) ? 0 : 6;
    });
  }
}

// Review of the spare's fix: a pass counted a victim kept as the next segment (256 KiB) as
// one of the size segments were made at (512 KiB), so its copies were planned to keep off the
// spare; they took it, the pass freed 512 KiB, and no 1 MiB spare could be made again: every
// erase failed for good. (A spare kept smaller on the full volume is allowed now; it must grow
// back once the room is.) The workload below is the reviewer's, from the generator state it
// had when it broke (one key after another, a third of them up to 300 KiB, on a 16 MiB
// tmpfs); nothing is erased or overwritten before the volume is full.
constexpr const char* spare_lost_state =
    "13764739613165463443 151500591041695829 15777600519135581631 1913963627890522741 "
    "18119517334442436192 18282805469974542364 12255765838852980470 3418296058450337580 "
    "7290232776737437822 4854729509089797635 9370831006809251354 8719753475942663681 "
    "10899214245438214334 6456171496820906202 3889865884484356316 11581195327105369061 "
    "6140160128945756013 1333005045849234459 10371358675807715190 14299487703743582579 "
    "3437261208847675074 16483491549256625068 7592500472804363316 6890756047245230633 "
    "7745019616755954683 16420813949742931097 428004626546307733 11812081799096550898 "
    "11779374060051438556 15357396120065701820 10785362999585729630 9360168049984936826 "
    "9777864916274387671 16604291214375163152 5002533050374292603 13526461313607341378 "
    "4402349314053508207 15381640355115947865 14445548494704347455 5009315892176757652 "
    "11041007882088874568 8633879638182790848 9864700817108960684 9462757905169280115 "
    "8589580752708113441 18413025062099858954 9665738262323472317 14323015984332322662 "
    "15222122693440059617 3828473683883840795 13083305719642249556 15189345728347916956 "
    "18320037766160841187 997919709282293819 9701621554297265355 4980950813987410113 "
    "9680088154522695326 12374972897273095202 4571220494634434823 4606371681315341628 "
    "2365814552156047923 10231927911906198839 13583325271069176976 5558043931214640043 "
    "2357664116719867702 1650886167448577453 4718376790719308777 9692922493613592228 "
    "6999093228934774737 9542169429054394507 2155647994314063022 8454716097227346015 "
    "12760987466291432347 11149238236521129943 16670103849667769233 16075680107671046843 "
    "14404147344583785961 8724172523633645852 3183070618561814818 4859252342513043763 "
    "8027684934668806310 8465097012347215246 12964625070716311712 2098795173958559263 "
    "8028397993937074858 5367560251527375538 6123887571933792683 10677029702658108755 "
    "1543460200846384012 17775697294707421065 16147504589501632791 2939568614891343310 "
    "15284584364516705802 10302841468328421331 12819920888311867047 1984792253630904433 "
    "7381189166209043242 13917853898947370465 15342159381332466551 4781517466497523730 "
    "2607637670054857433 17837598848897923332 10441245370146573437 972571146492368918 "
    "3187948676808754793 15642435248884478790 2121277595833612130 9931596095523063716 "
    "4127815624590699966 12616417756468267326 10734760302295247010 5692715293676422839 "
    "14880047296833200250 2693889894039322104 9117612292178823960 1246096820007407724 "
    "8591820308345915333 16395146262270043651 4137697336066653391 17834611816451101764 "
    "13833567671254895697 3143886616017391242 7245658645852367776 17953657214696433394 "
    "10589918766544601922 9076986201371336970 11887811918571796367 2766956238766467958 "
    "16220314711692015788 8271041674814935717 8642583823007512759 14790436195961510418 "
    "12023729832645718404 15927098274691796426 2729403560471055500 1800712242238613065 "
    "6778038847761081480 11186007184805078570 18419906787412179604 11921818176372580514 "
    "8963516926719598891 2496916385168480837 4436726043038747917 9621867913766091141 "
    "128519968927933571 8555569934530249296 17184493307174781897 15173929185040256066 "
    "10616457725153804366 14009033812650328202 1743570614032550101 14733943081616562561 "
    "15571523810699244529 12899894425421138322 14649557073233890546 5313117400748126386 "
    "12899412248006227798 319466192817414525 10727072194365620214 15362230942254133625 "
    "1591051891215014879 5731591493935981400 15765624716644579611 12852780498832802884 "
    "16854307757009306620 3722561807316152855 14904959803411072314 3138005247590606830 "
    "13609152548893856311 16270300734560108385 16249617934958645229 9557227185063439310 "
    "6811211699143811550 9364501520571504126 11128267112580309136 12453402730045133968 "
    "6995680917667582485 1977911969480497873 10372294946030601041 1996824436393386613 "
    "16440084819465370831 2476115039412522481 1225345765859079237 2656805795621071144 "
    "11380084683387125456 3498857968915149972 12874627849494694791 14260665708210623724 "
    "3832399837577214286 15095975521681497382 12865591946560853049 5765310600708765430 "
    "5130155489685574592 5659998439907939350 4406768187403242962 3483746121664292852 "
    "7821912158277917125 13771949470254809609 3067671642364889621 14679097522003228108 "
    "14422910390532592482 4050411868824667940 3250963180143031857 1330373695539657754 "
    "102638549997407605 4175219690018646391 4537073334017082611 5496072275421101092 "
    "17730941706923684909 2587915692261416643 18043510127288993856 1742163479234434655 "
    "16951185375871074797 2977214486424875316 1990930625734982463 10623113709417772995 "
    "12904916297662537952 14090328728787296130 16538625338334998890 4011278202154561491 "
    "12708778892061210515 1044606756389893119 12589469944274243862 7276540408061781085 "
    "18002142927213387856 2419213687036949533 10227870314870357969 9568366537785934570 "
    "1901009680934354329 12176348069561204149 14468785966624673701 15197647541514405623 "
    "10521300359186711181 16723906748422766273 3086499031026122554 12105742294170862642 "
    "1805444910197208971 2960532528260851958 9960176717736430306 14202493035311211459 "
    "706039193062370089 3492311711931905478 11153535361530618504 4350483160028930474 "
    "5748090206736778631 11133560942763715038 4860132112636828355 12634351157459864956 "
    "9033401384554188123 11641791359137540418 767092884517405898 15394076235556663197 "
    "5023174878200447987 1337255185668563507 13020171296608924069 14473844984082083204 "
    "11877602233411271075 5724837956445982149 14792734350504272909 14272927176707134690 "
    "18415480992963702246 14451505735778869531 678152147257711416 17813217753337624292 "
    "10162632642415438532 13418132401361307470 10212190095505582443 15017995234841795209 "
    "13096515866506261311 2792358274728468968 2309810095866115435 11732933943751200379 "
    "12231425315447939260 16024259233335826458 6219328708829453351 16146992992728764992 "
    "7251376316569841747 12330994969263527818 9755773246593254424 7534084979083323231 "
    "7766261863958611771 16360034500908533228 8906174596445643417 18437543401616116015 "
    "16915235847322367769 13165021211670686604 11946879311341829091 1905986119611483430 "
    "6362936149618209935 13492172754659732402 17732180279029515641 10877495384832301885 "
    "13163484324027759735 11091256738078719164 17070620890177572212 3919798591417920708 "
    "8800679819418382057 7839333635910567773 7403369313372264896 7963696471109403260 "
    "5181777037738028594 8886957966916324795 160100777950841390 6746268216584573001 "
    "16162925688156927946 10776413722154637889 791495487872858011 17503330683935085112 "
    "5848411116309327004 9662551775074083820 10851775316372564980 17174386316777044626 4 ";

std::string reviewer_key(unsigned long long i) {
  char k[32];
  std::snprintf(k, sizeof k, "key%012llu", i);
  return k;
}

std::string reviewer_value(unsigned long long i, std::size_t n) {
  std::string v(n, static_cast<char>('a' + i % 26));
  const std::string s = std::to_string(i);
  v.replace(0, std::min(v.size(), s.size()), s.substr(0, std::min(v.size(), s.size())));
  return v;
}

TEST(KvGrowth, APassWhoseRoomWasCountedHighNeverTakesTheSpareItCannotMakeAgain) {
  on_small_volume(16, [](const std::string& path) {
    std::mt19937_64 rng;
    std::istringstream(spare_lost_state) >> rng;
    options o;
    o.compact_dead_fraction = 0;
    auto s = store::open(path, o);
    if (!s) return 1;
    if (!(*s)->put("big", std::string(1000 * kib, 'b'))) return 2;
    std::vector<std::size_t> sizes;
    for (unsigned long long n = 0;; ++n) {
      const std::size_t z = rng() % 3 == 0 ? static_cast<std::size_t>(rng() % (300 * kib))
                                           : 100 + static_cast<std::size_t>(rng() % 4000);
      auto r = (*s)->put(reviewer_key(n), reviewer_value(n, z));
      if (!r) {
        if (r.error() != std::errc::no_space_on_device) return 3;
        break;
      }
      sizes.push_back(z);
    }
    std::fprintf(stderr, "%zu keys\n", sizes.size());
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      auto v = (*s)->get(reviewer_key(i));
      if (!v || *v != reviewer_value(i, sizes[i])) return 5;
      if (auto e = (*s)->erase(reviewer_key(i)); !e) {
        std::fprintf(stderr, "erase %zu of %zu: %s\n", i, sizes.size(),
                     e.error().message().c_str());
        return 6;
      }
    }
    if (!(*s)->verify()) return 7;
    if (!(*s)->compact()) return 8;
    return spare_as_large_as_every_log_segment(path) ? 0 : 4;
  });
}

// A blob larger than the segments made now gets a segment of its own, header and blob long (a
// page longer where that would be a log segment's size: the log's tail is never placed in it),
// so that no log segment, and so no spare, grows past them for it. A 700 KB blob in a 1 MiB log
// segment beside 256 KiB ones made the spare 1 MiB, and segments made of the spare after were
// as large; once another program on the volume took the room a pass gave back, the spare shrank
// to a 256 KiB victim, no pass could copy the 1 MiB segments, and 7 610 of 10 660 erases failed
// (`KvSharedVolumeGrowing.DeletesWorkBesideALiveBlobWhileAForeignWriterKeepsTheVolumeFull`).
// Both read back after a reopen, a rebuild of the index and a compaction; the log goes on
// beside them; and an overwritten one's segment goes.
TEST(KvGrowth, ABlobLargerThanTheSegmentsMadeNowGetsASegmentOfItsOwn) {
  on_small_volume(64, [](const std::string& path) {
    // The value length whose segment would be 1 MiB exactly.
    std::size_t exact = 0;
    for (std::size_t v = mib - disk::segment_header_size; v > 512 * kib && exact == 0; --v) {
      if (disk::segment_header_size + disk::blob_block_size(v) == mib) exact = v;
    }
    if (exact == 0) return 1;
    const std::string a(700'000, 'a');
    const std::string b(exact, 'b');
    const auto own_segments = [&] {
      int n = 0;
      for (const auto& [number, size] : segment_sizes(path)) {
        if ((size & (size - 1)) != 0 && size > 700'000) ++n;
      }
      return n;
    };
    {
      auto s = store::open(path);
      if (!s || !(*s)->put("a", a) || !(*s)->put("b", b)) return 2;
    }
    if (own_segments() != 2) return 3;
    if (size_of(path + "/seg/spare") != 256 * kib) return 4;
    const auto small_keys = [](store& s, int from, int to) {
      for (int i = from; i < to; ++i) {
        if (!s.put(key_of(i), std::string(100, 'v'))) return false;
      }
      return true;
    };
    const auto all_there = [&](store& s, int keys) {
      if (s.get("a") != a || s.get("b") != b) return false;
      for (int i = 0; i < keys; ++i) {
        if (s.get(key_of(i)) != std::string(100, 'v')) return false;
      }
      return static_cast<bool>(s.verify());
    };
    {
      auto s = store::open(path);
      if (!s || !small_keys(**s, 0, 1000) || !all_there(**s, 1000)) return 5;
    }
    std::filesystem::remove(path + "/index");  // rebuilt from the log at the next open
    {
      auto s = store::open(path);
      if (!s || !all_there(**s, 1000) || !small_keys(**s, 1000, 2000)) return 6;
    }
    {
      auto s = store::open(path);
      if (!s || !all_there(**s, 2000)) return 7;
      if (!(*s)->put("a", "small now") || !(*s)->compact()) return 8;
      if (own_segments() != 1 || (*s)->get("a") != "small now" || (*s)->get("b") != b) return 9;
      if (!(*s)->verify()) return 10;
    }
    return 0;
  });
}

// Review: a blob larger than a segment gets a segment of its header and its length, not a
// whole number of pages, and the budget added the segment table's sizes: the store's files
// passed max_bytes by a page for each such blob (8192 bytes with 30 blobs of 1.5 MB).
TEST(KvGrowth, BlobsLargerThanASegmentAreCountedAsTheVolumeAllocatesThem) {
  on_small_volume(512, [](const std::string& path) {
    constexpr std::uint64_t budget = 64 * mib;
    options o;
    o.compact_dead_fraction = 0;
    o.max_bytes = budget;
    auto s = store::open(path, o);
    if (!s) return 1;
    std::uint64_t most = 0;
    for (int i = 0;; ++i) {
      auto r = (*s)->put(key_of(i), std::string(i < 30 ? 1'572'760 : 1000, 'v'));
      most = std::max(most, allocated_under(path));
      if (!r) {
        if (r.error() != errc::budget_reached) return 2;
        break;
      }
    }
    std::fprintf(stderr, "the store's files took at most %llu bytes of a %llu budget\n",
                 static_cast<unsigned long long>(most), static_cast<unsigned long long>(budget));
    return most <= budget ? 0 : 3;
  });
}

// CI, on btrfs: an opener that was not alone read the index file's size, then the words that
// say which pages it holds. Near full the index grows by just the pages each split needs, and
// a writer that grew it in between made a sound index look cut short: the open failed with
// corrupt (one of a thousand processes opening a store being filled). Processes opening
// beside a writer that grows the index to the full volume never find it damaged.
TEST(KvGrowth, OpenersBesideAWriterGrowingTheIndexNearFullNeverFindItDamaged) {
  on_small_volume(48, [](const std::string& path) {
    {
      auto s = store::open(path);
      if (!s) return 1;
    }
    int done[2];
    if (::pipe(done) != 0) return 2;
    // New keys of one byte, a split every few dozen, until the volume is full.
    const pid_t writer = test::fork_child([&] {
      ::close(done[0]);
      auto s = store::open(path);
      if (!s) return 2;
      for (int i = 0;; ++i) {
        auto r = (*s)->put(key_of(i), "v");
        if (!r) return r.error() == std::errc::no_space_on_device ? 0 : 3;
      }
    });
    ::close(done[1]);  // the writer's end closes when it ends
    std::vector<pid_t> openers;
    for (int o = 0; o < 2; ++o) {
      openers.push_back(test::fork_child([&] {
        int opens = 0;
        for (;; ++opens) {
          pollfd p{done[0], POLLIN, 0};
          if (::poll(&p, 1, 0) != 0) break;
          auto s = store::open(path);
          if (!s && s.error() != std::errc::no_space_on_device) {
            std::fprintf(stderr, "open %d beside the writer: %s\n", opens,
                         s.error().message().c_str());
            return 4;
          }
        }
        std::fprintf(stderr, "%d opens beside the writer\n", opens);
        return opens >= 50 ? 0 : 5;  // else too few to prove anything
      }));
    }
    ::close(done[0]);
    int failed = test::wait_exit(writer);
    for (const pid_t p : openers) {
      if (const int code = test::wait_exit(p); code != 0 && failed == 0) failed = code;
    }
    if (failed != 0) return failed;
    auto s = store::open(path);
    return s && (*s)->verify() ? 0 : 6;
  });
}

}  // namespace
}  // namespace keel::kv
