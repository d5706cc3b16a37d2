#pragma once
// The space section of the report: keel-bench spacebench's JSON (one file per filesystem), against
// Tux3's out-of-space figures (issue "keel::space"), with a plot of fill and put rate against
// time as each volume fills.

#include <string>
#include <vector>

#include "section.hpp"

namespace keel::report {

//! Renders `spacebench_files` (keel-bench spacebench --json, one per filesystem).
section render_space(const std::string& out, const std::vector<std::string>& spacebench_files);

}  // namespace keel::report
