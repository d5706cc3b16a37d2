#include "kv_report.hpp"

#include <fmt/format.h>

#include <fstream>
#include <stdexcept>

namespace keel::report {

section render_kv(const std::string& /*out*/, const std::string& kvbench_file) {
  std::ifstream in(kvbench_file);
  if (!in) throw std::runtime_error("cannot read " + kvbench_file);
  const auto doc = nlohmann::json::parse(in);
  const auto& k = doc["keel"];
  const auto& l = doc["lmdb"];
  const double ins = k["insert"].get<double>(), fetch = k["fetch"].get<double>();
  const double ins_t = k["insert_threads"].get<double>();
  const double l_ins = l["insert"].get<double>(), l_fetch = l["fetch"].get<double>();
  const double l_ins_t = l["insert_threads"].get<double>();
  const double ins_p = k["insert_processes"].get<double>();
  const double l_ins_p = l["insert_processes"].get<double>();
  const unsigned threads = doc["threads"].get<unsigned>();
  const unsigned processes = doc["processes"].get<unsigned>();
  // The seed's toy: 696 k inserts/s and 5.99 M fetches/s on one thread (128-bit keys, 1 KiB
  // values); and faster than LMDB.
  std::vector<target_row> targets{
      {"kv insert, 1 thread (seed: 696 k/s)", fmt::format("{:.0f}/s", ins), "≥ 696000/s",
       ins >= 696000},
      {"kv fetch, 1 thread (seed: 5.99 M/s)", fmt::format("{:.0f}/s", fetch), "≥ 5990000/s",
       fetch >= 5.99e6},
      {"kv insert vs LMDB, 1 thread", fmt_ratio(ins / l_ins), "≥ 1×", ins >= l_ins},
      {"kv fetch vs LMDB, 1 thread", fmt_ratio(fetch / l_fetch), "≥ 1×", fetch >= l_fetch},
      {fmt::format("kv insert vs LMDB, {} threads", threads), fmt_ratio(ins_t / l_ins_t), "≥ 1×",
       ins_t >= l_ins_t},
      {fmt::format("kv insert vs LMDB, {} processes", processes), fmt_ratio(ins_p / l_ins_p),
       "≥ 1×", ins_p >= l_ins_p},
  };
  section s;
  s.results = doc;
  const std::string table = fmt::format(
      "<table><tr><th>workload ({} keys, {} B values)</th><th>keel ops/s</th><th>LMDB "
      "ops/s</th><th>ratio</th></tr>\n"
      "<tr><td>insert, 1 thread, one per "
      "transaction</td><td>{:.0f}</td><td>{:.0f}</td><td>{}</td></tr>\n"
      "<tr><td>fetch, 1 thread, random order</td><td>{:.0f}</td><td>{:.0f}</td><td>{}</td></tr>\n"
      "<tr><td>insert, {} threads</td><td>{:.0f}</td><td>{:.0f}</td><td>{}</td></tr>\n"
      "<tr><td>insert, {} processes (each its own store handle)</td><td>{:.0f}</td><td>{:.0f}</td>"
      "<td>{}</td></tr>\n</table>\n",
      doc["keys"].get<std::size_t>(), doc["value_size"].get<std::size_t>(), ins, l_ins,
      fmt_ratio(ins / l_ins), fetch, l_fetch, fmt_ratio(fetch / l_fetch), threads, ins_t, l_ins_t,
      fmt_ratio(ins_t / l_ins_t), processes, ins_p, l_ins_p, fmt_ratio(ins_p / l_ins_p));
  finish_section(s, "keel::kv beside LMDB (keel kvbench)", targets, {}, table);
  return s;
}

}  // namespace keel::report
