// keel-bench spacebench, run as a user would: it makes its volumes, fills them, and reports every
// figure in JSON; no put fails half-way and nothing dies of a signal.

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

TEST(KeelSpacebench, FillsSmallVolumesAndReportsEveryFigure) {
  keel::test::temp_dir dir;
  const std::string out = dir.file("space.json");
  auto r = run_program(
      KEEL_BENCH_BINARY,
      {"spacebench", "--size-mib", "12", "--stream-mib", "6", "--retries", "20", "--blurt-tasks",
       "20", "--blurt-steps", "40", "--blurt-dirs", "2", "--blurt-passes", "6",
       // Not 12: there the store's fixed share (the index, the spare, the
       // deletes' segment, the tail's rest) left blurt's 1.6 MiB of live
       // values too little room in about 1 run in 16 under load, with puts
       // failing no_space at a task's first step (also before this stop).
       "--blurt-mib", "16", "--dir", dir.path().string(), "--json", out},
      dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  std::ifstream in(out);
  nlohmann::json j;
  in >> j;
  const auto& fill = j.at("fill");
  if (fill.contains("skipped")) GTEST_SKIP() << fill.at("skipped").get<std::string>();
  EXPECT_EQ(fill.at("half_way_failures"), 0);
  EXPECT_EQ(fill.at("retries_not_no_space"), 0) << "a retry after no_space must fail the same";
  EXPECT_GT(fill.at("stored").get<std::uint64_t>(), 1000u);
  const double pct = fill.at("fill_pct").get<double>();
  EXPECT_GT(pct, 10.0);
  EXPECT_LT(pct, fill.at("fill_with_overhead_pct").get<double>());
  EXPECT_LT(fill.at("fill_with_overhead_pct").get<double>(),
            fill.at("fill_with_index_pct").get<double>());
  EXPECT_LE(fill.at("fill_with_index_pct").get<double>(), 100.0);
  EXPECT_NE(fill.at("first_error").get<std::string>().find("No space"), std::string::npos);
  // After full: every other key erased, compaction, and puts again, all work.
  const auto& after = fill.at("after_full");
  EXPECT_EQ(after.at("half_way_failures"), 0);
  EXPECT_EQ(after.at("erase_failures"), 0);
  EXPECT_GT(after.at("segments_removed").get<std::uint64_t>(), 0u);
  EXPECT_GT(after.at("stored_again").get<std::uint64_t>(), 0u);
  // Where the space was: the store's files and what was left free, within the volume.
  const auto& space = fill.at("space");
  std::uint64_t parts = 0;
  for (const char* k :
       {"segments", "spare", "deletes", "index", "checkpoint", "other", "volume_free"}) {
    parts += space.at(k).get<std::uint64_t>();
  }
  EXPECT_LE(parts, fill.at("free_bytes").get<std::uint64_t>() + (1u << 20));
  EXPECT_GT(space.at("spare").get<std::uint64_t>(), 0u);
  EXPECT_GT(j.at("plain_files").at("fill_pct").get<double>(), 90.0);
  EXPECT_EQ(j.at("stream_far").at("stored"), 6144) << "6 MiB of 1 KiB values fit a 48 MiB volume";
  EXPECT_LT(j.at("stream_near").at("stored").get<std::uint64_t>(), 6144u);
  EXPECT_GT(j.at("near_far_ratio").get<double>(), 0.0);
  // The shared volume: another process gets the room erase + compact freed beside an idle
  // opener, the store keeps to its budget on the device, and no erase fails while a foreign
  // writer keeps the volume full.
  const auto& idle = j.at("idle_opener");
  EXPECT_GT(idle.at("erased").get<std::uint64_t>(), 100u);
  // (Held by the idle opener's maps, it was 0 %. About a segment of the 12 MiB volume (8 %)
  // is not put again; on 64 MiB it is 98.6 %.)
  EXPECT_GE(idle.at("put_again_pct").get<double>(), 60.0);
  const auto& budget = j.at("idle_opener_budget");
  EXPECT_LE(budget.at("device_bytes").get<std::uint64_t>(),
            budget.at("max_bytes").get<std::uint64_t>());
  const auto& foreign = j.at("foreign_writer");
  EXPECT_FALSE(foreign.contains("error")) << foreign.dump();
  EXPECT_GT(foreign.at("erases_tried").get<std::uint64_t>(), 1000u);
  EXPECT_EQ(foreign.at("erase_failures"), 0) << foreign.dump();
  // The ledger on and off far from full: both streams ran, and a charge was timed.
  const auto& ledger = j.at("ledger");
  EXPECT_EQ(ledger.at("runs").size(), 30u);
  EXPECT_GT(ledger.at("best_on").get<double>(), 0.0);
  EXPECT_GT(ledger.at("best_off").get<double>(), 0.0);
  EXPECT_GT(ledger.at("charge_ns").get<double>(), 0.0);
  // blurt: 20 processes at once put 40 KiB each, into 2 ranges, 6 passes: 9.4 MiB of values
  // for 1.6 MiB live on a 12 MiB volume, more than the store's segments can hold beside its
  // index and the segments it keeps for deletes and compaction. No put may fail, with the
  // store or with files.
  const auto& blurt = j.at("blurt");
  EXPECT_EQ(blurt.at("rounds"), 12);
  EXPECT_EQ(blurt.at("failed_tasks"), 0);
  EXPECT_EQ(blurt.at("signalled_tasks"), 0);
  EXPECT_GT(blurt.at("seconds").get<double>(), 0.0);
  EXPECT_EQ(j.at("blurt_plain").at("rounds"), 12);
  EXPECT_EQ(j.at("blurt_plain").at("failed_tasks"), 0);
  // Its mount point and scratch file are gone.
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    EXPECT_FALSE(e.path().filename().string().starts_with("keel-spacebench"))
        << "left behind: " << e.path();
  }
}

TEST(KeelSpacebench, BadArgumentsAreUsageErrors) {
  keel::test::temp_dir dir;
  auto r = run_program(KEEL_BENCH_BINARY, {"spacebench", "--size-mib", "1"}, dir.path().string());
  EXPECT_EQ(r.code, 2) << r.err;
  r = run_program(KEEL_BENCH_BINARY, {"spacebench", "--help"}, dir.path().string());
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--size-mib"), std::string::npos);
}

}  // namespace
