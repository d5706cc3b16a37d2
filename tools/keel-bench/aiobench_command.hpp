#pragma once

namespace keel::tools {

//! `keel-bench aiobench`. argv[0] is "aiobench". Returns the exit status: 0, 1 when a measurement
//! failed, 2 on usage errors.
int run_aiobench_command(int argc, char** argv);

inline constexpr const char* aiobench_command_summary =
    "Measure keel::aio against fio, plain POSIX calls, cstdio and glibc POSIX AIO";

}  // namespace keel::tools
