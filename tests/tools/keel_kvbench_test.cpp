// keel-bench kvbench, run as a user would: keel and every peer on one workload, each
// engine's figures in the JSON, nothing left behind, and bad arguments refused.

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

TEST(KeelKvbench, MeasuresKeelAndEveryPeerOnTheSameWorkload) {
  keel::test::temp_dir dir;
  const std::string json = dir.file("kv.json");
#ifdef KEEL_TSAN_BUILD
  // The peers' own synchronisation (atomics in libraries that are not instrumented:
  // tkrzw's locks, RocksDB's write queue) is invisible to ThreadSanitizer, which then
  // reports their threads' accesses as races that are not keel's: keel alone here.
  const std::vector<std::string> peers{"--peers", "keel"};
#else
  const std::vector<std::string> peers;
#endif
  std::vector<std::string> args{"kvbench",
                                "--keys",
                                "2000",
                                "--seconds",
                                "0.2",
                                "--durable-writers",
                                "3",
                                "--dir",
                                dir.path().string(),
                                "--sync-dir",
                                dir.path().string(),
                                "--json",
                                json,
                                "--txn-keys",
                                "3000",
                                "--small-keys",
                                "1500",
                                "--small-value-size",
                                "100"};
  args.insert(args.end(), peers.begin(), peers.end());
  const auto r = run_program(KEEL_BENCH_BINARY, args, dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  const auto& engines = doc["engines"];
  ASSERT_EQ(doc["order"].size(), peers.empty() ? 7u : 1u) << doc.dump();
  for (const auto& id : doc["order"]) {
    const auto& e = engines[id.get<std::string>()];
    ASSERT_FALSE(e.contains("error")) << e.dump();
    EXPECT_EQ(e["keys"].get<std::size_t>(), 2000u) << id;
    // Every engine does these; the rest only where it can (threads, several processes).
    for (const char* what : {"insert", "fetch", "durable_1", "durable_n", "disk_bytes",
                             "small_insert", "small_fetch", "small_disk_bytes", "insert_cores"})
      EXPECT_GT(e[what].get<double>(), 0.0) << id << " " << what;
    // The small values' own store: as many keys as asked, each taking at least its bytes.
    EXPECT_EQ(e["small_keys"].get<std::size_t>(), 1500u) << id;
    EXPECT_EQ(e["small_fetched"].get<std::size_t>(), 1500u) << id;
    // The durable rows' stores held the workload's keys before their timed commits.
    EXPECT_EQ(e["durable_keys"].get<std::size_t>(), 2000u) << id;
    EXPECT_GE(e["small_disk_bytes"].get<double>(), 1500.0 * (16 + 100)) << id;
  }
  for (const char* who : {"keel", "lmdb", "sqlite", "tdb"}) {
    if (!engines.contains(who)) continue;
    EXPECT_GT(engines[who]["insert_processes"].get<double>(), 0.0) << who;
    EXPECT_GT(engines[who]["insert_processes_cores"].get<double>(), 0.0) << who;
    EXPECT_GT(engines[who]["insert_process_cores"].get<double>(), 0.0) << who;
  }
  for (const char* who : {"tkrzw", "rocksdb", "leveldb"}) {
    if (!engines.contains(who)) continue;
    EXPECT_TRUE(engines[who]["insert_processes"].is_null()) << who;
  }
  if (engines.contains("tdb")) {
    EXPECT_TRUE(engines["tdb"]["fetch_threads"].is_null());
    EXPECT_TRUE(engines["tdb"]["mixed_threads"].is_null());
  }
  // The bulk loads, in transactions of 1, 1 024 and (all 3 000 keys) one: every engine with
  // transactions of several keys; tkrzw's HashDBM has none.
  EXPECT_EQ(doc["txn_keys"].get<std::size_t>(), 3000u);
  for (const auto& id : doc["order"]) {
    for (const char* row : {"txn_1", "txn_1024", "txn_65536"}) {
      const auto& v = engines[id.get<std::string>()][row];
      if (id == "tkrzw") {
        EXPECT_TRUE(v.is_null()) << row;
      } else {
        EXPECT_GT(v.get<double>(), 0.0) << id << " " << row;
      }
    }
  }
  EXPECT_NE(r.out.find("load, txns of 3000"), std::string::npos) << r.out;
  EXPECT_GT(engines["keel"]["fetch_threads"].get<double>(), 0.0);
  EXPECT_GT(engines["keel"]["mixed_threads"].get<double>(), 0.0);
  EXPECT_GT(engines["keel"]["fetch_unchecked"].get<double>(), 0.0);
  EXPECT_NE(r.out.find("fetch, checksums off"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("mixed 90/10, 2 threads"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("durable, 3 writers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("insert, 100 B values"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("on disk B/record"), std::string::npos) << r.out;
  // Nothing of the stores is left behind.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_FALSE(entry.is_directory()) << entry.path();
}

TEST(KeelKvbench, SeveralRoundsGiveEachFigureAsTheMedianOfItsRounds) {
  keel::test::temp_dir dir;
  const std::string json = dir.file("kv.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"kvbench",
                              "--peers",
                              "keel",
                              "--rounds",
                              "3",
                              "--keys",
                              "1000",
                              "--seconds",
                              "0.1",
                              "--durable-writers",
                              "2",
                              "--txn-keys",
                              "1000",
                              "--small-keys",
                              "500",
                              "--dir",
                              dir.path().string(),
                              "--sync-dir",
                              dir.path().string(),
                              "--json",
                              json},
                             dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("round 3 of 3"), std::string::npos) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_EQ(doc["rounds"], 3);
  const auto& e = doc["engines"]["keel"];
  ASSERT_EQ(e["each_round"].size(), 3u) << e.dump();
  std::size_t numbers = 0;
  for (const auto& [name, value] : e.items()) {
    if (!value.is_number()) continue;
    ++numbers;
    std::vector<double> seen;
    for (const auto& round : e["each_round"])
      seen.push_back(round[name].get<double>());
    std::ranges::sort(seen);
    EXPECT_EQ(value.get<double>(), seen[1]) << name;
  }
  EXPECT_GT(numbers, 20u) << e.dump();
}

// An engine that cannot put every key within the fill limit runs the first round only: more
// rounds would spend the same time on the same limits (a full run took an hour and a half,
// most of it peers waiting out their limits again).
TEST(KeelKvbench, AnEngineThatCouldNotPutEveryKeyRunsOneRound) {
  keel::test::temp_dir dir;
  const std::string json = dir.file("kv.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"kvbench",
                              "--peers",
                              "keel",
                              "--rounds",
                              "3",
                              "--keys",
                              "500",
                              "--seconds",
                              "0.1",
                              "--durable-writers",
                              "2",
                              "--txn-keys",
                              "500",
                              "--small-keys",
                              "5000000",
                              "--small-value-size",
                              "0",
                              "--fill-seconds",
                              "1",
                              "--dir",
                              dir.path().string(),
                              "--sync-dir",
                              dir.path().string(),
                              "--json",
                              json},
                             dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  const auto& e = doc["engines"]["keel"];
  ASSERT_LT(e["small_keys"].get<std::size_t>(), 5000000u)
      << "5 M puts within a second: the test needs more keys to fall short";
  ASSERT_TRUE(e.contains("each_round") && e.contains("one_round")) << e.dump();
  EXPECT_EQ(e.at("each_round").size(), 1u) << r.err;
  EXPECT_EQ(e.at("one_round"), true) << e.dump();
  EXPECT_NE(r.err.find("runs this round only"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("round 2 of 3"), std::string::npos) << r.err;
}

TEST(KeelKvbench, RefusesBadArguments) {
  keel::test::temp_dir dir;
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"kvbench", "--keys", "0"}, dir.path().string()).code,
            2);
  const auto r = run_program(KEEL_BENCH_BINARY, {"kvbench", "--peers", "keel,berkeleydb"},
                             dir.path().string());
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("berkeleydb"), std::string::npos) << r.err;
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"kvbench", "--rounds", "0"}, dir.path().string()).code,
            2);
}

}  // namespace
