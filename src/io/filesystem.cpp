// The seam's real implementation (the system calls) and the forwarding wrapper.

#include "keel/io/filesystem.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <array>
#include <climits>
#include <cstdio>
#include <cstring>
#include <new>

#include "fs_info_detail.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::io {
namespace {

constexpr std::array<std::string_view, fs_op_count> op_names = {
    "open",           "close",    "read",       "write",          "append",         "sync",
    "sync_directory", "allocate", "punch_hole", "truncate",       "stat",           "statfs",
    "rename",         "link",     "unlink",     "make_directory", "list_directory", "map",
    "sync_map",       "unmap",    "lock",       "attributes"};

int dir_fd(const file_handle* dir) noexcept {
  return dir != nullptr && dir->is_open() ? dir->fd() : AT_FDCWD;
}

bool valid_flags(open_flags flags) noexcept {
  const bool r = has(flags, open_flags::read);
  const bool w = has(flags, open_flags::write);
  if (!r && !w && !has(flags, open_flags::directory)) return false;
  if (has(flags, open_flags::exclusive) && !has(flags, open_flags::create)) return false;
  if (has(flags, open_flags::temporary) && !w) return false;
  if (has(flags, open_flags::directory) && w) return false;
  return true;
}

int to_posix_flags(open_flags flags) noexcept {
  int f = O_CLOEXEC;
  const bool r = has(flags, open_flags::read);
  const bool w = has(flags, open_flags::write);
  f |= r && w ? O_RDWR : w ? O_WRONLY : O_RDONLY;
  if (has(flags, open_flags::create)) f |= O_CREAT;
  if (has(flags, open_flags::exclusive)) f |= O_EXCL;
  if (has(flags, open_flags::truncate)) f |= O_TRUNC;
  if (has(flags, open_flags::direct)) f |= O_DIRECT;
  if (has(flags, open_flags::sync)) f |= O_DSYNC;
  if (has(flags, open_flags::append)) f |= O_APPEND;
  if (has(flags, open_flags::directory)) f |= O_DIRECTORY;
  if (has(flags, open_flags::no_follow)) f |= O_NOFOLLOW;
  if (has(flags, open_flags::non_blocking)) f |= O_NONBLOCK;
  if (has(flags, open_flags::temporary)) f = (f & ~(O_CREAT | O_EXCL | O_TRUNC)) | O_TMPFILE;
  return f;
}

// The path a handle opened as `name` in `dir` is known by.
keel::detail::shared_path joined(const file_handle* dir, const char* name) noexcept {
  if (dir == nullptr || dir->path().empty() || name[0] == '/')
    return keel::detail::shared_path(name);
  const std::string_view d = dir->path();
  const std::size_t n = std::strlen(name);
  // The path is context for errors only: on allocation failure it is left out.
  char small[512];
  if (d.size() + 1 + n >= sizeof small) return keel::detail::shared_path(name);
  std::memcpy(small, d.data(), d.size());
  small[d.size()] = '/';
  std::memcpy(small + d.size() + 1, name, n);
  return keel::detail::shared_path(std::string_view(small, d.size() + 1 + n));
}

file_status status_of(const struct stat& st) noexcept {
  file_status s;
  s.device = static_cast<std::uint64_t>(st.st_dev);
  s.inode = static_cast<std::uint64_t>(st.st_ino);
  s.size = static_cast<std::uint64_t>(st.st_size);
  s.allocated = static_cast<std::uint64_t>(st.st_blocks) * 512;
  s.mode = st.st_mode;
  s.owner = st.st_uid;
  s.links = static_cast<std::uint64_t>(st.st_nlink);
  return s;
}

int iov_count(std::span<const iovec> buffers) noexcept {
  return static_cast<int>(std::min<std::size_t>(buffers.size(), IOV_MAX));
}

// The system calls. Every function is one call (two for append), errors as they come, except
// that a contended non-waiting lock is always operation_would_block (F_OFD_SETLK may say
// EACCES or EAGAIN).
class posix_filesystem final : public filesystem {
 public:
  result<file_handle> open(const file_handle* dir, const char* path, open_flags flags,
                           mode_t mode) noexcept override {
    if (path == nullptr || !valid_flags(flags)) return errc_error(std::errc::invalid_argument);
    const int posix = to_posix_flags(flags);
    int fd = -1;
    for (int attempt = 0;; ++attempt) {
      fd = ::openat(dir_fd(dir), path, posix, mode);
      // O_CREAT without O_EXCL never fails with EEXIST in POSIX, but a network filesystem's
      // client may (GlusterFS's, when another client made the file between its lookup and
      // its create): the file exists now, so opening it again is what was asked for.
      if (fd >= 0 || errno != EEXIST || (posix & (O_CREAT | O_EXCL)) != O_CREAT || attempt == 8) {
        break;
      }
    }
    if (fd < 0) return last_errno_error();
    return adopt(fd, joined(dir, path));
  }

  result<void> link(const file_handle& file, const file_handle* dir,
                    const char* name) noexcept override {
    if (name == nullptr || !file.is_open()) return errc_error(std::errc::invalid_argument);
    // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH on most kernels; the /proc route does not.
    if (::linkat(file.fd(), "", dir_fd(dir), name, AT_EMPTY_PATH) == 0) return {};
    if (errno != ENOENT && errno != EPERM) return last_errno_error();
    std::array<char, 64> proc{};
    std::snprintf(proc.data(), proc.size(), "/proc/self/fd/%d", file.fd());
    if (::linkat(AT_FDCWD, proc.data(), dir_fd(dir), name, AT_SYMLINK_FOLLOW) != 0) {
      return last_errno_error();
    }
    return {};
  }

  result<void> link_at(const file_handle* from_dir, const char* from, const file_handle* to_dir,
                       const char* to) noexcept override {
    if (from == nullptr || to == nullptr) return errc_error(std::errc::invalid_argument);
    if (::linkat(dir_fd(from_dir), from, dir_fd(to_dir), to, 0) != 0) return last_errno_error();
    return {};
  }

  result<void> rename(const file_handle* from_dir, const char* from, const file_handle* to_dir,
                      const char* to, rename_mode mode) noexcept override {
    if (from == nullptr || to == nullptr) return errc_error(std::errc::invalid_argument);
    const unsigned flags = mode == rename_mode::no_replace ? RENAME_NOREPLACE : 0;
    if (::renameat2(dir_fd(from_dir), from, dir_fd(to_dir), to, flags) != 0) {
      return last_errno_error();
    }
    return {};
  }

  result<void> unlink(const file_handle* dir, const char* name, bool directory) noexcept override {
    if (name == nullptr) return errc_error(std::errc::invalid_argument);
    if (::unlinkat(dir_fd(dir), name, directory ? AT_REMOVEDIR : 0) != 0) {
      return last_errno_error();
    }
    return {};
  }

  result<void> make_directory(const file_handle* dir, const char* name,
                              mode_t mode) noexcept override {
    if (name == nullptr) return errc_error(std::errc::invalid_argument);
    if (::mkdirat(dir_fd(dir), name, mode) != 0) return last_errno_error();
    return {};
  }

  result<std::vector<directory_entry>> list_directory(const file_handle& dir) noexcept override {
    // A descriptor of its own: readdir moves the position of the one it reads through.
    const int fd = ::openat(dir.fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return last_errno_error();
    DIR* d = ::fdopendir(fd);
    if (d == nullptr) {
      const int e = errno;
      ::close(fd);
      return errno_error(e);
    }
    std::vector<directory_entry> out;
    int failure = 0;
    try {
      for (;;) {
        errno = 0;
        const dirent* e = ::readdir(d);
        if (e == nullptr) {
          failure = errno;
          break;
        }
        if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
        entry_type t = entry_type::other;
        unsigned char type = e->d_type;
        if (type == DT_UNKNOWN) {
          struct stat st {};
          if (::fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
            type = S_ISREG(st.st_mode)   ? DT_REG
                   : S_ISDIR(st.st_mode) ? DT_DIR
                   : S_ISLNK(st.st_mode) ? DT_LNK
                                         : DT_UNKNOWN;
          }
        }
        if (type == DT_REG) t = entry_type::regular;
        if (type == DT_DIR) t = entry_type::directory;
        if (type == DT_LNK) t = entry_type::symlink;
        out.push_back({e->d_name, t});
      }
    } catch (const std::bad_alloc&) {
      failure = ENOMEM;
    }
    ::closedir(d);
    if (failure != 0) return errno_error(failure);
    return out;
  }

  result<file_status> stat_at(const file_handle* dir, const char* name,
                              bool follow) noexcept override {
    if (name == nullptr) return errc_error(std::errc::invalid_argument);
    struct stat st {};
    if (::fstatat(dir_fd(dir), name, &st, follow ? 0 : AT_SYMLINK_NOFOLLOW) != 0) {
      return last_errno_error();
    }
    return status_of(st);
  }

  result<fs_info> statfs(const char* path) noexcept override {
    if (path == nullptr) return errc_error(std::errc::invalid_argument);
    struct statfs s {};
    if (::statfs(path, &s) != 0) return last_errno_error();
    return detail::fs_info_of(s);
  }

  result<std::size_t> read(const file_handle& file, off_t offset,
                           std::span<const iovec> buffers) noexcept override {
    // One buffer goes as pread: the kernel's iovec import costs preadv ~10 % on 4 KiB.
    const ssize_t n = buffers.size() == 1
                          ? ::pread(file.fd(), buffers[0].iov_base, buffers[0].iov_len, offset)
                          : ::preadv(file.fd(), buffers.data(), iov_count(buffers), offset);
    if (n < 0) return last_errno_error();
    return static_cast<std::size_t>(n);
  }

  result<std::size_t> write(const file_handle& file, off_t offset,
                            std::span<const iovec> buffers) noexcept override {
    const ssize_t n = buffers.size() == 1
                          ? ::pwrite(file.fd(), buffers[0].iov_base, buffers[0].iov_len, offset)
                          : ::pwritev(file.fd(), buffers.data(), iov_count(buffers), offset);
    if (n < 0) return last_errno_error();
    return static_cast<std::size_t>(n);
  }

  result<std::size_t> write_nowait(const file_handle& file, off_t offset,
                                   std::span<const iovec> buffers) noexcept override {
    const ssize_t n = ::pwritev2(file.fd(), buffers.data(), iov_count(buffers), offset, RWF_NOWAIT);
    if (n < 0) return last_errno_error();
    return static_cast<std::size_t>(n);
  }

  result<appended> append(const file_handle& file,
                          std::span<const iovec> buffers) noexcept override {
    const ssize_t n = ::writev(file.fd(), buffers.data(), iov_count(buffers));
    if (n < 0) return last_errno_error();
    // After an O_APPEND write the descriptor's position is the end of what it wrote.
    const off_t end = ::lseek(file.fd(), 0, SEEK_CUR);
    if (end < 0) return last_errno_error();
    return appended{end - static_cast<off_t>(n), static_cast<std::size_t>(n)};
  }

  result<void> sync(const file_handle& file, sync_kind kind) noexcept override {
    int r = 0;
    switch (kind) {
      case sync_kind::data:
        r = ::fdatasync(file.fd());
        break;
      case sync_kind::all:
        r = ::fsync(file.fd());
        break;
      case sync_kind::filesystem:
        r = ::syncfs(file.fd());
        break;
    }
    if (r != 0) return last_errno_error();
    return {};
  }

  result<void> allocate(const file_handle& file, off_t offset, off_t length,
                        bool keep_size) noexcept override {
    if (::fallocate(file.fd(), keep_size ? FALLOC_FL_KEEP_SIZE : 0, offset, length) != 0) {
      return last_errno_error();
    }
    return {};
  }

  result<void> punch_hole(const file_handle& file, off_t offset, off_t length) noexcept override {
    if (::fallocate(file.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0) {
      return last_errno_error();
    }
    return {};
  }

  result<void> truncate(const file_handle& file, off_t length) noexcept override {
    if (::ftruncate(file.fd(), length) != 0) return last_errno_error();
    return {};
  }

  result<void> drop_cached(const file_handle& file, off_t offset, off_t length) noexcept override {
    // posix_fadvise returns the error rather than setting errno.
    if (const int e = ::posix_fadvise(file.fd(), offset, length, POSIX_FADV_DONTNEED); e != 0) {
      return std::unexpected(error(std::error_code(e, std::system_category())));
    }
    return {};
  }

  result<file_status> stat(const file_handle& file) noexcept override {
    struct stat st {};
    if (::fstat(file.fd(), &st) != 0) return last_errno_error();
    return status_of(st);
  }

  result<bool> disable_copy_on_write(const file_handle& file) noexcept override {
    int flags = 0;
    if (::ioctl(file.fd(), FS_IOC_GETFLAGS, &flags) != 0) {
      // No inode flags here at all (tmpfs, and others): no copy-on-write to turn off.
      if (errno == ENOTTY || errno == EOPNOTSUPP || errno == EINVAL) return false;
      return last_errno_error();
    }
    if ((flags & FS_NOCOW_FL) != 0) return true;
    flags |= FS_NOCOW_FL;
    if (::ioctl(file.fd(), FS_IOC_SETFLAGS, &flags) != 0) {
      if (errno == ENOTTY || errno == EOPNOTSUPP || errno == EINVAL) return false;
      return last_errno_error();
    }
    // Some filesystems accept the call and drop a flag they do not have: ask again.
    if (::ioctl(file.fd(), FS_IOC_GETFLAGS, &flags) != 0) return last_errno_error();
    return (flags & FS_NOCOW_FL) != 0;
  }

  result<fs_info> statfs(const file_handle& file) noexcept override {
    struct statfs s {};
    if (::fstatfs(file.fd(), &s) != 0) return last_errno_error();
    return detail::fs_info_of(s);
  }

  result<void> close(const file_handle& file) noexcept override {
    // On Linux the descriptor is released even when close(2) fails with EINTR, so that case
    // is not an error the caller could act on; anything else (EIO from NFS, say) is.
    if (::close(file.fd()) != 0 && errno != EINTR) return last_errno_error();
    return {};
  }

  result<void*> map(const file_handle& file, std::size_t length, off_t offset,
                    map_access access) noexcept override {
    const int prot = access == map_access::read_only ? PROT_READ : PROT_READ | PROT_WRITE;
    const int flags = access == map_access::copy_on_write ? MAP_PRIVATE : MAP_SHARED;
    void* addr = ::mmap(nullptr, length, prot, flags, file.fd(), offset);
    if (addr == MAP_FAILED) return last_errno_error();
    return addr;
  }

  result<void*> remap(void* address, std::size_t length, std::size_t new_length) noexcept override {
    void* addr = ::mremap(address, length, new_length, MREMAP_MAYMOVE);
    if (addr == MAP_FAILED) return last_errno_error();
    return addr;
  }

  result<void> sync_map(void* address, std::size_t length, bool wait) noexcept override {
    if (::msync(address, length, wait ? MS_SYNC : MS_ASYNC) != 0) return last_errno_error();
    return {};
  }

  result<void> unmap(void* address, std::size_t length) noexcept override {
    if (::munmap(address, length) != 0) return last_errno_error();
    return {};
  }

  result<void> lock(const file_handle& file, off_t offset, off_t length, lock_request request,
                    bool wait) noexcept override {
    struct flock fl {};
    fl.l_type = request == lock_request::shared      ? F_RDLCK
                : request == lock_request::exclusive ? F_WRLCK
                                                     : F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = offset;
    fl.l_len = length;
    if (::fcntl(file.fd(), wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0) return {};
    if (!wait && (errno == EAGAIN || errno == EACCES)) {
      return errc_error(std::errc::operation_would_block);
    }
    return last_errno_error();
  }

  result<bool> lock_is_free(const file_handle& file, off_t offset, off_t length,
                            lock_request request) noexcept override {
    struct flock fl {};
    fl.l_type = request == lock_request::shared ? F_RDLCK : F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = offset;
    fl.l_len = length;
    if (::fcntl(file.fd(), F_OFD_GETLK, &fl) != 0) return last_errno_error();
    return fl.l_type == F_UNLCK;
  }
};

}  // namespace

std::string_view to_string(fs_op op) noexcept {
  const auto i = static_cast<std::size_t>(op);
  return i < op_names.size() ? op_names[i] : "unknown";
}

result<fs_op> fs_op_from_string(std::string_view name) noexcept {
  for (std::size_t i = 0; i < op_names.size(); ++i) {
    if (op_names[i] == name) return static_cast<fs_op>(i);
  }
  return errc_error(std::errc::invalid_argument);
}

bool file_status::is_regular() const noexcept {
  return S_ISREG(mode);
}

bool file_status::is_directory() const noexcept {
  return S_ISDIR(mode);
}

filesystem::~filesystem() = default;

result<std::size_t> filesystem::write_nowait(const file_handle& file, off_t offset,
                                             std::span<const iovec> buffers) noexcept {
  (void)file;
  (void)offset;
  (void)buffers;
  return errc_error(std::errc::operation_not_supported);
}

file_handle filesystem::adopt(int fd, keel::detail::shared_path path) noexcept {
  return file_handle(fd, this, std::move(path));
}

void filesystem::take_over(file_handle& file) noexcept {
  file.fs_ = this;
}

filesystem& os() noexcept {
  static posix_filesystem the_os;
  return the_os;
}

// ---- the wrapper: every call forwarded, handles it opens made its own ----

result<file_handle> filesystem_wrapper::open(const file_handle* dir, const char* path,
                                             open_flags flags, mode_t mode) noexcept {
  auto f = target_.open(dir, path, flags, mode);
  if (f) take_over(*f);
  return f;
}
result<void> filesystem_wrapper::link(const file_handle& file, const file_handle* dir,
                                      const char* name) noexcept {
  return target_.link(file, dir, name);
}
result<void> filesystem_wrapper::link_at(const file_handle* from_dir, const char* from,
                                         const file_handle* to_dir, const char* to) noexcept {
  return target_.link_at(from_dir, from, to_dir, to);
}
result<void> filesystem_wrapper::rename(const file_handle* from_dir, const char* from,
                                        const file_handle* to_dir, const char* to,
                                        rename_mode mode) noexcept {
  return target_.rename(from_dir, from, to_dir, to, mode);
}
result<void> filesystem_wrapper::unlink(const file_handle* dir, const char* name,
                                        bool directory) noexcept {
  return target_.unlink(dir, name, directory);
}
result<void> filesystem_wrapper::make_directory(const file_handle* dir, const char* name,
                                                mode_t mode) noexcept {
  return target_.make_directory(dir, name, mode);
}
result<std::vector<directory_entry>> filesystem_wrapper::list_directory(
    const file_handle& dir) noexcept {
  return target_.list_directory(dir);
}
result<file_status> filesystem_wrapper::stat_at(const file_handle* dir, const char* name,
                                                bool follow) noexcept {
  return target_.stat_at(dir, name, follow);
}
result<fs_info> filesystem_wrapper::statfs(const char* path) noexcept {
  return target_.statfs(path);
}
result<std::size_t> filesystem_wrapper::read(const file_handle& file, off_t offset,
                                             std::span<const iovec> buffers) noexcept {
  return target_.read(file, offset, buffers);
}
result<std::size_t> filesystem_wrapper::write(const file_handle& file, off_t offset,
                                              std::span<const iovec> buffers) noexcept {
  return target_.write(file, offset, buffers);
}
result<appended> filesystem_wrapper::append(const file_handle& file,
                                            std::span<const iovec> buffers) noexcept {
  return target_.append(file, buffers);
}
result<void> filesystem_wrapper::sync(const file_handle& file, sync_kind kind) noexcept {
  return target_.sync(file, kind);
}
result<void> filesystem_wrapper::allocate(const file_handle& file, off_t offset, off_t length,
                                          bool keep_size) noexcept {
  return target_.allocate(file, offset, length, keep_size);
}
result<void> filesystem_wrapper::punch_hole(const file_handle& file, off_t offset,
                                            off_t length) noexcept {
  return target_.punch_hole(file, offset, length);
}

result<void> filesystem_wrapper::drop_cached(const file_handle& file, off_t offset,
                                             off_t length) noexcept {
  return target_.drop_cached(file, offset, length);
}
result<void> filesystem_wrapper::truncate(const file_handle& file, off_t length) noexcept {
  return target_.truncate(file, length);
}
result<file_status> filesystem_wrapper::stat(const file_handle& file) noexcept {
  return target_.stat(file);
}
result<fs_info> filesystem_wrapper::statfs(const file_handle& file) noexcept {
  return target_.statfs(file);
}

result<bool> filesystem_wrapper::disable_copy_on_write(const file_handle& file) noexcept {
  return target_.disable_copy_on_write(file);
}
result<void> filesystem_wrapper::close(const file_handle& file) noexcept {
  return target_.close(file);
}
result<void*> filesystem_wrapper::map(const file_handle& file, std::size_t length, off_t offset,
                                      map_access access) noexcept {
  return target_.map(file, length, offset, access);
}
result<void*> filesystem_wrapper::remap(void* address, std::size_t length,
                                        std::size_t new_length) noexcept {
  return target_.remap(address, length, new_length);
}
result<void> filesystem_wrapper::sync_map(void* address, std::size_t length, bool wait) noexcept {
  return target_.sync_map(address, length, wait);
}
result<void> filesystem_wrapper::unmap(void* address, std::size_t length) noexcept {
  return target_.unmap(address, length);
}
result<void> filesystem_wrapper::lock(const file_handle& file, off_t offset, off_t length,
                                      lock_request request, bool wait) noexcept {
  return target_.lock(file, offset, length, request, wait);
}
result<bool> filesystem_wrapper::lock_is_free(const file_handle& file, off_t offset, off_t length,
                                              lock_request request) noexcept {
  return target_.lock_is_free(file, offset, length, request);
}

}  // namespace keel::io
