// keel_report: renders build/report/ from the benchmark programs' JSON output.
//
// Reads Google Benchmark JSON files and bench/targets.json (which pairs each keel benchmark with
// the peer it is compared against, and the target ratio), then writes:
//   OUT/results.json   machine, every comparison (keel and peer times, ratio, target, met),
//                      every measurement, and the median of every benchmark run
//   OUT/index.html     the machine, the tables and the plots
//   OUT/*.png          plots, drawn by gnuplot
// and prints the summary table on stdout. ratio = peer time / keel time, from the medians of
// the repetitions, so 1.0 means keel is as fast as the peer in this very run.

#include <sys/utsname.h>

#include <fmt/format.h>
#include <fmt/os.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "aio_report.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/version.hpp"
#include "kv_report.hpp"
#include "lock_report.hpp"
#include "python_report.hpp"
#include "render.hpp"
#include "space_report.hpp"

namespace {

using keel::report::html_escape;
using nlohmann::json;

struct samples {
  std::vector<double> ns;  // one per repetition, nanoseconds per iteration
  [[nodiscard]] double median() const {
    std::vector<double> v = ns;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n == 0 ? 0.0 : n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  }
  [[nodiscard]] double min() const { return *std::min_element(ns.begin(), ns.end()); }
  [[nodiscard]] double max() const { return *std::max_element(ns.begin(), ns.end()); }
};

double to_ns(double value, const std::string& unit) {
  if (unit == "us") return value * 1e3;
  if (unit == "ms") return value * 1e6;
  if (unit == "s") return value * 1e9;
  return value;
}

// What one benchmark measured across its repetitions: time per iteration, and for a paired
// benchmark the keel and peer times per call (counters keel_ns and peer_ns).
struct runs_of {
  samples time;
  samples keel;
  samples peer;
};

// Every plain run (not an aggregate) of every benchmark, by name.
std::map<std::string, runs_of> load_runs(const std::vector<std::string>& files, json& contexts) {
  std::map<std::string, runs_of> runs;
  for (const auto& file : files) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file);
    const json doc = json::parse(in);
    contexts.push_back(doc.value("context", json::object()));
    for (const auto& b : doc.at("benchmarks")) {
      if (b.value("run_type", "iteration") != "iteration") continue;
      if (b.contains("error_occurred") && b["error_occurred"].get<bool>()) {
        throw std::runtime_error(fmt::format("{}: {} failed: {}", file, b.value("name", "?"),
                                             b.value("error_message", "?")));
      }
      runs_of& r = runs[b.value("run_name", b.value("name", ""))];
      r.time.ns.push_back(to_ns(b.at("real_time").get<double>(), b.value("time_unit", "ns")));
      if (b.contains("keel_ns") && b.contains("peer_ns")) {
        r.keel.ns.push_back(b["keel_ns"].get<double>());
        r.peer.ns.push_back(b["peer_ns"].get<double>());
      }
    }
  }
  return runs;
}

std::string read_first_line_with(const char* path, const char* key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) {
        auto v = line.substr(colon + 1);
        v.erase(0, v.find_first_not_of(" \t"));
        return v;
      }
    }
  }
  return "unknown";
}

json machine_info(const std::string& dir) {
  json m;
  m["cpu"] = read_first_line_with("/proc/cpuinfo", "model name");
  m["cores"] = std::thread::hardware_concurrency();
  utsname u{};
  if (::uname(&u) == 0) m["kernel"] = fmt::format("{} {} {}", u.sysname, u.release, u.machine);
  if (!dir.empty()) {
    m["bench_dir"] = dir;
    if (auto fs = keel::io::stat_fs(dir.c_str())) m["filesystem"] = std::string(fs->type_name());
  }
  m["keel_version"] = KEEL_VERSION_STRING;
  m["build_type"] = KEEL_BUILD_TYPE;
  m["compiler"] = __VERSION__;
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%d %H:%M:%S UTC", &tm);
  m["date"] = stamp;
  return m;
}

std::string format_ns(double ns) {
  if (ns >= 1e6) return fmt::format("{:.2f} ms", ns / 1e6);
  if (ns >= 1e3) return fmt::format("{:.2f} µs", ns / 1e3);
  return fmt::format("{:.1f} ns", ns);
}

// Draws the section's two plots: time per operation (keel and peer, with the spread of the
// repetitions) and ratio against target. Returns the plots written.
std::vector<keel::report::figure> plot_section(const std::string& out, const std::string& id,
                                               const json& comparisons) {
  if (comparisons.empty()) return {};
  const std::string dat = fmt::format("{}/{}.dat", out, id);
  {
    auto f = fmt::output_file(dat);
    f.print("# name keel_median keel_min keel_max peer_median peer_min peer_max ratio target\n");
    for (const auto& c : comparisons) {
      f.print("\"{}\" {} {} {} {} {} {} {} {}\n", c["name"].get<std::string>(),
              c["keel_ns"].get<double>(), c["keel_min_ns"].get<double>(),
              c["keel_max_ns"].get<double>(), c["peer_ns"].get<double>(),
              c["peer_min_ns"].get<double>(), c["peer_max_ns"].get<double>(),
              c["ratio"].get<double>(), c["target"].get<double>());
    }
  }
  const std::string times_png = id + "-times.png";
  const std::string ratio_png = id + "-ratios.png";
  const std::string gp = fmt::format("{}/{}.gp", out, id);
  {
    auto f = fmt::output_file(gp);
    f.print(R"gp(set terminal pngcairo size 900,480 font "sans,10"
set datafile separator " "
set style data histograms
set style histogram errorbars gap 2 lw 1
set style fill solid 0.8 border -1
set grid ytics
set key top left
set xtics noenhanced
set ylabel "nanoseconds per operation (median, bars: min-max of repetitions)"
set yrange [0:*]
set output "{out}/{times}"
set title "Time per operation: keel against its peer (lower is better)"
plot "{dat}" using 2:3:4:xtic(1) title "keel" lc rgb "#1f77b4", \
     "" using 5:6:7 title "peer" lc rgb "#aaaaaa"
set style data boxes
set style histogram clustered
set boxwidth 0.5
set ylabel "peer time / keel time"
set yrange [0:*]
set output "{out}/{ratios}"
set title "Ratio to peer (above the dashed target line: target met)"
plot "{dat}" using 0:8:xtic(1) with boxes title "ratio" lc rgb "#2ca02c", \
     "" using 0:9 with linespoints dt 2 lw 2 pt 7 lc rgb "#d62728" title "target"
)gp",
            fmt::arg("out", out), fmt::arg("times", times_png), fmt::arg("ratios", ratio_png),
            fmt::arg("dat", dat));
  }
  keel::report::run_gnuplot(gp);
  return {{times_png,
           "Bar chart: nanoseconds per operation of keel and of its peer for each comparison "
           "(median, with the range of the repetitions); lower is better."},
          {ratio_png,
           "Bar chart: peer time over keel time for each comparison, with the target as a "
           "dashed line; a bar above the line meets its target."}};
}

// The report's terms of art, each explained once, in the order a reader meets them.
const std::vector<std::pair<std::string, std::string>> glossary = {
    {"ratio",
     "keel against a peer from the same run: for rates, keel's over the peer's; for "
     "times, the peer's over keel's. Above 1 keel is better, except where a target "
     "says ≤ (a cost: below is better)."},
    {"target",
     "what keel promises for a figure; \"met\" or \"missed\" is this run's "
     "measurement against it (a missed row says what is known of why, where something is), "
     "\"info\" a figure with no target yet, \"missing\" one this run could not measure "
     "(the row says why)."},
    {"peer",
     "the tool keel is measured against: the kernel's own calls and locks, fio, glibc, "
     "LMDB, RocksDB, LevelDB, SQLite, tkrzw, TDB."},
    {"lockscale",
     "N processes take turns on one lock, each holding it for a busy time and "
     "then waiting an idle time; counts acquisitions (the seed's lockscale)."},
    {"lockmatrix",
     "lock+unlock per second for every number of waiting processes × number of "
     "entities locked at once, contended (everyone on the same entities) or not."},
    {"kernel locks",
     "flock(2), fcntl(2) record locks and System V semaphores: what keel's "
     "own lock algorithms (memory_map, byte_ranges, atomic_append, lock_files) "
     "are measured against."},
    {"sd/mean",
     "fairness: the standard deviation of the workers' acquisitions over their "
     "mean; 0 means every process got the lock as often."},
    {"CAS loop",
     "a bare compare-and-swap spin on shared memory: the floor of any lock, with "
     "none of keel's guarantees (deadlines, dead holders)."},
    {"OFD lock",
     "an open file description lock (fcntl F_OFD_SETLK), the kernel lock "
     "byte_ranges is built on."},
    {"TAI",
     "Threaded Async I/O, the thesis library whose benchmarks the aio section repeats "
     "(its section numbers, as TAI 3.4, name them): a workload that computes and writes "
     "64 KiB per item, overwrites, and many small requests."},
    {"qd", "queue depth: how many requests are in flight at once."},
    {"O_DIRECT",
     "I/O that bypasses the page cache, straight to the device; buffered I/O goes "
     "through it."},
    {"fsync every N",
     "the workload calls fsync after every N items: how often it asks for "
     "its writes to be on the device."},
    {"null engine",
     "keel::aio's engine that does no I/O: what is left is the cost of keel's "
     "own request machinery."},
    {"the seed", "the prototypes keel grew from; their figures are drawn as reference lines."},
    {"durable commit",
     "a commit that is on the device when it returns (fdatasync), so a "
     "power cut cannot take it back."},
    {"no_space", "keel's out-of-space error (ENOSPC): the store is full."},
    {"fill",
     "values stored at the first no_space over the volume's free space at the start; "
     "the ideal packer is the same against what a perfect packer of keel's records "
     "(and index entries) would fit."},
    {"half-way failure", "a commit that fails after part of it is visible: never allowed."},
    {"Tux3",
     "a Linux filesystem whose out-of-space post (one of keel's seeds) gives the space "
     "targets: fill to 99 %, fail fast, deletes work when full."},
    {"dd test",
     "Tux3's: how much slower a stream of writes gets into a volume about to fill "
     "than into one far from full (near / far)."},
    {"blurt",
     "Tux3's load generator: many processes (1000 in the seed) write 1 KiB at a time "
     "at once, round after round, rewriting their files; it must never see no_space "
     "early."},
    {"ledger",
     "keel::space's accounting (Tux3's): every commit that puts is charged its worst "
     "case before it writes, so it fails whole or not at all."},
    {"compaction",
     "moving a segment's live records out so that its file can be removed and "
     "its room given back."},
};

std::string glossary_html() {
  std::string items;
  for (const auto& [term, text] : glossary) {
    std::string id = term;
    std::replace(id.begin(), id.end(), ' ', '-');
    items += fmt::format("<dt id=\"term-{}\">{}</dt><dd>{}</dd>\n", html_escape(id),
                         html_escape(term), html_escape(text));
  }
  return "<h2 id=\"terms\">Terms</h2>\n<dl>\n" + items + "</dl>\n";
}

// One table per area: its headline rows, each with what it means for a user.
std::string summary_html(const std::vector<keel::report::section>& areas) {
  std::string html;
  for (const auto& a : areas) {
    if (a.headlines.empty()) continue;
    std::string rows;
    for (const auto& t : a.headlines) {
      const char* cls = keel::report::target_class(t);
      const bool missed = std::string_view(cls) == "missed" && !t.why_missed.empty();
      rows += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td>{}</td></tr>\n",
          html_escape(t.name), html_escape(t.measured), html_escape(t.target), cls, cls,
          html_escape(missed ? t.meaning + " Why it misses: " + t.why_missed : t.meaning));
    }
    html += fmt::format(
        "<table class=\"summary\"><caption>{}</caption><tr><th>figure</th><th>measured"
        "</th><th>target</th><th></th><th>what it means</th></tr>\n{}</table>\n",
        html_escape(a.title), rows);
  }
  return html;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"keel_report: render the benchmark report (tables, plots, results.json)"};
  std::string out = "build/report";
  std::string targets_path;
  std::string dir;
  std::vector<std::string> inputs;
  app.add_option("--out", out, "Directory to write the report into")->capture_default_str();
  app.add_option("--targets", targets_path, "The comparisons and targets (bench/targets.json)")
      ->required()
      ->check(CLI::ExistingFile);
  app.add_option("--dir", dir, "The directory the benchmarks ran in (its filesystem is reported)");
  keel::report::lock_inputs locks_in;
  app.add_option("--lockscale", locks_in.lockscale, "keel-bench lockscale --json files")
      ->check(CLI::ExistingFile);
  app.add_option("--lockscale-short", locks_in.lockscale_short,
                 "keel-bench lockscale --json files of short critical sections")
      ->check(CLI::ExistingFile);
  app.add_option("--lockscale-fs", locks_in.lockscale_fs,
                 "keel-bench lockscale --json files of runs on other filesystems")
      ->check(CLI::ExistingFile);
  app.add_option("--fs-skipped", locks_in.fs_skipped,
                 "\"FS: reason\" for a filesystem the benchmarks could not run on");
  app.add_option("--lockmatrix", locks_in.lockmatrix, "keel-bench lockmatrix --json file")
      ->check(CLI::ExistingFile);
  app.add_option("--lockcli", locks_in.lockcli, "keel-bench lockcli --json file")
      ->check(CLI::ExistingFile);
  std::string aiobench_file;
  app.add_option("--aiobench", aiobench_file, "keel-bench aiobench --json file")
      ->check(CLI::ExistingFile);
  std::string kvbench_file;
  app.add_option("--kvbench", kvbench_file, "keel-bench kvbench --json file")
      ->check(CLI::ExistingFile);
  std::vector<std::string> spacebench_files;
  std::string python_file;
  app.add_option("--python", python_file, "python/bench/bench.py --json file");
  app.add_option("--spacebench", spacebench_files, "keel-bench spacebench --json files")
      ->check(CLI::ExistingFile);
  app.add_option("inputs", inputs, "Google Benchmark JSON files")
      ->required()
      ->check(CLI::ExistingFile);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }

  try {
    json contexts = json::array();
    const auto runs = load_runs(inputs, contexts);
    std::ifstream tin(targets_path);
    const json targets = json::parse(tin);

    json results;
    results["machine"] = machine_info(dir);
    results["benchmark_context"] = contexts;
    results["sections"] = json::array();
    int missed = 0;
    int absent = 0;

    std::string html_sections;
    std::vector<keel::report::section> areas;  // in the page's order, for its summary
    for (const auto& section : targets.at("sections")) {
      keel::report::section area;
      area.title = section.at("title").get<std::string>();
      const std::string id = section.at("id");
      json sec = {{"id", id},
                  {"title", section.at("title")},
                  {"comparisons", json::array()},
                  {"measurements", json::array()}};
      fmt::print("\n{}\n", section.at("title").get<std::string>());
      fmt::print("{:<28} {:>12} {:>12} {:>8} {:>8}  {}\n", "comparison", "keel", "peer", "ratio",
                 "target", "");
      for (const auto& c : section.value("comparisons", json::array())) {
        const std::string bname = c.at("bench");
        if (!runs.contains(bname) || runs.at(bname).keel.ns.empty()) {
          fmt::print("{:<28} not run ({} missing)\n", c.at("name").get<std::string>(), bname);
          ++absent;
          continue;
        }
        const samples& k = runs.at(bname).keel;
        const samples& p = runs.at(bname).peer;
        const double ratio = p.median() / k.median();
        const double target = c.at("target");
        const bool met = ratio >= target;
        if (!met) ++missed;
        sec["comparisons"].push_back({{"name", c.at("name")},
                                      {"bench", bname},
                                      {"peer_name", c.value("peer_name", "peer")},
                                      {"keel_ns", k.median()},
                                      {"keel_min_ns", k.min()},
                                      {"keel_max_ns", k.max()},
                                      {"peer_ns", p.median()},
                                      {"peer_min_ns", p.min()},
                                      {"peer_max_ns", p.max()},
                                      {"repetitions", k.ns.size()},
                                      {"ratio", ratio},
                                      {"target", target},
                                      {"met", met}});
        if (c.contains("meaning")) {
          area.headlines.push_back({fmt::format("{} vs {}", c.at("name").get<std::string>(),
                                                c.value("peer_name", "peer")),
                                    fmt::format("{:.3f}×", ratio), fmt::format("≥ {:.2f}×", target),
                                    met, true, c.at("meaning").get<std::string>()});
        }
        fmt::print("{:<28} {:>12} {:>12} {:>7.3f}x {:>7.2f}x  {}\n",
                   c.at("name").get<std::string>(), format_ns(k.median()), format_ns(p.median()),
                   ratio, target, met ? "met" : "MISSED");
      }
      for (const auto& m : section.value("measurements", json::array())) {
        const std::string bname = m.at("bench");
        if (!runs.contains(bname)) continue;
        const samples& s = runs.at(bname).time;
        sec["measurements"].push_back({{"name", m.at("name")},
                                       {"bench", bname},
                                       {"median_ns", s.median()},
                                       {"min_ns", s.min()},
                                       {"max_ns", s.max()}});
        fmt::print("{}: {} (min {}, max {})\n", m.at("name").get<std::string>(),
                   format_ns(s.median()), format_ns(s.min()), format_ns(s.max()));
      }

      const auto pngs = plot_section(out, id, sec["comparisons"]);
      std::string rows;
      for (const auto& c : sec["comparisons"]) {
        rows += fmt::format(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}×</td><td>{:.2f}×</td>"
            "<td class=\"{}\">{}</td></tr>\n",
            html_escape(c["name"]), format_ns(c["keel_ns"]), html_escape(c["peer_name"]),
            format_ns(c["peer_ns"]), c["ratio"].get<double>(), c["target"].get<double>(),
            c["met"].get<bool>() ? "met" : "missed", c["met"].get<bool>() ? "met" : "missed");
      }
      std::string mrows;
      for (const auto& m : sec["measurements"]) {
        mrows +=
            fmt::format("<tr><td>{}</td><td>{}</td><td>{} – {}</td></tr>\n", html_escape(m["name"]),
                        format_ns(m["median_ns"]), format_ns(m["min_ns"]), format_ns(m["max_ns"]));
      }
      const std::string imgs = keel::report::images_html(pngs);
      html_sections += fmt::format(
          "<h2>{}</h2>\n<table><tr><th>comparison</th><th>keel</th><th>peer</th><th>peer "
          "time</th><th>ratio</th><th>target</th><th></th></tr>\n{}</table>\n{}{}\n",
          html_escape(section.at("title")), rows,
          mrows.empty() ? ""
                        : "<table><tr><th>measurement</th><th>median</th><th>range</th></tr>\n" +
                              mrows + "</table>\n",
          imgs);
      results["sections"].push_back(sec);
      areas.push_back(std::move(area));
    }

    // A rendered section: into the page, the results and the count of misses, and its
    // targets on stdout under `heading`.
    const auto add = [&](const char* key, const char* heading, keel::report::section sec) {
      html_sections += sec.html;
      results[key] = sec.results;
      missed += sec.missed;
      fmt::print("\n{}\n{}", heading, sec.summary);
      areas.push_back(std::move(sec));
    };
    if (!locks_in.lockscale.empty() || !locks_in.lockscale_short.empty() ||
        !locks_in.lockscale_fs.empty() || !locks_in.lockmatrix.empty() ||
        !locks_in.lockcli.empty()) {
      add("locks", "locks: targets (same run)", keel::report::render_locks(out, locks_in));
    }
    if (!aiobench_file.empty()) {
      add("aio", "aio: targets (same run)", keel::report::render_aio(out, aiobench_file));
    }
    if (!kvbench_file.empty()) {
      add("kv", "kv: targets (same run)", keel::report::render_kv(out, kvbench_file));
    }
    if (!spacebench_files.empty()) {
      add("space", "space: targets", keel::report::render_space(out, spacebench_files));
    }
    if (!python_file.empty()) {
      add("python", "python: targets (same run)", keel::report::render_python(python_file));
    }

    results["benchmarks"] = json::object();
    for (const auto& [name, r] : runs) {
      json& b = results["benchmarks"][name];
      b = {{"median_ns", r.time.median()}, {"runs_ns", r.time.ns}};
      if (!r.keel.ns.empty()) {
        b["keel_ns"] = r.keel.ns;
        b["peer_ns"] = r.peer.ns;
      }
    }
    results["missed_targets"] = missed;
    {
      std::ofstream rj(out + "/results.json");
      rj << results.dump(2) << '\n';
    }

    std::string machine_rows;
    for (const auto& [k, v] : results["machine"].items()) {
      machine_rows += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html_escape(k),
                                  html_escape(v.is_string() ? v.get<std::string>() : v.dump()));
    }
    std::ofstream html(out + "/index.html");
    html << fmt::format(R"(<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>keel benchmark report</title>
<style>
body {{ font-family: sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ border: 1px solid #ccc; padding: 4px 10px; text-align: left; }}
td.met {{ background: #d8f0d8; }} td.missed {{ background: #f6d5d5; font-weight: bold; }}
td.missing {{ background: #eeeeee; color: #666; }}
td.info {{ background: #e4ecf7; }}
table.matrix {{ display: inline-table; margin-right: 1em; font-size: 85%; }}
table.summary td:last-child {{ font-size: 90%; }}
caption {{ font-weight: bold; text-align: left; }}
dt {{ font-weight: bold; margin-top: 0.4em; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
</style></head><body>
<h1>keel benchmark report</h1>
<p>keel measured beside the tools it means to beat, every peer in the same run on this
machine. First one table per area: keel against the best peer, the ratio, the target and what
the figure means for a user; then the terms these tables use, the machine, and each area in
full, with its plots. A ratio of 1 means keel matches its peer; above 1 it is better (the
<a href="#terms">Terms</a> say exactly how each is taken). Raw numbers:
<a href="results.json">results.json</a>.</p>
<h2>At a glance</h2>
{summary}<p>Of every target in the full sections below, {missed} missed in this run.</p>
{glossary}<h2>Machine</h2><table>{machine}</table>
{sections}
</body></html>
)",
                        fmt::arg("missed", missed), fmt::arg("machine", machine_rows),
                        fmt::arg("summary", summary_html(areas)),
                        fmt::arg("glossary", glossary_html()), fmt::arg("sections", html_sections));
    fmt::print("\nreport: {}/index.html ({} target(s) missed{})\n", out, missed,
               absent != 0 ? fmt::format(", {} comparison(s) not run", absent) : "");
    return 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "keel_report: {}\n", e.what());
    return 1;
  }
}
