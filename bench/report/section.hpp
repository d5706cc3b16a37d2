#pragma once
// A section of the report that checks targets (io, locks, aio, kv, space): its HTML, its JSON,
// the targets table every such section shows first, and its headline rows, which the report
// gathers into one table per area at its top.

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "render.hpp"

namespace keel::report {

struct target_row {
  std::string name;
  std::string measured;
  std::string target;
  bool met = false;
  bool measured_at_all = true;
  //! For a headline row (one the report's summary at the top shows): one sentence on what the
  //! figure means for a user. Empty: the row shows in its section only.
  std::string meaning{};
  //! What is known of why the target is missed, shown beside the row when it is (empty: not
  //! known, or nothing to say).
  std::string why_missed{};
};

//! A plot and its alternative text, which says what the plot shows (not its file name).
struct figure {
  std::string png;
  std::string alt;
};

struct section {
  std::string title;
  std::string html;
  nlohmann::json results;
  int missed = 0;
  std::string summary;                // for stdout
  std::vector<target_row> headlines;  // the rows with a meaning, for the report's top
};

//! "met", "missed", "missing" (not measured) or "info" (measured, no target set).
inline const char* target_class(const target_row& t) {
  return !t.measured_at_all ? "missing" : t.target.empty() ? "info" : t.met ? "met" : "missed";
}

//! A target row for the summary at the top: `row` with its meaning.
inline target_row headline(target_row row, std::string meaning) {
  row.meaning = std::move(meaning);
  return row;
}

//! `row` with what is known of why it misses its target (shown only when it does).
inline target_row when_missed(target_row row, std::string why) {
  row.why_missed = std::move(why);
  return row;
}

inline std::string fmt_ratio(double r) {
  return std::isfinite(r) ? fmt::format("{:.3f}×", r) : "n/a";
}

//! The <img> elements of `figures`.
inline std::string images_html(const std::vector<figure>& figures) {
  std::string imgs;
  for (const auto& f : figures)
    imgs += fmt::format("<img src=\"{}\" alt=\"{}\">\n", f.png, html_escape(f.alt));
  return imgs;
}

//! Fills `s` from the targets, the plots and the tables: a targets table first (missed ones
//! counted in s.missed and listed in s.summary for stdout), then the plots, then `tables`.
//! The rows with a meaning become s.headlines.
inline void finish_section(section& s, const std::string& title,
                           const std::vector<target_row>& targets,
                           const std::vector<figure>& figures, const std::string& tables) {
  s.title = title;
  std::string trs;
  s.results["targets"] = nlohmann::json::array();
  std::size_t width = 0;  // of the names, so that the columns line up on stdout
  // (A column for why, only in a section with a missed row that says.)
  bool whys = false;
  for (const auto& t : targets) {
    width = std::max(width, t.name.size());
    whys = whys || (std::string_view(target_class(t)) == "missed" && !t.why_missed.empty());
  }
  for (const auto& t : targets) {
    const char* cls = target_class(t);
    const bool missed = std::string_view(cls) == "missed";
    if (missed) ++s.missed;
    const std::string why = missed ? t.why_missed : std::string();
    trs += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td>{}</tr>\n",
                       html_escape(t.name), html_escape(t.measured), html_escape(t.target), cls,
                       cls, whys ? "<td>" + html_escape(why) + "</td>" : "");
    s.results["targets"].push_back({{"name", t.name},
                                    {"measured", t.measured},
                                    {"target", t.target},
                                    {"met", t.met},
                                    {"measured_at_all", t.measured_at_all}});
    if (!why.empty()) s.results["targets"].back()["why_missed"] = why;
    s.summary += fmt::format("{:<{}} {:>10} {:>9}  {}\n", t.name, width, t.measured, t.target, cls);
    if (!t.meaning.empty()) s.headlines.push_back(t);
  }
  s.html = fmt::format(
      "<h2>{}</h2>\n<table><tr><th>what</th><th>measured</th><th>target</th><th></th>{}</tr>\n"
      "{}</table>\n{}{}",
      html_escape(title), whys ? "<th>why missed</th>" : "", trs, images_html(figures), tables);
}

}  // namespace keel::report
