// keel-bench spacebench: keel::kv on a small volume that it fills, after Tux3's out-of-space
// metrics (issue "keel::space"). Each run makes a volume of its own (a tmpfs in a private
// mount namespace, so it vanishes with the run), and measures, with 1 KiB values:
// - fill: the value bytes stored when a put first fails with no_space, against the volume's
//   free space at the start; beside it the same with the format's per-record overhead (what
//   an ideal packer of keel's records would reach), then with each key's index entry too (a
//   packer of the records and a full index), and what plain files reach there;
// - half-way failures: puts that failed with anything but no_space, and deaths by signal
//   (SIGBUS from a write into an unallocated block): both must be 0;
// - time to fail: how long the first failing put took, and tar's "keep banging on the full
//   disk" translated (puts retried after no_space): their mean and worst;
// - after full: every other key erased, compaction until it frees nothing more, then puts
//   until no_space again (deletes, compaction and writes must all work);
// - near full: the seed's dd test translated, a stream of puts into a volume far from full
//   and into one it overflows: the ratio of their times;
// - the ledger's cost far from full: the same stream of puts with the space ledger on and
//   off, alternated, and one charge and leave alone, in nanoseconds;
// - the shared volume: another process fills the store and sits idle with it open while
//   this one erases half, compacts and puts again (how much of the erased room it gets), the
//   same under max_bytes (the device bytes the store takes), and erases while a foreign
//   program keeps the volume full (how many fail; the longest);
// - on btrfs, a qgroup another program holds at its limit: store writers and readers under
//   it (killed by a signal, the longest call, what was refused, acknowledged puts lost);
// - blurt, translated: rounds of many processes at once, each putting `steps` values under
//   keys of its own in one of `dirs` key ranges, the same ranges again pass after pass (so
//   later passes rewrite); no put may fail while the live data is far from filling the
//   volume. Beside it the seed's own blurt with files, on a volume of the same size.
// Exits 1 when a run died or a task was killed by a signal; tasks that failed with an error
// are figures in the report (a miss), not a failure of the run.

#include "spacebench_command.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/kv/store.hpp"
#include "keel/space/ledger.hpp"

namespace keel::tools {
namespace {

using clock_type = std::chrono::steady_clock;
using nlohmann::json;

struct config {
  std::string fs = "tmpfs";
  std::uint64_t size_mib = 64;
  std::uint64_t segment_mib = 0;  // 0: left to the store (segments that grow)
  std::size_t value_size = 1024;
  std::uint64_t stream_mib = 16;
  std::size_t retries = 1000;
  std::string dir;
  std::string json_path;
  // blurt: the seed's 1000 tasks of 40 writes, into 9 directories, 9 times over.
  std::size_t blurt_tasks = 1000;
  std::size_t blurt_steps = 40;
  std::size_t blurt_dirs = 9;
  std::size_t blurt_passes = 9;
  std::uint64_t blurt_mib = 0;  // 0: what the live data needs, 3.5 times over (the seed's ~30 %)
  double qgroup_seconds = 10;   // btrfs: how long the qgroup is held at its limit
  bool qgroup_only = false;     // btrfs: that run alone
};

std::uint64_t blurt_volume_mib(const config& c) {
  if (c.blurt_mib != 0) return c.blurt_mib;
  const double live = static_cast<double>(c.blurt_dirs * c.blurt_tasks * c.blurt_steps) *
                      static_cast<double>(c.value_size);
  return std::max<std::uint64_t>(16, static_cast<std::uint64_t>(live * 3.5 / 1048576.0) + 1);
}

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

std::string key_of(std::uint64_t i) {
  return fmt::format("k{:015}", i);  // 16 bytes, as kvbench's keys
}

// The format's bytes per record of a put in a block of its own (doc/kv-format.md): a block
// header and a record header of 48 bytes each, the key, the value, 8-byte aligned.
std::uint64_t record_bytes(std::size_t key, std::size_t value) {
  return (48 + 48 + key + value + 7) / 8 * 8;
}

// The index's bytes per key (doc/kv-format.md, bucket pages): one entry of 32 bytes, in a
// page packed full (an ideal packer would leave no entry empty).
constexpr std::uint64_t index_entry_bytes = 32;

// Why a volume could not be made, by the exit status of the child that tried.
constexpr int cannot_mount = 77;  // no private mount namespace, or no tmpfs there
constexpr int cannot_mkfs = 78;
constexpr int cannot_loop = 79;

// Makes a `fs` volume of `mib` MiB on `mnt` (in the caller's mount namespace): a tmpfs, or a
// filesystem made on an image file beside `mnt` and mounted through a loop device (the
// image's name is gone once mounted; the device goes with the mount). 0, or why not.
int make_volume(const std::string& fs, const std::string& mnt, std::uint64_t mib) {
  if (fs == "tmpfs") {
    const std::string opts = fmt::format("size={}m", mib);
    return ::mount("tmpfs", mnt.c_str(), "tmpfs", 0, opts.c_str()) == 0 ? 0 : cannot_mount;
  }
  const std::string img = mnt + ".img";
  {
    std::ofstream f(img, std::ios::binary | std::ios::trunc);
    if (!f) return cannot_mkfs;
  }
  std::error_code ec;
  std::filesystem::resize_file(img, mib << 20, ec);
  // ext4 without the 5 % kept for root (root may write into it: fill would pass 100 %).
  const std::string force = fs == "ext4" ? "-F -m 0" : "-f";
  const int made =
      ec ? -1
         : std::system(fmt::format("mkfs.{} -q {} '{}' >/dev/null 2>&1", fs, force, img).c_str());
  if (made != 0) {
    std::filesystem::remove(img, ec);
    return cannot_mkfs;
  }
  const int mounted =
      std::system(fmt::format("mount -o loop '{}' '{}' >/dev/null 2>&1", img, mnt).c_str());
  std::filesystem::remove(img, ec);
  return mounted == 0 ? 0 : cannot_loop;
}

// Runs `body` in a child with a volume of `mib` MiB mounted on `mnt` in a mount namespace of
// its own; the child writes its JSON result to `out`. The child's exit status, or -signal.
template <class F>
int on_volume(const config& c, const std::string& mnt, std::uint64_t mib, const std::string& out,
              F&& body) {
  const pid_t pid = ::fork();
  if (pid < 0) return -1000;
  if (pid == 0) {
    if (::unshare(CLONE_NEWNS) != 0 ||
        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
      ::_exit(cannot_mount);
    }
    if (const int why = make_volume(c.fs, mnt, mib); why != 0) ::_exit(why);
    json result = body(mnt);
    // The loop device (if any) is released when the namespace goes with this process.
    ::umount2(mnt.c_str(), MNT_DETACH);
    write_json("spacebench", out, result);
    ::_exit(0);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1001;
  }
  if (WIFSIGNALED(status)) return -WTERMSIG(status);
  return WEXITSTATUS(status);
}

std::uint64_t free_bytes(const std::string& path) {
  auto info = io::stat_fs(path.c_str());
  return info ? info->available_bytes : 0;
}

// Puts until a put fails; what happened.
struct filled {
  std::uint64_t stored = 0;        // keys put
  std::uint64_t other_errors = 0;  // failures other than no_space
  std::string error;               // the last failure's message
  double seconds = 0;
  double failing_put_seconds = 0;  // the put that first failed with no_space
  json series = json::array();     // [seconds, value bytes stored, puts/s since the last]
};

// `sample_every`: puts between two points of the series (0: none).
filled fill(kv::store& s, std::uint64_t from, const std::string& value,
            std::uint64_t sample_every = 0) {
  filled f;
  const auto start = clock_type::now();
  auto last = start;
  for (std::uint64_t i = from;; ++i) {
    const auto t = clock_type::now();
    auto r = s.put(key_of(i), value);
    if (r) {
      ++f.stored;
      if (sample_every != 0 && f.stored % sample_every == 0) {
        const auto now = clock_type::now();
        const double dt = std::chrono::duration<double>(now - last).count();
        f.series.push_back({std::chrono::duration<double>(now - start).count(),
                            f.stored * value.size(),
                            dt > 0 ? static_cast<double>(sample_every) / dt : 0.0});
        last = now;
      }
      continue;
    }
    f.error = r.error().message();
    if (r.error() == std::errc::no_space_on_device) {
      f.failing_put_seconds = seconds_since(t);
    } else {
      ++f.other_errors;
    }
    break;
  }
  f.seconds = seconds_since(start);
  return f;
}

// Where the volume's bytes are: each of the store's files by kind, allocated blocks.
json space_by_file(const std::string& store_dir) {
  json j = {{"segments", 0}, {"spare", 0},      {"deletes", 0},
            {"index", 0},    {"checkpoint", 0}, {"other", 0}};
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(store_dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    struct stat st {};
    if (::lstat(it->path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
    const std::string name = it->path().filename().string();
    const std::string parent = it->path().parent_path().filename().string();
    const char* kind = name == "spare"                  ? "spare"
                       : name == "deletes"              ? "deletes"
                       : parent == "seg"                ? "segments"
                       : name == "index"                ? "index"
                       : name.starts_with("checkpoint") ? "checkpoint"
                                                        : "other";
    j[kind] = j[kind].get<std::uint64_t>() + static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return j;
}

// Compacts until a pass removes nothing (at most 64 passes): the segments removed; the
// error of a pass that failed goes to `error`.
std::uint64_t compact_until_dry(kv::store& s, std::string& error) {
  std::uint64_t removed = 0;
  for (int pass = 0; pass < 64; ++pass) {
    auto r = s.compact();
    if (!r) {
      error = r.error().message();
      break;
    }
    if (r->segments_removed == 0) break;
    removed += r->segments_removed;
  }
  return removed;
}

json fill_run(const config& c, const std::string& mnt) {
  json j;
  const std::uint64_t free0 = free_bytes(mnt);
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  auto opened = kv::store::open(mnt + "/s", o);
  if (!opened) {
    j["error"] = opened.error().message();
    return j;
  }
  auto& s = **opened;
  const std::string value(c.value_size, 'v');
  // About 200 points from empty to full.
  const filled f = fill(s, 0, value, std::max<std::uint64_t>(1, free0 / 200 / c.value_size));
  j["free_bytes"] = free0;
  j["series"] = f.series;
  j["stored"] = f.stored;
  j["first_error"] = f.error;
  j["half_way_failures"] = f.other_errors;
  j["fill_pct"] = 100.0 * static_cast<double>(f.stored * c.value_size) / static_cast<double>(free0);
  j["fill_with_overhead_pct"] = 100.0 *
                                static_cast<double>(f.stored * record_bytes(16, c.value_size)) /
                                static_cast<double>(free0);
  j["fill_with_index_pct"] =
      100.0 * static_cast<double>(f.stored * (record_bytes(16, c.value_size) + index_entry_bytes)) /
      static_cast<double>(free0);
  j["fail_seconds"] = f.failing_put_seconds;
  j["space"] = space_by_file(mnt + "/s");
  if (auto st = s.stats()) {
    j["space"]["live_bytes"] = st->live_bytes;
    j["space"]["dead_bytes"] = st->dead_bytes;
    j["space"]["index_pages"] = st->index_pages;
    j["space"]["index_free_pages"] = st->index_free_pages;
    j["space"]["index_load"] = st->index_load;
    j["space"]["records"] = st->records;
  }
  j["space"]["volume_free"] = free_bytes(mnt);

  // Keep banging: puts retried after no_space.
  double worst = 0;
  double total = 0;
  std::uint64_t not_no_space = 0;
  for (std::size_t k = 0; k < c.retries; ++k) {
    const auto t = clock_type::now();
    auto r = s.put(key_of(f.stored + 1 + k), value);
    const double took = seconds_since(t);
    total += took;
    worst = std::max(worst, took);
    if (r || r.error() != std::errc::no_space_on_device) ++not_no_space;
  }
  j["retry_mean_seconds"] = c.retries == 0 ? 0.0 : total / static_cast<double>(c.retries);
  j["retry_worst_seconds"] = worst;
  j["retries_not_no_space"] = not_no_space;

  // After full: erase every other key, compact until nothing more comes free, put again.
  std::uint64_t erase_failures = 0;
  for (std::uint64_t i = 0; i < f.stored; i += 2) {
    if (!s.erase(key_of(i))) ++erase_failures;
  }
  std::string compact_error;
  const std::uint64_t removed = compact_until_dry(s, compact_error);
  const filled again = fill(s, f.stored + c.retries + 1, value);
  j["after_full"] = {{"erase_failures", erase_failures},
                     {"segments_removed", removed},
                     {"compact_error", compact_error},
                     {"stored_again", again.stored},
                     {"half_way_failures", again.other_errors}};
  return j;
}

// The filesystem's own fill: 1 MiB files written in value-sized pieces until ENOSPC.
json plain_run(const config& c, const std::string& mnt) {
  const std::uint64_t free0 = free_bytes(mnt);
  std::vector<std::byte> piece(c.value_size, std::byte{'v'});
  std::uint64_t written = 0;
  for (int n = 0;; ++n) {
    const std::string name = fmt::format("{}/f{}", mnt, n);
    auto f = io::file_handle::open(name.c_str(), io::open_flags::write | io::open_flags::create);
    if (!f) break;
    bool full = false;
    for (std::uint64_t off = 0; off + c.value_size <= (1u << 20); off += c.value_size) {
      if (!f->write_at(static_cast<off_t>(off), piece)) {
        full = true;
        break;
      }
      written += c.value_size;
    }
    if (full) break;
  }
  return {{"free_bytes", free0},
          {"written", written},
          {"fill_pct", 100.0 * static_cast<double>(written) / static_cast<double>(free0)}};
}

// The dd test: `stream_mib` of puts into a fresh store on the volume.
json stream_run(const config& c, const std::string& mnt) {
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  auto opened = kv::store::open(mnt + "/s", o);
  if (!opened) return {{"error", opened.error().message()}};
  const std::string value(c.value_size, 'v');
  const std::uint64_t n = (c.stream_mib << 20) / c.value_size;
  const auto start = clock_type::now();
  std::uint64_t stored = 0;
  std::string stopped;
  for (; stored < n; ++stored) {
    auto r = (*opened)->put(key_of(stored), value);
    if (!r) {
      stopped = r.error().message();
      break;
    }
  }
  return {{"seconds", seconds_since(start)}, {"stored", stored}, {"stopped", stopped}};
}

// The ledger far from full: `stream_mib` of puts into a fresh store, with the ledger on and
// off in turn, 15 times each (which goes first alternating); the cost is the median of the
// rounds' ratios (this machine's runs vary by up to 20 % from one to the next). Far from full for
// the ledger: it charges each 1 KiB put its worst case, about 14 KiB (its block twice, index pages
// for a split and a directory doubling), so the volume is 32 times the stream. And what one
// charge and leave cost alone, uncontended.
constexpr int ledger_rounds = 15;

json ledger_run(const config& c, const std::string& mnt) {
  const std::string value(c.value_size, 'v');
  const std::uint64_t n = (c.stream_mib << 20) / c.value_size;
  double best[2] = {0, 0};     // puts/s: off, on
  std::vector<double> ratios;  // on / off, per round
  json runs = json::array();
  for (int round = 0; round < ledger_rounds; ++round) {
    // Each run in a fresh store on an otherwise empty volume, and which goes first alternates:
    // the second run of a round would otherwise reuse the pages the first freed.
    double rate_of[2] = {0, 0};
    for (const bool first : {true, false}) {
      const bool on = first == (round % 2 == 0);
      kv::options o;
      o.segment_size = c.segment_mib << 20;
      o.ledger = on;
      const std::string path = mnt + "/l";
      std::error_code ec;
      std::filesystem::remove_all(path, ec);
      auto s = kv::store::open(path, o);
      if (!s) return {{"error", s.error().message()}};
      const auto start = clock_type::now();
      for (std::uint64_t i = 0; i < n; ++i) {
        if (auto r = (*s)->put(key_of(i), value); !r) return {{"error", r.error().message()}};
      }
      const double rate = static_cast<double>(n) / seconds_since(start);
      best[on ? 1 : 0] = std::max(best[on ? 1 : 0], rate);
      rate_of[on ? 1 : 0] = rate;
      runs.push_back({{"ledger", on}, {"puts_per_second", rate}});
    }
    ratios.push_back(rate_of[1] / rate_of[0]);
  }
  std::ranges::sort(ratios);
  // One writer charging and leaving, over and over, in a budget it never exhausts.
  space::ledger_words words{};
  space::writer_words pin{};
  space::ledger l(words, reinterpret_cast<std::byte*>(&pin), 1, sizeof pin);
  (void)l.transition(space::ledger::max_amount);
  constexpr std::uint64_t charges = 10'000'000;
  const auto start = clock_type::now();
  for (std::uint64_t i = 0; i < charges; ++i) {
    auto ch = l.try_charge(0, 1);
    if (!ch || !*ch) return {{"error", "a charge failed in an endless budget"}};
    l.leave(0);
  }
  const double ns = seconds_since(start) * 1e9 / static_cast<double>(charges);
  return {{"puts", n},
          {"runs", runs},
          {"best_on", best[1]},
          {"best_off", best[0]},
          {"best_cost_pct", 100.0 * (1.0 - best[1] / best[0])},
          // The median of the rounds' ratios: a disturbance hits one run of one round.
          {"cost_pct", 100.0 * (1.0 - ratios[ratios.size() / 2])},
          {"charge_ns", ns}};
}

// Used share of the volume, as df counts it.
double used_pct(const std::string& path) {
  auto info = io::stat_fs(path.c_str());
  if (!info || info->total_bytes == 0) return -1;
  return 100.0 * static_cast<double>(info->total_bytes - info->free_bytes) /
         static_cast<double>(info->total_bytes);
}

// Shared volume (issue 46): another process holding the store open and idle, and a foreign
// program writing to the same volume. In a child of the run's: opens the store at `path`,
// puts until the first failure, writes the count to `told`, then sits idle (its maps of
// every segment it wrote still there) until `go` is written to or closed.
pid_t idle_opener(const std::string& path, const kv::options& o, const std::string& value,
                  const int (&told_pipe)[2], const int (&go_pipe)[2]) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::close(told_pipe[0]);
  ::close(go_pipe[1]);
  const int told = told_pipe[1];
  const int go = go_pipe[0];
  auto opened = kv::store::open(path, o);
  std::uint64_t n = 0;
  if (opened) {
    while ((*opened)->put(key_of(n), value))
      ++n;
  }
  if (::write(told, &n, sizeof n) != sizeof n) ::_exit(2);
  char ch = 0;
  (void)::read(go, &ch, 1);
  ::_exit(opened ? 0 : 3);
}

// A process that appends to `path` until the volume refuses, tells `full`, then takes every
// block that comes free until killed.
// With `pulses`, the writer does not hold the volume full: each time it is, it waits a
// while (10 to 300 ms), gives all it wrote back (truncates and syncs, so a btrfs qgroup
// learns of the room), counts one in `*pulses` and fills again.
pid_t foreign_writer(const std::string& path, int full,
                     std::atomic<std::uint64_t>* pulses = nullptr) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_APPEND, 0600);
  if (fd < 0) ::_exit(2);
  static const std::vector<char> big(64 << 10, 'f');
  bool told = false;
  std::uint64_t next = static_cast<std::uint64_t>(::getpid());
  for (;;) {
    ssize_t w = ::write(fd, big.data(), big.size());
    if (w < 0 && (errno == ENOSPC || errno == EDQUOT)) w = ::write(fd, big.data(), 4096);
    if (w >= 0) continue;
    if (errno != ENOSPC && errno != EDQUOT) ::_exit(3);
    if (!told) {
      told = true;
      if (::write(full, "f", 1) != 1) ::_exit(4);
    }
    if (pulses == nullptr) {
      ::sched_yield();
      continue;
    }
    next = next * 6364136223846793005ULL + 1442695040888963407ULL;
    std::this_thread::sleep_for(std::chrono::milliseconds(10 + (next >> 33) % 291));
    if (::ftruncate(fd, 0) != 0 || ::syncfs(fd) != 0) ::_exit(5);
    pulses->fetch_add(1);
  }
}

// Bytes the volume has given out.
std::uint64_t used_bytes(const std::string& path) {
  auto info = io::stat_fs(path.c_str());
  return info ? info->total_bytes - info->free_bytes : 0;
}

// With an idle opener: it fills the store; this process erases the first half, compacts
// until nothing more comes free, and puts until the first failure. Under `max_bytes` (0:
// none) it also measures the device bytes the store takes then.
json idle_opener_run(const config& c, const std::string& mnt, std::uint64_t max_bytes) {
  json j;
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  o.max_bytes = max_bytes;
  const std::string value(c.value_size, 'v');
  const std::uint64_t used0 = used_bytes(mnt);
  int told[2], go[2];
  if (::pipe(told) != 0 || ::pipe(go) != 0) return {{"error", "pipe"}};
  const pid_t idle = idle_opener(mnt + "/s", o, value, told, go);
  ::close(told[1]);
  ::close(go[0]);
  std::uint64_t n = 0;
  const bool heard = ::read(told[0], &n, sizeof n) == sizeof n;
  ::close(told[0]);
  std::uint64_t erase_failures = 0, removed = 0, again = 0;
  std::string error;
  if (heard && n != 0) {
    auto opened = kv::store::open(mnt + "/s", o);
    if (opened) {
      auto& s = **opened;
      for (std::uint64_t i = 0; i < n / 2; ++i) {
        if (!s.erase(key_of(i))) ++erase_failures;
      }
      removed = compact_until_dry(s, error);
      while (s.put(key_of(n + again), value))
        ++again;
    } else {
      error = opened.error().message();
    }
  } else {
    error = "the idle opener stored nothing";
  }
  const std::uint64_t used = used_bytes(mnt) - std::min(used_bytes(mnt), used0);
  ::close(go[1]);
  int status = 0;
  while (::waitpid(idle, &status, 0) < 0 && errno == EINTR) {
  }
  j["stored"] = n;
  j["erased"] = n / 2;
  j["erase_failures"] = erase_failures;
  j["segments_removed"] = removed;
  j["put_again"] = again;
  j["put_again_pct"] =
      n / 2 == 0 ? 0.0 : 100.0 * static_cast<double>(again) / static_cast<double>(n / 2);
  j["device_bytes"] = used;
  j["max_bytes"] = max_bytes;
  if (!error.empty()) j["error"] = error;
  return j;
}

// With a foreign writer: the store filled, a quarter erased, then another program fills the
// volume and keeps taking free blocks while this process compacts and erases the rest, for
// at most a minute (on a full btrfs each page an erase writes first waits ~10 ms for the
// filesystem's reservations: three quarters of a 128 MiB store's keys would take an hour).
json foreign_writer_run(const config& c, const std::string& mnt) {
  json j;
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  auto opened = kv::store::open(mnt + "/s", o);
  if (!opened) return {{"error", opened.error().message()}};
  auto& s = **opened;
  const filled f = fill(s, 0, std::string(c.value_size, 'v'));
  std::uint64_t erase_failures = 0, tried = 0;
  for (std::uint64_t i = 0; i < f.stored / 4; ++i, ++tried) {
    if (!s.erase(key_of(i))) ++erase_failures;
  }
  int full[2];
  if (::pipe(full) != 0) return {{"error", "pipe"}};
  const pid_t writer = foreign_writer(mnt + "/foreign", full[1]);
  ::close(full[1]);
  char ch = 0;
  const bool is_full = ::read(full[0], &ch, 1) == 1;
  ::close(full[0]);
  std::string first, compact_error;
  double longest = 0;
  if (is_full) {
    if (auto r = s.compact(); !r) compact_error = r.error().message();
    const auto until = clock_type::now() + std::chrono::minutes(1);
    for (std::uint64_t i = f.stored / 4; i < f.stored && clock_type::now() < until; ++i, ++tried) {
      const auto t = clock_type::now();
      auto r = s.erase(key_of(i));
      longest = std::max(longest, seconds_since(t));
      if (!r && erase_failures++ == 0) first = r.error().message();
    }
  }
  ::kill(writer, SIGKILL);
  int status = 0;
  while (::waitpid(writer, &status, 0) < 0 && errno == EINTR) {
  }
  j["stored"] = f.stored;
  j["erases_tried"] = tried;
  j["erase_failures"] = erase_failures;
  j["longest_erase_seconds"] = longest;
  if (!first.empty()) j["first_failure"] = first;
  if (!compact_error.empty()) j["compact_error"] = compact_error;
  if (!is_full) j["error"] = "the foreign writer never filled the volume";
  return j;
}

// A btrfs qgroup held at its limit (issue 46, item 3): statfs cannot see the limit, and
// btrfs then refuses every write, a write fault on a shared map too. In a subvolume limited
// to 64 MiB, a store a quarter full; two writers (each puts a set of keys of its own over and
// over, and reads one back; the second's commits are durability::sync), a reader opened before the
// limit and one opened at it, while a foreign program takes the qgroup to its limit and holds it
// there for `hold` seconds; then for `hold` seconds more it fills the qgroup, waits a moment and
// gives the room back, over and over (so btrfs writes back the store's pages at the limit while its
// writers store into them); then it lets go. Measured: the processes killed by a signal (target 0),
// the longest call against lock_timeout (the target: no call waits past it), the calls refused
// (with what) and the other failures, the calls that went in once the limit was gone, and
// acknowledged puts that do not read back after (target 0).
constexpr std::size_t qgroup_workers = 4;
// Keys each writer puts over and over (4 MiB of 1 KiB values): its log's dead versions need
// compaction while the qgroup is at its limit.
constexpr std::size_t qgroup_max_puts = 4096;

struct qgroup_tally {
  std::atomic<std::uint64_t> calls{0}, ok{0}, refused{0}, other{0}, ok_after{0}, longest_ns{0};
  std::atomic<int> opened{0};
  char first_refused[160]{};
  char first_other[160]{};
};

// In memory the run's processes share (MAP_SHARED | MAP_ANONYMOUS, before the forks).
struct qgroup_shared {
  std::atomic<int> ready{0}, go{0}, limited{0}, released{0}, stop{0};
  std::atomic<std::uint64_t> pulses{0};
  qgroup_tally tally[qgroup_workers];
  std::atomic<std::uint64_t> puts[2]{};
  std::atomic<std::uint8_t> acked[2][qgroup_max_puts]{};
};

void note_first(char (&to)[160], const std::string& what) {
  if (to[0] == '\0') std::snprintf(to, sizeof to, "%s", what.c_str());
}

// One timed call: counted refused (EDQUOT, ENOSPC), other, or ok (and ok after the limit
// was let go).
template <class F>
bool qgroup_call(qgroup_shared& sh, qgroup_tally& t, F&& call) {
  const auto t0 = clock_type::now();
  auto r = call();
  const auto ns = static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - t0).count());
  t.calls.fetch_add(1);
  std::uint64_t seen = t.longest_ns.load();
  while (ns > seen && !t.longest_ns.compare_exchange_weak(seen, ns)) {
  }
  if (r) {
    t.ok.fetch_add(1);
    if (sh.released.load() != 0) t.ok_after.fetch_add(1);
    return true;
  }
  if (r.error() == std::errc::no_space_on_device ||
      r.error() == std::error_code(EDQUOT, std::system_category())) {
    t.refused.fetch_add(1);
    note_first(t.first_refused, r.error().message());
  } else {
    t.other.fetch_add(1);
    note_first(t.first_other, r.error().message());
  }
  return false;
}

// Worker `w` of the qgroup run, in a child: 0 and 1 write, 2 reads from before the limit,
// 3 opens read-only at the limit and reads.
[[noreturn]] void qgroup_worker(qgroup_shared& sh, std::size_t w, const std::string& path,
                                const kv::options& o, std::uint64_t keys,
                                const std::string& value) {
  qgroup_tally& t = sh.tally[w];
  kv::options mine = o;
  mine.read_only = w >= 2;
  if (w == 1) mine.durable = kv::durability::sync;
  if (w == 3) {
    sh.ready.fetch_add(1);
    while (sh.limited.load() == 0 && sh.stop.load() == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::unique_ptr<kv::store> s;
  qgroup_call(sh, t, [&]() -> result<void> {
    auto opened = kv::store::open(path, mine);
    if (!opened) return std::unexpected(opened.error());
    s = std::move(*opened);
    return {};
  });
  t.opened.store(s ? 1 : 0);
  if (w != 3) sh.ready.fetch_add(1);
  if (!s) ::_exit(0);
  while (sh.go.load() == 0)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::uint64_t next = 0;
  for (std::uint64_t i = 0; sh.stop.load() == 0; ++i) {
    if (w < 2) {
      const std::uint64_t k = i % qgroup_max_puts;
      const std::string key = fmt::format("w{}-{:012}", w, k);
      if (qgroup_call(sh, t, [&] { return s->put(key, value); })) sh.acked[w][k].store(1);
      if (i < qgroup_max_puts) sh.puts[w].store(i + 1);
    }
    const std::string key =
        key_of((next = next * 6364136223846793005ULL + 1442695040888963407ULL) % keys);
    qgroup_call(sh, t, [&]() -> result<void> {
      auto v = s->get(key);
      if (!v) return std::unexpected(v.error());
      if (*v != value) return std::unexpected(error(std::make_error_code(std::errc::bad_message)));
      return {};
    });
  }
  s.reset();  // its close counts too: a signal there kills it
  ::_exit(0);
}

json qgroup_run(const config& c, const std::string& mnt, double hold) {
  const std::string sv = mnt + "/q";
  if (std::system(fmt::format("(btrfs quota enable '{0}' && btrfs subvolume create '{1}' && "
                              "btrfs qgroup limit 64M '{1}') >/dev/null 2>&1",
                              mnt, sv)
                      .c_str()) != 0) {
    return {{"skipped", "btrfs qgroups cannot be set up here (kernel or btrfs-progs)"}};
  }
  const std::string path = sv + "/s";
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  const std::string value(c.value_size, 'v');
  const std::uint64_t keys = (16u << 20) / record_bytes(key_of(0).size(), c.value_size);
  {
    auto opened = kv::store::open(path, o);
    if (!opened) return {{"error", "open: " + opened.error().message()}};
    for (std::uint64_t i = 0; i < keys; ++i) {
      if (auto r = (*opened)->put(key_of(i), value); !r) {
        return {{"error", fmt::format("put {} before the limit: {}", i, r.error().message())}};
      }
    }
  }
  ::sync();  // the store's pages written back: the next store to each faults
  void* mem = ::mmap(nullptr, sizeof(qgroup_shared), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return {{"error", "mmap"}};
  auto* sh = new (mem) qgroup_shared;
  std::vector<pid_t> pids;
  for (std::size_t w = 0; w < qgroup_workers; ++w) {
    const pid_t pid = ::fork();
    if (pid == 0) qgroup_worker(*sh, w, path, o, keys, value);
    pids.push_back(pid);
  }
  // (A worker that died opening never says ready: counted below, once the wait is over.)
  const auto opening_ends = clock_type::now() + std::chrono::minutes(1);
  while (sh->ready.load() < static_cast<int>(qgroup_workers) && clock_type::now() < opening_ends)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  sh->go.store(1);
  int full[2];
  if (::pipe(full) != 0) return {{"error", "pipe"}};
  const pid_t writer = foreign_writer(sv + "/foreign", full[1]);
  ::close(full[1]);
  char ch = 0;
  const bool is_full = ::read(full[0], &ch, 1) == 1;
  ::close(full[0]);
  const auto held_from = clock_type::now();
  sh->limited.store(1);
  if (is_full) std::this_thread::sleep_for(std::chrono::duration<double>(hold));
  const double held = seconds_since(held_from);
  ::kill(writer, SIGKILL);
  while (::waitpid(writer, nullptr, 0) < 0 && errno == EINTR) {
  }
  std::error_code ec;
  std::filesystem::remove(sv + "/foreign", ec);
  double pulsed = 0;
  if (is_full) {
    int unused[2];
    if (::pipe(unused) != 0) return {{"error", "pipe"}};
    const auto pulsed_from = clock_type::now();
    const pid_t pulser = foreign_writer(sv + "/foreign", unused[1], &sh->pulses);
    ::close(unused[1]);
    std::this_thread::sleep_for(std::chrono::duration<double>(hold));
    ::kill(pulser, SIGKILL);
    while (::waitpid(pulser, nullptr, 0) < 0 && errno == EINTR) {
    }
    ::close(unused[0]);
    pulsed = seconds_since(pulsed_from);
    std::filesystem::remove(sv + "/foreign", ec);
  }
  ::sync();  // (the qgroup learns of the room at the commit)
  sh->released.store(1);
  std::this_thread::sleep_for(std::chrono::seconds(2));  // what goes in once it is let go
  sh->stop.store(1);
  // Each worker ends at its next call's end: one that hangs is killed after a minute, and
  // counted so.
  json died = json::array();
  std::uint64_t signalled = 0, hung = 0;
  const auto deadline = clock_type::now() + std::chrono::minutes(1);
  for (std::size_t w = 0; w < pids.size(); ++w) {
    int status = 0;
    pid_t got = 0;
    while ((got = ::waitpid(pids[w], &status, WNOHANG)) == 0 && clock_type::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (got == 0) {
      ::kill(pids[w], SIGKILL);
      (void)::waitpid(pids[w], &status, 0);
      ++hung;
      died.push_back(fmt::format("worker {} hung past a minute", w));
    } else if (WIFSIGNALED(status)) {
      ++signalled;
      died.push_back(fmt::format("worker {} killed by {}", w, strsignal(WTERMSIG(status))));
    }
  }
  // Every acknowledged put reads back.
  std::uint64_t acked = 0, lost = 0;
  std::string verified;
  {
    auto opened = kv::store::open(path, o);
    if (!opened) return {{"error", "open after: " + opened.error().message()}};
    for (std::size_t w = 0; w < 2; ++w) {
      for (std::uint64_t i = 0; i < sh->puts[w].load(); ++i) {
        if (sh->acked[w][i].load() == 0) continue;
        ++acked;
        auto v = (*opened)->get(fmt::format("w{}-{:012}", w, i));
        if (!v || *v != value) ++lost;
      }
    }
    auto v = (*opened)->verify();
    verified = v ? "ok" : v.error().message();
  }
  json j;
  static constexpr const char* roles[qgroup_workers] = {
      "writer", "writer (sync)", "reader opened before", "reader opened at the limit"};
  double longest = 0;
  j["workers"] = json::array();
  for (std::size_t w = 0; w < qgroup_workers; ++w) {
    const qgroup_tally& t = sh->tally[w];
    json r;
    r["role"] = roles[w];
    r["opened"] = t.opened.load() != 0;
    r["calls"] = t.calls.load();
    r["ok"] = t.ok.load();
    r["ok_after_release"] = t.ok_after.load();
    r["refused"] = t.refused.load();
    r["other_failures"] = t.other.load();
    r["longest_call_seconds"] = static_cast<double>(t.longest_ns.load()) / 1e9;
    if (t.first_refused[0] != '\0') r["first_refused"] = t.first_refused;
    if (t.first_other[0] != '\0') r["first_other"] = t.first_other;
    longest = std::max(longest, r["longest_call_seconds"].get<double>());
    j["workers"].push_back(r);
  }
  j["limit_mib"] = 64;
  j["held_seconds"] = held;
  j["pulsed_seconds"] = pulsed;
  j["pulses"] = sh->pulses.load();
  j["processes"] = qgroup_workers;
  j["killed_by_signal"] = signalled;
  j["hung"] = hung;
  if (!died.empty()) j["died"] = died;
  j["longest_call_seconds"] = longest;
  j["lock_timeout_seconds"] = std::chrono::duration<double>(kv::options{}.lock_timeout).count();
  j["acknowledged_puts"] = acked;
  j["lost_puts"] = lost;
  j["verify"] = verified;
  if (!is_full) j["error"] = "the foreign writer never reached the limit";
  sh->~qgroup_shared();
  ::munmap(mem, sizeof(qgroup_shared));
  return j;
}

// Dead versions (issue 46, item 4): a few keys (a twentieth of the volume) put over and over,
// four volumes' worth of values, once with background compaction (the default policy) and
// once with none (compaction only when a put finds no room): the volume's use, peak and at the
// end, and what the background work costs the puts.
json dead_versions_run(const config& c, const std::string& mnt) {
  json j;
  const std::uint64_t volume = c.size_mib << 20;
  const std::uint64_t per_record = record_bytes(key_of(0).size(), c.value_size);
  const std::uint64_t keys = std::max<std::uint64_t>(1, volume / 20 / per_record);
  const std::uint64_t puts = std::max<std::uint64_t>(keys, 4 * volume / per_record);
  const std::string value(c.value_size, 'v');
  for (const double fraction : {0.5, 0.0}) {
    const std::string path = mnt + (fraction > 0 ? "/background" : "/none");
    json r;
    kv::options o;
    o.segment_size = c.segment_mib << 20;
    o.compact_dead_fraction = fraction;
    const std::uint64_t used0 = used_bytes(mnt);
    double peak = 0;
    std::uint64_t failed = 0;
    std::string error;
    const auto t0 = clock_type::now();
    {
      auto opened = kv::store::open(path, o);
      if (!opened) return {{"error", opened.error().message()}};
      auto& s = **opened;
      for (std::uint64_t i = 0; i < puts; ++i) {
        if (auto p = s.put(key_of(i % keys), value); !p) {
          if (++failed == 1) error = p.error().message();
        }
        if (i % 256 == 0) peak = std::max(peak, used_pct(mnt));
      }
      r["seconds"] = seconds_since(t0);
      auto st = s.stats();
      if (st) {
        r["live_bytes"] = st->live_bytes;
        r["dead_bytes"] = st->dead_bytes;
        r["segments"] = st->segments;
        r["segment_bytes"] = st->segment_bytes;
        r["compactions"] = st->compactions;
      }
    }
    r["puts"] = puts;
    r["keys"] = keys;
    r["failed_puts"] = failed;
    if (!error.empty()) r["first_error"] = error;
    r["puts_per_s"] = static_cast<double>(puts) / r["seconds"].get<double>();
    r["peak_used_pct"] = std::max(peak, used_pct(mnt));
    r["end_used_pct"] = used_pct(mnt);
    r["device_bytes"] = used_bytes(mnt) - std::min(used_bytes(mnt), used0);
    j[fraction > 0 ? "background" : "none"] = r;
    // The next run starts on an empty volume.
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  const double on = j["background"]["puts_per_s"].get<double>();
  const double off = j["none"]["puts_per_s"].get<double>();
  j["cost_pct"] = off > 0 ? 100.0 * (1.0 - on / off) : 0.0;
  return j;
}

// Runs every round of blurt: `task(dir, t)` in `blurt_tasks` processes at once (its exit
// code: 0, or 1 after printing why), dirs in the inner loop, passes in the outer, until a
// round has a failed task.
template <class Task>
json blurt_rounds(const config& c, const std::string& mnt, Task&& task) {
  const auto start = clock_type::now();
  std::uint64_t rounds = 0;
  std::uint64_t failed = 0;
  std::uint64_t signalled = 0;
  std::map<std::string, std::uint64_t> signals;  // by name: which signal killed tasks
  for (std::size_t pass = 0; pass < c.blurt_passes && failed + signalled == 0; ++pass) {
    for (std::size_t dir = 0; dir < c.blurt_dirs && failed + signalled == 0; ++dir) {
      std::vector<pid_t> pids;
      for (std::size_t t = 0; t < c.blurt_tasks; ++t) {
        const pid_t pid = ::fork();
        if (pid == 0) ::_exit(task(dir, t));
        if (pid < 0) {
          ++failed;
          break;
        }
        pids.push_back(pid);
      }
      for (const pid_t pid : pids) {
        int status = 0;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
        if (WIFSIGNALED(status)) {
          ++signalled;
          const char* name = ::sigabbrev_np(WTERMSIG(status));
          ++signals[name != nullptr ? std::string("SIG") + name
                                    : fmt::format("signal {}", WTERMSIG(status))];
        } else if (WEXITSTATUS(status) != 0) {
          ++failed;
        }
      }
      ++rounds;
    }
  }
  return {{"seconds", seconds_since(start)},
          {"rounds", rounds},
          {"rounds_planned", c.blurt_passes * c.blurt_dirs},
          {"failed_tasks", failed},
          {"signalled_tasks", signalled},
          {"signals", signals},
          {"used_pct", used_pct(mnt)}};
}

// blurt with the store: each task opens it and puts its values one commit each.
json blurt_run(const config& c, const std::string& mnt) {
  kv::options o;
  o.segment_size = c.segment_mib << 20;
  const std::string path = mnt + "/s";
  {
    auto made = kv::store::open(path, o);
    if (!made) return {{"error", made.error().message()}};
  }
  const std::string value(c.value_size, 'b');
  json j = blurt_rounds(c, mnt, [&](std::size_t dir, std::size_t t) {
    auto s = kv::store::open(path, o);
    if (!s) {
      fmt::print(stderr, "keel-bench spacebench: blurt task {}: open: {}\n", t,
                 s.error().message());
      return 1;
    }
    for (std::size_t step = 0; step < c.blurt_steps; ++step) {
      if (auto r = (*s)->put(fmt::format("{}/f{}/{}", dir, t, step), value); !r) {
        fmt::print(stderr, "keel-bench spacebench: blurt task {} step {}: {}\n", t, step,
                   r.error().message());
        return 1;
      }
    }
    return 0;
  });
  if (auto s = kv::store::open(path, o)) {
    if (auto st = (*s)->stats()) {
      j["live_bytes"] = st->live_bytes;
      j["dead_bytes"] = st->dead_bytes;
    }
  }
  j["live_pct"] = 100.0 * static_cast<double>(c.blurt_dirs * c.blurt_tasks * c.blurt_steps) *
                  static_cast<double>(c.value_size) /
                  static_cast<double>(blurt_volume_mib(c) << 20);
  return j;
}

// The seed's blurt itself: each task creates (truncating) its file and writes its pieces.
json plain_blurt_run(const config& c, const std::string& mnt) {
  std::vector<std::byte> piece(c.value_size, std::byte{'b'});
  for (std::size_t dir = 0; dir < c.blurt_dirs; ++dir) {
    std::error_code ec;
    std::filesystem::create_directories(fmt::format("{}/{}", mnt, dir), ec);
  }
  return blurt_rounds(c, mnt, [&](std::size_t dir, std::size_t t) {
    const std::string name = fmt::format("{}/{}/f{}", mnt, dir, t);
    auto f = io::file_handle::open(
        name.c_str(), io::open_flags::write | io::open_flags::create | io::open_flags::truncate);
    if (!f) {
      fmt::print(stderr, "keel-bench spacebench: plain blurt: {}: {}\n", name, f.error().message());
      return 1;
    }
    for (std::size_t step = 0; step < c.blurt_steps; ++step) {
      if (auto w = f->write_at(static_cast<off_t>(step * c.value_size), piece); !w) {
        fmt::print(stderr, "keel-bench spacebench: plain blurt: {}: {}\n", name,
                   w.error().message());
        return 1;
      }
    }
    return 0;
  });
}

// The qgroup run's figures, for people.
void print_qgroup(std::FILE* text, const json& q) {
  const auto num = [](const json& j, const char* k) {
    return j.contains(k) && j[k].is_number() ? j[k].get<double>() : -1.0;
  };
  if (!q.contains("workers") || q.contains("error")) {
    std::string why = q.dump();
    for (const char* k : {"skipped", "died", "error"}) {
      if (q.contains(k) && q[k].is_string()) why = q[k].get<std::string>();
    }
    fmt::print(text, "  qgroup held at its limit    not measured: {}\n", why);
    return;
  }
  fmt::print(text,
             "  qgroup held at its limit    {:.1f} s, then filled and freed {:.0f} times in "
             "{:.1f} s: {} of {} processes killed by a signal, {} hung; the longest call "
             "{:.3f} s (lock_timeout {:.0f} s); {} of {} acknowledged puts lost; verify {}\n",
             num(q, "held_seconds"), num(q, "pulses"), num(q, "pulsed_seconds"),
             q["killed_by_signal"].get<std::uint64_t>(), q["processes"].get<std::uint64_t>(),
             q["hung"].get<std::uint64_t>(), num(q, "longest_call_seconds"),
             num(q, "lock_timeout_seconds"), q["lost_puts"].get<std::uint64_t>(),
             q["acknowledged_puts"].get<std::uint64_t>(), q["verify"].get<std::string>());
  for (const json& w : q["workers"]) {
    fmt::print(text,
               "    {:<28}{}{} calls: {} ok ({} after the limit went), {} refused{}, {} other{}; "
               "the longest {:.3f} s\n",
               w["role"].get<std::string>(), w["opened"].get<bool>() ? "" : "(open failed) ",
               w["calls"].get<std::uint64_t>(), w["ok"].get<std::uint64_t>(),
               w["ok_after_release"].get<std::uint64_t>(), w["refused"].get<std::uint64_t>(),
               w.contains("first_refused") ? " (" + w["first_refused"].get<std::string>() + ")"
                                           : std::string(),
               w["other_failures"].get<std::uint64_t>(),
               w.contains("first_other") ? " (" + w["first_other"].get<std::string>() + ")"
                                         : std::string(),
               num(w, "longest_call_seconds"));
  }
}

int run(const config& c) {
  std::error_code ec;
  const std::filesystem::path base =
      c.dir.empty() ? std::filesystem::temp_directory_path() : std::filesystem::path(c.dir);
  const std::string mnt = (base / fmt::format("keel-spacebench.{}", ::getpid())).string();
  std::filesystem::create_directories(mnt, ec);
  if (ec) {
    fmt::print(stderr, "keel-bench spacebench: cannot make {}: {}\n", mnt, ec.message());
    return 1;
  }
  const std::string out = mnt + ".json";
  json doc;
  doc["volume"] = c.fs;
  doc["size_mib"] = c.size_mib;
  doc["segment_mib"] = c.segment_mib;
  doc["value_size"] = c.value_size;
  doc["blurt_tasks"] = c.blurt_tasks;
  bool ok = true;
  const auto step = [&](const char* name, std::uint64_t mib, auto body) -> json {
    fmt::print(stderr, "keel-bench spacebench: {} on a {} MiB {}\n", name, mib, c.fs);
    std::filesystem::remove(out, ec);
    const int code = on_volume(c, mnt, mib, out, body);
    json j;
    if (code == cannot_mount) {
      j["skipped"] =
          fmt::format("cannot mount a {} in a private mount namespace here (needs root)", c.fs);
    } else if (code == cannot_mkfs) {
      j["skipped"] =
          fmt::format("mkfs.{} failed on a {} MiB image (missing, or too small)", c.fs, mib);
    } else if (code == cannot_loop) {
      j["skipped"] = fmt::format("cannot mount a {} image through a loop device here", c.fs);
    } else if (code < 0) {
      j["died"] = fmt::format("signal {} ({})", -code, strsignal(-code));
      ok = false;
    } else {
      std::ifstream in(out);
      try {
        in >> j;
      } catch (const std::exception&) {
        j["died"] = fmt::format("exit {}, no result", code);
        ok = false;
      }
    }
    return j;
  };
  if (c.qgroup_only) {
    doc["qgroup"] = step("writers and readers while a qgroup is held at its limit", c.size_mib,
                         [&](const std::string& m) { return qgroup_run(c, m, c.qgroup_seconds); });
    std::filesystem::remove(out, ec);
    std::filesystem::remove(mnt, ec);
    print_qgroup(c.json_path == "-" ? stderr : stdout, doc["qgroup"]);
    if (!c.json_path.empty() && !write_json("spacebench", c.json_path, doc)) return 1;
    return ok && doc["qgroup"].value("killed_by_signal", std::uint64_t{0}) == 0 ? 0 : 1;
  }
  doc["fill"] = step("fill", c.size_mib, [&](const std::string& m) { return fill_run(c, m); });
  doc["plain_files"] =
      step("plain files", c.size_mib, [&](const std::string& m) { return plain_run(c, m); });
  doc["stream_far"] = step("stream, far from full", c.stream_mib * 8,
                           [&](const std::string& m) { return stream_run(c, m); });
  doc["stream_near"] = step("stream, just over full", c.stream_mib,
                            [&](const std::string& m) { return stream_run(c, m); });
  doc["ledger"] = step("the ledger on and off, far from full", c.stream_mib * 32,
                       [&](const std::string& m) { return ledger_run(c, m); });
  doc["idle_opener"] = step("erase, compact and put beside an idle opener", c.size_mib,
                            [&](const std::string& m) { return idle_opener_run(c, m, 0); });
  doc["idle_opener_budget"] =
      step("the same under max_bytes of half the volume", c.size_mib,
           [&](const std::string& m) { return idle_opener_run(c, m, (c.size_mib << 20) / 2); });
  doc["foreign_writer"] = step("erases while a foreign writer keeps the volume full", c.size_mib,
                               [&](const std::string& m) { return foreign_writer_run(c, m); });
  doc["dead_versions"] =
      step("a few keys put over and over, background compaction on and off", c.size_mib,
           [&](const std::string& m) { return dead_versions_run(c, m); });
  if (c.fs == "btrfs" && c.qgroup_seconds > 0) {
    doc["qgroup"] = step("writers and readers while a qgroup is held at its limit", c.size_mib,
                         [&](const std::string& m) { return qgroup_run(c, m, c.qgroup_seconds); });
    if (doc["qgroup"].value("killed_by_signal", std::uint64_t{0}) != 0) ok = false;
  }
  if (c.blurt_tasks != 0) {
    doc["blurt"] =
        step("blurt", blurt_volume_mib(c), [&](const std::string& m) { return blurt_run(c, m); });
    doc["blurt_plain"] = step("blurt with plain files", blurt_volume_mib(c),
                              [&](const std::string& m) { return plain_blurt_run(c, m); });
    doc["blurt"]["volume_mib"] = blurt_volume_mib(c);
  }
  std::filesystem::remove(out, ec);
  std::filesystem::remove(mnt, ec);

  // The figures for people: on stderr when the JSON goes to stdout.
  std::FILE* text = c.json_path == "-" ? stderr : stdout;
  const json& f = doc["fill"];
  if (f.contains("skipped")) {
    fmt::print(text, "keel-bench spacebench: skipped: {}\n", f["skipped"].get<std::string>());
    return write_json("spacebench", c.json_path.empty() ? "/dev/null" : c.json_path, doc) ? 0 : 1;
  }
  const auto num = [](const json& j, const char* k) {
    return j.contains(k) && j[k].is_number() ? j[k].get<double>() : -1.0;
  };
  if (f.contains("stored")) {
    fmt::print(text, "{} {} MiB, {}, {} B values\n", c.fs, c.size_mib,
               c.segment_mib == 0 ? std::string("segments that grow from 256 KiB")
                                  : fmt::format("{} MiB segments", c.segment_mib),
               c.value_size);
    fmt::print(text,
               "  fill at first no_space      {:6.1f} % of free space ({:.1f} % with keel's "
               "per-record overhead, {:.1f} % with its index entry too); plain files {:.1f} %\n",
               num(f, "fill_pct"), num(f, "fill_with_overhead_pct"), num(f, "fill_with_index_pct"),
               num(doc["plain_files"], "fill_pct"));
    const json& sp = f["space"];
    const auto mib = [&](const char* k) { return num(sp, k) / 1048576.0; };
    fmt::print(
        text,
        "  where the space was         records {:.1f} MiB (dead {:.1f}), segments {:.1f} MiB, "
        "spare {:.1f}, deletes' room {:.1f}, index {:.1f}, checkpoint {:.1f}, other {:.1f}, "
        "free {:.1f}\n",
        mib("live_bytes"), mib("dead_bytes"), mib("segments"), mib("spare"), mib("deletes"),
        mib("index"), mib("checkpoint"), mib("other"), mib("volume_free"));
    fmt::print(text, "  half-way failures           {} (and {} after full)\n",
               f["half_way_failures"].get<std::uint64_t>(),
               f["after_full"]["half_way_failures"].get<std::uint64_t>());
    fmt::print(text,
               "  time to fail                {:.6f} s; retried after no_space: mean {:.6f} s, "
               "worst {:.6f} s\n",
               num(f, "fail_seconds"), num(f, "retry_mean_seconds"), num(f, "retry_worst_seconds"));
    fmt::print(text,
               "  after full                  {} erase failures, {} segments compacted away, "
               "{} puts fitted again\n",
               f["after_full"]["erase_failures"].get<std::uint64_t>(),
               f["after_full"]["segments_removed"].get<std::uint64_t>(),
               f["after_full"]["stored_again"].get<std::uint64_t>());
    const json& io = doc["idle_opener"];
    const json& ib = doc["idle_opener_budget"];
    const json& fw = doc["foreign_writer"];
    const auto why_not = [](const json& r) {
      for (const char* k : {"skipped", "died", "error"}) {
        if (r.contains(k)) return r[k].get<std::string>();
      }
      return std::string("no result");
    };
    if (io.contains("put_again")) {
      fmt::print(text,
                 "  beside an idle opener       {} of {} erased keys' room put again by another "
                 "process ({:.1f} %)\n",
                 io["put_again"].get<std::uint64_t>(), io["erased"].get<std::uint64_t>(),
                 num(io, "put_again_pct"));
    } else {
      fmt::print(text, "  beside an idle opener       not measured: {}\n", why_not(io));
    }
    if (ib.contains("device_bytes")) {
      fmt::print(text,
                 "  max_bytes, idle opener      {:.2f} MiB of the device for a {:.2f} MiB "
                 "budget\n",
                 num(ib, "device_bytes") / 1048576.0, num(ib, "max_bytes") / 1048576.0);
    } else {
      fmt::print(text, "  max_bytes, idle opener      not measured: {}\n", why_not(ib));
    }
    if (fw.contains("erases_tried") && !fw.contains("error")) {
      fmt::print(
          text, "  foreign writer, volume full {} of {} erases failed, the longest {:.3f} s{}\n",
          fw["erase_failures"].get<std::uint64_t>(), fw["erases_tried"].get<std::uint64_t>(),
          num(fw, "longest_erase_seconds"),
          fw.contains("first_failure") ? " (first: " + fw["first_failure"].get<std::string>() + ")"
                                       : std::string());
    } else {
      fmt::print(text, "  foreign writer, volume full not measured: {}\n", why_not(fw));
    }
    // Per put: the run into the small volume stops at its first no_space.
    const double far = num(doc["stream_far"], "seconds") / num(doc["stream_far"], "stored");
    const double near = num(doc["stream_near"], "seconds") / num(doc["stream_near"], "stored");
    if (num(doc["stream_far"], "stored") <= 0 || num(doc["stream_near"], "stored") <= 0) {
      // The run that measured nothing: its volume could not be made, or no put fitted.
      const auto why = [](const json& j) -> std::string {
        for (const char* k : {"skipped", "died", "error", "stopped"}) {
          if (j.contains(k)) return j[k].get<std::string>();
        }
        return "no put fitted";
      };
      std::string said;
      if (num(doc["stream_far"], "stored") <= 0) said = "far from full: " + why(doc["stream_far"]);
      if (num(doc["stream_near"], "stored") <= 0) {
        said +=
            (said.empty() ? "" : "; ") + std::string("just over full: ") + why(doc["stream_near"]);
      }
      fmt::print(text, "  {} MiB stream               not measured: {}\n", c.stream_mib, said);
    } else if (far > 0 && near > 0) {
      doc["near_far_ratio"] = near / far;
      fmt::print(text,
                 "  {} MiB stream, per put       far from full {:.2f} us, up to full {:.2f} us "
                 "({:.2f}x)\n",
                 c.stream_mib, far * 1e6, near * 1e6, near / far);
    }
    if (const json& l = doc["ledger"]; l.contains("charge_ns")) {
      fmt::print(text,
                 "  ledger far from full        best {:.0f} puts/s with it, {:.0f} without; cost "
                 "{:+.2f} % (median of 15 rounds); a charge and leave {:.1f} ns\n",
                 num(l, "best_on"), num(l, "best_off"), num(l, "cost_pct"), num(l, "charge_ns"));
    } else {
      fmt::print(text, "  ledger far from full        not measured: {}\n", l.dump());
    }
    if (const json& d = doc["dead_versions"]; d.contains("cost_pct")) {
      const auto row = [&](const json& r) {
        return fmt::format(
            "{:.0f} puts/s, volume used {:.1f} % at the peak and {:.1f} % at the end, {} "
            "segments for {:.1f} MiB live, {} compactions, {} failed puts",
            num(r, "puts_per_s"), num(r, "peak_used_pct"), num(r, "end_used_pct"),
            r.value("segments", std::uint64_t{0}), num(r, "live_bytes") / 1048576.0,
            r.value("compactions", std::uint64_t{0}), r.value("failed_puts", std::uint64_t{0}));
      };
      fmt::print(text, "  dead versions ({} puts over {} keys)\n",
                 d["background"].value("puts", std::uint64_t{0}),
                 d["background"].value("keys", std::uint64_t{0}));
      fmt::print(text, "    compaction in background  {}\n", row(d["background"]));
      fmt::print(text, "    only when full            {}\n", row(d["none"]));
      fmt::print(text, "    cost of the background    {:+.1f} % puts/s\n", num(d, "cost_pct"));
    } else {
      fmt::print(text, "  dead versions               not measured: {}\n",
                 doc["dead_versions"].dump());
    }
    if (doc.contains("qgroup")) print_qgroup(text, doc["qgroup"]);
    if (c.blurt_tasks != 0) {
      const json& b = doc["blurt"];
      const json& p = doc["blurt_plain"];
      const auto line = [&](const json& r) {
        if (!r.contains("seconds")) {
          return fmt::format("not measured ({})", r.contains("error")     ? r["error"].dump()
                                                  : r.contains("skipped") ? r["skipped"].dump()
                                                                          : r.dump());
        }
        std::string killed;
        if (r.contains("signals")) {
          for (const auto& [name, n] : r["signals"].items()) {
            killed += fmt::format(", {} killed by {}", n.get<std::uint64_t>(), name);
          }
        }
        return fmt::format(
            "{:.3f} s, {}/{} rounds, {} failed tasks{}, {:.1f} % used", num(r, "seconds"),
            r["rounds"].get<std::uint64_t>(), r["rounds_planned"].get<std::uint64_t>(),
            r["failed_tasks"].get<std::uint64_t>() + r["signalled_tasks"].get<std::uint64_t>(),
            killed, num(r, "used_pct"));
      };
      fmt::print(
          text,
          "  blurt ({} tasks x {} x {} B, {} dirs x {} passes, {} MiB volume, live {:.1f} %)\n",
          c.blurt_tasks, c.blurt_steps, c.value_size, c.blurt_dirs, c.blurt_passes,
          blurt_volume_mib(c), num(b, "live_pct"));
      fmt::print(text, "    keel                      {}\n", line(b));
      fmt::print(text, "    plain files               {}\n", line(p));
      // A task that failed with an error is a figure (btrfs refuses plain files too, and
      // timeouts measure how slow it got): the report shows it. One killed by a signal is a
      // crash, and fails the run.
      if (b.contains("signalled_tasks") && b["signalled_tasks"].get<std::uint64_t>() != 0) {
        ok = false;
      }
    }
  } else {
    fmt::print(stderr, "keel-bench spacebench: the fill run failed: {}\n",
               f.contains("error") ? f["error"].get<std::string>() : f.dump());
    ok = false;
  }
  if (!c.json_path.empty() && !write_json("spacebench", c.json_path, doc)) return 1;
  return ok ? 0 : 1;
}

}  // namespace

int run_spacebench_command(int argc, char** argv) {
  config c;
  CLI::App app{
      "Fill a small volume with a keel::kv store, after Tux3's out-of-space metrics: fill %, "
      "half-way failures, time to fail, deletes and compaction when full, near-full slowdown",
      "keel-bench spacebench"};
  app.add_option("--fs", c.fs,
                 "The volumes' filesystem: tmpfs, or ext4, xfs, btrfs on a loop device (the "
                 "images go in --dir)")
      ->check(CLI::IsMember({"tmpfs", "ext4", "xfs", "btrfs"}));
  app.add_option("--size-mib", c.size_mib, "The volume's size (one the run makes)")
      ->check(CLI::Range(std::uint64_t{4}, std::uint64_t{65536}));
  app.add_option("--segment-mib", c.segment_mib,
                 "The store's segment size (a power of two; 0, the default: left to the store, "
                 "whose segments then start at 256 KiB and grow)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1024}));
  app.add_option("--value-size", c.value_size, "Bytes per value")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20));
  app.add_option("--stream-mib", c.stream_mib,
                 "The dd test's stream: into a volume 8 times larger, and into one this large")
      ->check(CLI::Range(std::uint64_t{2}, std::uint64_t{4096}));
  app.add_option("--retries", c.retries, "Puts retried after the first no_space");
  app.add_option("--qgroup-seconds", c.qgroup_seconds,
                 "btrfs: how long a foreign writer holds a qgroup at its limit, then as long "
                 "filling and freeing it, while store "
                 "writers and readers work under it (0: no qgroup run)")
      ->check(CLI::Range(0.0, 600.0));
  app.add_flag("--qgroup-only", c.qgroup_only, "btrfs: only the qgroup run (--fs btrfs)");
  app.add_option("--blurt-tasks", c.blurt_tasks,
                 "blurt: processes at once in each round (0: no blurt run)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1000}));
  app.add_option("--blurt-steps", c.blurt_steps, "blurt: values each task puts")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100000}));
  app.add_option("--blurt-dirs", c.blurt_dirs, "blurt: key ranges (the seed's directories)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1000}));
  app.add_option("--blurt-passes", c.blurt_passes, "blurt: passes over every range")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1000}));
  app.add_option("--blurt-mib", c.blurt_mib,
                 "blurt: the volume's size (default: 3.5 times the live data)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{65536}));
  app.add_option("--dir", c.dir, "Where the volume's mount point goes (default: the temp dir)");
  app.add_option("--json", c.json_path, "Write every figure as JSON to this file (- : stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (c.qgroup_only && (c.fs != "btrfs" || c.qgroup_seconds <= 0)) {
    fmt::print(stderr,
               "keel-bench spacebench: --qgroup-only needs --fs btrfs and "
               "--qgroup-seconds above 0\n");
    return 2;
  }
  return run(c);
}

}  // namespace keel::tools
