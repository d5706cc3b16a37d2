#include "aio_report.hpp"

#include <fmt/format.h>
#include <fmt/os.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>

namespace keel::report {
namespace {

using nlohmann::json;

// Items per second of `method` with `threads` threads and an fsync every `every` items.
double workload_rate(const json& rows, const std::string& method, unsigned threads,
                     unsigned every) {
  for (const auto& r : rows) {
    if (r["method"] == method && r["threads"] == threads && r["fsync_every"] == every) {
      return r["items_per_second"].get<double>();
    }
  }
  return NAN;
}

// One panel per thread count: items/s by method, clustered by fsync frequency.
void plot_workload(const std::string& out, const json& rows, std::vector<figure>& pngs,
                   const std::string& name, const std::string& title) {
  std::vector<std::string> methods;
  std::vector<unsigned> everies;
  std::vector<unsigned> threads;
  for (const auto& r : rows) {
    const auto m = r["method"].get<std::string>();
    const auto e = r["fsync_every"].get<unsigned>();
    const auto t = r["threads"].get<unsigned>();
    if (std::find(methods.begin(), methods.end(), m) == methods.end()) methods.push_back(m);
    if (std::find(everies.begin(), everies.end(), e) == everies.end()) everies.push_back(e);
    if (std::find(threads.begin(), threads.end(), t) == threads.end()) threads.push_back(t);
  }
  const std::string dat = out + "/" + name + ".dat";
  {
    auto f = fmt::output_file(dat);
    for (const unsigned t : threads) {
      f.print("# {} threads\nfsync_every", t);
      for (const auto& m : methods)
        f.print(" {}", m);
      f.print("\n");
      for (const unsigned e : everies) {
        f.print("\"every {}\"", e);
        for (const auto& m : methods) {
          const double v = workload_rate(rows, m, t, e);
          f.print(" {}", std::isfinite(v) ? v : 0.0);
        }
        f.print("\n");
      }
      f.print("\n\n");
    }
  }
  std::vector<std::string> titles;
  for (const unsigned t : threads)
    titles.push_back(fmt::format("{} thread(s)", t));
  plot_clustered_bars(out, name, dat, titles, methods.size(),
                      title + ", fsync every N (higher is better)", "items per second", 520);
  std::string names;
  for (std::size_t i = 0; i < methods.size(); ++i)
    names += (i == 0 ? "" : ", ") + methods[i];
  pngs.push_back(
      {name + ".png", fmt::format("Bar charts, one per thread count: items per second of the "
                                  "workload ({}) for each method ({}), clustered by how often it "
                                  "calls fsync; higher is better. The table below gives the "
                                  "figures and each one's ratio to plain POSIX calls.",
                                  title, names)});
}

// The table of one form of the workload, each row beside plain POSIX calls.
std::string workload_table(const json& part, const std::string& title) {
  const json& rows = part["rows"];
  std::string t = fmt::format(
      "<h3>{} ({} passes of compute, about one 64 KiB write; items/s)</h3>\n<table><tr>"
      "<th>method</th><th>threads</th><th>N</th><th>items</th><th>s</th><th>items/s</th>"
      "<th>vs posix</th></tr>\n",
      html_escape(title), part["compute_rounds"].get<unsigned>());
  for (const auto& r : rows) {
    const double base = workload_rate(rows, "posix", r["threads"].get<unsigned>(),
                                      r["fsync_every"].get<unsigned>());
    t += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.2f}</td><td>{:.0f}</td>"
        "<td>{}</td></tr>\n",
        html_escape(r["method"].get<std::string>()), r["threads"].get<unsigned>(),
        r["fsync_every"].get<unsigned>(), r["items"].get<std::uint64_t>(),
        r["seconds"].get<double>(), r["items_per_second"].get<double>(),
        fmt_ratio(r["items_per_second"].get<double>() / base));
  }
  for (const auto& skip : part.value("skipped", json::array())) {
    t += fmt::format("<tr><td>{}</td><td colspan=\"6\">not measured: {}</td></tr>\n",
                     html_escape(skip["method"].get<std::string>()),
                     html_escape(skip["reason"].get<std::string>()));
  }
  return t + "</table>\n";
}

// A target of keel + cache against another method of the same part (1 thread, fsync every
// 30), or why it was not measured.
void cache_target(std::vector<target_row>& targets, const json& part, const std::string& name,
                  const char* peer, const std::string& goal_text, double goal,
                  std::string meaning = {}) {
  if (part.contains("skipped_all")) {
    targets.push_back(
        {name, "not measured: " + part["skipped_all"].get<std::string>(), "", false, false});
    return;
  }
  const double keel = workload_rate(part["rows"], "keel_io_uring_cache", 1, 30);
  const double other = workload_rate(part["rows"], peer, 1, 30);
  if (!std::isfinite(keel) || !std::isfinite(other)) {
    targets.push_back({name, "not measured (io_uring cannot start here)", "", false, false});
    return;
  }
  targets.push_back(headline({name, fmt_ratio(keel / other), goal_text, keel / other >= goal},
                             std::move(meaning)));
}

}  // namespace

section render_aio(const std::string& out, const std::string& aiobench_file) {
  std::ifstream in(aiobench_file);
  if (!in) throw std::runtime_error("cannot read " + aiobench_file);
  const json doc = json::parse(in);
  section s;
  s.results = doc;
  std::vector<target_row> targets;
  std::vector<figure> pngs;
  std::string tables =
      fmt::format("<p>Files on {} ({}); the controller's default engine here: {}{}.</p>\n",
                  html_escape(doc.value("filesystem", "?")), html_escape(doc.value("dir", "?")),
                  html_escape(doc.value("default_engine", "?")),
                  doc.value("fallback_reason", "").empty()
                      ? ""
                      : " (" + html_escape(doc.value("fallback_reason", "")) + ")");

  if (doc.contains("randread")) {
    const json& r = doc["randread"];
    if (r.contains("skipped")) {
      for (const char* name : {"randread O_DIRECT: keel io_uring vs fio io_uring",
                               "randread buffered: keel io_uring vs fio io_uring",
                               "randread buffered: keel posix vs fio psync, one at a time",
                               "randread buffered: keel posix vs fio psync, 32 queued"}) {
        targets.push_back(
            {name, "not measured: " + r["skipped"].get<std::string>(), "", false, false});
      }
    } else {
      const auto ratio = [](const json& j, const char* keel, const char* peer) {
        return j[keel].get<double>() / j[peer].get<double>();
      };
      const double d = ratio(r["direct"], "keel_io_uring", "fio_io_uring");
      const double b = ratio(r["buffered"], "keel_io_uring", "fio_io_uring");
      const double p = ratio(r["psync"], "keel_posix", "fio_psync");
      const unsigned threads = r["psync"]["threads"].get<unsigned>();
      // Older results have no one-at-a-time row.
      const double one = r["psync"].contains("keel_posix_one_at_a_time")
                             ? ratio(r["psync"], "keel_posix_one_at_a_time", "fio_psync")
                             : std::nan("");
      targets.push_back(headline({"randread 4 KiB O_DIRECT qd 32: keel io_uring vs fio io_uring",
                                  fmt_ratio(d), "≥ 0.9×", d >= 0.9},
                                 "Random reads from the device, 32 in flight: keel's io_uring "
                                 "engine against fio, the reference I/O benchmark; near 1, keel "
                                 "adds nothing to what the kernel does."));
      targets.push_back({"randread 4 KiB buffered qd 32: keel io_uring vs fio io_uring",
                         fmt_ratio(b), "≥ 0.85×", b >= 0.85});
      if (std::isfinite(one)) {
        targets.push_back({fmt::format("randread 4 KiB buffered, {} threads: keel posix vs fio "
                                       "psync, each thread one read at a time (fio's shape)",
                                       threads),
                           fmt_ratio(one), "≥ 0.9×", one >= 0.9});
      }
      targets.push_back({fmt::format("randread 4 KiB buffered, {} threads: keel posix ({} workers, "
                                     "one thread keeping 32 queued) vs fio psync",
                                     threads, threads),
                         fmt_ratio(p), "≥ 0.9×", p >= 0.9});
      tables += fmt::format(
          "<h3>Random 4 KiB reads of a {} MiB file (IOPS)</h3>\n<table><tr><th></th><th>fio</th>"
          "<th>keel</th><th>ratio</th></tr>\n"
          "<tr><td>O_DIRECT, io_uring, qd 32</td><td>{:.0f}</td><td>{:.0f}</td><td>{}</td></tr>\n"
          "<tr><td>buffered (page cache), io_uring, qd 32</td><td>{:.0f}</td><td>{:.0f}</td>"
          "<td>{}</td></tr>\n<tr><td>buffered, fio psync × {} threads / keel posix × {} "
          "workers, one thread keeping 32 queued</td><td>{:.0f}</td><td>{:.0f}</td><td>{}</td>"
          "</tr>\n{}</table>\n",
          r["file_bytes"].get<std::uint64_t>() >> 20, r["direct"]["fio_io_uring"].get<double>(),
          r["direct"]["keel_io_uring"].get<double>(), fmt_ratio(d),
          r["buffered"]["fio_io_uring"].get<double>(), r["buffered"]["keel_io_uring"].get<double>(),
          fmt_ratio(b), r["psync"]["threads"].get<unsigned>(),
          r["psync"]["threads"].get<unsigned>(), r["psync"]["fio_psync"].get<double>(),
          r["psync"]["keel_posix"].get<double>(), fmt_ratio(p),
          std::isfinite(one)
              ? fmt::format("<tr><td>buffered, fio psync × {} threads / keel posix, {} threads "
                            "each reading one block at a time</td><td>{:.0f}</td><td>{:.0f}</td>"
                            "<td>{}</td></tr>\n",
                            threads, threads, r["psync"]["fio_psync"].get<double>(),
                            r["psync"]["keel_posix_one_at_a_time"].get<double>(), fmt_ratio(one))
              : std::string());
    }
  }
  if (doc.contains("workload")) {
    const json& rows = doc["workload"]["rows"];
    const double posix = workload_rate(rows, "posix", 1, 30);
    // (The comparison with glibc's POSIX AIO is the small-request row's: this workload's
    // 64 KiB writes do not meet its global lock.)
    const double keel = workload_rate(rows, "keel_io_uring", 1, 30);
    for (const auto& skip : doc["workload"].value("skipped", json::array())) {
      if (skip["method"] != "keel_io_uring") continue;
      targets.push_back({"workload, 1 thread, fsync every 30: keel io_uring",
                         "not measured: " + skip["reason"].get<std::string>(), "", false, false});
    }
    if (std::isfinite(keel) && std::isfinite(posix)) {
      targets.push_back(
          headline({"workload, 1 thread, fsync every 30: keel io_uring vs plain POSIX calls",
                    fmt_ratio(keel / posix), "≥ 1.3×", keel / posix >= 1.3},
                   "A program that computes and writes (TAI's workload): with keel its writes "
                   "and fsyncs go on while it computes, instead of stopping it each time."));
    }
    cache_target(targets, doc["workload"],
                 "sequential workload, 1 thread, fsync every 30: keel io_uring + cache vs "
                 "without (the cache steps aside)",
                 "keel_io_uring", "≥ 0.95×", 0.95);
    plot_workload(out, rows, pngs, "aio-workload", "compute + 64 KiB write per item");
    tables += workload_table(doc["workload"], "The TAI workload: compute + 64 KiB write per item");
  }
  if (doc.contains("overwrite")) {
    const json& part = doc["overwrite"];
    cache_target(targets, part,
                 "overwrite workload, 1 thread, fsync every 30: keel io_uring + cache vs plain "
                 "POSIX calls",
                 "posix", "≥ 1.3×", 1.3,
                 "A program that rewrites what it has just written: keel's write-back cache "
                 "sends the last version only.");
    cache_target(targets, part,
                 "overwrite workload, 1 thread, fsync every 30: keel io_uring + cache vs "
                 "without",
                 "keel_io_uring", "≥ 1.2×", 1.2);
    plot_workload(out, part["rows"], pngs, "aio-overwrite",
                  "compute + 64 KiB write + its overwrite per item");
    tables += workload_table(part,
                             "Overwrites (TAI 3.4): compute + 64 KiB write + its overwrite per "
                             "item, counted once");
  }
  if (doc.contains("overwrite_direct")) {
    const json& part = doc["overwrite_direct"];
    cache_target(targets, part,
                 "O_DIRECT overwrite workload, 1 thread, fsync every 30: keel io_uring + cache "
                 "vs without",
                 "keel_io_uring", "≥ 1.5×", 1.5);
    if (!part.contains("skipped_all")) {
      plot_workload(out, part["rows"], pngs, "aio-overwrite-direct",
                    "O_DIRECT: compute + 64 KiB write + its overwrite per item");
      tables += workload_table(part,
                               "Overwrites with O_DIRECT (TAI 3.5): the cache in front of "
                               "O_DIRECT");
    }
  }
  for (const char* key : {"small", "small_memory"}) {
    if (!doc.contains(key)) continue;
    const json& part = doc[key];
    const std::string where = part.value("where", std::string("on the benchmark's directory"));
    const auto rate = [&](const char* m) {
      for (const auto& r : part["rows"]) {
        if (r["method"] == m) return r["writes_per_second"].get<double>();
      }
      return std::nan("");
    };
    const double keel = rate("keel_io_uring");
    const double glibc = rate("posix_aio");
    const std::string name = fmt::format(
        "4 KiB random writes, {} threads x {} in flight, fsync every {}, {}: keel io_uring vs "
        "glibc POSIX AIO",
        part["threads"].get<unsigned>(), part["in_flight"].get<unsigned>(),
        part["fsync_every"].get<unsigned>(), where);
    if (std::isfinite(keel) && std::isfinite(glibc)) {
      target_row row{name, fmt_ratio(keel / glibc), "≥ 2×", keel / glibc >= 2};
      if (std::string(key) == "small") {
        row = headline(std::move(row),
                       "Many small writes in flight at once: keel against glibc's POSIX AIO, "
                       "the standard C library's asynchronous I/O.");
      }
      targets.push_back(std::move(row));
    } else {
      targets.push_back({name, "not measured (io_uring cannot start here)", "", false, false});
    }
    tables += fmt::format(
        "<h3>Many small requests (TAI 2.3), {}: 4 KiB writes at random offsets of one file "
        "(writes/s)</h3>\n<table><tr><th>method</th><th>writes</th><th>s</th>"
        "<th>writes/s</th><th>vs glibc POSIX AIO</th></tr>\n",
        html_escape(where));
    for (const auto& r : part["rows"]) {
      tables +=
          fmt::format("<tr><td>{}</td><td>{}</td><td>{:.2f}</td><td>{:.0f}</td><td>{}</td></tr>\n",
                      html_escape(r["method"].get<std::string>()), r["writes"].get<std::uint64_t>(),
                      r["seconds"].get<double>(), r["writes_per_second"].get<double>(),
                      fmt_ratio(r["writes_per_second"].get<double>() / glibc));
    }
    tables += "</table>\n";
  }
  if (doc.contains("null")) {
    const double single = doc["null"]["single_ns"].get<double>();
    const double batched = doc["null"]["batched_ns"].get<double>();
    targets.push_back(headline({"null engine: framework cost per request, one at a time",
                                fmt::format("{:.0f} ns", single), "≤ 300 ns", single <= 300},
                               "What keel's request machinery costs on top of the I/O itself "
                               "(the null engine does no I/O)."));
    targets.push_back({fmt::format("null engine: framework cost per request, batches of {}",
                                   doc["null"]["batch"].get<unsigned>()),
                       fmt::format("{:.0f} ns", batched), "≤ 100 ns", batched <= 100});
  }
  finish_section(s, "Asynchronous I/O: keel::aio against fio, POSIX, cstdio and POSIX AIO", targets,
                 pngs, tables);
  return s;
}

}  // namespace keel::report
