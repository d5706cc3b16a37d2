// keel-bench aiobench, run as a user would: the parts it is asked for, JSON, usage errors.
// Speed is make bench's business; these check that the measurements happen and are reported.

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "keel/aio/controller.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

// Whether this process may use io_uring (a seccomp filter, as containers have, forbids it;
// the keel it runs inherits the filter).
bool uring_works_here() {
  keel::aio::options o;
  o.engine = keel::aio::engine_kind::io_uring;
  o.workers = 1;
  return keel::aio::controller::start(o).has_value();
}

TEST(KeelAiobench, NullAndWorkloadPartsReportEveryMethod) {
#ifdef KEEL_TSAN_BUILD
  // The workload includes glibc's POSIX AIO, whose helper threads crashed the ThreadSanitizer
  // build (SIGSEGV, once in two CI runs); keel's own threads are covered by the aio tests.
  GTEST_SKIP() << "glibc POSIX AIO is not run under ThreadSanitizer";
#endif
  keel::test::temp_dir dir;
  const std::string json = dir.file("a.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"aiobench", "--parts", "null,workload", "--seconds", "0.1", "--items",
                              "20", "--dir", dir.file("files"), "--json", json},
                             dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_GT(doc["null"]["single_ns"].get<double>(), 0.0);
  EXPECT_GT(doc["null"]["batched_ns"].get<double>(), 0.0);
  EXPECT_FALSE(doc.contains("randread"));
  const auto& rows = doc["workload"]["rows"];
  const auto& skipped = doc["workload"]["skipped"];
  // 9 methods (3 peers, keel's 3 engines without and with the cache) x fsync every 1, 30,
  // 300 x 1 and 2 threads; where io_uring is forbidden, keel's 2 io_uring methods are
  // reported skipped, with the reason, and the rest still run.
  if (uring_works_here()) {
    EXPECT_TRUE(skipped.empty()) << skipped.dump();
    EXPECT_NE(r.out.find("keel_io_uring"), std::string::npos) << r.out;
  } else {
    ASSERT_EQ(skipped.size(), 2u) << skipped.dump();
    for (const auto& s : skipped) {
      EXPECT_TRUE(s["method"].get<std::string>().starts_with("keel_io_uring")) << s.dump();
      EXPECT_NE(s["reason"].get<std::string>().find("io_uring"), std::string::npos) << s.dump();
    }
    EXPECT_NE(r.out.find("keel_io_uring skipped"), std::string::npos) << r.out;
  }
  ASSERT_EQ(rows.size() + 6 * skipped.size(), 54u);
  for (const auto& row : rows) {
    EXPECT_GT(row["items_per_second"].get<double>(), 0.0) << row.dump();
    EXPECT_EQ(row["items"].get<std::uint64_t>(), 20u * row["threads"].get<std::uint64_t>());
  }
  EXPECT_NE(r.out.find("keel_stdio_cache"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("aiobench: workload"), std::string::npos) << "progress on stderr";
}

// The overwrite workload (buffered and O_DIRECT) and the small-request row: every method
// measured or skipped with the reason; cstdio has no O_DIRECT.
TEST(KeelAiobench, OverwriteAndSmallPartsReportEveryMethod) {
#ifdef KEEL_TSAN_BUILD
  GTEST_SKIP() << "glibc POSIX AIO is not run under ThreadSanitizer";
#endif
  keel::test::temp_dir dir;
  const std::string json = dir.file("o.json");
  const auto r = run_program(KEEL_BENCH_BINARY,
                             {"aiobench", "--parts", "overwrite,overwrite_direct,small",
                              "--methods", "posix,cstdio,keel_io_uring,keel_io_uring_cache",
                              "--items", "20", "--dir", dir.file("files"), "--json", json},
                             dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(keel::test::slurp(json));
  EXPECT_FALSE(doc.contains("workload"));
  const auto& over = doc["overwrite"];
  EXPECT_TRUE(over["overwrite"].get<bool>());
  const std::size_t uring_skips = uring_works_here() ? 0 : 2;
  // 4 methods x fsync every 30 and 300 x 1 and 2 threads.
  EXPECT_EQ(over["rows"].size() + 4 * over["skipped"].size(), 16u) << over.dump();
  EXPECT_EQ(over["skipped"].size(), uring_skips);
  const auto& direct = doc["overwrite_direct"];
  if (direct.contains("skipped_all")) {
    EXPECT_NE(direct["skipped_all"].get<std::string>().find("O_DIRECT"), std::string::npos);
  } else {
    EXPECT_TRUE(direct["direct"].get<bool>());
    EXPECT_EQ(direct["rows"].size() + 4 * direct["skipped"].size(), 16u) << direct.dump();
    EXPECT_EQ(direct["skipped"][0]["method"], "cstdio") << direct.dump();
  }
  const auto& small = doc["small"];
  EXPECT_EQ(small["rows"].size() + small["skipped"].size(), 3u) << small.dump();
  for (const auto& row : small["rows"])
    EXPECT_GT(row["writes_per_second"].get<double>(), 0.0) << row.dump();
}

TEST(KeelAiobench, BadArgumentsAreUsageErrors) {
  keel::test::temp_dir dir;
  EXPECT_EQ(
      run_program(KEEL_BENCH_BINARY, {"aiobench", "--parts", "nope"}, dir.path().string()).code, 2);
  EXPECT_EQ(
      run_program(KEEL_BENCH_BINARY, {"aiobench", "--seconds", "-1"}, dir.path().string()).code, 2);
  const auto bad_method =
      run_program(KEEL_BENCH_BINARY, {"aiobench", "--methods", "posix,nope"}, dir.path().string());
  EXPECT_EQ(bad_method.code, 2);
  EXPECT_NE(bad_method.err.find("unknown method 'nope'"), std::string::npos) << bad_method.err;
  const auto help = run_program(KEEL_BENCH_BINARY, {"aiobench", "--help"}, dir.path().string());
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--parts"), std::string::npos);
}

}  // namespace
