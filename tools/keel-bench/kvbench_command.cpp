// keel-bench kvbench: keel::kv beside LMDB, tkrzw HashDBM, RocksDB, LevelDB, SQLite and Samba TDB
// on the seed's workload (128-bit keys, 1 KiB values), in one run on one filesystem. Every
// store gets the same keys, values and order; the report is their ratios.
//
// Each engine runs in a process of its own (its peak RSS is its own, and a crash is a failed
// row, not a failed run):
// - inserts, one put per transaction, then fetches in random order, on one thread, and the
//   fetches again on several threads; peak RSS and bytes on disk after them; then, on that
//   store, keel's fetches with its checksums off, and a read-mostly load (nine gets to a put)
//   from several threads;
// - inserts from several threads into a fresh store;
// - writers in 1 and in several processes on one store, for a fixed time (engines that allow
//   several processes);
// - durable commits (one put per commit, on stable storage when it returns) from 1 and from
//   several writers, for a fixed time, on a disk-backed directory;
// - a bulk load of a workload of its own (300 000 keys of 100-byte values by default) in
//   transactions of 1, 1 024 and 65 536 puts, each into a fresh store: what a transaction
//   costs per put as it grows (engines with transactions of several keys);
// - small values: inserts and fetches of a workload of its own (10 M keys of 100-byte values
//   in `make bench`) into a fresh store, on one thread, and what the store takes per record,
//   on disk and in memory.
// With --rounds N, every engine runs all of that N times, the engines in turn each round, and
// each figure is the median of its rounds.

#include "kvbench_command.hpp"

#include <fmt/format.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cli_util.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"
#include "kvbench_peers.hpp"
#include "lockscale_command.hpp"
#include "worker_pool.hpp"

namespace keel::tools {
namespace {

using clock_type = std::chrono::steady_clock;
using kvbench::engine;
using kvbench::kv_handle;
using nlohmann::json;

struct workload {
  std::vector<std::string> keys;
  std::vector<std::size_t> fetch_order;
  std::string value;
};

workload make_workload(std::size_t n, std::size_t value_size) {
  workload w;
  std::mt19937_64 rng(42);
  w.keys.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::string& k = w.keys.emplace_back(16, '\0');
    const std::uint64_t a = rng();
    const std::uint64_t b = rng();
    std::memcpy(k.data(), &a, 8);
    std::memcpy(k.data() + 8, &b, 8);
  }
  w.fetch_order.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    w.fetch_order[i] = i;
  std::shuffle(w.fetch_order.begin(), w.fetch_order.end(), rng);
  w.value.assign(value_size, 'v');
  for (std::size_t i = 0; i < value_size; ++i)
    w.value[i] = static_cast<char>('a' + rng() % 26);
  return w;
}

struct config {
  std::size_t keys = 200000;
  std::size_t value_size = 1024;
  unsigned threads = 2;
  unsigned processes = 2;
  unsigned durable_writers = 8;
  double seconds = 2;
  double fill_seconds = 60;       // the most an insert row may take; slower engines fill less
  std::string dir;                // where the stores of the unsynced rows go
  std::string sync_dir;           // where the stores of the durable rows go
  std::size_t txn_keys = 300000;  // the transaction rows' workload
  std::size_t txn_value_size = 100;
  std::size_t small_keys = 2'000'000;  // the small-value rows' workload (0: no such rows)
  std::size_t small_value_size = 100;
};

// The sizes of the transaction rows' transactions (puts each), and their keys in the JSON.
constexpr std::size_t txn_sizes[] = {1, 1024, 65536};
std::string txn_key(std::size_t size) {
  return fmt::format("txn_{}", size);
}

double per_second(std::size_t n, clock_type::duration d) {
  return static_cast<double>(n) / std::chrono::duration<double>(d).count();
}

// A figure from /proc/self/status ("VmRSS", "VmHWM"), in bytes; 0 when unreadable.
std::uint64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;
  }
  return 0;
}

// Bytes of blocks allocated to the files under `dir`.
std::uint64_t allocated_bytes(const std::string& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (!entry.is_regular_file()) continue;
    if (auto st = io::os().stat_at(nullptr, entry.path().c_str(), false)) total += st->allocated;
  }
  return total;
}

// CPU time this process has used so far, all its threads (an engine's own threads, such as
// keel's supplier of log pages, count), in seconds.
double cpu_seconds() {
  rusage ru{};
  ::getrusage(RUSAGE_SELF, &ru);
  const auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return s(ru.ru_utime) + s(ru.ru_stime);
}

// The peak RSS counted from now on (clear_refs 5 resets it): what this process holds now,
// its baseline.
std::uint64_t rss_baseline() {
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  return status_bytes("VmRSS");
}

// The peak RSS's growth over `baseline` as out[key] (left out when there is none).
void put_rss_growth(json& out, const char* key, std::uint64_t baseline) {
  const std::uint64_t hwm = status_bytes("VmHWM");
  if (hwm > baseline) out[key] = hwm - baseline;
}

// The CPUs this process may run on.
unsigned online_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return std::thread::hardware_concurrency();
  return static_cast<unsigned>(CPU_COUNT(&set));
}

void remove_store(const std::string& dir) {
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

// Runs body(t, i) for i in [0, n) split over `threads` threads (t: the thread's index), or
// until `limit` has passed. Returns how many ran and the wall time.
template <class Body>
std::pair<std::size_t, clock_type::duration> in_threads(std::size_t n, unsigned threads,
                                                        clock_type::duration limit, Body&& body) {
  const auto start = clock_type::now();
  std::atomic<std::size_t> done{0};
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::size_t mine = 0;
      for (std::size_t i = t; i < n; i += threads, ++mine) {
        if ((mine & 1023) == 1023 && clock_type::now() - start > limit) break;
        body(t, i);
      }
      done += mine;
    });
  }
  for (auto& t : ts)
    t.join();
  return {done.load(), clock_type::now() - start};
}

// Runs op(t, i) for i = t, t + threads, ... on `threads` threads for `seconds`, each thread
// at least once (a thread that starts only after the window, on a busy machine or under a
// sanitizer, would otherwise make the rate 0), until it returns false. Returns how many ran,
// the wall time, and whether any returned false.
template <class Op>
std::tuple<std::uint64_t, clock_type::duration, bool> for_seconds(unsigned threads, double seconds,
                                                                  Op&& op) {
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> bad{false};
  const auto start = clock_type::now();
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      std::uint64_t mine = 0;
      for (std::size_t i = t;; i += threads) {
        if (!op(t, i)) {
          bad = true;
          break;
        }
        ++mine;
        if (stop.load(std::memory_order_relaxed)) break;
      }
      done += mine;
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : ts)
    t.join();
  return {done.load(), clock_type::now() - start, bad.load()};
}

// One engine's runs, in its own process.
class engine_run {
 public:
  engine_run(const engine& e, const config& c, const workload& w, const workload& tw,
             const workload& sw)
      : e_(e), c_(c), w_(w), tw_(tw), sw_(sw) {}

  json run() {
    json out{{"name", e_.name}, {"setup", e_.setup}};
    // The peak RSS counted from here: what the workload's own arrays take is the baseline.
    const std::uint64_t rss_before = rss_baseline();
    const std::string one = c_.dir + "/" + e_.id + "-one";
    {
      auto h = open_store(one, false);
      const double cpu_start = cpu_seconds();
      const auto [n, took] = insert_all(*h, w_);
      out["insert"] = row("insert, 1 thread", per_second(n, took));
      // The CPUs the engine kept busy meanwhile (its own threads too), in CPUs.
      out["insert_cores"] =
          (cpu_seconds() - cpu_start) / std::chrono::duration<double>(took).count();
      out["keys"] = n;
      if (n < w_.keys.size()) {
        fmt::print(stderr, "keel-bench kvbench: {}: {} of {} keys in {} s; the rest is left out\n",
                   e_.name, n, w_.keys.size(), c_.fill_seconds);
      }
      for (const std::size_t i : w_.fetch_order) {
        if (i < n) fetch_order_.push_back(i);
      }
      const auto start = clock_type::now();
      fetch_each(*h, w_, fetch_order_, n, clock_type::duration::max());
      out["fetch"] = row("fetch, 1 thread", per_second(n, clock_type::now() - start));
      out["fetch_threads"] = fetch_in_threads(*h, one);
      put_rss_growth(out, "rss_bytes", rss_before);
    }
    // Closed: whatever it buffers is in its files now. The records the insert row put, as
    // they are: not scaled, so that every engine is compared on what it allocates for them.
    out["disk_bytes"] = allocated_bytes(one);
    if (e_.id == "keel") out["fetch_unchecked"] = fetch_unchecked(one);
    {
      // (After the size: its overwrites leave dead versions in the stores that log them.)
      auto h = open_store(one, false);
      out["mixed_threads"] = mixed_in_threads(*h, one);
    }
    remove_store(one);
    out["insert_threads"] = insert_in_threads();
    out["insert_process"] = in_processes(1, false, &out["insert_process_cores"]);
    out["insert_processes"] = in_processes(c_.processes, false, &out["insert_processes_cores"]);
    out["durable_1"] = durable(1);
    out["durable_n"] = durable(c_.durable_writers);
    out["durable_keys"] = durable_keys_;
    for (const std::size_t size : txn_sizes)
      out[txn_key(size)] = in_transactions(size, out);
    if (!sw_.keys.empty()) small_values(out);
    return out;
  }

 private:
  // Puts w's keys, in order, until every one is in or the fill limit has passed: how many,
  // and how long that took.
  std::pair<std::size_t, clock_type::duration> insert_all(kv_handle& h, const workload& w) const {
    const auto start = clock_type::now();
    std::size_t n = 0;
    for (; n < w.keys.size(); ++n) {
      if ((n & 1023) == 1023 && clock_type::now() - start > fill_limit()) break;
      check(h.put(w.keys[n], w.value), h, "insert");
    }
    return {n, clock_type::now() - start};
  }

  // Gets the keys of w that `order` names below `n`, in that order, each checked to come back
  // whole, until `limit` has passed (looked at every 1 024 gets): how many.
  std::size_t fetch_each(kv_handle& h, const workload& w, std::span<const std::size_t> order,
                         std::size_t n, clock_type::duration limit) const {
    std::string v;
    std::size_t fetched = 0;
    const auto start = clock_type::now();
    for (const std::size_t i : order) {
      if (i >= n) continue;
      if ((fetched & 1023) == 1023 && clock_type::now() - start > limit) break;
      check(h.get(w.keys[i], v), h, "fetch");
      if (v.size() != w.value.size()) throw std::runtime_error("fetch: a value came back short");
      ++fetched;
    }
    return fetched;
  }

  [[nodiscard]] clock_type::duration fill_limit() const {
    return std::chrono::duration_cast<clock_type::duration>(
        std::chrono::duration<double>(c_.fill_seconds));
  }
  std::unique_ptr<kv_handle> open_store(const std::string& dir, bool durable) const {
    std::string why;
    auto h = e_.open({dir, durable, w_.keys.size(), w_.value.size()}, why);
    if (!h) throw std::runtime_error(fmt::format("open {}: {}", dir, why));
    return h;
  }
  static void check(bool ok, const kv_handle& h, const char* what) {
    if (!ok) throw std::runtime_error(fmt::format("{}: {}", what, h.error()));
  }
  double row(const std::string& what, double rate) const {
    fmt::print(stderr, "keel-bench kvbench: {:<14} {:<26} {:>12.0f}/s\n", e_.name, what, rate);
    return rate;
  }
  json skipped(const std::string& what, const std::string& why) const {
    fmt::print(stderr, "keel-bench kvbench: {:<14} {:<26} n/a: {}\n", e_.name, what, why);
    return json();
  }

  // The same fetches split over c_.threads threads.
  json fetch_in_threads(kv_handle& shared, const std::string& dir) const {
    const std::string what = fmt::format("fetch, {} threads", c_.threads);
    if (e_.threading == engine::threads::none) return skipped(what, "not for threads");
    std::vector<std::unique_ptr<kv_handle>> own;
    for (unsigned t = 0; e_.threading == engine::threads::own_handle && t < c_.threads; ++t)
      own.push_back(open_store(dir, false));
    std::atomic<bool> bad{false};
    const auto [n, took] =
        in_threads(fetch_order_.size(), c_.threads, clock_type::duration::max(),
                   [&](unsigned t, std::size_t i) {
                     thread_local std::string v;
                     kv_handle& h = own.empty() ? shared : *own[t];
                     if (!h.get(w_.keys[fetch_order_[i]], v) || v.size() != w_.value.size())
                       bad = true;
                   });
    if (bad) throw std::runtime_error(what + ": a fetch failed");
    return row(what, per_second(n, took));
  }

  // The fetch row again, on the store reopened with reads that check nothing (keel's
  // options::verify_checksums off): what keel's checksums cost, against peers that check
  // nothing on read.
  json fetch_unchecked(const std::string& dir) const {
    std::string why;
    auto h = e_.open({dir, false, w_.keys.size(), w_.value.size(), false}, why);
    if (!h) throw std::runtime_error(fmt::format("open {}: {}", dir, why));
    const auto fetch_all = [&] {
      fetch_each(*h, w_, fetch_order_, w_.keys.size(), clock_type::duration::max());
    };
    // Once untimed: the reopened store maps its segments afresh, and the first touch of each
    // page is a fault the checked row (on the store that wrote them) did not take.
    fetch_all();
    const auto start = clock_type::now();
    fetch_all();
    return row("fetch, checksums off", per_second(fetch_order_.size(), clock_type::now() - start));
  }

  // c_.threads threads for c_.seconds, each going through its share of the keys in random
  // order: nine gets, then a put of a new value over the next key, and again (a read-mostly
  // service's load). Gets and puts together, per second.
  json mixed_in_threads(kv_handle& shared, const std::string& dir) const {
    const std::string what = fmt::format("mixed 90/10, {} threads", c_.threads);
    if (e_.threading == engine::threads::none) return skipped(what, "not for threads");
    if (fetch_order_.empty()) return skipped(what, "no keys were inserted");
    std::vector<std::unique_ptr<kv_handle>> own;
    for (unsigned t = 0; e_.threading == engine::threads::own_handle && t < c_.threads; ++t)
      own.push_back(open_store(dir, false));
    std::string other = w_.value;
    std::ranges::reverse(other);  // (the same size: a get still checks it)
    const auto [n, took, bad] = for_seconds(c_.threads, c_.seconds, [&](unsigned t, std::size_t i) {
      thread_local std::string v;
      kv_handle& h = own.empty() ? shared : *own[t];
      const std::string& key = w_.keys[fetch_order_[i % fetch_order_.size()]];
      const std::size_t op = i / c_.threads;  // this thread's count
      return op % 10 == 9 ? h.put(key, (op / 10) % 2 == 0 ? other : w_.value)
                          : h.get(key, v) && v.size() == w_.value.size();
    });
    if (bad) throw std::runtime_error(what + ": a get or put failed");
    return row(what, per_second(n, took));
  }

  json insert_in_threads() const {
    const std::string what = fmt::format("insert, {} threads", c_.threads);
    if (e_.threading == engine::threads::none) return skipped(what, "not for threads");
    const std::string dir = c_.dir + "/" + e_.id + "-threads";
    json rate;
    {
      auto shared = open_store(dir, false);
      std::vector<std::unique_ptr<kv_handle>> own;
      for (unsigned t = 0; e_.threading == engine::threads::own_handle && t < c_.threads; ++t)
        own.push_back(open_store(dir, false));
      std::atomic<bool> bad{false};
      const auto [n, took] =
          in_threads(w_.keys.size(), c_.threads, fill_limit(), [&](unsigned t, std::size_t i) {
            kv_handle& h = own.empty() ? *shared : *own[t];
            if (!h.put(w_.keys[i], w_.value)) bad = true;
          });
      if (bad) throw std::runtime_error(what + ": a put failed");
      rate = row(what, per_second(n, took));
    }
    remove_store(dir);
    return rate;
  }

  // `processes` forked writers, each with its own handle on one store, each putting its
  // share of the keys (over and over) for c_.seconds: puts per second, all together.
  // `cores`, when given, gets the CPUs the writers kept busy (their CPU time, all their
  // threads, over the run's time).
  json in_processes(unsigned processes, bool durable = false, json* cores = nullptr) const {
    const std::string what =
        durable ? fmt::format("durable, {} processes", processes)
                : fmt::format("insert, {} process{}", processes, processes == 1 ? "" : "es");
    if (!e_.multi_process) return skipped(what, "one process at a time");
    const std::string dir =
        (durable ? c_.sync_dir : c_.dir) + "/" + e_.id + fmt::format("-p{}", processes);
    // Made (and loaded, for the durable rows), and closed again before the fork.
    if (durable) {
      preload(dir);
    } else {
      open_store(dir, false).reset();
    }
    run_options ro;
    ro.workers = processes;
    ro.duration = std::chrono::duration<double>(c_.seconds);
    std::unique_ptr<kv_handle> mine;  // each worker's own, in its own process
    const std::size_t n = w_.keys.size();
    // (Opened before the start: a slow open, a sanitizer's or a busy machine's, must not eat
    // the timed run.)
    ro.setup = [&](worker_context& ctx) {
      std::string why;
      mine = e_.open({dir, durable, n, w_.value.size()}, why);
      if (!mine) ctx.fail("open: " + why);
    };
    const run_result r = run_workers(ro, [&](worker_context& ctx) {
      if (!mine) return;
      for (std::size_t i = ctx.index(); !ctx.stopping(); i += processes) {
        if (!mine->put(w_.keys[i % n], durable ? changed_value(i) : w_.value)) {
          ctx.fail("put: " + mine->error());
          return;
        }
        ctx.count();
      }
    });
    remove_store(dir);
    if (r.failures != 0) throw std::runtime_error(what + ": " + r.first_error);
    if (cores != nullptr) *cores = (r.user_cpu + r.system_cpu) / r.seconds;
    return row(what, static_cast<double>(r.total()) / r.seconds);
  }

  // The store of a durable row, made at `dir` and loaded with the workload's keys before the
  // timed commits (the "durable commits on a store of 1 M keys": a fresh store would
  // hold only the few thousand keys a row puts in its seconds). Loaded without syncs, in
  // transactions of at most 256 KiB (keel's must fit a segment, 1 MiB on a small volume),
  // within the fill limit; then closed, and the machine synced (sync(2)), so that the timed
  // commits pay for no writeback but their own. The keys it put are the row's durable_keys.
  void preload(const std::string& dir) const {
    auto h = open_store(dir, false);
    const std::span<const std::string> keys(w_.keys);
    const std::size_t per_txn = std::max<std::size_t>(1, (256 * 1024) / (w_.value.size() + 64));
    const auto start = clock_type::now();
    std::size_t n = 0;
    while (n < keys.size() && clock_type::now() - start <= fill_limit()) {
      const std::size_t take = std::min(per_txn, keys.size() - n);
      if (e_.transactions) {
        check(h->put_all(keys.subspan(n, take), w_.value), *h, "preload");
      } else {
        for (std::size_t i = n; i < n + take; ++i)
          check(h->put(keys[i], w_.value), *h, "preload");
      }
      n += take;
    }
    h.reset();
    ::sync();
    durable_keys_ = n;
  }

  // The value of a durable row's put number i (over the workload's keys, again and again):
  // never the one its key holds, so that every commit changes something (TDB commits a
  // transaction whose put found the same bytes without a sync).
  [[nodiscard]] const std::string& changed_value(std::size_t i) const {
    return (i / w_.keys.size()) % 2 == 0 ? other_value_ : w_.value;
  }

  // Durable puts from `writers` writers for c_.seconds, on a store loaded with the keys
  // (preload): threads of one process where the engine allows threads, else processes.
  json durable(unsigned writers) const {
    if (e_.threading == engine::threads::none) return in_processes(writers, true);
    const std::string what = fmt::format("durable, {} thread{}", writers, writers == 1 ? "" : "s");
    const std::string dir = c_.sync_dir + "/" + e_.id + fmt::format("-d{}", writers);
    json rate;
    preload(dir);
    {
      auto shared = open_store(dir, true);
      std::vector<std::unique_ptr<kv_handle>> own;
      for (unsigned t = 0; e_.threading == engine::threads::own_handle && t < writers; ++t)
        own.push_back(open_store(dir, true));
      const std::size_t n = w_.keys.size();
      const auto [puts, took, bad] =
          for_seconds(writers, c_.seconds, [&](unsigned t, std::size_t i) {
            kv_handle& h = own.empty() ? *shared : *own[t];
            return h.put(w_.keys[i % n], changed_value(i));
          });
      if (bad) throw std::runtime_error(what + ": a put failed");
      rate = row(what, per_second(puts, took));
    }
    remove_store(dir);
    return rate;
  }

  // The transaction workload put into a fresh store, `size` puts per transaction, until every
  // key is in or the fill limit has passed: puts per second. A failure (keel's transaction
  // must fit one segment: too_large on a small volume) is a gap in the row, said in
  // `out["txn_failed"]`, not a failed run.
  json in_transactions(std::size_t size, json& out) const {
    const std::string what = fmt::format("load, txns of {}", std::min(size, tw_.keys.size()));
    if (!e_.transactions) return skipped(what, "no transactions of several keys");
    const std::string dir = c_.dir + "/" + e_.id + fmt::format("-t{}", size);
    json rate;
    {
      std::string why;
      auto h = e_.open({dir, false, tw_.keys.size(), tw_.value.size()}, why);
      if (!h) throw std::runtime_error(fmt::format("open {}: {}", dir, why));
      const std::span<const std::string> keys(tw_.keys);
      const auto start = clock_type::now();
      std::size_t n = 0;
      while (n < keys.size() && clock_type::now() - start <= fill_limit()) {
        const std::size_t take = std::min(size, keys.size() - n);
        if (!h->put_all(keys.subspan(n, take), tw_.value)) {
          out["txn_failed"][txn_key(size)] = h->error();
          rate = skipped(what, h->error());
          break;
        }
        n += take;
      }
      if (!out.contains("txn_failed") || !out["txn_failed"].contains(txn_key(size))) {
        rate = row(what, per_second(n, clock_type::now() - start));
        out["txn_keys_" + std::to_string(size)] = n;
      }
    }
    remove_store(dir);
    return rate;
  }

  // The small-value workload put into a fresh store on one thread (until the fill limit),
  // then fetched in random order; with the peak RSS growth and the bytes on disk of those
  // records. Figures as "small_*" in `out`.
  void small_values(json& out) const {
    const std::string what = fmt::format("{} B values", sw_.value.size());
    const std::string dir = c_.dir + "/" + e_.id + "-small";
    const std::uint64_t rss_before = rss_baseline();  // the peak RSS counted from here
    {
      std::string why;
      auto h = e_.open({dir, false, sw_.keys.size(), sw_.value.size()}, why);
      if (!h) throw std::runtime_error(fmt::format("open {}: {}", dir, why));
      const auto [n, took] = insert_all(*h, sw_);
      out["small_insert"] = row("insert, " + what, per_second(n, took));
      out["small_keys"] = n;
      if (n < sw_.keys.size()) {
        fmt::print(stderr,
                   "keel-bench kvbench: {}: {} of {} small keys in {} s; the rest is left out\n",
                   e_.name, n, sw_.keys.size(), c_.fill_seconds);
      }
      // In random order, so a fetch cut short by the fill limit (an engine whose gets of
      // 10 M keys would take minutes) has fetched a random sample.
      const auto start = clock_type::now();
      const std::size_t fetched = fetch_each(*h, sw_, sw_.fetch_order, n, fill_limit());
      out["small_fetch"] = row("fetch, " + what, per_second(fetched, clock_type::now() - start));
      out["small_fetched"] = fetched;
      if (fetched < n) {
        fmt::print(stderr, "keel-bench kvbench: {}: fetched {} of its {} small keys in {} s\n",
                   e_.name, fetched, n, c_.fill_seconds);
      }
      put_rss_growth(out, "small_rss_bytes", rss_before);
    }
    out["small_disk_bytes"] = allocated_bytes(dir);
    remove_store(dir);
  }

  const engine& e_;
  const config& c_;
  const workload& w_;
  const workload& tw_;
  const workload& sw_;
  std::vector<std::size_t> fetch_order_;  // the workload's, of the keys the insert row put
  mutable std::size_t durable_keys_ = 0;  // the keys the last durable row's store held
  // The workload's value reversed: as long, other bytes (where they differ at all).
  const std::string other_value_{w_.value.rbegin(), w_.value.rend()};
};

// The figures, one row per workload, one column per engine, on stdout.
// An engine's figures over its rounds: each number the median of the rounds that gave it (of
// an even number, the lower middle one: a figure some round measured), the rest as the first
// round that has them has them (a row failed in any round says so).
json median_of_rounds(const std::vector<json>& rounds) {
  json out = json::object();
  for (const json& r : rounds) {
    for (const auto& [name, value] : r.items()) {
      if (!out.contains(name)) out[name] = value;
    }
  }
  for (auto& [name, value] : out.items()) {
    if (!value.is_number()) continue;
    std::vector<const json*> seen;
    for (const json& r : rounds) {
      if (const auto at = r.find(name); at != r.end() && at->is_number()) seen.push_back(&*at);
    }
    std::ranges::sort(seen, {}, [](const json* v) { return v->get<double>(); });
    value = *seen[(seen.size() - 1) / 2];
  }
  return out;
}

void print_table(const json& doc, const std::vector<const engine*>& chosen) {
  const auto txn_label = [&](std::size_t size) {
    return fmt::format("load, txns of {}", std::min(size, doc["txn_keys"].get<std::size_t>()));
  };
  const std::vector<std::pair<std::string, std::string>> rows{
      {"insert", "insert, 1 thread"},
      {"insert_cores", "  CPUs busy, 1 thread"},
      {"fetch", "fetch, 1 thread"},
      {"fetch_unchecked", "fetch, checksums off"},
      {"fetch_threads", fmt::format("fetch, {} threads", doc["threads"].get<unsigned>())},
      {"insert_threads", fmt::format("insert, {} threads", doc["threads"].get<unsigned>())},
      {"mixed_threads", fmt::format("mixed 90/10, {} threads", doc["threads"].get<unsigned>())},
      {"insert_process", "insert, 1 process"},
      {"insert_processes", fmt::format("insert, {} processes", doc["processes"].get<unsigned>())},
      {"insert_process_cores", "  CPUs busy, 1 process"},
      {"insert_processes_cores",
       fmt::format("  CPUs busy, {} processes", doc["processes"].get<unsigned>())},
      {"durable_1", "durable, 1 writer"},
      {"durable_n", fmt::format("durable, {} writers", doc["durable_writers"].get<unsigned>())},
      {txn_key(txn_sizes[0]), txn_label(txn_sizes[0])},
      {txn_key(txn_sizes[1]), txn_label(txn_sizes[1])},
      {txn_key(txn_sizes[2]), txn_label(txn_sizes[2])},
      {"rss_bytes", "peak RSS growth MiB"},
      {"disk_bytes", "on disk MiB"},
      {"small_insert",
       fmt::format("insert, {} B values", doc["small_value_size"].get<std::size_t>())},
      {"small_fetch",
       fmt::format("fetch, {} B values", doc["small_value_size"].get<std::size_t>())},
      {"small_rss_bytes", "  peak RSS growth B/record"},
      {"small_disk_bytes", "  on disk B/record"},
  };
  fmt::print("{:<28}", "ops/s");
  for (const auto* e : chosen)
    fmt::print(" {:>13}", e->name.substr(0, 13));
  fmt::print("\n");
  for (const auto& [key, label] : rows) {
    fmt::print("{:<28}", label);
    const bool mib = key.ends_with("_bytes");
    const bool per_record = key.starts_with("small_") && mib;
    for (const auto* e : chosen) {
      const auto& r = doc["engines"][e->id];
      if (r.contains("error")) {
        fmt::print(" {:>13}", "failed");
      } else if (!r.contains(key) || r[key].is_null()) {
        fmt::print(" {:>13}", "n/a");
      } else {
        if (key.ends_with("_cores")) {
          fmt::print(" {:>13.2f}", r[key].get<double>());
        } else if (per_record) {
          fmt::print(" {:>13.1f}", r[key].get<double>() / r["small_keys"].get<double>());
        } else if (mib) {
          fmt::print(" {:>13.1f}", r[key].get<double>() / 1048576.0);
        } else {
          fmt::print(" {:>13.0f}", r[key].get<double>());
        }
      }
    }
    fmt::print("\n");
  }
}

}  // namespace

int run_kvbench_command(int argc, char** argv) {
  CLI::App app{kvbench_command_summary, "keel-bench kvbench"};
  config c;
  std::string peers;
  std::string json_path;
  unsigned rounds = 1;
  app.add_option("--keys", c.keys, "Keys inserted and fetched (16-byte random keys)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000'000}));
  app.add_option("--value-size", c.value_size, "Bytes per value")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20));
  app.add_option("--threads", c.threads, "Threads of the threaded fetch and insert rows")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--processes", c.processes, "Writer processes of the multi-process row")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--durable-writers", c.durable_writers,
                 "Writers of the many-writer durable row (threads; processes for TDB)")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--seconds", c.seconds, "How long each timed row (processes, durable) runs")
      ->check(CLI::Range(0.1, 600.0));
  app.add_option("--fill-seconds", c.fill_seconds,
                 "The most an insert row may take: an engine that has not put every key by "
                 "then goes on with the keys it did (the small values' fetch row stops there "
                 "too, with a random sample fetched)")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--peers", peers,
                 "Comma-separated engines to run (default all): keel,lmdb,tkrzw,rocksdb,"
                 "leveldb,sqlite,tdb");
  app.add_option("--dir", c.dir, "Where the stores go (default: a fresh directory on /dev/shm)");
  app.add_option("--sync-dir", c.sync_dir,
                 "Where the stores of the durable rows go: a disk, for fdatasync to mean "
                 "something (default: a fresh directory under /var/tmp)");
  app.add_option("--txn-keys", c.txn_keys,
                 "Keys the transaction rows load, in transactions of 1, 1024 and 65536 puts")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000'000}));
  app.add_option("--txn-value-size", c.txn_value_size, "Bytes per value of the transaction rows")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20));
  app.add_option("--small-keys", c.small_keys,
                 "Keys the small-value rows insert and fetch (0: no such rows)")
      ->check(CLI::Range(std::size_t{0}, std::size_t{100'000'000}));
  app.add_option("--small-value-size", c.small_value_size,
                 "Bytes per value of the small-value rows")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20));
  app.add_option("--rounds", rounds,
                 "Runs of every engine's rows, the engines in turn each round: each figure is "
                 "the median of its rounds (of an even number, the lower middle one); an "
                 "engine that did not put or fetch every key within --fill-seconds runs the "
                 "first round only")
      ->check(CLI::Range(1u, 15u));
  app.add_option("--json", json_path, "Write the figures as JSON to this file (- for stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  std::vector<const engine*> chosen;
  for (const auto& e : kvbench::engines()) {
    if (peers.empty() || ("," + peers + ",").find("," + e.id + ",") != std::string::npos)
      chosen.push_back(&e);
  }
  for (std::size_t at = 0; !peers.empty() && at <= peers.size();) {
    const std::size_t comma = std::min(peers.find(',', at), peers.size());
    const std::string id = peers.substr(at, comma - at);
    const auto& all = kvbench::engines();
    if (std::none_of(all.begin(), all.end(), [&](const engine& e) { return e.id == id; })) {
      fmt::print(stderr, "keel-bench kvbench: --peers: no engine '{}'\n", id);
      return 2;
    }
    at = comma + 1;
  }
  auto scratch = scratch_dir::make(c.dir);
  if (!scratch) {
    fmt::print(stderr, "keel-bench kvbench: cannot make a directory in {}: {}\n",
               c.dir.empty() ? "the default place" : c.dir, scratch.error().message());
    return 1;
  }
  auto sync_scratch = scratch_dir::make(c.sync_dir.empty() ? "/var/tmp" : c.sync_dir);
  if (!sync_scratch) {
    fmt::print(stderr, "keel-bench kvbench: cannot make a directory in {}: {}\n",
               c.sync_dir.empty() ? "/var/tmp" : c.sync_dir, sync_scratch.error().message());
    return 1;
  }
  c.dir = scratch->path;
  c.sync_dir = sync_scratch->path;
  const auto fs_name = [](const std::string& path) {
    auto info = io::stat_fs(path.c_str());
    return info ? std::string(info->type_name()) : std::string("unknown");
  };
  const workload w = make_workload(c.keys, c.value_size);
  const workload tw = make_workload(c.txn_keys, c.txn_value_size);
  const workload sw = make_workload(c.small_keys, c.small_value_size);
  fmt::print(stderr,
             "keel-bench kvbench: {} keys, {} B values, in {} ({}); durable rows in {} ({})\n",
             c.keys, c.value_size, c.dir, fs_name(c.dir), c.sync_dir, fs_name(c.sync_dir));
  json doc{{"keys", c.keys},
           {"value_size", c.value_size},
           {"threads", c.threads},
           {"processes", c.processes},
           {"durable_writers", c.durable_writers},
           {"seconds", c.seconds},
           {"fill_seconds", c.fill_seconds},
           {"txn_keys", c.txn_keys},
           {"txn_value_size", c.txn_value_size},
           {"small_keys", c.small_keys},
           {"small_value_size", c.small_value_size},
           {"rounds", rounds},
           {"cpus", online_cpus()},
           {"filesystem", fs_name(c.dir)},
           {"sync_filesystem", fs_name(c.sync_dir)},
           {"order", json::array()},
           {"engines", json::object()}};
  // Round by round, the engines in turn: a slow spell of a busy machine falls on one round of
  // one engine, and the median of its rounds leaves it out.
  std::map<std::string, std::vector<json>> figures;
  std::map<std::string, json> failed;  // engine -> [{round, error}]
  // An engine that could not put (or fetch) every key within the fill limit in the first
  // round runs that round only: later rounds would spend the same minutes on the same limits
  // (TDB, SQLite and RocksDB took most of an hour's run that way), and its figures are
  // whatever that round measured.
  std::set<std::string> one_round;
  const auto fell_short = [&](const json& f) {
    return f.value("keys", c.keys) < c.keys || f.value("small_keys", c.small_keys) < c.small_keys ||
           f.value("small_fetched", c.small_keys) < f.value("small_keys", c.small_keys);
  };
  for (unsigned round = 1; round <= rounds; ++round) {
    if (std::ranges::all_of(chosen, [&](const engine* e) { return one_round.contains(e->id); }))
      break;
    if (rounds > 1) fmt::print(stderr, "keel-bench kvbench: round {} of {}\n", round, rounds);
    for (const auto* e : chosen) {
      if (one_round.contains(e->id)) continue;
      // The figures come back through a file of the scratch directory.
      const child_outcome got = run_in_child(
          [&] { return engine_run(*e, c, w, tw, sw).run().dump(); }, c.dir + "/" + e->id + ".json");
      if (got.ok) {
        figures[e->id].push_back(json::parse(got.output));
        if (round == 1 && rounds > 1 && fell_short(figures[e->id].back())) {
          one_round.insert(e->id);
          fmt::print(stderr,
                     "keel-bench kvbench: {}: did not put or fetch every key within {} s: it "
                     "runs this round only\n",
                     e->name, c.fill_seconds);
        }
      } else {
        fmt::print(stderr, "keel-bench kvbench: {}: {}\n", e->name, got.error);
        failed[e->id].push_back({{"round", round}, {"error", got.error}});
      }
    }
  }
  for (const auto* e : chosen) {
    doc["order"].push_back(e->id);
    const auto f = failed.find(e->id);
    if (figures[e->id].empty()) {
      doc["engines"][e->id] = {
          {"name", e->name}, {"setup", e->setup}, {"error", f->second.front()["error"]}};
      continue;
    }
    // A round that failed takes nothing from the others': the figures are theirs, and the
    // failure is on record beside them.
    doc["engines"][e->id] = median_of_rounds(figures[e->id]);
    // Each round's own figures too, when there were several: the spread is on record.
    if (rounds > 1) doc["engines"][e->id]["each_round"] = figures[e->id];
    if (one_round.contains(e->id)) doc["engines"][e->id]["one_round"] = true;
    if (f != failed.end()) doc["engines"][e->id]["failed_rounds"] = f->second;
  }
  print_table(doc, chosen);
  if (!json_path.empty() && !write_json("kvbench", json_path, doc)) return 1;
  // keel failing (in any round) is a failed run; a peer failing is a gap in the table, or a
  // round fewer in its medians, said above.
  return doc["engines"].contains("keel") && (doc["engines"]["keel"].contains("error") ||
                                             doc["engines"]["keel"].contains("failed_rounds"))
             ? 1
             : 0;
}

}  // namespace keel::tools
