#pragma once
// The aio section of the report: keel-bench aiobench's JSON, its plots, and the aio targets
// checked against the peers measured in the same run.

#include <string>

#include "section.hpp"

namespace keel::report {

//! Renders `aiobench_file` (keel-bench aiobench --json) into plots under `out`.
section render_aio(const std::string& out, const std::string& aiobench_file);

}  // namespace keel::report
