// keel and keel-bench, as installed: `keel` (what users run) links no other database and names
// only its own commands; the benchmarks, with their peers, are keel-bench's, and `keel` points
// there when asked for one.

#include <gtest/gtest.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <string>

#include "keel/version.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

constexpr const char* benchmark_commands[] = {"lockscale", "lockmatrix", "aiobench",
                                              "kvbench",   "spacebench", "torture"};

TEST(KeelPrograms, KeelLinksNoBenchmarkPeer) {
  if (::access("/usr/bin/ldd", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/ldd to list libraries";
  keel::test::temp_dir dir;
  const auto keel = run_program("/usr/bin/ldd", {KEEL_BINARY}, dir.path().string());
  ASSERT_EQ(keel.code, 0) << keel.err;
  for (const char* peer : {"liblmdb", "libleveldb", "librocksdb", "libtkrzw", "libsqlite3",
                           "libtdb", "libsnappy", "libzstd"}) {
    EXPECT_EQ(keel.out.find(peer), std::string::npos) << peer << " in\n" << keel.out;
  }
  // The check can fail: keel-bench links the peers, and ldd lists them there.
  const auto bench = run_program("/usr/bin/ldd", {KEEL_BENCH_BINARY}, dir.path().string());
  ASSERT_EQ(bench.code, 0) << bench.err;
  EXPECT_NE(bench.out.find("liblmdb"), std::string::npos) << bench.out;
}

TEST(KeelPrograms, EachListsItsOwnCommandsAndKeelSendsBenchmarksToKeelBench) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  const auto help = run_program(KEEL_BINARY, {"--help"}, d);
  ASSERT_EQ(help.code, 0) << help.err;
  for (const char* own : {"lock", "locks", "kv", "fsinfo", "keel-bench"})
    EXPECT_NE(help.out.find(own), std::string::npos) << own << " in\n" << help.out;
  const auto bench_help = run_program(KEEL_BENCH_BINARY, {"--help"}, d);
  ASSERT_EQ(bench_help.code, 0) << bench_help.err;
  for (const char* command : benchmark_commands) {
    EXPECT_EQ(help.out.find(command), std::string::npos) << command << " in\n" << help.out;
    EXPECT_NE(bench_help.out.find(command), std::string::npos) << command;
    const auto moved = run_program(KEEL_BINARY, {command, "--help"}, d);
    EXPECT_EQ(moved.code, 2) << command;
    EXPECT_NE(moved.err.find(std::string("keel-bench ") + command), std::string::npos) << moved.err;
  }
  const auto unknown = run_program(KEEL_BENCH_BINARY, {"nonesuch"}, d);
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("nonesuch"), std::string::npos) << unknown.err;
  for (const char* program : {KEEL_BINARY, KEEL_BENCH_BINARY}) {
    const auto v = run_program(program, {"--version"}, d);
    EXPECT_EQ(v.code, 0) << program;
    EXPECT_NE(v.out.find(KEEL_VERSION_STRING), std::string::npos) << v.out;
  }
}

// keel-bench lockcli runs both programs and writes what it measured; no timing is asserted.
TEST(KeelPrograms, LockcliMeasuresKeelLockBesideFlock) {
  if (::access("/usr/bin/flock", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/flock";
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  const std::string json = d + "/lockcli.json";
  const auto r =
      run_program(KEEL_BENCH_BINARY,
                  {"lockcli", "--runs", "3", "--keel", KEEL_BINARY, "--dir", d, "--json", json}, d);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_EQ(doc["runs"], 3);
  for (const char* id : {"flock", "keel_lock", "keel_version", "true"})
    EXPECT_GT(doc["median_us"][id].get<double>(), 0.0) << id;
  EXPECT_GT(doc["keel_lock_vs_flock"].get<double>(), 0.0);
  // A keel that is not there, and one whose lock fails, are errors, not figures.
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockcli", "--keel", d + "/nonesuch"}, d).code, 2);
  const auto failing =
      run_program(KEEL_BENCH_BINARY, {"lockcli", "--runs", "1", "--keel", "/bin/false"}, d);
  EXPECT_EQ(failing.code, 1);
  EXPECT_NE(failing.err.find("exited with status 1"), std::string::npos) << failing.err;
}

}  // namespace
