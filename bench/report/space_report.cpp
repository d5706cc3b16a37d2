#include "space_report.hpp"

#include <fmt/format.h>
#include <fmt/os.h>

#include <cmath>
#include <fstream>
#include <stdexcept>

namespace keel::report {
namespace {

using nlohmann::json;

double number(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : NAN;
}

std::string name_of(const json& doc) {
  return fmt::format("{} {} MiB", doc.value("volume", "?"), doc.value("size_mib", 0));
}

// Fill % of the volume's free space and puts/s against seconds, one line per volume.
std::string plot(const std::string& out, const std::vector<json>& docs) {
  const std::string dat = out + "/space.dat";
  std::string fill_lines;
  std::string rate_lines;
  {
    auto f = fmt::output_file(dat);
    std::size_t block = 0;
    for (const auto& doc : docs) {
      const json& fill = doc["fill"];
      if (!fill.contains("series") || fill["series"].empty()) continue;
      const double free0 = number(fill, "free_bytes");
      f.print("# {}\n", name_of(doc));
      for (const auto& p : fill["series"]) {
        f.print("{} {} {}\n", p[0].get<double>(), 100.0 * p[1].get<double>() / free0,
                p[2].get<double>());
      }
      f.print("\n\n");
      const std::string sep = block == 0 ? "" : ", ";
      fill_lines += fmt::format("{}\"{}\" index {} using 1:2 with lines lw 2 title \"{}\"", sep,
                                dat, block, name_of(doc));
      rate_lines += fmt::format("{}\"{}\" index {} using 1:3 with lines title \"{}\"", sep, dat,
                                block, name_of(doc));
      ++block;
    }
  }
  if (fill_lines.empty()) return "";
  const std::string gp = out + "/space.gp";
  {
    auto f = fmt::output_file(gp);
    f.print(R"gp(set terminal pngcairo size 1000,470 font "sans,10"
set termoption noenhanced
set output "{out}/space.png"
set grid
set key bottom right
set xlabel "seconds since the store was made (log scale)"
set logscale x
set multiplot layout 1,2 title "keel::kv filling a volume to its first no_space (keel-bench spacebench)"
set title "values stored, % of the volume's free space"
set yrange [0:100]
plot {fill}
set title "puts/s (log scale)"
set logscale y
set yrange [*:*]
plot {rate}
unset multiplot
)gp",
            fmt::arg("out", out), fmt::arg("fill", fill_lines), fmt::arg("rate", rate_lines));
  }
  run_gnuplot(gp);
  return "space.png";
}

std::string table_html(const std::vector<json>& docs) {
  std::string rows;
  for (const auto& doc : docs) {
    const json& f = doc["fill"];
    if (f.contains("skipped") || !f.contains("stored")) {
      rows +=
          fmt::format("<tr><td>{}</td><td colspan=\"7\">{}</td></tr>\n", html_escape(name_of(doc)),
                      html_escape(f.contains("skipped") ? f["skipped"].get<std::string>()
                                                        : "the fill run failed: " + f.dump()));
      continue;
    }
    const json& a = f["after_full"];
    const json& sp = f["space"];
    const auto mib = [&](const char* k) { return number(sp, k) / 1048576.0; };
    rows += fmt::format(
        "<tr><td>{}</td><td>{:.1f} % ({:.1f} %, {:.1f} %)</td><td>{:.1f} %</td><td>{}</td>"
        "<td>{} erase failures, {} segments compacted, {} puts again</td><td>{:.2f}×</td>"
        "<td>{:.1f} µs / {:.1f} µs</td><td>index {:.1f}, checkpoint {:.1f}, spare {:.1f}, "
        "deletes' room {:.1f}, segments {:.1f} (records {:.1f}), free {:.1f}</td></tr>\n",
        html_escape(name_of(doc)), number(f, "fill_pct"), number(f, "fill_with_overhead_pct"),
        number(f, "fill_with_index_pct"), number(doc["plain_files"], "fill_pct"),
        f["half_way_failures"].get<std::uint64_t>() + a["half_way_failures"].get<std::uint64_t>(),
        a["erase_failures"].get<std::uint64_t>(), a["segments_removed"].get<std::uint64_t>(),
        a["stored_again"].get<std::uint64_t>(), number(doc, "near_far_ratio"),
        number(f, "fail_seconds") * 1e6, number(f, "retry_mean_seconds") * 1e6, mib("index"),
        mib("checkpoint"), mib("spare"), mib("deletes"), mib("segments"), mib("live_bytes"),
        mib("volume_free"));
  }
  return fmt::format(
      "<p>Each volume is made for the run (tmpfs, or ext4, xfs, btrfs on a loop device) and "
      "filled with 1 KiB puts by one store until the first no_space. Fill is the values stored "
      "against the volume's free space at the start (in brackets: with keel's per-record "
      "overhead, what an ideal packer of its records would reach; then with each key's "
      "32-byte index entry too, records and a full index); plain files: what 1 MiB "
      "files reach on the same volume. After full: every other key erased, compaction until "
      "it frees nothing, then puts again. Near/far: the seed's dd test, per put, into a volume "
      "the stream overflows against one 8 times larger. Sizes in MiB at the first "
      "no_space.</p>\n<table><tr><th>volume</th><th>fill</th><th>plain files</th>"
      "<th>half-way failures</th><th>after full</th><th>near / far</th>"
      "<th>time to fail / retried put</th><th>where the space was</th></tr>\n{}</table>\n",
      rows);
}

}  // namespace

section render_space(const std::string& out, const std::vector<std::string>& spacebench_files) {
  std::vector<json> docs;
  for (const auto& file : spacebench_files) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file);
    docs.push_back(json::parse(in));
  }
  std::vector<target_row> targets;
  for (const auto& doc : docs) {
    const json& f = doc["fill"];
    if (!f.contains("stored")) continue;  // skipped or failed: in the table, with why
    const std::string v = name_of(doc);
    const json& a = f["after_full"];
    const std::uint64_t half_way =
        f["half_way_failures"].get<std::uint64_t>() + a["half_way_failures"].get<std::uint64_t>();
    targets.push_back(headline({v + ": commits failed half-way, deaths by signal",
                                fmt::format("{}", half_way), "0", half_way == 0},
                               "A commit either happens whole or fails before anything of it "
                               "is visible, even as the volume fills: none may fail half-way."));
    // The ideal packer stores each record and its index entry (both the format's, per key).
    // A file of an older spacebench has only the records' figure.
    const bool with_index = f.contains("fill_with_index_pct");
    const double fill = number(f, with_index ? "fill_with_index_pct" : "fill_with_overhead_pct");
    targets.push_back(
        headline({v + (with_index ? ": fill at first no_space (ideal packer of records and "
                                    "index entries)"
                                  : ": fill at first no_space (ideal packer of records)"),
                  fmt::format("{:.1f} %", fill), "≥ 99 %", fill >= 99.0},
                 "How much of the volume the store uses before it says full, against a perfect "
                 "packer of the same records (Tux3's target: 99 %)."));
    const bool after = a["erase_failures"].get<std::uint64_t>() == 0 &&
                       a["segments_removed"].get<std::uint64_t>() > 0 &&
                       a["stored_again"].get<std::uint64_t>() > 0;
    targets.push_back(headline({v + ": deletes, compaction, then puts after full",
                                after ? "all worked" : "failed", "all work", after},
                               "On a full volume deletes still work and give their room back."));
    const double ratio = number(doc, "near_far_ratio");
    targets.push_back({v + ": near-full stream vs far", fmt_ratio(ratio), "≤ 2×",
                       std::isfinite(ratio) && ratio <= 2.0, std::isfinite(ratio)});
    const double fail = std::max(number(f, "fail_seconds"), number(f, "retry_mean_seconds"));
    targets.push_back({v + ": time to fail, retried puts", fmt::format("{:.6f} s", fail), "≤ 0.1 s",
                       fail <= 0.1});
  }
  // The shared volume (issue 46): an idle opener, a budget, a foreign writer. A file of an
  // older spacebench has none of them.
  for (const auto& doc : docs) {
    const std::string v = name_of(doc);
    const auto why_not = [](const json& r) {
      for (const char* k : {"skipped", "died", "error"}) {
        if (r.contains(k) && r[k].is_string()) return "not measured: " + r[k].get<std::string>();
      }
      return std::string("not measured");
    };
    if (doc.contains("idle_opener")) {
      const json& r = doc["idle_opener"];
      const bool measured = r.contains("put_again") && !r.contains("error");
      const double pct = number(r, "put_again_pct");
      targets.push_back({v + ": puts another process fits after erase + compact, an opener idle",
                         measured ? fmt::format("{:.1f} % ({} of {} erased)", pct,
                                                r["put_again"].get<std::uint64_t>(),
                                                r["erased"].get<std::uint64_t>())
                                  : why_not(r),
                         "≥ 95 %", measured && pct >= 95.0, measured});
    }
    if (doc.contains("idle_opener_budget")) {
      const json& r = doc["idle_opener_budget"];
      const bool measured = r.contains("device_bytes") && !r.contains("error");
      const double used = number(r, "device_bytes");
      const double budget = number(r, "max_bytes");
      targets.push_back(
          {v + ": device bytes under max_bytes, an opener idle",
           measured ? fmt::format("{:.2f} MiB of {:.2f} MiB", used / 1048576.0, budget / 1048576.0)
                    : why_not(r),
           "≤ the budget", measured && used <= budget, measured});
    }
    if (doc.contains("foreign_writer")) {
      const json& r = doc["foreign_writer"];
      const bool measured = r.contains("erases_tried") && !r.contains("error");
      const std::uint64_t failed = measured ? r["erase_failures"].get<std::uint64_t>() : 0;
      targets.push_back({v + ": erases failed while a foreign writer keeps the volume full",
                         measured ? fmt::format("{} of {} (longest {:.3f} s)", failed,
                                                r["erases_tried"].get<std::uint64_t>(),
                                                number(r, "longest_erase_seconds"))
                                  : why_not(r),
                         "0", measured && failed == 0, measured});
    }
    if (doc.contains("qgroup")) {
      // btrfs only: a qgroup another program holds at its limit (statfs cannot see it).
      const json& r = doc["qgroup"];
      const bool measured = r.contains("workers") && !r.contains("error");
      const std::uint64_t killed =
          measured ? r["killed_by_signal"].get<std::uint64_t>() + r["hung"].get<std::uint64_t>()
                   : 0;
      targets.push_back({v + ": store processes killed by a signal (or hung) under a qgroup at "
                             "its limit, held and then filled and freed",
                         measured
                             ? fmt::format("{} of {}", killed, r["processes"].get<std::uint64_t>())
                             : why_not(r),
                         "0", measured && killed == 0, measured});
      const double longest = number(r, "longest_call_seconds");
      const double timeout = number(r, "lock_timeout_seconds");
      targets.push_back(
          {v + ": the longest call under a qgroup at its limit, held and then filled and freed",
           measured ? fmt::format("{:.3f} s", longest) : why_not(r),
           fmt::format("≤ lock_timeout ({:.0f} s)", timeout), measured && longest <= timeout,
           measured});
      const std::uint64_t lost = measured ? r["lost_puts"].get<std::uint64_t>() : 0;
      targets.push_back(
          {v + ": acknowledged puts lost, a qgroup held at its limit",
           measured ? fmt::format("{} of {}", lost, r["acknowledged_puts"].get<std::uint64_t>())
                    : why_not(r),
           "0", measured && lost == 0, measured});
    }
  }
  for (const auto& doc : docs) {
    if (!doc.contains("ledger")) continue;
    const json& l = doc["ledger"];
    if (!l.contains("charge_ns")) {
      targets.push_back({name_of(doc) + ": ledger cost far from full (on vs off)",
                         "not measured: " + l.dump(), "≤ 1 %, < 100 ns", false, false});
      continue;
    }
    const double pct = number(l, "cost_pct");
    const double ns = number(l, "charge_ns");
    targets.push_back(
        {name_of(doc) + ": ledger cost far from full (on vs off, median of 15 rounds)",
         fmt::format("{:+.2f} % (best {:.0f} vs {:.0f} puts/s); {:.1f} ns a charge", pct,
                     number(l, "best_on"), number(l, "best_off"), ns),
         "≤ 1 %, < 100 ns", pct <= 1.0 && ns < 100.0});
  }
  bool blurt_measured = false;
  for (const auto& doc : docs) {
    if (!doc.contains("blurt") || !doc["blurt"].contains("seconds")) continue;
    blurt_measured = true;
    const json& b = doc["blurt"];
    const json& p = doc["blurt_plain"];
    const std::uint64_t failed =
        b["failed_tasks"].get<std::uint64_t>() + b["signalled_tasks"].get<std::uint64_t>();
    const std::string plain = p.contains("seconds")
                                  ? fmt::format("plain files {:.2f} s, {:.1f} % used",
                                                number(p, "seconds"), number(p, "used_pct"))
                                  : "plain files not measured";
    targets.push_back(
        {fmt::format("{}: blurt, {} processes at once, {} rounds, live {:.0f} % of {} MiB",
                     name_of(doc), doc.value("blurt_tasks", 0), b["rounds_planned"].get<int>(),
                     number(b, "live_pct"), b.value("volume_mib", 0)),
         fmt::format("{} failed tasks, {:.2f} s, {:.1f} % used ({})", failed, number(b, "seconds"),
                     number(b, "used_pct"), plain),
         "0 failed (no early no_space)",
         failed == 0 && b["rounds"].get<int>() == b["rounds_planned"].get<int>()});
  }
  if (!blurt_measured) {
    targets.push_back({"blurt: processes rewriting in parallel", "not measured in this run",
                       "no early no_space", false, false});
  }
  section s;
  s.results["runs"] = docs;
  std::vector<figure> pngs;
  if (auto png = plot(out, docs); !png.empty()) {
    pngs.push_back({png,
                    "Two line charts, one line per volume, against seconds since the store was "
                    "made (log scale): left, the values stored as a percentage of the volume's "
                    "free space, up to the first no_space; right, puts per second (log scale), "
                    "which should stay level as the volume fills."});
  }
  finish_section(s, "keel::space: filling a volume (keel-bench spacebench)", targets, pngs,
                 table_html(docs));
  return s;
}

}  // namespace keel::report
