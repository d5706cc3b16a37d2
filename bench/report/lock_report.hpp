#pragma once
// The lock section of the report: keel lockscale and keel lockmatrix results, their plots,
// and the lock targets checked against measurements of the same run.

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace keel::report {

struct section {
  std::string html;
  nlohmann::json results;
  int missed = 0;
  std::string summary;  // for stdout
};

//! Renders the lockscale results (one JSON per algorithm) and the lockmatrix JSON (may be
//! empty) into plots under `out`; returns the HTML, the JSON and the targets missed.
//! `short_files` are lockscale runs with short critical sections (their own target).
section render_locks(const std::string& out, const std::vector<std::string>& lockscale_files,
                     const std::vector<std::string>& short_files,
                     const std::string& lockmatrix_file);

}  // namespace keel::report
