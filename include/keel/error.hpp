#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

//! keel's errors: one category for the conditions keel detects itself (`keel::errc`), the
//! kernel's errno for everything else, and an `error` value that can also say which file,
//! and where in it, the error is about (as LevelDB's `PosixError(context, errno)` does).
namespace keel {

//! Conditions keel detects itself, for every layer. Each compares equal to the std::errc
//! the kernel would have used where there is one (so `ec == std::errc::bad_message` still
//! holds for `corrupt`), and says what is wrong and what to do about it. Conditions with no
//! kernel counterpart (`not_found`, `conflict`, `budget_reached`, ...) compare equal only to
//! themselves: a store's budget is never mistaken for a full device.
enum class errc : int {
  // ---- files keel reads ----
  //! A checksum or structural check failed: the file (named by the error) was damaged, or
  //! written by something that is not keel. Nothing was read from the damaged part.
  corrupt = 1,  // ≈ bad_message
  //! The file at the path is not one keel wrote; keel refuses it and leaves it untouched.
  //! Use another path, or remove the file if it is garbage.
  not_keel_file,  // ≈ bad_message
  //! The file was written by an incompatible version of keel (newer, or another layout).
  unsupported_version,  // ≈ protocol_not_supported

  // ---- lock ----
  //! A lock's shared table has no free user entry (too many threads and processes).
  too_many_users,  // ≈ EUSERS

  // ---- aio ----
  //! The controller is stopping or stopped: the request was not run. Start a new one.
  controller_stopped,  // ≈ operation_canceled
  //! The file was closed before the request was submitted. Open it again.
  file_closed,  // ≈ bad_file_descriptor
  //! An O_DIRECT request whose offset, length or buffer address is not a multiple of the
  //! file's direct-I/O alignment (`file::alignment()`). Align them, or open without direct.
  misaligned_direct_io,  // ≈ invalid_argument
  //! The request reaches past the largest file offset, or its buffer is null.
  bad_request,  // ≈ invalid_argument
  //! A request the file was not opened for (a write on a read-only file, ...).
  not_opened_for,  // ≈ bad_file_descriptor
  //! The engine cannot do this (O_DIRECT through stdio, ...). Pick another engine.
  not_supported_by_engine,  // ≈ operation_not_supported
  //! The write-back cache was asked for on an O_DIRECT file. Open it without one of them.
  cache_needs_buffered_io,  // ≈ invalid_argument

  // ---- kv (the store) ----
  //! The key is not in the store (or not in the transaction's snapshot).
  not_found,
  //! Another transaction committed a key this one read or wrote since its snapshot: nothing
  //! of this one was applied. Retry it.
  conflict,
  //! A key or value is larger than the store allows.
  too_large,  // ≈ value_too_large
  //! The store (or transaction) was opened read-only.
  read_only,  // ≈ read_only_file_system

  // ---- space ----
  //! The store's own byte budget (`max_bytes`) is reached; the device may have room.
  //! Delete or compact, or raise the budget. (A full device is ENOSPC, no_space_on_device.)
  budget_reached,

  // ---- kv, after a failed sync ----
  //! An fdatasync of the store's file the error names failed: the kernel may have dropped
  //! the data it could not write, and the sync is never retried (a retry could report
  //! success over lost data). The store takes no change until it is reopened by a user alone
  //! (every process closed it); reads go on. Nothing else (EMFILE, ENOMEM) makes a store read
  //! only.
  sync_failed,  // ≈ io_error

  // ---- aio, in a forked child ----
  //! The aio controller (or a file or request of it) came from the parent across fork():
  //! its threads and their requests stayed there, so the child may not use it (it would run
  //! or re-run the parent's requests). Start a controller of the child's own.
  inherited_across_fork,

  // ---- lock and kv, on a filesystem other machines may share ----
  //! The lock algorithm (or store) works only where every user is on this machine, and the
  //! file (named by the error) is on a filesystem other machines may share: a network or
  //! cluster filesystem, FUSE, or one keel does not know. Use byte_ranges or lock_files
  //! there; a store opens once its caller states that every user is on this host.
  needs_local_filesystem,  // ≈ operation_not_supported

  // ---- lock, one path used two ways ----
  //! The lock file or directory (named by the error, with both algorithms) is open with
  //! another keel algorithm, which would not exclude this one: open it with that algorithm.
  used_by_another_algorithm,  // ≈ device_or_resource_busy
};

//! The category of keel::errc ("keel").
[[nodiscard]] const std::error_category& category() noexcept;

[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), category()};
}

namespace detail {

//! An immutable, reference-counted string: a file's path kept by its handle and shared,
//! without copying, by the errors about that file. Null when empty (or when allocating it
//! failed: a path is context, never worth failing for).
class shared_path {
 public:
  shared_path() noexcept = default;
  explicit shared_path(std::string_view s) noexcept;
  shared_path(const shared_path& other) noexcept : rep_(other.rep_) { acquire(); }
  shared_path(shared_path&& other) noexcept : rep_(other.rep_) { other.rep_ = nullptr; }
  shared_path& operator=(const shared_path& other) noexcept {
    if (this != &other) {
      release();
      rep_ = other.rep_;
      acquire();
    }
    return *this;
  }
  shared_path& operator=(shared_path&& other) noexcept {
    if (this != &other) {
      release();
      rep_ = other.rep_;
      other.rep_ = nullptr;
    }
    return *this;
  }
  ~shared_path() { release(); }

  [[nodiscard]] std::string_view view() const noexcept;
  [[nodiscard]] const char* c_str() const noexcept;
  [[nodiscard]] bool empty() const noexcept { return rep_ == nullptr; }

 private:
  struct rep;
  void acquire() noexcept;
  void release() noexcept;
  rep* rep_ = nullptr;
};

}  // namespace detail

//! What went wrong: a `std::error_code` (the kernel's errno in the system category, or a
//! keel::errc), and optionally the file it is about and the offset in it. Behaves like the
//! error_code for comparisons (`e == std::errc::timed_out`, `e == keel::errc::corrupt`) and
//! converts to it; `message()` names the file and offset when known.
class error {
 public:
  static constexpr std::uint64_t no_offset = ~std::uint64_t{0};

  error() noexcept = default;
  error(std::error_code code) noexcept : code_(code) {}  // NOLINT: implicit by design
  template <class E>
  requires std::is_error_code_enum_v<E> error(E e)
  noexcept : code_(make_error_code(e)) {}  // NOLINT: implicit by design
  error(std::error_code code, detail::shared_path path, std::uint64_t offset = no_offset) noexcept
      : code_(code), path_(std::move(path)), offset_(offset) {}
  error(std::error_code code, std::string_view path, std::uint64_t offset = no_offset) noexcept
      : code_(code), path_(path), offset_(offset) {}

  [[nodiscard]] const std::error_code& code() const noexcept { return code_; }
  operator const std::error_code&() const noexcept { return code_; }  // NOLINT: implicit
  [[nodiscard]] int value() const noexcept { return code_.value(); }
  [[nodiscard]] const std::error_category& category() const noexcept { return code_.category(); }
  [[nodiscard]] std::error_condition default_error_condition() const noexcept {
    return code_.default_error_condition();
  }
  explicit operator bool() const noexcept { return static_cast<bool>(code_); }

  //! The file the error is about, or empty.
  [[nodiscard]] std::string_view path() const noexcept { return path_.view(); }
  [[nodiscard]] bool has_offset() const noexcept { return offset_ != no_offset; }
  //! The byte offset in that file, or no_offset.
  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  //! This error about `path` (and `offset`, else the offset it has), unless it already names
  //! a file. A parser that knows where but not which file returns an error with an offset
  //! only; its caller adds the file.
  [[nodiscard]] error about(std::string_view path, std::uint64_t offset = no_offset) const noexcept;
  [[nodiscard]] error about(const detail::shared_path& path,
                            std::uint64_t offset = no_offset) const noexcept;

  //! "PATH at offset N: what" (or just "what" without a file).
  [[nodiscard]] std::string message() const;

  friend bool operator==(const error& a, const error& b) noexcept { return a.code_ == b.code_; }
  friend bool operator==(const error& a, const std::error_code& b) noexcept { return a.code_ == b; }
  friend bool operator==(const error& a, const std::error_condition& b) noexcept {
    return a.code_ == b;
  }
  template <class E>
  requires(std::is_error_code_enum_v<E> || std::is_error_condition_enum_v<E>) friend bool
  operator==(const error& a, E b) noexcept {
    return a.code_ == b;
  }

 private:
  std::error_code code_;
  detail::shared_path path_;
  std::uint64_t offset_ = no_offset;
};

//! Prints `e.message()` (and the code's category and value), for tests and logs.
std::ostream& operator<<(std::ostream& os, const error& e);

}  // namespace keel

template <>
struct std::is_error_code_enum<keel::errc> : std::true_type {};
