// keel-bench lockscale, run as a user would: the seed's output format, JSON, the exclusion check
// (which must be able to fail), and usage errors.

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

class KeelLockscale : public ::testing::TestWithParam<std::string_view> {
 protected:
  keel::test::temp_dir dir_;
};

TEST_P(KeelLockscale, PrintsTheSeedsFormatAndJson) {
  const std::string algo(GetParam());
  const std::string json = dir_.file("out.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"lockscale", "-t", "0.3", "-w", "2:5", "-b", "200", "-i", "10",
                              "--dir", dir_.path().string(), "--json", json, algo},
                             dir_.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  ASSERT_TRUE(std::getline(lines, line));
  EXPECT_EQ(line, "# " + algo + " 200 10 0.3");
  for (const int workers : {2, 5}) {
    ASSERT_TRUE(std::getline(lines, line));
    std::istringstream fields(line);
    int w = 0;
    double duration = 0, user = 0, sys = 0, mean = 0, sd = 0;
    long total = 0, min = 0, max = 0;
    ASSERT_TRUE(fields >> w >> duration >> user >> sys >> total >> min >> max >> mean >> sd)
        << line;
    EXPECT_EQ(w, workers);
    // Format and sanity, not speed (the machine may be busy): the run lasted at least -t, and
    // every count is consistent with the others.
    EXPECT_GE(duration, 0.3);
    EXPECT_LT(duration, 10.0);
    EXPECT_GT(total, 0);
    EXPECT_LE(max, total);
    EXPECT_LE(min, max);
    EXPECT_NEAR(mean, static_cast<double>(total) / workers, 0.1);
  }
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_EQ(doc["algorithm"], algo);
  EXPECT_EQ(doc["rows"].size(), 2u);
  EXPECT_TRUE(doc["exclusion_verified"].get<bool>());
  EXPECT_EQ(doc["rows"][1]["workers"], 5);
}

INSTANTIATE_TEST_SUITE_P(Every, KeelLockscale, ::testing::ValuesIn(keel::lock::algorithm_names()),
                         [](const auto& param_info) { return std::string(param_info.param); });

TEST(KeelLockscaleChecks, BrokenExclusionFailsLoudly) {
  keel::test::temp_dir dir;
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"lockscale", "-t", "0.3", "-w", "4", "-b", "100", "--dir",
                              dir.path().string(), "--break-exclusion", "fcntl"},
                             dir.path().string());
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("MUTUAL EXCLUSION BROKEN"), std::string::npos) << r.err;
}

TEST(KeelLockscaleChecks, UsageErrorsExitTwo) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale", "nonesuch"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale", "-w", "10:x", "fcntl"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale", "-w", "0", "fcntl"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale", "-t", "-1", "fcntl"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale"}, d).code, 2);
  const auto help = run_program(KEEL_BENCH_BINARY, {"lockscale", "--help"}, d);
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("BUSY_US"), std::string::npos);
}

// --through: every second worker locks through another path of the directory (in the report,
// the second client mount of a network filesystem; here a symlink to the same directory).
TEST(KeelLockscaleChecks, ThroughAnotherPathOfTheDirectory) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  ASSERT_EQ(::mkdir((d + "/a").c_str(), 0755), 0);
  ASSERT_EQ(::symlink("a", (d + "/b").c_str()), 0);
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"lockscale", "-t", "0.2", "-w", "2", "-b", "100", "--dir", d + "/a",
                              "--through", d + "/b", "--json", "-", "byte_ranges"},
                             d);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_TRUE(doc["through"].get<bool>());
  // A symlink reaches the same filesystem: not a second client, and not reported as one.
  EXPECT_FALSE(doc["two_mounts"].get<bool>());
  EXPECT_TRUE(doc["exclusion_verified"].get<bool>());
  EXPECT_GT(doc["rows"][0]["total"].get<long>(), 0);
  // Without --dir there is nothing to see through it; a directory that is not another path
  // of --dir is named.
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockscale", "--through", d + "/b", "fcntl"}, d).code,
            2);
  const auto elsewhere = run_program(
      KEEL_BENCH_BINARY,
      {"lockscale", "-t", "0.2", "-w", "2", "--dir", d + "/a", "--through", d, "fcntl"}, d);
  EXPECT_EQ(elsewhere.code, 1);
  EXPECT_NE(elsewhere.err.find("--through"), std::string::npos) << elsewhere.err;
}

}  // namespace
