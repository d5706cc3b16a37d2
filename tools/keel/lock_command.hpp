#pragma once

namespace keel::tools {

//! `keel lock`: runs a command while holding entities of a shared_fs_mutex. argv[0] is
//! "lock". Returns the process exit status.
int run_lock_command(int argc, char** argv);

//! One line of help for `keel --help`.
inline constexpr const char* lock_command_summary =
    "Run a command while holding named locks (like flock(1), for any keel algorithm)";

}  // namespace keel::tools
