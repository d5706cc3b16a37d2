// keel_report, the page `make bench` writes, rendered from one quick run's saved output
// (tests/tools/report_inputs): it opens with one table per area that a newcomer can read, explains
// its terms, says in words what each plot shows, writes the figures into its heatmaps, and
// compares sizes like with like.

#include <gtest/gtest.h>

#include <cstddef>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

const std::string inputs = std::string(KEEL_SOURCE_DIR) + "/tests/tools/report_inputs/";

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++n;
  return n;
}

// The text between `open` (after position `from`) and `close`.
std::string between(const std::string& text, const std::string& open, const std::string& close,
                    std::size_t from = 0) {
  const auto a = text.find(open, from);
  if (a == std::string::npos) return {};
  const auto b = text.find(close, a + open.size());
  return b == std::string::npos ? std::string() : text.substr(a + open.size(), b - a - open.size());
}

class KeelReport : public ::testing::Test {
 protected:
  void SetUp() override {
    // (Appended, not `+`: GCC 12 warns falsely of bounds on `string(literal) + literal`.)
    std::string targets = KEEL_SOURCE_DIR;
    targets.append("/bench/targets.json");
    std::vector<std::string> args{"--out", dir_.path().string(), "--targets", targets};
    for (const char* algo : {"memory_map", "fcntl", "flock", "byte_ranges"})
      args.insert(args.end(), {"--lockscale", inputs + "lockscale-" + algo + ".json"});
    for (const char* algo : {"memory_map", "fcntl", "flock", "atomic_append"})
      args.insert(args.end(), {"--lockscale-short", inputs + "lockscale-short-" + algo + ".json"});
    args.insert(args.end(),
                {"--lockmatrix", inputs + "lockmatrix.json", "--lockcli", inputs + "lockcli.json",
                 "--aiobench", inputs + "aiobench.json", "--kvbench", inputs + "kvbench.json",
                 "--spacebench", inputs + "spacebench-tmpfs.json", "--python",
                 inputs + "python.json", inputs + "io.json"});
    const auto r = run_program(KEEL_REPORT_BINARY, args, dir_.path().string());
    ASSERT_EQ(r.code, 0) << r.err;
    html_ = keel::test::slurp(dir_.file("index.html"));
    ASSERT_FALSE(html_.empty());
  }
  keel::test::temp_dir dir_;
  std::string html_;
};

TEST_F(KeelReport, OpensWithOneTablePerAreaEachRowSayingWhatItMeans) {
  const auto glance = html_.find("<h2>At a glance</h2>");
  ASSERT_NE(glance, std::string::npos);
  // Nothing but the introduction comes before the summary.
  EXPECT_EQ(html_.find("<h2>"), glance);
  const std::string summary = between(html_, "<h2>At a glance</h2>", "<h2 id=\"terms\">");
  // io, locks, aio, kv, space, python
  EXPECT_EQ(count(summary, "<table class=\"summary\">"), 6u) << summary;
  for (const char* area :
       {"io layer", "Locks", "Asynchronous I/O", "keel::kv", "keel::space", "Python"})
    EXPECT_NE(summary.find("<caption>" + std::string(area)), std::string::npos) << area;
  // Every row: what, measured, target, verdict, and a sentence (the last cell) that is one.
  std::size_t rows = 0;
  for (auto at = summary.find("<tr><td>"); at != std::string::npos;
       at = summary.find("<tr><td>", at + 1)) {
    const std::string row = summary.substr(at, summary.find("</tr>", at) - at);
    EXPECT_EQ(count(row, "<td"), 5u) << row;
    const auto last = row.rfind("<td>") + 4;
    const std::string meaning = row.substr(last, row.rfind("</td>") - last);
    EXPECT_GT(meaning.size(), 30u) << row;
    EXPECT_EQ(meaning.back(), '.') << row;
    ++rows;
  }
  EXPECT_GE(rows, 15u);
  // The size row compares the records as they are, and gives no verdict it has no target for.
  EXPECT_NE(summary.find("kv on disk, "), std::string::npos) << summary;
  EXPECT_NE(summary.find("class=\"info\""), std::string::npos) << summary;
}

TEST_F(KeelReport, ExplainsEveryTermOfArtItUses) {
  const std::string terms = between(html_, "<h2 id=\"terms\">", "<h2>Machine</h2>");
  for (const char* id : {"TAI", "blurt", "dd-test", "Tux3", "lockscale", "lockmatrix", "sd/mean",
                         "qd", "O_DIRECT", "fill", "ledger", "null-engine", "the-seed"})
    EXPECT_NE(terms.find("id=\"term-" + std::string(id) + "\""), std::string::npos) << id;
  EXPECT_NE(html_.find("<a href=\"#terms\">"), std::string::npos);
}

TEST_F(KeelReport, EveryPlotHasTextThatSaysWhatItShows) {
  std::size_t images = 0;
  for (auto at = html_.find("<img "); at != std::string::npos; at = html_.find("<img ", at + 1)) {
    const std::string src = between(html_, "src=\"", "\"", at);
    const std::string alt = between(html_, "alt=\"", "\"", at);
    EXPECT_NE(alt, src);
    EXPECT_EQ(alt.find(".png"), std::string::npos) << alt;
    EXPECT_GT(alt.size(), 60u) << src << ": " << alt;
    ++images;
  }
  EXPECT_GE(images, 8u);
}

TEST_F(KeelReport, HeatmapsCarryTheirFiguresInTheCells) {
  for (const char* mode : {"contended", "uncontended"}) {
    const std::string gp = keel::test::slurp(dir_.file(std::string("matrix-") + mode + ".gp"));
    EXPECT_NE(gp.find("with labels"), std::string::npos) << gp;
  }
}

TEST_F(KeelReport, SizesAreOfTheRecordsAsTheyAreNotScaled) {
  const std::string kv = html_.substr(html_.find("<h2>keel::kv"));
  EXPECT_NE(kv.find("on disk once closed, the insert row's records (MiB)"), std::string::npos);
  EXPECT_EQ(kv.find("per 1 M records"), std::string::npos);
}

TEST_F(KeelReport, SmallValuesAreComparedPerRecordAmongEnginesThatPutThemAll) {
  const std::string kv = html_.substr(html_.find("<h2>keel::kv"));
  const std::string row = between(
      kv, "<td>on disk once closed, bytes per record, 10000000 keys of 100 B values</td>", "</tr>");
  ASSERT_FALSE(row.empty()) << kv;
  // keel's and tkrzw's per record; LMDB, which put fewer, says how many and is not compared.
  EXPECT_NE(row.find("<td>337.0</td>"), std::string::npos) << row;
  EXPECT_NE(row.find("<td>136.0</td>"), std::string::npos) << row;
  EXPECT_NE(row.find("(9938943 records)"), std::string::npos) << row;
  EXPECT_NE(row.find("(tkrzw HashDBM)"), std::string::npos) << row;
  EXPECT_NE(html_.find("337 B against 136 B"), std::string::npos);
  EXPECT_NE(html_.find("kv insert, 1 thread, 10000000 keys of 100 B values, vs the fastest peer "
                       "(tkrzw HashDBM)"),
            std::string::npos);
}

TEST_F(KeelReport, TheProcessesRowSaysWhatTheMachineAllowsIt) {
  // One writer process kept 1.32 CPUs busy: two CPUs leave room for 2 / 1.32 of it.
  EXPECT_NE(html_.find("1 process kept 1.32 CPUs busy: 2 CPUs allow 2 at most 1.515×"),
            std::string::npos);
  const std::string kv = html_.substr(html_.find("<h2>keel::kv"));
  const std::string row =
      between(kv, "<td>CPUs kept busy by the insert from 2 processes</td>", "</tr>");
  EXPECT_NE(row.find("<td>1.95</td>"), std::string::npos) << row;
  EXPECT_NE(row.find("<td>1.90</td>"), std::string::npos) << row;
}

TEST_F(KeelReport, EachPanelOfTheKvPlotHoldsItsOwnRows) {
  const std::string dat = keel::test::slurp(dir_.file("kv.dat"));
  // Panels are separated by two blank lines; each row's label starts its line.
  std::vector<std::string> panels;
  for (std::size_t at = 0; at < dat.size();) {
    const std::size_t end = std::min(dat.find("\n\n\n", at), dat.size());
    panels.push_back(dat.substr(at, end - at));
    at = end + 3;
  }
  const auto labels = [](const std::string& panel) {
    std::vector<std::string> out;
    std::size_t at = panel.find('\n');  // past the header
    while (at != std::string::npos && at + 1 < panel.size()) {
      const std::size_t q = panel.find('"', at + 2);
      out.push_back(panel.substr(at + 2, q - at - 2));
      at = panel.find('\n', q);
    }
    return out;
  };
  ASSERT_EQ(panels.size(), 4u) << dat;  // the fixture has no bulk-load rows
  EXPECT_EQ(labels(panels[0]),
            (std::vector<std::string>{"insert, 1 thread", "fetch, 1 thread, random order",
                                      "fetch, 1 thread, checksums off"}));
  EXPECT_EQ(labels(panels[2]),
            (std::vector<std::string>{"durable commits, 1 writer", "durable commits, 8 writers"}));
  EXPECT_EQ(labels(panels[3]), (std::vector<std::string>{"insert", "fetch"}));
}

// The kv section alone, rendered from the fixture's kvbench figures as `edit` leaves them.
template <class Edit>
std::string kv_section_of(Edit&& edit) {
  keel::test::temp_dir dir;
  auto doc = nlohmann::json::parse(keel::test::slurp(inputs + "kvbench.json"));
  edit(doc);
  const std::string kvbench = dir.file("kvbench.json");
  std::ofstream(kvbench) << doc.dump();
  std::string targets = KEEL_SOURCE_DIR;
  targets.append("/bench/targets.json");
  const auto r = run_program(KEEL_REPORT_BINARY,
                             {"--out", dir.path().string(), "--targets", targets, "--kvbench",
                              kvbench, inputs + "io.json"},
                             dir.path().string());
  EXPECT_EQ(r.code, 0) << r.err;
  const std::string html = keel::test::slurp(dir.file("index.html"));
  const auto at = html.find("<h2>keel::kv");
  return at == std::string::npos ? std::string() : html.substr(at);
}

TEST(KeelReportKv, AnEngineWithNoSmallValuesHasNoFigurePerRecord) {
  const std::string kv =
      kv_section_of([](nlohmann::json& doc) { doc["engines"]["tkrzw"]["small_keys"] = 0; });
  const std::string row = between(
      kv, "<td>on disk once closed, bytes per record, 10000000 keys of 100 B values</td>", "</tr>");
  EXPECT_NE(row.find("<td>n/a (0 records)</td>"), std::string::npos) << row;
  EXPECT_EQ(row.find("inf"), std::string::npos) << row;
}

// A missed target says what is known of why, beside it; a met one says nothing of it.
TEST(KeelReportKv, AMissedTargetSaysWhyAndAMetOneDoesNot) {
  const auto insert_row = [](double keel_insert) {
    return kv_section_of(
        [&](nlohmann::json& doc) { doc["engines"]["keel"]["insert"] = keel_insert; });
  };
  const std::string why = "Each put is a commit of its own";
  const std::string missed = insert_row(100000);  // 0.5× tkrzw's 199 745
  const std::string row =
      between(missed, "<td>kv insert, 1 thread, vs tkrzw HashDBM</td>", "</tr>");
  EXPECT_NE(row.find("missed"), std::string::npos) << row;
  EXPECT_NE(row.find(why), std::string::npos) << row;
  EXPECT_NE(missed.find("<th>why missed</th>"), std::string::npos);
  const std::string met = insert_row(1000000);  // 5×
  const std::string met_row =
      between(met, "<td>kv insert, 1 thread, vs tkrzw HashDBM</td>", "</tr>");
  EXPECT_NE(met_row.find(">met<"), std::string::npos) << met_row;
  EXPECT_EQ(met_row.find(why), std::string::npos) << met_row;
}

TEST(KeelReportKv, AFetchCutShortByTheLimitSaysItFetchedASample) {
  const std::string kv =
      kv_section_of([](nlohmann::json& doc) { doc["engines"]["keel"]["small_fetched"] = 4000000; });
  EXPECT_NE(kv.find("fetched 4000000 of its small values' keys, a random sample"),
            std::string::npos);
}

TEST(KeelReportKv, DurableRowsSayTheirStoresHeldTheKeys) {
  const std::string kv =
      kv_section_of([](nlohmann::json& doc) { doc["engines"]["keel"]["durable_keys"] = 20000; });
  EXPECT_NE(kv.find("the durable ones on a store loaded with the run's keys first"),
            std::string::npos);
  // (A kvbench from before the preload says nothing of it.)
  EXPECT_EQ(kv_section_of([](nlohmann::json&) {}).find("loaded with the run's keys"),
            std::string::npos);
}

TEST(KeelReportKv, FiguresOfSeveralRoundsSayTheyAreMedians) {
  const std::string kv = kv_section_of([](nlohmann::json& doc) { doc["rounds"] = 3; });
  EXPECT_NE(kv.find("ran all its rows 3 times, the engines in turn each round, and each figure "
                    "is the median of its rounds"),
            std::string::npos);
  // (One round, or a kvbench from before rounds, says nothing of them.)
  EXPECT_EQ(kv_section_of([](nlohmann::json&) {}).find("median of its rounds"), std::string::npos);
  EXPECT_EQ(kv_section_of([](nlohmann::json& doc) { doc["rounds"] = 1; }).find("median of its"),
            std::string::npos);
  // A round an engine failed in is named beside it.
  const std::string failed = kv_section_of([](nlohmann::json& doc) {
    doc["rounds"] = 3;
    doc["engines"]["tkrzw"]["failed_rounds"] =
        nlohmann::json::array({{{"round", 2}, {"error", "killed by signal 9 (Killed)"}}});
  });
  EXPECT_NE(failed.find("failed in round 2 (killed by signal 9 (Killed)); its figures are the "
                        "median of the rounds that ran"),
            std::string::npos);
}

TEST(KeelReportKv, ARunWithoutTheSmallValuesSizeHasNoSmallValueRows) {
  const std::string kv = kv_section_of([](nlohmann::json& doc) { doc.erase("small_value_size"); });
  ASSERT_FALSE(kv.empty());
  EXPECT_EQ(kv.find("bytes per record"), std::string::npos);
}

}  // namespace
