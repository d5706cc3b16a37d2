#pragma once
// Small helpers the report's sections share.

#include <fmt/format.h>
#include <fmt/os.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace keel::report {

inline std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

//! Runs gnuplot on `script`; throws with the script's name if it fails.
inline void run_gnuplot(const std::string& script) {
  const std::string cmd = fmt::format("gnuplot '{}'", script);
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("gnuplot failed on " + script + " (is gnuplot-nox installed?)");
  }
}

//! How a clustered bar chart departs from the plain one.
struct bar_chart_style {
  bool log_y = false;             //!< a log scale from 100: rates that span decades
  bool one_legend = false;        //!< the legend under the first panel only (same series)
  bool slanted_labels = false;    //!< cluster labels slanted, for long ones
  std::string first_panel_extra;  //!< more plot items for the first panel (reference lines)
};

//! Draws `out`/`name`.png: one clustered bar chart per data block of `dat` (`panel_titles`,
//! in order), side by side. Each block has a header line naming its `columns` series
//! (after the label column), then one row per cluster: its label, then the values.
//! `absent[b][c]`, where given and true, leaves series c out of panel b (it has no value
//! there: gnuplot refuses a series with no valid point); each series keeps its colour.
inline void plot_clustered_bars(const std::string& out, const std::string& name,
                                const std::string& dat,
                                const std::vector<std::string>& panel_titles, std::size_t columns,
                                const std::string& title, const std::string& ylabel,
                                std::size_t panel_width, const bar_chart_style& style = {},
                                const std::vector<std::vector<bool>>& absent = {}) {
  std::string panels;
  for (std::size_t b = 0; b < panel_titles.size(); ++b) {
    std::string cols;
    for (std::size_t c = 0; c < columns; ++c) {
      const bool left_out = b < absent.size() && c < absent[b].size() && absent[b][c];
      if (left_out && (c + 1 < columns || !cols.empty())) continue;
      cols += fmt::format("{}\"{}\" index {} using {}{} title columnheader lt {}",
                          cols.empty() ? "" : ", ", dat, b, c + 2, cols.empty() ? ":xtic(1)" : "",
                          c + 1);
    }
    if (b == 0 && !style.first_panel_extra.empty()) cols += ", " + style.first_panel_extra;
    panels += fmt::format("set title \"{}\"\nplot {}\n{}", panel_titles[b], cols,
                          b == 0 && style.one_legend ? "unset key\n" : "");
  }
  const std::string gp = out + "/" + name + ".gp";
  {
    auto f = fmt::output_file(gp);
    f.print(R"gp(set terminal pngcairo size {w},{h} font "sans,10"
set termoption noenhanced
set output "{out}/{name}.png"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set grid ytics
set key outside bottom horizontal
set ylabel "{ylabel}"
{scale}set multiplot layout 1,{panes} title "{title}"
{panels}unset multiplot
)gp",
            fmt::arg("w", panel_width * panel_titles.size() + 90),
            fmt::arg("h", style.slanted_labels ? 520 : 470), fmt::arg("out", out),
            fmt::arg("scale", fmt::format("{}{}",
                                          style.log_y ? "set logscale y\nset yrange [100:*]\n"
                                                      : "set yrange [0:*]\n",
                                          style.slanted_labels ? "set xtics rotate by -20\n" : "")),
            fmt::arg("name", name), fmt::arg("ylabel", ylabel),
            fmt::arg("panes", panel_titles.size()), fmt::arg("title", title),
            fmt::arg("panels", panels));
  }
  run_gnuplot(gp);
}

}  // namespace keel::report
