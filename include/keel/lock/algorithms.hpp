#pragma once
// Every shared_fs_mutex implementation by name: what the CLI, the tests and the benchmarks
// use to treat them alike.

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "keel/io/filesystem.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::lock {

//! keel's algorithms, then the kernel baselines: lock_files, byte_ranges, atomic_append,
//! memory_map, flock, fcntl, sysv.
[[nodiscard]] std::span<const std::string_view> algorithm_names() noexcept;

//! Whether `algorithm` takes a directory (lock_files, flock) rather than a file.
[[nodiscard]] bool uses_directory(std::string_view algorithm) noexcept;

//! Opens the mutex `algorithm` on `path` (a lock file, or a directory for lock_files and
//! flock; created if missing). Errors: invalid_argument for an unknown name;
//! errc::used_by_another_algorithm (every algorithm's open) where a user of another
//! algorithm has the path open (they would not exclude each other; byte_ranges and fcntl
//! are one family); else the algorithm's own.
[[nodiscard]] result<std::unique_ptr<shared_fs_mutex>> open_mutex(
    std::string_view algorithm, const std::string& path, io::filesystem& fs = io::os()) noexcept;

//! Removes what a mutex leaves outside `path` once nobody uses it: the SysV semaphore set of
//! sysv, the shared-memory map of memory_map users that were killed; nothing for the others.
[[nodiscard]] result<void> remove_mutex_resources(std::string_view algorithm,
                                                  const std::string& path) noexcept;

}  // namespace keel::lock
