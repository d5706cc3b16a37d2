#include "lock_report.hpp"

#include <fmt/format.h>
#include <fmt/os.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "render.hpp"

namespace keel::report {
namespace {

using nlohmann::json;

const std::vector<std::string> kernel_baselines = {"flock", "fcntl", "sysv"};
const std::vector<std::string> keel_contenders = {"byte_ranges", "atomic_append", "memory_map"};

// lockscale: algorithm → workers → row
using scale_rows = std::map<std::string, std::map<std::size_t, json>>;

void plot_lockscale(const std::string& out, const scale_rows& rows, std::vector<figure>& pngs) {
  const std::string dat = out + "/lockscale.dat";
  {
    auto f = fmt::output_file(dat);
    for (const auto& [algo, by_n] : rows) {
      f.print("# {}\n", algo);
      for (const auto& [n, r] : by_n) {
        const double total = r["total"].get<double>();
        const double mean = std::max(r["mean"].get<double>(), 1e-9);
        const double cpu_us =
            total > 0 ? (r["user_cpu"].get<double>() + r["system_cpu"].get<double>()) * 1e6 / total
                      : 0;
        const double sys_us = total > 0 ? r["system_cpu"].get<double>() * 1e6 / total : 0;
        f.print("{} {} {} {} {} {} {} {}\n", n, total, r["ideal"].get<double>(), cpu_us, sys_us,
                r["min"].get<double>() / mean, r["max"].get<double>() / mean,
                r["stddev"].get<double>() / mean);
      }
      f.print("\n\n");
    }
  }
  std::string plots_total, plots_cpu, plots_fair;
  int index = 0;
  for (const auto& [algo, by_n] : rows) {
    const std::string sep = index == 0 ? "" : ", \\\n     ";
    plots_total += fmt::format("{}\"{}\" index {} using 1:2 with linespoints lw 2 title \"{}\"",
                               sep, dat, index, algo);
    plots_cpu += fmt::format("{}\"{}\" index {} using 1:4 with linespoints lw 2 title \"{}\"", sep,
                             dat, index, algo);
    // The min-max band of each algorithm, nudged sideways so they do not hide each other.
    plots_fair += fmt::format(
        "{}\"{}\" index {} using ($1*(1+0.04*{})):(1):6:7 with yerrorbars lw 2 title \"{}\"", sep,
        dat, index, index - 3, algo);
    ++index;
  }
  const std::string gp = out + "/lockscale.gp";
  {
    auto f = fmt::output_file(gp);
    f.print(R"gp(set terminal pngcairo size 900,500 font "sans,10"
set termoption noenhanced
set logscale x
set grid
set key outside right
set xlabel "worker processes"
set output "{out}/lockscale-total.png"
set title "lockscale: total acquisitions (higher is better; dashed: ideal, 1e6·t/busy)"
set ylabel "acquisitions in the run"
set yrange [0:*]
plot {total}, \
     "{dat}" index 0 using 1:3 with lines dt 2 lc rgb "black" title "ideal"
set output "{out}/lockscale-cpu.png"
set title "lockscale: CPU (user + system) per acquisition (lower is better)"
set ylabel "µs of CPU per acquisition"
set logscale y
set yrange [*:*]
plot {cpu}
unset logscale y
set output "{out}/lockscale-fairness.png"
set title "lockscale: fairness, acquisitions per worker from min to max, relative to the mean"
set ylabel "acquisitions / mean"
set yrange [0:*]
plot {fair}
)gp",
            fmt::arg("out", out), fmt::arg("total", plots_total), fmt::arg("cpu", plots_cpu),
            fmt::arg("fair", plots_fair), fmt::arg("dat", dat));
  }
  run_gnuplot(gp);
  pngs.push_back({"lockscale-total.png",
                  "Line chart: lock acquisitions in the run against the number of worker "
                  "processes (log scale), one line per lock algorithm, with the ideal as a dashed "
                  "line; higher is better."});
  pngs.push_back({"lockscale-cpu.png",
                  "Line chart: microseconds of CPU (user and system) per acquisition against the "
                  "number of worker processes, one line per algorithm, both axes log scale; lower "
                  "is better."});
  pngs.push_back({"lockscale-fairness.png",
                  "Fairness: for each algorithm and worker count, a bar from the fewest to the "
                  "most acquisitions one worker made, relative to the mean (1); a short bar "
                  "around 1 is fair."});
}

void plot_matrix(const std::string& out, const json& m, std::vector<figure>& pngs) {
  const auto& algos = m["algorithms"];
  const auto waiters = m["waiters"].get<std::vector<int>>();
  const auto entities = m["entities"].get<std::vector<int>>();
  for (const std::string mode : {"contended", "uncontended"}) {
    std::vector<std::string> names;
    for (auto it = algos.begin(); it != algos.end(); ++it) {
      if (it.value().contains(mode)) names.push_back(it.key());
    }
    if (names.empty()) continue;
    // One colour scale for every panel, so algorithms compare at a glance.
    double lo = 1e300;
    double hi = 1.0;
    for (const auto& name : names) {
      for (const auto& row : algos[name][mode]) {
        for (const auto& cell : row) {
          lo = std::min(lo, std::max(cell.get<double>(), 1.0));
          hi = std::max(hi, cell.get<double>());
        }
      }
    }
    if (hi <= lo) hi = lo * 10;
    const std::string gp = fmt::format("{}/matrix-{}.gp", out, mode);
    const std::size_t cols = 4;
    const std::size_t rows_n = (names.size() + cols - 1) / cols;
    auto f = fmt::output_file(gp);
    f.print(R"gp(set terminal pngcairo size 1200,{h} font "sans,9"
set output "{out}/matrix-{mode}.png"
set termoption noenhanced
set multiplot layout {r},{c} title "lockmatrix, {mode}: lock+unlock per second (one colour scale, log)"
set logscale cb
set cbrange [{lo}:{hi}]
set palette rgbformulae 21,22,23
set xlabel "entities"
set ylabel "waiters"
set style textbox opaque noborder
)gp",
            fmt::arg("h", 330 * rows_n + 40), fmt::arg("out", out), fmt::arg("mode", mode),
            fmt::arg("r", rows_n), fmt::arg("c", cols), fmt::arg("lo", lo), fmt::arg("hi", hi));
    std::string xtics, ytics;
    for (std::size_t i = 0; i < entities.size(); ++i) {
      xtics += fmt::format("{}\"{}\" {}", i == 0 ? "" : ", ", entities[i], i);
    }
    for (std::size_t i = 0; i < waiters.size(); ++i) {
      ytics += fmt::format("{}\"{}\" {}", i == 0 ? "" : ", ", waiters[i], i);
    }
    f.print("set xtics ({})\nset ytics ({})\n", xtics, ytics);
    for (const auto& name : names) {
      const std::string dat = fmt::format("{}/matrix-{}-{}.dat", out, mode, name);
      {
        auto d = fmt::output_file(dat);
        for (const auto& row : algos[name][mode]) {
          for (const auto& cell : row)
            d.print("{} ", std::max(cell.get<double>(), 1.0));
          d.print("\n");
        }
      }
      // The figure in each cell too (gnuplot's %s%c: mantissa and k, M), so that the colours
      // need no legend to be read.
      f.print(
          "set title \"{}\"\nplot \"{}\" matrix with image notitle, \"\" matrix using "
          "1:2:(gprintf(\"%.1s%c\",$3)) with labels boxed font \",8\" notitle\n",
          name, dat);
    }
    f.print("unset multiplot\n");
    f.close();
    run_gnuplot(gp);
    pngs.push_back(
        {fmt::format("matrix-{}.png", mode),
         fmt::format("Heatmaps, one per lock algorithm: lock+unlock operations per second, {}, "
                     "for each number of waiting processes (rows) and of entities locked at "
                     "once (columns), the figure written in each cell; one colour scale for "
                     "all, log, lighter is faster. The tables below give the same figures.",
                     mode == std::string("contended") ? "every waiter on the same entities"
                                                      : "each waiter on entities of its own")});
  }
}

std::string matrix_tables_html(const json& m) {
  std::string html;
  const auto waiters = m["waiters"].get<std::vector<int>>();
  const auto entities = m["entities"].get<std::vector<int>>();
  for (auto it = m["algorithms"].begin(); it != m["algorithms"].end(); ++it) {
    for (const std::string mode : {"contended", "uncontended"}) {
      if (!it.value().contains(mode)) continue;
      html += fmt::format("<table class=\"matrix\"><caption>!{} ({})</caption><tr><th></th>",
                          html_escape(it.key()), mode);
      for (int e : entities)
        html += fmt::format("<th>{} entities</th>", e);
      html += "</tr>\n";
      const auto& table = it.value()[mode];
      for (std::size_t w = 0; w < waiters.size() && w < table.size(); ++w) {
        html += fmt::format("<tr><th>{} waiters</th>", waiters[w]);
        for (const auto& cell : table[w])
          html += fmt::format("<td>{:.0f}</td>", cell.get<double>());
        html += "</tr>\n";
      }
      html += "</table>\n";
    }
  }
  return html;
}

}  // namespace

// lockscale JSON files by algorithm and worker count; refuses a run whose exclusion broke.
scale_rows load_scale(const std::vector<std::string>& files, json& params) {
  scale_rows rows;
  for (const auto& file : files) {
    std::ifstream in(file);
    if (!in) throw std::runtime_error("cannot read " + file);
    const json doc = json::parse(in);
    if (!doc.value("exclusion_verified", false)) {
      throw std::runtime_error(file + ": mutual exclusion was broken in that run");
    }
    params = {{"busy_us", doc["busy_us"]},
              {"idle_us", doc["idle_us"]},
              {"seconds", doc["seconds"]},
              {"filesystem", doc.value("filesystem", "")},
              {"two_mounts", doc.value("two_mounts", false)}};
    for (const auto& r : doc["rows"])
      rows[doc["algorithm"]][r["workers"].get<std::size_t>()] = r;
  }
  return rows;
}

namespace {

// The lockscale sweep on other filesystems: a table of totals with the ratio to the best
// kernel lock on the same filesystem, and one clustered bar chart per worker count.
// The main sweep (`main_rows`, on `main_fs`) is shown beside them, for the same algorithms
// and worker counts.
std::string render_fs(const std::string& out, const lock_inputs& in, const scale_rows& main_rows,
                      const std::string& main_fs, json& results, std::vector<figure>& pngs) {
  // filesystem → algorithm → workers → row
  std::map<std::string, scale_rows> by_fs;
  std::set<std::string> fs_algos;
  std::set<std::size_t> fs_counts;
  for (const auto& file : in.lockscale_fs) {
    json params;
    const scale_rows rows = load_scale({file}, params);
    std::string fs = params["filesystem"].get<std::string>();
    // lockscale --through: half the workers locked through a second client mount.
    if (params.value("two_mounts", false)) fs += ", 2 client mounts";
    for (const auto& [algo, by_n] : rows) {
      by_fs[fs][algo].insert(by_n.begin(), by_n.end());
      fs_algos.insert(algo);
      for (const auto& [n, r] : by_n)
        fs_counts.insert(n);
    }
  }
  if (!by_fs.empty() && !by_fs.contains(main_fs)) {
    for (const auto& [algo, by_n] : main_rows) {
      if (!fs_algos.contains(algo)) continue;
      for (const auto& [n, r] : by_n) {
        if (fs_counts.contains(n)) by_fs[main_fs][algo][n] = r;
      }
    }
  }
  std::string html;
  results["lockscale_fs"] = {{"rows", json::object()}, {"skipped", in.fs_skipped}};
  if (!by_fs.empty()) {
    std::set<std::size_t> counts;
    std::set<std::string> algos;
    for (const auto& [fs, rows] : by_fs) {
      for (const auto& [algo, by_n] : rows) {
        algos.insert(algo);
        for (const auto& [n, r] : by_n) {
          counts.insert(n);
          results["lockscale_fs"]["rows"][fs][algo].push_back(r);
        }
      }
    }
    html +=
        "<h3>lockscale on other filesystems (ext4, xfs and btrfs on loop devices; fuse: a "
        "GlusterFS volume mounted twice, every second worker locking through the other mount, "
        "as two machines would; total acquisitions, and the ratio to the best of flock and "
        "fcntl on the same filesystem)</h3>\n<table><tr>"
        "<th>filesystem</th><th>algorithm</th>";
    for (const std::size_t n : counts)
      html += fmt::format("<th>{} workers</th>", n);
    html += "</tr>\n";
    const auto best_kernel = [](const scale_rows& rows, std::size_t n) {
      double best = 0;
      for (const char* k : {"flock", "fcntl"}) {
        if (rows.contains(k) && rows.at(k).contains(n)) {
          best = std::max(best, rows.at(k).at(n)["total"].get<double>());
        }
      }
      return best;
    };
    for (const auto& [fs, rows] : by_fs) {
      for (const auto& [algo, by_n] : rows) {
        html += fmt::format("<tr><td>{}</td><td>{}</td>", html_escape(fs), html_escape(algo));
        for (const std::size_t n : counts) {
          if (!by_n.contains(n)) {
            html += "<td></td>";
            continue;
          }
          const double total = by_n.at(n)["total"].get<double>();
          const double best = best_kernel(rows, n);
          html += fmt::format("<td>{:.0f} ({})</td>", total,
                              best > 0 ? fmt_ratio(total / best) : std::string("n/a"));
        }
        html += "</tr>\n";
      }
    }
    html += "</table>\n";

    // Data: one block per worker count; a row per filesystem, a column per algorithm.
    const std::string dat = out + "/lockscale-fs.dat";
    {
      auto f = fmt::output_file(dat);
      for (const std::size_t n : counts) {
        f.print("# {} workers\nfs", n);
        for (const auto& a : algos)
          f.print(" {}", a);
        f.print("\n");
        for (const auto& [fs, rows] : by_fs) {
          f.print("{}", fs);
          for (const auto& a : algos) {
            const bool has = rows.contains(a) && rows.at(a).contains(n);
            f.print(" {}", has ? rows.at(a).at(n)["total"].dump() : "0");
          }
          f.print("\n");
        }
        f.print("\n\n");
      }
    }
    std::vector<std::string> titles;
    for (const std::size_t n : counts)
      titles.push_back(fmt::format("{} workers", n));
    plot_clustered_bars(out, "lockscale-fs", dat, titles, algos.size(),
                        "lockscale by filesystem (higher is better)", "acquisitions in the run",
                        450);
    pngs.push_back({"lockscale-fs.png",
                    "Bar charts, one per worker count: acquisitions in the run for each "
                    "filesystem (clusters) and lock algorithm (bars); higher is better. The "
                    "table above gives the figures and each one's ratio to the best kernel "
                    "lock on the same filesystem."});
  }
  if (!in.fs_skipped.empty()) {
    html += "<p>Not measured on other filesystems: ";
    for (std::size_t i = 0; i < in.fs_skipped.size(); ++i)
      html += (i == 0 ? "" : "; ") + html_escape(in.fs_skipped[i]);
    html += ".</p>\n";
  }
  return html;
}

}  // namespace

section render_locks(const std::string& out, const lock_inputs& inputs) {
  const auto& lockscale_files = inputs.lockscale;
  const auto& short_files = inputs.lockscale_short;
  const auto& lockmatrix_file = inputs.lockmatrix;
  section s;
  s.results = json::object();
  std::vector<figure> pngs;
  std::vector<target_row> targets;
  std::string tables;

  json scale_params;
  scale_rows rows = load_scale(lockscale_files, scale_params);
  if (!rows.empty()) {
    s.results["lockscale"] = {{"parameters", scale_params}, {"rows", json::object()}};
    for (const auto& [algo, by_n] : rows) {
      for (const auto& [n, r] : by_n)
        s.results["lockscale"]["rows"][algo].push_back(r);
    }
    plot_lockscale(out, rows, pngs);
    // The table, in lockscale's own columns.
    tables += fmt::format(
        "<h3>lockscale (busy {} µs, idle {} µs, {} s per run, "
        "{})</h3>\n<table><tr><th>algorithm</th>"
        "<th>workers</th><th>duration s</th><th>user s</th><th>system s</th><th>total</th>"
        "<th>min</th><th>max</th><th>mean</th><th>sd</th></tr>\n",
        scale_params["busy_us"].dump(), scale_params["idle_us"].dump(),
        scale_params["seconds"].dump(), html_escape(scale_params["filesystem"].get<std::string>()));
    for (const auto& [algo, by_n] : rows) {
      for (const auto& [n, r] : by_n) {
        tables += fmt::format(
            "<tr><td>{}</td><td>{}</td><td>{:.3f}</td><td>{:.3f}</td><td>{:.3f}</td><td>{}</td>"
            "<td>{}</td><td>{}</td><td>{:.1f}</td><td>{:.1f}</td></tr>\n",
            html_escape(algo), n, r["seconds"].get<double>(), r["user_cpu"].get<double>(),
            r["system_cpu"].get<double>(), r["total"].dump(), r["min"].dump(), r["max"].dump(),
            r["mean"].get<double>(), r["stddev"].get<double>());
      }
    }
    tables += "</table>\n";

    // Targets against the best kernel baseline of the same run, worker count by worker count.
    std::set<std::size_t> counts;
    for (const auto& [algo, by_n] : rows) {
      for (const auto& [n, r] : by_n)
        counts.insert(n);
    }
    for (const std::size_t n : counts) {
      double best = 0;
      std::string best_name;
      double flock_sys = NAN;
      double fcntl_fair = NAN;
      for (const auto& k : kernel_baselines) {
        if (!rows.contains(k) || !rows[k].contains(n)) continue;
        const auto& r = rows[k][n];
        if (r["total"].get<double>() > best) {
          best = r["total"].get<double>();
          best_name = k;
        }
        if (k == "flock" && r["total"].get<double>() > 0) {
          flock_sys = r["system_cpu"].get<double>() / r["total"].get<double>();
        }
        if (k == "fcntl" && r["mean"].get<double>() > 0) {
          fcntl_fair = r["stddev"].get<double>() / r["mean"].get<double>();
        }
      }
      for (const auto& a : keel_contenders) {
        if (!rows.contains(a) || !rows[a].contains(n)) continue;
        const auto& r = rows[a][n];
        const double total = r["total"].get<double>();
        if (best > 0) {
          const double ratio = total / best;
          target_row row{
              fmt::format("lockscale {} workers: {} total vs best kernel ({})", n, a, best_name),
              fmt_ratio(ratio), "≥ 0.98×", ratio >= 0.98};
          if (a == "memory_map" && n == *counts.rbegin()) {
            row = headline(std::move(row),
                           fmt::format("With {} processes taking turns on one lock, each holding "
                                       "it {} µs, keel's fastest lock lets through {} as many "
                                       "as the best kernel lock.",
                                       n, scale_params["busy_us"].dump(), fmt_ratio(ratio)));
          }
          targets.push_back(std::move(row));
        }
        const double fair =
            r["mean"].get<double>() > 0 ? r["stddev"].get<double>() / r["mean"].get<double>() : NAN;
        if (a == "byte_ranges") {
          targets.push_back({fmt::format("lockscale {} workers: byte_ranges sd/mean vs fcntl's", n),
                             fmt::format("{:.3f} (fcntl {:.3f})", fair, fcntl_fair), "≤ fcntl's",
                             std::isfinite(fair) && fair <= fcntl_fair});
        } else {
          target_row row{fmt::format("lockscale {} workers: {} sd/mean", n, a),
                         fmt::format("{:.3f}", fair), "≤ 0.1", std::isfinite(fair) && fair <= 0.1};
          if (a == "memory_map" && n == *counts.rbegin()) {
            row = headline(std::move(row),
                           "Fairness: how much the processes' shares of the lock differ "
                           "(standard deviation over mean); near 0, nobody starves.");
          }
          targets.push_back(std::move(row));
        }
        if (std::isfinite(flock_sys) && total > 0) {
          const double sys = r["system_cpu"].get<double>() / total;
          targets.push_back(
              {fmt::format("lockscale {} workers: {} system CPU per acquisition", n, a),
               fmt::format("{:.1f} µs (flock {:.1f} µs)", sys * 1e6, flock_sys * 1e6), "≤ flock's",
               sys <= flock_sys});
        }
      }
    }
  }

  bool measured_short = false;
  if (!short_files.empty()) {
    json short_params;
    scale_rows short_rows = load_scale(short_files, short_params);
    s.results["lockscale_short"] = {{"parameters", short_params}, {"rows", json::object()}};
    tables += fmt::format(
        "<h3>lockscale, short critical sections (busy {} µs, idle {} µs, {} s)</h3>\n<table>"
        "<tr><th>algorithm</th><th>workers</th><th>total</th><th>user s</th><th>system s</th>"
        "</tr>\n",
        short_params["busy_us"].dump(), short_params["idle_us"].dump(),
        short_params["seconds"].dump());
    std::set<std::size_t> counts;
    for (const auto& [algo, by_n] : short_rows) {
      for (const auto& [n, r] : by_n) {
        counts.insert(n);
        s.results["lockscale_short"]["rows"][algo].push_back(r);
        tables += fmt::format(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.3f}</td><td>{:.3f}</td></tr>\n",
            html_escape(algo), n, r["total"].dump(), r["user_cpu"].get<double>(),
            r["system_cpu"].get<double>());
      }
    }
    tables += "</table>\n";
    for (const std::size_t n : counts) {
      double best = 0;
      std::string best_name;
      for (const auto& k : kernel_baselines) {
        if (short_rows.contains(k) && short_rows[k].contains(n) &&
            short_rows[k][n]["total"].get<double>() > best) {
          best = short_rows[k][n]["total"].get<double>();
          best_name = k;
        }
      }
      if (best > 0 && short_rows.contains("memory_map") && short_rows["memory_map"].contains(n)) {
        const double ratio = short_rows["memory_map"][n]["total"].get<double>() / best;
        target_row row{fmt::format("lockscale busy {} µs, {} workers: memory_map total vs best "
                                   "kernel ({})",
                                   short_params["busy_us"].dump(), n, best_name),
                       fmt_ratio(ratio), "≥ 1×", ratio >= 1.0};
        if (n == *counts.rbegin()) {
          row = headline(std::move(row),
                         fmt::format("With short critical sections ({} µs), where the lock's own "
                                     "cost shows, keel's fastest lock against the best kernel "
                                     "lock.",
                                     short_params["busy_us"].dump()));
        }
        targets.push_back(std::move(row));
        measured_short = true;
      }
      // Issue 15: atomic_append against the kernel locks with short holds.
      const auto total_of = [&](const std::string& k) {
        return short_rows.contains(k) && short_rows[k].contains(n)
                   ? short_rows[k][n]["total"].get<double>()
                   : 0.0;
      };
      const double aa = total_of("atomic_append");
      const double fcntl = total_of("fcntl");
      const double flock = total_of("flock");
      if (aa > 0 && fcntl > 0 && flock > 0) {
        const std::string hold =
            fmt::format("busy {} µs, {} workers", short_params["busy_us"].dump(), n);
        targets.push_back({fmt::format("lockscale {}: atomic_append total vs fcntl", hold),
                           fmt_ratio(aa / fcntl), "≥ 0.9×", aa / fcntl >= 0.9});
        const double aa_sys = short_rows["atomic_append"][n]["system_cpu"].get<double>() / aa;
        const double flock_sys = short_rows["flock"][n]["system_cpu"].get<double>() / flock;
        targets.push_back(
            {fmt::format("lockscale {}: atomic_append system CPU per acquisition", hold),
             fmt::format("{:.1f} µs (flock {:.1f} µs)", aa_sys * 1e6, flock_sys * 1e6),
             "≤ 2× flock's", aa_sys <= 2 * flock_sys});
      }
    }
  }
  bool measured_cas = false;
  bool measured_ofd = false;
  std::vector<std::string> missing;
  if (!lockmatrix_file.empty()) {
    std::ifstream in(lockmatrix_file);
    if (!in) throw std::runtime_error("cannot read " + lockmatrix_file);
    const json m = json::parse(in);
    if (!m.value("exclusion_verified", false)) {
      throw std::runtime_error(lockmatrix_file + ": mutual exclusion was broken in that run");
    }
    s.results["lockmatrix"] = m;
    plot_matrix(out, m, pngs);
    tables += fmt::format("<h3>lockmatrix ({} s per cell, {})</h3>\n", m["seconds"].dump(),
                          html_escape(m.value("filesystem", "")));
    tables += matrix_tables_html(m);
    const auto& algos = m["algorithms"];
    const auto entities = m["entities"].get<std::vector<int>>();
    const auto col_of = [&](int e) -> int {
      for (std::size_t i = 0; i < entities.size(); ++i) {
        if (entities[i] == e) return static_cast<int>(i);
      }
      return -1;
    };
    const auto cell = [&](const std::string& a, const char* mode, std::size_t row,
                          int col) -> double {
      if (!algos.contains(a) || !algos[a].contains(mode) || col < 0) return std::nan("");
      return algos[a][mode][row][static_cast<std::size_t>(col)].get<double>();
    };
    const double mm = cell("memory_map", "uncontended", 0, col_of(1));
    const double br = cell("byte_ranges", "uncontended", 0, col_of(1));
    if (std::isfinite(mm) && std::isfinite(br)) {
      targets.push_back({"lockmatrix uncontended, 1 waiter, 1 entity: memory_map vs byte_ranges",
                         fmt_ratio(mm / br), "≥ 15×", mm / br >= 15});
    }
    const double cas = cell("cas", "uncontended", 0, col_of(1));
    const double ofd = cell("ofd", "uncontended", 0, col_of(1));
    if (std::isfinite(mm) && std::isfinite(cas)) {
      targets.push_back(headline(
          {"lockmatrix uncontended, 1 waiter, 1 entity: memory_map vs bare CAS loop",
           fmt_ratio(mm / cas), "≥ 0.5×", mm / cas >= 0.5},
          "An uncontended lock and unlock against the floor: a bare compare-and-swap loop on "
          "shared memory, which offers none of keel's guarantees (deadlines, dead holders)."));
      measured_cas = true;
    }
    if (std::isfinite(br) && std::isfinite(ofd)) {
      targets.push_back({"lockmatrix uncontended, 1 waiter, 1 entity: byte_ranges vs raw OFD loop",
                         fmt_ratio(br / ofd), "≥ 0.9×", br / ofd >= 0.9});
      measured_ofd = true;
    }
    const double aa1 = cell("atomic_append", "uncontended", 0, col_of(1));
    const double aa8 = cell("atomic_append", "uncontended", 0, col_of(8));
    if (std::isfinite(aa1) && std::isfinite(aa8)) {
      targets.push_back({"lockmatrix uncontended, 1 waiter: atomic_append 8 entities vs 1",
                         fmt_ratio(aa8 / aa1), "≥ 0.8×", aa8 / aa1 >= 0.8});
    }
  }
  if (!inputs.lockcli.empty()) {
    std::ifstream cli_in(inputs.lockcli);
    if (!cli_in) throw std::runtime_error("cannot read " + inputs.lockcli);
    const json c = json::parse(cli_in);
    s.results["lockcli"] = c;
    const double ratio = c["keel_lock_vs_flock"].get<double>();
    const auto& med = c["median_us"];
    targets.push_back(headline(
        {"keel lock -n FILE -- true vs flock -n FILE true (a shell user's cost per command)",
         fmt::format("{} ({:.2f} ms against {:.2f} ms; starting `true` alone: {:.2f} ms)",
                     fmt_ratio(ratio), med["keel_lock"].get<double>() / 1000,
                     med["flock"].get<double>() / 1000, med["true"].get<double>() / 1000),
         "≤ 1.5×", ratio <= 1.5},
        "What a shell script pays for each command it runs under `keel lock`, against "
        "flock(1) (a time ratio: below 1 keel is faster)."));
  } else {
    missing.push_back("keel lock -n FILE -- true vs flock -n FILE true (no flock(1) here)");
  }
  tables += render_fs(out, inputs, rows,
                      scale_params.is_null() ? std::string() : scale_params.value("filesystem", ""),
                      s.results, pngs);
  if (!measured_short) {
    missing.push_back("lockscale with busy 10 µs, idle 10 µs: memory_map vs best kernel (≥ 1×)");
  }
  if (!measured_cas) missing.push_back("memory_map vs a bare CAS loop (lockmatrix --peers)");
  if (!measured_ofd) missing.push_back("byte_ranges vs a raw OFD loop (lockmatrix --peers)");
  for (const auto& m : missing)
    targets.push_back({m, "not measured yet", "", false, false});

  finish_section(s, "Locks: scaling and the waiters × entities matrix", targets, pngs, tables);
  return s;
}

}  // namespace keel::report
