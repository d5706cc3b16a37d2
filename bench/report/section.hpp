#pragma once
// A section of the report that checks targets (locks, aio): its HTML, its JSON, and the
// targets table every such section shows first.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "render.hpp"

namespace keel::report {

struct section {
  std::string html;
  nlohmann::json results;
  int missed = 0;
  std::string summary;  // for stdout
};

struct target_row {
  std::string name;
  std::string measured;
  std::string target;
  bool met = false;
  bool measured_at_all = true;
};

inline std::string fmt_ratio(double r) {
  return std::isfinite(r) ? fmt::format("{:.3f}×", r) : "n/a";
}

//! Fills `s` from the targets, the plots and the tables: a targets table first (missed ones
//! counted in s.missed and listed in s.summary for stdout), then the plots, then `tables`.
inline void finish_section(section& s, const std::string& title,
                           const std::vector<target_row>& targets,
                           const std::vector<std::string>& pngs, const std::string& tables) {
  std::string trs;
  s.results["targets"] = nlohmann::json::array();
  std::size_t width = 0;  // of the names, so that the columns line up on stdout
  for (const auto& t : targets)
    width = std::max(width, t.name.size());
  for (const auto& t : targets) {
    const char* cls = !t.measured_at_all ? "missing" : t.met ? "met" : "missed";
    if (t.measured_at_all && !t.met) ++s.missed;
    trs +=
        fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td></tr>\n",
                    html_escape(t.name), html_escape(t.measured), html_escape(t.target), cls, cls);
    s.results["targets"].push_back({{"name", t.name},
                                    {"measured", t.measured},
                                    {"target", t.target},
                                    {"met", t.met},
                                    {"measured_at_all", t.measured_at_all}});
    s.summary += fmt::format("{:<{}} {:>10} {:>9}  {}\n", t.name, width, t.measured, t.target, cls);
  }
  std::string imgs;
  for (const auto& png : pngs)
    imgs += fmt::format("<img src=\"{}\" alt=\"{}\">\n", png, png);
  s.html = fmt::format(
      "<h2>{}</h2>\n<table><tr><th>target</th><th>measured</th><th>target</th><th></th></tr>\n"
      "{}</table>\n{}{}",
      html_escape(title), trs, imgs, tables);
}

}  // namespace keel::report
