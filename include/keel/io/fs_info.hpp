#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"

namespace keel::io {

enum class fs_type : std::uint8_t {
  unknown,
  tmpfs,
  ramfs,
  ext4,  //!< also ext2 and ext3, which share the magic
  xfs,
  btrfs,
  f2fs,
  zfs,
  bcachefs,
  overlay,
  fuse,
  nfs,
  cifs,  //!< also smb2/smb3
  ceph,
  gfs2,
  ocfs2,
  proc,
  sysfs,
};

//! What statfs(2) says about the filesystem holding a path.
struct fs_info {
  fs_type type = fs_type::unknown;
  std::uint64_t magic = 0;  //!< f_type as the kernel reports it
  std::uint64_t block_size = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;       //!< free, counting blocks reserved for root
  std::uint64_t available_bytes = 0;  //!< free for an unprivileged user
  std::uint64_t max_name_length = 0;
  //! False for network and cluster filesystems (nfs, cifs, ceph, gfs2, ocfs2), for FUSE,
  //! whose backing store may be anywhere, and for every filesystem not in keel's table
  //! (`type` unknown: Lustre, GPFS, 9p and others look like that): there, shared memory and
  //! advisory locks may not be shared with every user of the files.
  bool is_local = true;

  [[nodiscard]] std::string_view type_name() const noexcept;
};

[[nodiscard]] result<fs_info> stat_fs(const char* path) noexcept;
[[nodiscard]] result<fs_info> stat_fs(filesystem& fs, const char* path) noexcept;
[[nodiscard]] result<fs_info> stat_fs(const file_handle& file) noexcept;
//! The filesystem `path` is on, or would be made on: statfs of the path, or of its directory
//! when the path does not exist yet. Errors are statfs's, about `path`.
[[nodiscard]] result<fs_info> stat_fs_of_path_or_parent(filesystem& fs,
                                                        const std::string& path) noexcept;
[[nodiscard]] std::string_view to_string(fs_type type) noexcept;

}  // namespace keel::io
