#pragma once
// Small helpers the report's sections share.

#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

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

}  // namespace keel::report
