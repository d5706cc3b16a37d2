#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "keel/io/filesystem.hpp"
#include "keel/result.hpp"

namespace keel::io {

//! An owned file descriptor with full-length positional I/O, reaching the kernel through a
//! `filesystem` (the seam: `os()` unless it was opened through another). Move-only; closes
//! on destruction (use `close()` to see the error of a close). Not synchronised: one handle
//! may be used from several threads for positional I/O (the kernel serialises nothing else
//! here), but moving, closing or reassigning it while another thread uses it is a data race.
//!
//! Errors of reads, writes, syncs and allocations name the handle's path (and the offset),
//! as `keel::error` allows.
//!
//! Durability: a failed `sync_data`/`sync_all` is returned as is and never retried. After a
//! failed fsync the kernel may already have dropped the dirty pages and cleared the error, so
//! a retry that succeeds proves nothing: treat the data written since the last good sync as
//! lost, and rewrite it from your own copy if you have one.
class file_handle {
 public:
  file_handle() noexcept = default;
  //! Adopts `fd` (which must be open, or -1), reached through `os()`.
  explicit file_handle(int fd) noexcept : fd_(fd) {}
  file_handle(file_handle&& other) noexcept
      : fd_(other.fd_), fs_(other.fs_), path_(std::move(other.path_)) {
    other.fd_ = -1;
  }
  file_handle& operator=(file_handle&& other) noexcept;
  file_handle(const file_handle&) = delete;
  file_handle& operator=(const file_handle&) = delete;
  ~file_handle();

  //! Opens `path` with `flags`; `mode` applies when a file is created. Errors: the errno of
  //! open(2) (no_such_file_or_directory, file_exists with exclusive, permission_denied, ...),
  //! invalid_argument when neither read nor write is asked or exclusive comes without create.
  [[nodiscard]] static result<file_handle> open(const char* path, open_flags flags,
                                                mode_t mode = 0644) noexcept;
  [[nodiscard]] static result<file_handle> open(filesystem& fs, const char* path, open_flags flags,
                                                mode_t mode = 0644) noexcept;
  //! Like `open`, relative to the directory `dir` (through `dir`'s filesystem).
  [[nodiscard]] static result<file_handle> open_at(const file_handle& dir, const char* name,
                                                   open_flags flags, mode_t mode = 0644) noexcept;
  //! Opens a directory, for `sync_all` (directory fsync), `open_at` and `link_at`.
  [[nodiscard]] static result<file_handle> open_directory(const char* path) noexcept;
  [[nodiscard]] static result<file_handle> open_directory(filesystem& fs,
                                                          const char* path) noexcept;
  //! An anonymous file in directory `dir` (O_TMPFILE): it has no name, vanishes when closed,
  //! and can be given one with `link_at`. Errors: operation_not_supported where the
  //! filesystem lacks O_TMPFILE (the errno the kernel gave is kept in the error). See
  //! `make_temp_file` for the fallback to a named temporary.
  [[nodiscard]] static result<file_handle> temp_file(const char* dir,
                                                     open_flags flags = open_flags::read_write,
                                                     mode_t mode = 0600) noexcept;

  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] bool is_open() const noexcept { return fd_ >= 0; }
  //! The filesystem its operations go through.
  [[nodiscard]] filesystem& fs() const noexcept { return fs_ != nullptr ? *fs_ : os(); }
  //! The path it was opened as (relative ones as given), or empty.
  [[nodiscard]] std::string_view path() const noexcept { return path_.view(); }
  [[nodiscard]] const keel::detail::shared_path& shared_path() const noexcept { return path_; }
  //! Gives up ownership of the descriptor without closing it.
  [[nodiscard]] int release() noexcept;
  //! Closes the descriptor and returns close(2)'s error, if any. The descriptor is gone
  //! either way (Linux never leaves it open after EINTR).
  result<void> close() noexcept;

  //! Reads up to `buffer.size()` bytes at `offset`, retrying EINTR and short reads. Returns
  //! the number of bytes read, which is less than asked only when end of file was reached.
  //! Errors: bad_file_descriptor, invalid_argument (negative offset, or offset + size past
  //! the largest file offset; for O_DIRECT, misaligned buffer, offset or size), the errno of
  //! pread(2).
  [[nodiscard]] result<std::size_t> read_at(off_t offset,
                                            std::span<std::byte> buffer) const noexcept;
  //! Writes all of `data` at `offset`, retrying EINTR and short writes. On error, a prefix
  //! of `data` may have been written. Errors as `read_at`, plus no_space_on_device,
  //! file_too_large.
  [[nodiscard]] result<void> write_at(off_t offset, std::span<const std::byte> data) const noexcept;
  //! Vectored `read_at`: fills the buffers in order; returns the total read, short only at
  //! end of file. The iovec array is not modified.
  [[nodiscard]] result<std::size_t> read_at(off_t offset,
                                            std::span<const iovec> buffers) const noexcept;
  //! Vectored `write_at`: writes every buffer in order, all of them or an error.
  [[nodiscard]] result<void> write_at(off_t offset, std::span<const iovec> buffers) const noexcept;
  //! Appends `data` in one write(2) on a handle opened with open_flags::append (so that
  //! concurrent appenders never interleave within one call) and returns where it landed.
  //! A short append (the kernel took part of it, as on a full disk) is returned as such:
  //! `length` below data.size(); the caller decides what the partial record means.
  [[nodiscard]] result<appended> append(std::span<const std::byte> data) const noexcept;

  //! fdatasync(2): the data, and the metadata needed to read it back, are durable.
  [[nodiscard]] result<void> sync_data() const noexcept;
  //! fsync(2): data and all metadata are durable. On a directory handle this makes the
  //! directory's entries (creations, renames, unlinks in it) durable.
  [[nodiscard]] result<void> sync_all() const noexcept;
  //! syncfs(2) of the filesystem holding this file (sync_kind::filesystem).
  [[nodiscard]] result<void> sync_filesystem() const noexcept;
  [[nodiscard]] result<void> truncate(off_t length) const noexcept;
  //! Reserves blocks for [offset, offset + length) so later writes there (and writes through
  //! a shared map) cannot fail for lack of space. Extends the file if the range passes its
  //! end. Uses fallocate(2); where the filesystem lacks it, writes a zero into every block
  //! of the range that is a hole (as glibc's posix_fallocate does). Errors:
  //! no_space_on_device, invalid_argument.
  [[nodiscard]] result<void> allocate(off_t offset, off_t length) const noexcept;
  //! Frees the blocks of [offset, offset + length), which then read as zeros; the size
  //! stays. Errors: operation_not_supported where the filesystem cannot.
  [[nodiscard]] result<void> punch_hole(off_t offset, off_t length) const noexcept;
  //! Drops this kernel's clean cached pages of [offset, offset + length) (0: to the end), so
  //! the next read asks the filesystem: on a network filesystem, what the server holds now
  //! rather than what this client read or wrote earlier.
  [[nodiscard]] result<void> drop_cached(off_t offset = 0, off_t length = 0) const noexcept;
  [[nodiscard]] result<off_t> size() const noexcept;
  [[nodiscard]] result<file_status> status() const noexcept;
  //! Gives this anonymous file (from `temp_file`) the name `name` in `dir` (or, with
  //! `dir` not open, the path `name`). Fails with file_exists if the name is taken.
  [[nodiscard]] result<void> link_at(const file_handle& dir, const char* name) const noexcept;

 private:
  friend class filesystem;
  friend class extent_guard;
  file_handle(int fd, filesystem* fs, keel::detail::shared_path path) noexcept
      : fd_(fd), fs_(fs), path_(std::move(path)) {}

  int fd_ = -1;
  filesystem* fs_ = nullptr;  // null: os()
  keel::detail::shared_path path_;
};

//! Removes the name `path` (unlink(2)).
[[nodiscard]] result<void> unlink(const char* path) noexcept;
[[nodiscard]] result<void> unlink(filesystem& fs, const char* path) noexcept;
//! Removes the name `name` in directory `dir` (unlinkat(2)), through `dir`'s filesystem.
[[nodiscard]] result<void> unlink_at(const file_handle& dir, const char* name) noexcept;
//! Makes the entries of the directory `path` durable (open it, fsync it).
[[nodiscard]] result<void> sync_directory(const char* path) noexcept;
[[nodiscard]] result<void> sync_directory(filesystem& fs, const char* path) noexcept;

//! A new file to be given its name(s) later: anonymous (O_TMPFILE) where the filesystem
//! allows, else created under a fresh random name `<prefix><random>` in the directory.
struct temp_file {
  file_handle file;
  std::string name;  //!< empty for an anonymous file; else its temporary name
  //! Gives it `to` in `dir` as well (a hard link): fails with file_exists if taken.
  [[nodiscard]] result<void> link_as(const file_handle& dir, const char* to) const noexcept;
  //! Removes the temporary name, if it has one (after it was linked where it belongs).
  result<void> remove_name(const file_handle& dir) noexcept;
};
//! Makes a `temp_file` in `dir` (through `dir`'s filesystem), `flags` needing write. The one
//! place keel decides when a filesystem lacks O_TMPFILE (EOPNOTSUPP, EISDIR, EINVAL).
[[nodiscard]] result<temp_file> make_temp_file(const file_handle& dir, std::string_view prefix,
                                               open_flags flags = open_flags::read_write,
                                               mode_t mode = 0600) noexcept;

//! The steps of `atomic_replace`, in order; a test hook sees each before it runs.
enum class replace_step : std::uint8_t {
  create_temp,     //!< before the temporary file is created
  write,           //!< before the new content is written to it
  sync_temp,       //!< before the temporary file is fsynced
  link_temp,       //!< before an anonymous temporary gets its temporary name
  rename,          //!< before it is renamed over the target
  sync_directory,  //!< before the directory is fsynced
};

struct replace_options {
  mode_t mode = 0644;
  //! Fault-injection seam for tests: called before each step (may kill the process).
  void (*hook)(replace_step, void* context) noexcept = nullptr;
  void* hook_context = nullptr;
  //! The filesystem it goes through.
  filesystem* fs = nullptr;
};

//! Replaces the content of `path` with `content` so that, whatever happens (a crash, a kill,
//! a power cut after it returns), `path` holds either the old or the new content, never a
//! mix and never nothing: the content goes to a temporary file in the same directory, which
//! is fsynced, renamed over `path`, and the directory is fsynced. Returns once the new
//! content is durable. On an error before the rename, `path` is untouched and the temporary
//! file is removed; if only the final directory fsync fails, `path` already shows the new
//! content but the rename may not survive a power cut. A process killed part-way can leave a
//! temporary file named `.<name>.keel-tmp.<random>` (none at all where the filesystem has
//! O_TMPFILE, except between link and rename).
[[nodiscard]] result<void> atomic_replace(const char* path, std::span<const std::byte> content,
                                          const replace_options& options = {}) noexcept;

}  // namespace keel::io
