#pragma once
// The Python section of the report: python/bench/bench.py's JSON, keel's Python module beside
// what Python users have (filelock and portalocker for locks, python-lmdb for a store).

#include <string>

#include "section.hpp"

namespace keel::report {

//! Renders `python_file` (python/bench/bench.py --json).
section render_python(const std::string& python_file);

}  // namespace keel::report
