// keel kvbench: keel::kv beside LMDB on the seed's workload (128-bit keys, 1 KiB values):
// inserts, one per transaction, then fetches in random order, one thread, and the same
// inserts from several threads, and from several processes. Both stores get the same keys,
// values and order in the same run; the report is their ratio.

#include "kvbench_command.hpp"

#include <fmt/format.h>
#include <lmdb.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cli_util.hpp"
#include "keel/kv/store.hpp"
#include "lockscale_command.hpp"
#include "worker_pool.hpp"

namespace keel::tools {
namespace {

using clock_type = std::chrono::steady_clock;

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
    std::string k(16, '\0');
    const std::uint64_t a = rng();
    const std::uint64_t b = rng();
    std::memcpy(k.data(), &a, 8);
    std::memcpy(k.data() + 8, &b, 8);
    w.keys.push_back(std::move(k));
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

struct figures {
  double insert_per_s = 0;
  double fetch_per_s = 0;
  double insert_threads_per_s = 0;
  double insert_processes_per_s = 0;
};

// `processes` forked writers, each putting its share of the keys (over and over) into the
// store at `path` for `seconds`, one transaction per put: puts per second, all together.
// `start` runs in each worker and returns its put function (or an error message).
result<double> in_processes(
    unsigned processes, double seconds,
    const std::function<std::function<bool(std::size_t)>(std::string&)>& start, std::size_t keys) {
  run_options ro;
  ro.workers = processes;
  ro.duration = std::chrono::duration<double>(seconds);
  const run_result r = run_workers(ro, [&](worker_context& ctx) {
    std::string why;
    auto put = start(why);
    if (!put) {
      ctx.fail(why);
      return;
    }
    for (std::size_t i = ctx.index(); !ctx.stopping(); i += processes) {
      if (!put(i % keys)) {
        ctx.fail("a put failed");
        return;
      }
      ctx.count();
    }
  });
  if (r.failures != 0) {
    fmt::print(stderr, "keel kvbench: a writer process failed: {}\n", r.first_error);
    return errc_error(std::errc::io_error);
  }
  return static_cast<double>(r.total()) / r.seconds;
}

double per_second(std::size_t n, clock_type::duration d) {
  return static_cast<double>(n) / std::chrono::duration<double>(d).count();
}

// Runs `body(i)` for i in [0, n) split over `threads` threads; returns the wall time.
template <class Body>
clock_type::duration in_threads(std::size_t n, unsigned threads, Body&& body) {
  const auto start = clock_type::now();
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      for (std::size_t i = t; i < n; i += threads)
        body(i);
    });
  }
  for (auto& t : ts)
    t.join();
  return clock_type::now() - start;
}

result<figures> run_keel(const std::string& dir, const workload& w, unsigned threads,
                         unsigned processes, double seconds) {
  figures f;
  kv::options o;
  auto s = kv::store::open(dir + "/keel", o);
  if (!s) return std::unexpected(s.error());
  const std::size_t n = w.keys.size();
  auto start = clock_type::now();
  for (std::size_t i = 0; i < n; ++i) {
    if (auto r = (*s)->put(w.keys[i], w.value); !r) return std::unexpected(r.error());
  }
  f.insert_per_s = per_second(n, clock_type::now() - start);
  start = clock_type::now();
  std::size_t bytes = 0;
  for (const std::size_t i : w.fetch_order) {
    auto v = (*s)->get(w.keys[i]);
    if (!v) return std::unexpected(v.error());
    bytes += v->size();
  }
  f.fetch_per_s = per_second(n, clock_type::now() - start);
  if (bytes != n * w.value.size()) return errc_error(std::errc::bad_message);
  std::atomic<bool> bad{false};
  auto s2 = kv::store::open(dir + "/keel-threads", o);
  if (!s2) return std::unexpected(s2.error());
  const auto took = in_threads(n, threads, [&](std::size_t i) {
    if (!(*s2)->put(w.keys[i], w.value)) bad = true;
  });
  if (bad) return errc_error(std::errc::io_error);
  f.insert_threads_per_s = per_second(n, took);
  s2->reset();
  const std::string shared = dir + "/keel-processes";
  if (auto made = kv::store::open(shared, o); !made) return std::unexpected(made.error());
  std::unique_ptr<kv::store> mine;  // each worker's own, in its own process
  auto procs = in_processes(
      processes, seconds,
      [&](std::string& why) -> std::function<bool(std::size_t)> {
        auto opened = kv::store::open(shared, o);
        if (!opened) {
          why = opened.error().message();
          return {};
        }
        mine = std::move(*opened);
        return [&](std::size_t i) { return mine->put(w.keys[i], w.value).has_value(); };
      },
      n);
  if (!procs) return std::unexpected(procs.error());
  f.insert_processes_per_s = *procs;
  return f;
}

result<figures> run_lmdb(const std::string& dir, const workload& w, unsigned threads,
                         unsigned processes, double seconds) {
  figures f;
  const std::size_t n = w.keys.size();
  const auto open_env = [&](const std::string& path, MDB_env** env, MDB_dbi* dbi) -> int {
    std::filesystem::create_directories(path);
    int rc = mdb_env_create(env);
    if (rc == 0) rc = mdb_env_set_mapsize(*env, (n * (w.value.size() + 128)) * 3 + (64 << 20));
    if (rc == 0) rc = mdb_env_set_maxreaders(*env, 256);
    // Durability as keel's `none`: a process crash loses nothing, the OS writes back.
    if (rc == 0) rc = mdb_env_open(*env, path.c_str(), MDB_NOSYNC | MDB_NOMETASYNC, 0644);
    MDB_txn* txn = nullptr;
    if (rc == 0) rc = mdb_txn_begin(*env, nullptr, 0, &txn);
    if (rc == 0) rc = mdb_dbi_open(txn, nullptr, 0, dbi);
    if (rc == 0) rc = mdb_txn_commit(txn);
    return rc;
  };
  const auto put = [&](MDB_env* env, MDB_dbi dbi, std::size_t i) -> int {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env, nullptr, 0, &txn);
    if (rc != 0) return rc;
    MDB_val k{w.keys[i].size(), const_cast<char*>(w.keys[i].data())};
    MDB_val v{w.value.size(), const_cast<char*>(w.value.data())};
    rc = mdb_put(txn, dbi, &k, &v, 0);
    if (rc != 0) {
      mdb_txn_abort(txn);
      return rc;
    }
    return mdb_txn_commit(txn);
  };
  MDB_env* env = nullptr;
  MDB_dbi dbi = 0;
  if (int rc = open_env(dir + "/lmdb", &env, &dbi); rc != 0) return errno_error(rc);
  auto start = clock_type::now();
  for (std::size_t i = 0; i < n; ++i) {
    if (int rc = put(env, dbi, i); rc != 0) return errno_error(rc);
  }
  f.insert_per_s = per_second(n, clock_type::now() - start);
  MDB_txn* rtxn = nullptr;
  if (int rc = mdb_txn_begin(env, nullptr, MDB_RDONLY, &rtxn); rc != 0) return errno_error(rc);
  mdb_txn_reset(rtxn);
  start = clock_type::now();
  std::size_t bytes = 0;
  for (const std::size_t i : w.fetch_order) {
    // A read transaction per fetch, as keel's get takes a snapshot per call: LMDB's
    // cheapest form (renew a reset one). The value is copied out, as keel's get does.
    if (int rc = mdb_txn_renew(rtxn); rc != 0) return errno_error(rc);
    MDB_val k{w.keys[i].size(), const_cast<char*>(w.keys[i].data())};
    MDB_val v{};
    if (int rc = mdb_get(rtxn, dbi, &k, &v); rc != 0)
      return errno_error(rc == MDB_NOTFOUND ? ENOENT : rc);
    std::string copy(static_cast<const char*>(v.mv_data), v.mv_size);
    bytes += copy.size();
    mdb_txn_reset(rtxn);
  }
  f.fetch_per_s = per_second(n, clock_type::now() - start);
  mdb_txn_abort(rtxn);
  mdb_env_close(env);
  if (bytes != n * w.value.size()) return errc_error(std::errc::bad_message);
  if (int rc = open_env(dir + "/lmdb-threads", &env, &dbi); rc != 0) return errno_error(rc);
  std::atomic<bool> bad{false};
  const auto took = in_threads(n, threads, [&](std::size_t i) {
    if (put(env, dbi, i) != 0) bad = true;
  });
  mdb_env_close(env);
  if (bad) return errc_error(std::errc::io_error);
  f.insert_threads_per_s = per_second(n, took);
  const std::string shared = dir + "/lmdb-processes";
  if (int rc = open_env(shared, &env, &dbi); rc != 0) return errno_error(rc);
  mdb_env_close(env);
  MDB_env* mine = nullptr;  // each worker's own environment, in its own process
  MDB_dbi mine_dbi = 0;
  auto procs = in_processes(
      processes, seconds,
      [&](std::string& why) -> std::function<bool(std::size_t)> {
        if (int rc = open_env(shared, &mine, &mine_dbi); rc != 0) {
          why = mdb_strerror(rc);
          return {};
        }
        return [&](std::size_t i) { return put(mine, mine_dbi, i) == 0; };
      },
      n);
  if (!procs) return std::unexpected(procs.error());
  f.insert_processes_per_s = *procs;
  return f;
}

}  // namespace

int run_kvbench_command(int argc, char** argv) {
  CLI::App app{kvbench_command_summary, "keel kvbench"};
  std::size_t keys = 200000;
  std::size_t value_size = 1024;
  unsigned threads = 2;
  unsigned processes = 2;
  double seconds = 2;
  std::string dir;
  std::string json;
  app.add_option("--keys", keys, "Keys inserted and fetched (16-byte random keys)")
      ->check(CLI::Range(std::size_t{1}, std::size_t{100'000'000}));
  app.add_option("--value-size", value_size, "Bytes per value")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 20));
  app.add_option("--threads", threads, "Writer threads of the threaded insert row")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--processes", processes, "Writer processes of the multi-process insert row")
      ->check(CLI::Range(1u, 256u));
  app.add_option("--seconds", seconds, "How long the multi-process row runs")
      ->check(CLI::Range(0.1, 600.0));
  app.add_option("--dir", dir, "Where the stores go (default: a fresh directory on /dev/shm)");
  app.add_option("--json", json, "Write the figures as JSON to this file (- for stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  auto scratch = scratch_dir::make(dir);
  if (!scratch) {
    fmt::print(stderr, "keel kvbench: {}\n", scratch.error().message());
    return 1;
  }
  const workload w = make_workload(keys, value_size);
  fmt::print(stderr, "keel kvbench: {} keys, {} B values, in {}\n", keys, value_size,
             scratch->path);
  auto k = run_keel(scratch->path, w, threads, processes, seconds);
  if (!k) {
    fmt::print(stderr, "keel kvbench: keel: {}\n", k.error().message());
    return 1;
  }
  auto l = run_lmdb(scratch->path, w, threads, processes, seconds);
  if (!l) {
    fmt::print(stderr, "keel kvbench: lmdb: {}\n", l.error().message());
    return 1;
  }
  fmt::print("{:<28} {:>14} {:>14} {:>8}\n", "workload", "keel ops/s", "LMDB ops/s", "ratio");
  const auto row = [](const char* name, double a, double b) {
    fmt::print("{:<28} {:>14.0f} {:>14.0f} {:>7.2f}x\n", name, a, b, a / b);
  };
  row("insert, 1 thread", k->insert_per_s, l->insert_per_s);
  row("fetch, 1 thread", k->fetch_per_s, l->fetch_per_s);
  row(fmt::format("insert, {} threads", threads).c_str(), k->insert_threads_per_s,
      l->insert_threads_per_s);
  row(fmt::format("insert, {} processes", processes).c_str(), k->insert_processes_per_s,
      l->insert_processes_per_s);
  if (!json.empty()) {
    nlohmann::json doc{{"keys", keys},
                       {"value_size", value_size},
                       {"threads", threads},
                       {"processes", processes},
                       {"keel",
                        {{"insert", k->insert_per_s},
                         {"fetch", k->fetch_per_s},
                         {"insert_threads", k->insert_threads_per_s},
                         {"insert_processes", k->insert_processes_per_s}}},
                       {"lmdb",
                        {{"insert", l->insert_per_s},
                         {"fetch", l->fetch_per_s},
                         {"insert_threads", l->insert_threads_per_s},
                         {"insert_processes", l->insert_processes_per_s}}}};
    if (!write_json("kvbench", json, doc)) return 1;
  }
  return 0;
}

}  // namespace keel::tools
