#pragma once
// The lock section of the report: keel-bench lockscale and keel-bench lockmatrix results, their
// plots, and the lock targets checked against measurements of the same run.

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "section.hpp"

namespace keel::report {

//! What the lock section is made of (file names of keel-bench lockscale / lockmatrix --json
//! output).
struct lock_inputs {
  std::vector<std::string> lockscale;        // one per algorithm, the main sweep
  std::vector<std::string> lockscale_short;  // short critical sections (their own target)
  std::vector<std::string> lockscale_fs;     // the sweep on other filesystems (no targets)
  std::vector<std::string> fs_skipped;       // "fs: why" for filesystems not measured
  std::string lockmatrix;                    // may be empty
  std::string lockcli;                       // keel lock beside flock(1); may be empty
};

//! Renders the lock results into plots under `out`; returns the HTML, the JSON and the
//! targets missed.
section render_locks(const std::string& out, const lock_inputs& in);

}  // namespace keel::report
