#include "python_report.hpp"

#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <stdexcept>

namespace keel::report {
namespace {

using nlohmann::json;

double rate(const json& doc, const char* group, const char* tool, const char* what) {
  if (!doc.contains(group) || !doc[group].contains(tool)) return NAN;
  const json& t = doc[group][tool];
  return t.contains(what) && t[what].is_number() ? t[what].get<double>() : NAN;
}

std::string per_second(double v) {
  if (!std::isfinite(v)) return "n/a";
  if (v >= 1e6) return fmt::format("{:.2f} M/s", v / 1e6);
  if (v >= 1e3) return fmt::format("{:.1f} k/s", v / 1e3);
  return fmt::format("{:.0f}/s", v);
}

// keel's rate over the peer's, against `target` (0: no target, shown as information).
target_row compare(const json& doc, const char* group, const char* peer, const char* what,
                   std::string name, double target, std::string meaning = {}) {
  const double k = rate(doc, group, "keel", what);
  const double p = rate(doc, group, peer, what);
  target_row row;
  row.name = std::move(name);
  if (!std::isfinite(k) || !std::isfinite(p) || p <= 0) {
    row.measured_at_all = false;
    row.measured = fmt::format("not measured ({} missing)", peer);
    row.target = target > 0 ? fmt::format("≥ {:.1f}×", target) : "";
    return row;
  }
  const double r = k / p;
  row.measured = fmt::format("{} ({} against {})", fmt_ratio(r), per_second(k), per_second(p));
  if (target > 0) {
    row.target = fmt::format("≥ {:.1f}×", target);
    row.met = r >= target;
  }
  row.meaning = std::move(meaning);
  return row;
}

std::string microseconds(double seconds) {
  if (!std::isfinite(seconds)) return "n/a";
  if (seconds >= 1e-3) return fmt::format("{:.1f} ms", seconds * 1e3);
  return fmt::format("{:.0f} µs", seconds * 1e6);
}

// The time from a release to the waiter holding the lock, keel's against the peer's (the
// ratio is the peer's time over keel's: above 1, keel hands over sooner). Information only.
target_row handoff(const json& doc, const char* peer, std::string meaning = {}) {
  const double k = rate(doc, "locks", "keel", "handoff_s");
  const double p = rate(doc, "locks", peer, "handoff_s");
  target_row row;
  row.name =
      fmt::format("keel.FileLock handover (a release to the waiter holding it), against {}", peer);
  if (!std::isfinite(k) || !std::isfinite(p) || k <= 0) {
    row.measured_at_all = false;
    row.measured = fmt::format("not measured ({} missing)", peer);
    return row;
  }
  row.measured =
      fmt::format("{} ({} against {})", fmt_ratio(p / k), microseconds(k), microseconds(p));
  row.meaning = std::move(meaning);
  return row;
}

}  // namespace

section render_python(const std::string& python_file) {
  std::ifstream in(python_file);
  if (!in) throw std::runtime_error("cannot read " + python_file);
  const json doc = json::parse(in);
  const int procs = doc.value("processes", 4);
  std::vector<target_row> targets{
      compare(doc, "locks", "filelock", "alone",
              "keel.FileLock lock+unlock, alone, against filelock", 1.0,
              "What a Python program pays for keel's file lock against filelock's: above 1, less."),
      compare(doc, "locks", "filelock", "contended_busy",
              fmt::format("keel.FileLock, {} processes wanting it back to back, against filelock",
                          procs),
              2.0),
      compare(doc, "locks", "filelock", "contended_sleep",
              fmt::format("keel.FileLock, {} processes sleeping 200 µs between holds, against "
                          "filelock",
                          procs),
              2.0,
              "Locks handed over per second when Python processes contend: filelock's waiters "
              "poll every 50 ms, keel's wake when the lock is let go."),
      handoff(doc, "filelock",
              "How soon a waiting Python process gets a file lock let go: filelock's waiters "
              "look every 50 ms, keel's are woken by the kernel."),
      handoff(doc, "portalocker"),
      compare(doc, "locks", "portalocker", "alone",
              "keel.FileLock lock+unlock, alone, against portalocker", 0),
      compare(doc, "locks", "portalocker", "contended_sleep",
              fmt::format("keel.FileLock, {} processes sleeping between holds, against "
                          "portalocker",
                          procs),
              0),
      compare(doc, "stores", "lmdb", "get", "keel.Store get, 1 thread, against python-lmdb", 1.0,
              "Reads of 1 KiB values from Python, each checked against its checksum by keel."),
      compare(doc, "stores", "lmdb", "put", "keel.Store put, 1 thread, against python-lmdb", 0),
      compare(doc, "stores", "lmdb", "put_procs",
              fmt::format("keel.Store put, {} processes at once, against python-lmdb", procs), 2.0,
              "Python processes writing one store at once: LMDB takes one writer at a time."),
  };
  std::string rows;
  for (const char* tool : {"keel", "filelock", "portalocker"}) {
    rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n", tool,
                        per_second(rate(doc, "locks", tool, "alone")),
                        per_second(rate(doc, "locks", tool, "contended_busy")),
                        per_second(rate(doc, "locks", tool, "contended_sleep")),
                        microseconds(rate(doc, "locks", tool, "handoff_s")));
  }
  std::string store_rows;
  for (const char* tool : {"keel", "lmdb"}) {
    store_rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n", tool,
                              per_second(rate(doc, "stores", tool, "put")),
                              per_second(rate(doc, "stores", tool, "get")),
                              per_second(rate(doc, "stores", tool, "put_procs")));
  }
  const std::string tables = fmt::format(
      "<p>Python {} (python/bench/bench.py, in one run; the median of {} rounds, the tools "
      "interleaved). Locks: one object's lock and unlock on a file of its own, then {} "
      "processes on one file, each holding it 20 µs and then either working 20 µs more (back "
      "to back) or sleeping 200 µs. Stores: {} keys of {} B, one commit per put, then {} "
      "processes putting keys of their own at once; python-lmdb opened with sync=False and "
      "metasync=False, the durability keel's default has (a commit survives the process, not a "
      "power cut).</p>\n"
      "<table><tr><th>lock</th><th>lock+unlock alone</th><th>{} processes, back to "
      "back</th><th>{} processes, sleeping between</th><th>handover</th></tr>\n{}</table>\n"
      "<table><tr><th>store</th><th>put, 1 thread</th><th>get, 1 thread</th><th>put, {} "
      "processes</th></tr>\n{}</table>\n",
      doc.value("python", "?"), doc.value("rounds", 0), procs, doc.value("keys", 0),
      doc.value("value_bytes", 0), procs, procs, procs, rows, procs, store_rows);
  section s;
  s.results = doc;
  finish_section(s, "Python: keel's module beside filelock, portalocker and python-lmdb", targets,
                 {}, tables);
  return s;
}

}  // namespace keel::report
