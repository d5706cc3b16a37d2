#pragma once
// The kv section of the report: keel-bench kvbench's JSON, checked against the seed's figures and
// against LMDB measured in the same run.

#include <string>

#include "section.hpp"

namespace keel::report {

//! Renders `kvbench_file` (keel-bench kvbench --json).
section render_kv(const std::string& out, const std::string& kvbench_file);

}  // namespace keel::report
