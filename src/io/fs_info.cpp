#include "keel/io/fs_info.hpp"

#include <linux/magic.h>
#include <sys/statfs.h>

#include "fs_info_detail.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::io {
namespace {

// Magics linux/magic.h does not carry (they live in out-of-tree or filesystem headers).
constexpr std::uint64_t zfs_magic = 0x2fc12fc1;
constexpr std::uint64_t bcachefs_magic = 0xca451a4e;
constexpr std::uint64_t gfs2_magic = 0x01161970;

struct known {
  std::uint64_t magic;
  fs_type type;
  bool local;
};

constexpr known known_filesystems[] = {
    {TMPFS_MAGIC, fs_type::tmpfs, true},
    {RAMFS_MAGIC, fs_type::ramfs, true},
    {EXT4_SUPER_MAGIC, fs_type::ext4, true},
    {XFS_SUPER_MAGIC, fs_type::xfs, true},
    {BTRFS_SUPER_MAGIC, fs_type::btrfs, true},
    {F2FS_SUPER_MAGIC, fs_type::f2fs, true},
    {zfs_magic, fs_type::zfs, true},
    {bcachefs_magic, fs_type::bcachefs, true},
    {OVERLAYFS_SUPER_MAGIC, fs_type::overlay, true},
    {FUSE_SUPER_MAGIC, fs_type::fuse, false},
    {NFS_SUPER_MAGIC, fs_type::nfs, false},
    {SMB_SUPER_MAGIC, fs_type::cifs, false},
    {CIFS_SUPER_MAGIC, fs_type::cifs, false},
    {SMB2_SUPER_MAGIC, fs_type::cifs, false},
    {CEPH_SUPER_MAGIC, fs_type::ceph, false},
    {gfs2_magic, fs_type::gfs2, false},
    {OCFS2_SUPER_MAGIC, fs_type::ocfs2, false},
    {PROC_SUPER_MAGIC, fs_type::proc, true},
    {SYSFS_MAGIC, fs_type::sysfs, true},
};

}  // namespace

fs_info detail::fs_info_of(const struct statfs& s) noexcept {
  fs_info info;
  // A filesystem not in the table may be a network or cluster one (Lustre, GPFS, 9p,
  // AFS, ...): it is not called local, so nothing relies on it being this machine's alone.
  info.is_local = false;
  // f_type is a signed word; magics with the top bit set (CIFS) must not sign-extend.
  info.magic = static_cast<std::uint32_t>(s.f_type);
  for (const known& k : known_filesystems) {
    if (k.magic == info.magic) {
      info.type = k.type;
      info.is_local = k.local;
      break;
    }
  }
  info.block_size = static_cast<std::uint64_t>(s.f_bsize);
  const auto unit = static_cast<std::uint64_t>(s.f_frsize != 0 ? s.f_frsize : s.f_bsize);
  info.total_bytes = static_cast<std::uint64_t>(s.f_blocks) * unit;
  info.free_bytes = static_cast<std::uint64_t>(s.f_bfree) * unit;
  info.available_bytes = static_cast<std::uint64_t>(s.f_bavail) * unit;
  info.max_name_length = static_cast<std::uint64_t>(s.f_namelen);
  return info;
}

std::string_view to_string(fs_type type) noexcept {
  switch (type) {
    case fs_type::unknown:
      return "unknown";
    case fs_type::tmpfs:
      return "tmpfs";
    case fs_type::ramfs:
      return "ramfs";
    case fs_type::ext4:
      return "ext4";
    case fs_type::xfs:
      return "xfs";
    case fs_type::btrfs:
      return "btrfs";
    case fs_type::f2fs:
      return "f2fs";
    case fs_type::zfs:
      return "zfs";
    case fs_type::bcachefs:
      return "bcachefs";
    case fs_type::overlay:
      return "overlay";
    case fs_type::fuse:
      return "fuse";
    case fs_type::nfs:
      return "nfs";
    case fs_type::cifs:
      return "cifs";
    case fs_type::ceph:
      return "ceph";
    case fs_type::gfs2:
      return "gfs2";
    case fs_type::ocfs2:
      return "ocfs2";
    case fs_type::proc:
      return "proc";
    case fs_type::sysfs:
      return "sysfs";
  }
  return "unknown";
}

std::string_view fs_info::type_name() const noexcept {
  return to_string(type);
}

result<fs_info> stat_fs(const char* path) noexcept {
  return os().statfs(path);
}

result<fs_info> stat_fs(filesystem& fs, const char* path) noexcept {
  return fs.statfs(path);
}

result<fs_info> stat_fs(const file_handle& file) noexcept {
  return file.fs().statfs(file);
}

result<fs_info> stat_fs_of_path_or_parent(filesystem& fs, const std::string& path) noexcept {
  auto where = fs.statfs(path.c_str());
  if (!where && where.error() == std::errc::no_such_file_or_directory) {
    const auto slash = path.find_last_of('/');
    const std::string parent = slash == std::string::npos ? "."
                               : slash == 0               ? "/"
                                                          : path.substr(0, slash);
    where = fs.statfs(parent.c_str());
  }
  if (!where) return std::unexpected(where.error().about(path));
  return where;
}

}  // namespace keel::io
