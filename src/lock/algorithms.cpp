#include "keel/lock/algorithms.hpp"

#include <array>

#include "keel/lock/atomic_append.hpp"
#include "keel/lock/baselines.hpp"
#include "keel/lock/byte_ranges.hpp"
#include "keel/lock/lock_files.hpp"
#include "keel/lock/memory_map.hpp"

namespace keel::lock {
namespace {

constexpr std::array<std::string_view, 7> names = {
    "lock_files", "byte_ranges", "atomic_append", "memory_map", "flock", "fcntl", "sysv"};

template <class T>
result<std::unique_ptr<shared_fs_mutex>> up(result<std::unique_ptr<T>> r) noexcept {
  if (!r) return std::unexpected(r.error());
  return std::unique_ptr<shared_fs_mutex>(std::move(*r));
}

}  // namespace

std::span<const std::string_view> algorithm_names() noexcept {
  return names;
}

bool uses_directory(std::string_view algorithm) noexcept {
  return algorithm == "lock_files" || algorithm == "flock";
}

result<std::unique_ptr<shared_fs_mutex>> open_mutex(std::string_view algorithm,
                                                    const std::string& path,
                                                    io::filesystem& fs) noexcept {
  if (algorithm == "lock_files") return up(lock_files::open(path, fs));
  if (algorithm == "byte_ranges") return up(byte_ranges::open(path, fs));
  if (algorithm == "atomic_append") return up(atomic_append::open(path, fs));
  if (algorithm == "memory_map") {
    memory_map::options o;
    o.fs = &fs;
    return up(memory_map::open(path, o));
  }
  if (algorithm == "flock") return up(flock_files::open(path, fs));
  if (algorithm == "fcntl") return up(fcntl_ofd::open(path, fs));
  if (algorithm == "sysv") return up(sysv::open(path, sysv::default_slots, fs));
  return errc_error(std::errc::invalid_argument);
}

result<void> remove_mutex_resources(std::string_view algorithm, const std::string& path) noexcept {
  if (algorithm == "sysv") return sysv::remove(path);
  if (algorithm == "memory_map") {
    // Users killed instead of closed leave their map: a first user removes it, and the last
    // user removes its own. Opening and closing once does both.
    auto m = memory_map::open(path);
    if (!m) return std::unexpected(m.error());
  }
  return {};
}

}  // namespace keel::lock
