#pragma once
// Opening or making a store's directory and its store file (doc/kv-format.md, "Files"): the
// first step of every open. A store exists exactly when its store file does; the file is
// written whole to a temporary, synced, then linked into place (link fails if another
// creator won the race, and then that one's store is opened), so a crash at any point
// leaves either no store or a whole one, never a half-made one.

#include <optional>
#include <string>
#include <string_view>

#include "keel/io/file_handle.hpp"
#include "keel/io/filesystem.hpp"
#include "kv/format.hpp"

namespace keel::kv {

constexpr const char* store_file_name = "keel-kv";
constexpr const char* segments_dir_name = "seg";

//! The number a file name in `seg/` gives its segment (16 lowercase hex digits, 1 to the
//! largest segment number), or nullopt for any other name.
[[nodiscard]] std::optional<std::uint64_t> segment_number_of(std::string_view name) noexcept;

struct store_dir_options {
  bool create_if_missing = true;
  bool error_if_exists = false;
  //! For a new store only (a power of two, 1 MiB to 1 GiB; 0: chosen for the volume, see
  //! kv::options::segment_size).
  std::uint64_t segment_size = 0;
  io::filesystem* fs = nullptr;  //!< null: io::os()
};

struct store_dir {
  io::file_handle dir;       //!< the store's directory
  io::file_handle segments;  //!< its `seg` directory
  //! Its store file, read only: what private readers hold their bytes on
  //! (store::impl::private_index), there from the store's first moment to its last.
  io::file_handle store_file;
  disk::store_params params;
  bool created = false;  //!< this call made the store
};

//! Opens the store at `path`, making it if asked and absent. Errors: no_such_file_or_directory
//! (no store and create_if_missing off), file_exists (error_if_exists), not_keel_file (a
//! directory that holds something else, or a store file that is not one), unsupported_version,
//! corrupt (the store file, with its offset), invalid_argument (a bad segment size), and the
//! errno of what failed (not_a_directory, permission_denied, read_only_file_system, ...).
//! Nothing that exists is changed unless it is a store being completed (its `seg` made).
[[nodiscard]] result<store_dir> open_store_dir(const std::string& path,
                                               const store_dir_options& options) noexcept;

//! The segment size a store made at `path` with `options` would get (its volume's, from the
//! path or its nearest existing parent, unless the options say), so that options can be
//! judged before anything is made. Errors: statfs's.
[[nodiscard]] result<std::uint64_t> new_store_segment_size(
    const std::string& path, const store_dir_options& options) noexcept;

}  // namespace keel::kv
