#pragma once

namespace keel::tools {

//! `keel kv PATH put|get|del|scan|stats|verify|compact|checkpoint|salvage|backup|dump|load`.
//! argv[0] is "kv". Exit status: 0 ok, 1 not found, 2 usage, 3 corrupt (or not a store, or another
//! version), 4 conflict, 5 other errors, 6 the --max-bytes budget reached.
int run_kv_command(int argc, char** argv);

inline constexpr const char* kv_command_summary =
    "Use a keel::kv store: put, get, del, scan, stats, verify, compact, checkpoint, salvage, "
    "backup, dump, load (binary-safe)";

}  // namespace keel::tools
