#pragma once

#include <string>

#include "keel/result.hpp"

namespace keel::tools {

//! `keel-bench lockscale`. argv[0] is "lockscale". Returns the exit status: 0, 1 on a failure or
//! a broken mutual exclusion, 2 on usage errors.
int run_lockscale_command(int argc, char** argv);

inline constexpr const char* lockscale_command_summary =
    "Measure how a lock scales with contending processes (lockscale-compatible)";

//! A fresh directory (on /dev/shm by default, else under `parent`) removed with its content.
struct scratch_dir {
  std::string path;
  static result<scratch_dir> make(const std::string& parent);
  scratch_dir() = default;
  scratch_dir(scratch_dir&& o) noexcept;
  scratch_dir& operator=(scratch_dir&&) = delete;
  ~scratch_dir();
};

}  // namespace keel::tools
