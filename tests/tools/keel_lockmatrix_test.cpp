// keel-bench lockmatrix, run as a user would: the talk's table layout, JSON, usage errors.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

TEST(KeelLockmatrix, PrintsTablesAndJsonForEveryAlgorithmAsked) {
  keel::test::temp_dir dir;
  const std::string json = dir.file("m.json");
  const auto r =
      run_program(KEEL_BENCH_BINARY,
                  {"lockmatrix", "--seconds", "0.1", "--waiters", "1:3", "--entities", "1:2",
                   "--dir", dir.path().string(), "--json", json, "byte_ranges", "memory_map"},
                  dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* header : {"!byte_ranges (contended)", "!byte_ranges (uncontended)",
                             "!memory_map (contended)", "!memory_map (uncontended)"}) {
    EXPECT_NE(r.out.find(header), std::string::npos) << header << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("3 waiters"), std::string::npos);
  EXPECT_NE(r.out.find("2 entities"), std::string::npos);
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_TRUE(doc["exclusion_verified"].get<bool>());
  const auto& table = doc["algorithms"]["memory_map"]["uncontended"];
  ASSERT_EQ(table.size(), 2u);
  ASSERT_EQ(table[1].size(), 2u);
  for (const auto& row : table) {
    for (const auto& cell : row)
      EXPECT_GT(cell.get<double>(), 0.0);  // work happened; speed is not tested here
  }
  EXPECT_NE(r.err.find("cell 16/16"), std::string::npos) << "progress on stderr";
}

TEST(KeelLockmatrix, PeersAreMeasuredByTheSameHarness) {
  keel::test::temp_dir dir;
  const std::string json = dir.file("m.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"lockmatrix", "--seconds", "0.1", "--waiters", "2", "--entities",
                              "1:3", "--dir", dir.path().string(), "--json", json, "cas", "ofd"},
                             dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_TRUE(doc["exclusion_verified"].get<bool>());
  for (const char* peer : {"cas", "ofd"}) {
    for (const char* mode : {"contended", "uncontended"}) {
      EXPECT_GT(doc["algorithms"][peer][mode][0][1].get<double>(), 0.0) << peer << " " << mode;
    }
  }
}

TEST(KeelLockmatrix, UsageErrorsExitTwo) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockmatrix", "nonesuch"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockmatrix", "--waiters", "0"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockmatrix", "--entities", "a"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockmatrix", "--mode", "sideways"}, d).code, 2);
  EXPECT_EQ(run_program(KEEL_BENCH_BINARY, {"lockmatrix", "--help"}, d).code, 0);
}

}  // namespace
