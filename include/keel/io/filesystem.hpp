#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "keel/result.hpp"

//! The seam: the one door through which keel's storage code reaches files (what SQLite's VFS
//! and LevelDB's Env are). Every open, read, write, sync, allocation, rename, map and
//! byte-range lock of keel goes through a `filesystem`, so a test can put another one in its
//! place: `os()` is the real thing, `filesystem_wrapper` forwards everything to another one
//! and lets a test double override a part, and `fault_filesystem` (fault_filesystem.hpp)
//! fails the N-th operation of a kind or loses what was not made durable, as a power cut
//! would.
//!
//! Each operation is one system call (two for `append`), with the kernel's errors as they
//! come: short transfers are returned as short counts and EINTR as `interrupted`; the loops
//! that retry them live above the seam (file_handle), so a test double that returns a short
//! count exercises them. Every function is thread-safe as the kernel's calls are.
namespace keel::io {

class file_handle;
struct fs_info;

//! How a file is opened. Combine with `|`. Every descriptor keel opens is O_CLOEXEC.
enum class open_flags : std::uint32_t {
  none = 0,
  read = 1u << 0,           //!< O_RDONLY (with write: O_RDWR)
  write = 1u << 1,          //!< O_WRONLY (with read: O_RDWR)
  create = 1u << 2,         //!< O_CREAT
  exclusive = 1u << 3,      //!< O_EXCL: fail with file_exists if it exists (needs create)
  truncate = 1u << 4,       //!< O_TRUNC
  direct = 1u << 5,         //!< O_DIRECT: transfers must be aligned to the device's block size
  sync = 1u << 6,           //!< O_DSYNC: each write returns once its data is durable
  append = 1u << 7,         //!< O_APPEND: every write goes to the end, atomically
  directory = 1u << 8,      //!< O_DIRECTORY: only a directory (read, no write)
  no_follow = 1u << 9,      //!< O_NOFOLLOW: a symlink as the last component fails with ELOOP
  temporary = 1u << 10,     //!< O_TMPFILE: an unnamed file in the directory `path` (needs write)
  non_blocking = 1u << 11,  //!< O_NONBLOCK: opening a FIFO or device at the path never blocks
  read_write = read | write,
};
[[nodiscard]] constexpr open_flags operator|(open_flags a, open_flags b) noexcept {
  return static_cast<open_flags>(static_cast<std::uint32_t>(a) | static_cast<std::uint32_t>(b));
}
[[nodiscard]] constexpr bool has(open_flags set, open_flags f) noexcept {
  return (static_cast<std::uint32_t>(set) & static_cast<std::uint32_t>(f)) != 0;
}

//! The kinds of operations, as fault injection and operation counts name them.
enum class fs_op : std::uint8_t {
  open,            //!< open, open_at, temporary files, opening a directory
  close,           //!< closing a descriptor
  read,            //!< preadv
  write,           //!< pwritev
  append,          //!< write at the end of an O_APPEND file
  sync,            //!< fsync / fdatasync of a file
  sync_directory,  //!< fsync of a directory (makes its entries durable)
  allocate,        //!< fallocate (reserve)
  punch_hole,      //!< fallocate (free a range)
  truncate,        //!< ftruncate
  stat,            //!< fstat / fstatat
  statfs,          //!< statfs / fstatfs
  rename,          //!< renameat2
  link,            //!< linkat (a new name for a file)
  unlink,          //!< unlinkat (a file or a directory)
  make_directory,  //!< mkdirat
  list_directory,  //!< reading a directory's entries
  map,             //!< mmap / mremap
  sync_map,        //!< msync
  unmap,           //!< munmap
  lock,            //!< byte-range (OFD) locks: lock, unlock, test
  attributes,      //!< inode flags (FS_IOC_GETFLAGS / FS_IOC_SETFLAGS)
};
inline constexpr std::size_t fs_op_count = 22;

//! A set of operation kinds.
class fs_ops {
 public:
  constexpr fs_ops() noexcept = default;
  constexpr fs_ops(fs_op op) noexcept : bits_(bit(op)) {}  // NOLINT: implicit by design
  [[nodiscard]] static constexpr fs_ops all() noexcept {
    fs_ops s;
    s.bits_ = (std::uint32_t{1} << fs_op_count) - 1;
    return s;
  }
  [[nodiscard]] static constexpr fs_ops none() noexcept { return {}; }
  //! Every operation that changes a file's content or a directory's entries, or makes them
  //! durable: what a crash or a full disk can interrupt.
  [[nodiscard]] static constexpr fs_ops mutating() noexcept {
    return fs_ops(fs_op::write) | fs_op::append | fs_op::sync | fs_op::sync_directory |
           fs_op::allocate | fs_op::punch_hole | fs_op::truncate | fs_op::rename | fs_op::link |
           fs_op::attributes | fs_op::unlink | fs_op::make_directory | fs_op::sync_map;
  }
  [[nodiscard]] constexpr bool has(fs_op op) const noexcept { return (bits_ & bit(op)) != 0; }
  [[nodiscard]] constexpr bool empty() const noexcept { return bits_ == 0; }
  friend constexpr fs_ops operator|(fs_ops a, fs_ops b) noexcept {
    fs_ops s;
    s.bits_ = a.bits_ | b.bits_;
    return s;
  }
  friend constexpr bool operator==(fs_ops, fs_ops) noexcept = default;

 private:
  static constexpr std::uint32_t bit(fs_op op) noexcept {
    return std::uint32_t{1} << static_cast<unsigned>(op);
  }
  std::uint32_t bits_ = 0;
};

//! The name of an operation kind ("write", "sync_directory", ...), and back.
[[nodiscard]] std::string_view to_string(fs_op op) noexcept;
[[nodiscard]] result<fs_op> fs_op_from_string(std::string_view name) noexcept;

//! What fstat(2) says of a file.
struct file_status {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  std::uint64_t size = 0;
  std::uint64_t allocated = 0;  //!< bytes of blocks allocated (st_blocks * 512)
  std::uint32_t mode = 0;       //!< type and permission bits (st_mode)
  std::uint32_t owner = 0;      //!< st_uid
  std::uint64_t links = 0;      //!< st_nlink
  [[nodiscard]] bool is_regular() const noexcept;
  [[nodiscard]] bool is_directory() const noexcept;
  //! Whether both describe the same file (device and inode).
  [[nodiscard]] bool same_file(const file_status& other) const noexcept {
    return device == other.device && inode == other.inode;
  }
};

enum class entry_type : std::uint8_t { regular, directory, symlink, other };

struct directory_entry {
  std::string name;
  entry_type type = entry_type::other;
};

//! fsync(2), fdatasync(2) or syncfs(2).
enum class sync_kind : std::uint8_t {
  data,  //!< the data, and the metadata needed to read it back
  all,   //!< data and every metadata (on a directory: its entries)
  //! syncfs(2): the whole filesystem holding the file, so that it settles what it holds in
  //! reserve (btrfs's space reserved for dirty pages, blocks freed by its last transaction).
  //! keel never counts on it for durability, and the fault seam's power-loss model does
  //! not either.
  filesystem,
};

//! What a byte-range lock call asks for.
enum class lock_request : std::uint8_t { shared, exclusive, unlock };

//! What `append` wrote: where its first byte landed and how many bytes went in (fewer than
//! asked only when the kernel took part of it, as on a full disk).
struct appended {
  off_t offset = 0;
  std::size_t length = 0;
};

enum class map_access : std::uint8_t {
  read_only,      //!< PROT_READ, MAP_SHARED: sees other writers' changes
  read_write,     //!< PROT_READ|PROT_WRITE, MAP_SHARED: writes reach the file
  copy_on_write,  //!< PROT_READ|PROT_WRITE, MAP_PRIVATE: writes stay in this process
};

//! How renameat2(2) treats an existing target.
enum class rename_mode : std::uint8_t {
  replace,     //!< the target, if any, is replaced atomically
  no_replace,  //!< fail with file_exists if the target exists (RENAME_NOREPLACE)
};

//! The interface. Directory arguments are `const file_handle*`: a directory handle, or null
//! for the current directory (as AT_FDCWD). Handles it returns belong to this filesystem:
//! their later operations come back to it.
class filesystem {
 public:
  filesystem() noexcept = default;
  filesystem(const filesystem&) = delete;
  filesystem& operator=(const filesystem&) = delete;
  virtual ~filesystem();

  // ---- names ----
  //! openat(2), O_CLOEXEC always. Flags keel cannot make sense of (neither read nor write
  //! nor directory, exclusive without create, temporary without write) are invalid_argument.
  [[nodiscard]] virtual result<file_handle> open(const file_handle* dir, const char* path,
                                                 open_flags flags, mode_t mode) noexcept = 0;
  //! Gives the open file `file` the name `name` in `dir` (linkat with AT_EMPTY_PATH, or its
  //! /proc/self/fd route where that needs a privilege): how an O_TMPFILE file gets a name.
  [[nodiscard]] virtual result<void> link(const file_handle& file, const file_handle* dir,
                                          const char* name) noexcept = 0;
  //! A second name for an existing one (linkat).
  [[nodiscard]] virtual result<void> link_at(const file_handle* from_dir, const char* from,
                                             const file_handle* to_dir,
                                             const char* to) noexcept = 0;
  [[nodiscard]] virtual result<void> rename(const file_handle* from_dir, const char* from,
                                            const file_handle* to_dir, const char* to,
                                            rename_mode mode) noexcept = 0;
  //! unlinkat(2); `directory` removes an empty directory (AT_REMOVEDIR).
  [[nodiscard]] virtual result<void> unlink(const file_handle* dir, const char* name,
                                            bool directory) noexcept = 0;
  [[nodiscard]] virtual result<void> make_directory(const file_handle* dir, const char* name,
                                                    mode_t mode) noexcept = 0;
  //! The entries of a directory, without "." and "..".
  [[nodiscard]] virtual result<std::vector<directory_entry>> list_directory(
      const file_handle& dir) noexcept = 0;
  //! fstatat(2) of `name` in `dir` (`follow`: through a final symlink).
  [[nodiscard]] virtual result<file_status> stat_at(const file_handle* dir, const char* name,
                                                    bool follow) noexcept = 0;
  //! statfs(2) of the filesystem holding `path`.
  [[nodiscard]] virtual result<fs_info> statfs(const char* path) noexcept = 0;

  // ---- an open file ----
  //! One preadv(2): may return fewer bytes than asked (0 at end of file).
  [[nodiscard]] virtual result<std::size_t> read(const file_handle& file, off_t offset,
                                                 std::span<const iovec> buffers) noexcept = 0;
  //! One pwritev(2): may write fewer bytes than asked.
  [[nodiscard]] virtual result<std::size_t> write(const file_handle& file, off_t offset,
                                                  std::span<const iovec> buffers) noexcept = 0;
  //! One pwritev2(2) with RWF_NOWAIT: a write that must not block. May write fewer bytes
  //! than asked; operation_would_block where it would have blocked; operation_not_supported,
  //! having written nothing, where the file's filesystem cannot take a buffered write that
  //! way (ext4 and tmpfs cannot; io_uring then hands every such write to a kernel thread).
  //! By default a filesystem says operation_not_supported, so that a wrapper which sees every
  //! write (a fault_filesystem) sees these too, as plain writes.
  [[nodiscard]] virtual result<std::size_t> write_nowait(const file_handle& file, off_t offset,
                                                         std::span<const iovec> buffers) noexcept;
  //! One writev(2) on a descriptor opened with open_flags::append, and where it landed
  //! (lseek). Not for a handle that two threads append through at once (the landing offset
  //! is read from the descriptor's position).
  [[nodiscard]] virtual result<appended> append(const file_handle& file,
                                                std::span<const iovec> buffers) noexcept = 0;
  //! fsync(2) / fdatasync(2). Never retried by keel: after a failure, the data written since
  //! the last good sync may be gone (file_handle.hpp).
  [[nodiscard]] virtual result<void> sync(const file_handle& file, sync_kind kind) noexcept = 0;
  //! fallocate(2) mode 0 (or KEEP_SIZE): blocks reserved for [offset, offset + length).
  //! operation_not_supported where the filesystem cannot.
  [[nodiscard]] virtual result<void> allocate(const file_handle& file, off_t offset, off_t length,
                                              bool keep_size) noexcept = 0;
  //! fallocate(2) PUNCH_HOLE|KEEP_SIZE: [offset, offset + length) reads as zeros and its
  //! blocks are freed.
  [[nodiscard]] virtual result<void> punch_hole(const file_handle& file, off_t offset,
                                                off_t length) noexcept = 0;
  [[nodiscard]] virtual result<void> truncate(const file_handle& file, off_t length) noexcept = 0;
  //! posix_fadvise(2) POSIX_FADV_DONTNEED: this kernel's clean cached pages of the range
  //! are dropped, so the next read asks the filesystem (on a network one, its server).
  [[nodiscard]] virtual result<void> drop_cached(const file_handle& file, off_t offset,
                                                 off_t length) noexcept = 0;
  [[nodiscard]] virtual result<file_status> stat(const file_handle& file) noexcept = 0;
  [[nodiscard]] virtual result<fs_info> statfs(const file_handle& file) noexcept = 0;
  //! Turns copy-on-write off for `file` (FS_NOCOW_FL, `chattr +C`): on btrfs its blocks are
  //! then written in place, so room fallocate reserved stays theirs; on a directory, for the
  //! files made in it from then on. Returns whether the flag is set now: false where the
  //! filesystem has no such flag (ext4, xfs, tmpfs, ...). Errors: the ioctl's others.
  [[nodiscard]] virtual result<bool> disable_copy_on_write(const file_handle& file) noexcept = 0;
  //! Closes the handle's descriptor (the handle stops owning it either way).
  virtual result<void> close(const file_handle& file) noexcept = 0;

  // ---- maps ----
  //! mmap(2) of `length` bytes of `file` from `offset`.
  [[nodiscard]] virtual result<void*> map(const file_handle& file, std::size_t length, off_t offset,
                                          map_access access) noexcept = 0;
  //! mremap(2) with MREMAP_MAYMOVE: the new address.
  [[nodiscard]] virtual result<void*> remap(void* address, std::size_t length,
                                            std::size_t new_length) noexcept = 0;
  //! msync(2) of a page-aligned range of a map (`wait`: MS_SYNC).
  [[nodiscard]] virtual result<void> sync_map(void* address, std::size_t length,
                                              bool wait) noexcept = 0;
  virtual result<void> unmap(void* address, std::size_t length) noexcept = 0;

  // ---- byte-range locks (OFD) ----
  //! F_OFD_SETLK (`wait` false: operation_would_block when held elsewhere) or F_OFD_SETLKW
  //! (`wait` true: `interrupted` when a signal came first). See byte_lock.hpp.
  [[nodiscard]] virtual result<void> lock(const file_handle& file, off_t offset, off_t length,
                                          lock_request request, bool wait) noexcept = 0;
  //! F_OFD_GETLK: whether [offset, offset + length) could be locked as `request` now.
  [[nodiscard]] virtual result<bool> lock_is_free(const file_handle& file, off_t offset,
                                                  off_t length, lock_request request) noexcept = 0;

 protected:
  //! For implementations: a handle of this filesystem owning `fd`, opened as `path` (the
  //! path errors about it name).
  [[nodiscard]] file_handle adopt(int fd, keel::detail::shared_path path) noexcept;
  //! For wrappers: makes `file` (opened by another filesystem) one of this filesystem's.
  void take_over(file_handle& file) noexcept;
};

//! The real system calls: what keel uses unless told otherwise.
[[nodiscard]] filesystem& os() noexcept;

//! Forwards every operation to `target`; derive from it and override what a test double
//! changes. Handles opened through the wrapper belong to the wrapper (their operations come
//! back through it), whatever the target did to open them.
class filesystem_wrapper : public filesystem {
 public:
  explicit filesystem_wrapper(filesystem& target) noexcept : target_(target) {}
  [[nodiscard]] filesystem& target() const noexcept { return target_; }

  [[nodiscard]] result<file_handle> open(const file_handle* dir, const char* path, open_flags flags,
                                         mode_t mode) noexcept override;
  [[nodiscard]] result<void> link(const file_handle& file, const file_handle* dir,
                                  const char* name) noexcept override;
  [[nodiscard]] result<void> link_at(const file_handle* from_dir, const char* from,
                                     const file_handle* to_dir, const char* to) noexcept override;
  [[nodiscard]] result<void> rename(const file_handle* from_dir, const char* from,
                                    const file_handle* to_dir, const char* to,
                                    rename_mode mode) noexcept override;
  [[nodiscard]] result<void> unlink(const file_handle* dir, const char* name,
                                    bool directory) noexcept override;
  [[nodiscard]] result<void> make_directory(const file_handle* dir, const char* name,
                                            mode_t mode) noexcept override;
  [[nodiscard]] result<std::vector<directory_entry>> list_directory(
      const file_handle& dir) noexcept override;
  [[nodiscard]] result<file_status> stat_at(const file_handle* dir, const char* name,
                                            bool follow) noexcept override;
  [[nodiscard]] result<fs_info> statfs(const char* path) noexcept override;
  [[nodiscard]] result<std::size_t> read(const file_handle& file, off_t offset,
                                         std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<std::size_t> write(const file_handle& file, off_t offset,
                                          std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<appended> append(const file_handle& file,
                                        std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<void> sync(const file_handle& file, sync_kind kind) noexcept override;
  [[nodiscard]] result<void> allocate(const file_handle& file, off_t offset, off_t length,
                                      bool keep_size) noexcept override;
  [[nodiscard]] result<void> punch_hole(const file_handle& file, off_t offset,
                                        off_t length) noexcept override;
  [[nodiscard]] result<void> truncate(const file_handle& file, off_t length) noexcept override;
  [[nodiscard]] result<void> drop_cached(const file_handle& file, off_t offset,
                                         off_t length) noexcept override;
  [[nodiscard]] result<file_status> stat(const file_handle& file) noexcept override;
  [[nodiscard]] result<fs_info> statfs(const file_handle& file) noexcept override;
  [[nodiscard]] result<bool> disable_copy_on_write(const file_handle& file) noexcept override;
  result<void> close(const file_handle& file) noexcept override;
  [[nodiscard]] result<void*> map(const file_handle& file, std::size_t length, off_t offset,
                                  map_access access) noexcept override;
  [[nodiscard]] result<void*> remap(void* address, std::size_t length,
                                    std::size_t new_length) noexcept override;
  [[nodiscard]] result<void> sync_map(void* address, std::size_t length,
                                      bool wait) noexcept override;
  result<void> unmap(void* address, std::size_t length) noexcept override;
  [[nodiscard]] result<void> lock(const file_handle& file, off_t offset, off_t length,
                                  lock_request request, bool wait) noexcept override;
  [[nodiscard]] result<bool> lock_is_free(const file_handle& file, off_t offset, off_t length,
                                          lock_request request) noexcept override;

 private:
  filesystem& target_;
};

}  // namespace keel::io
