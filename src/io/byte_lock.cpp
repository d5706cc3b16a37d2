#include "keel/io/byte_lock.hpp"

#include <limits>

#include "io/lock_wait.hpp"

namespace keel::io {
namespace {

constexpr off_t max_offset = std::numeric_limits<off_t>::max();

bool valid_extent(off_t offset, off_t length) noexcept {
  return offset >= 0 && length > 0 && length <= max_offset - offset;
}

// One attempt through the seam; interrupted attempts are repeated.
result<void> try_once(const file_handle& f, off_t offset, off_t length, lock_request r) noexcept {
  for (;;) {
    auto g = f.fs().lock(f, offset, length, r, false);
    if (g || g.error() != std::errc::interrupted) return g;
  }
}

}  // namespace

extent_guard::extent_guard(extent_guard&& other) noexcept
    : fd_(other.fd_),
      offset_(other.offset_),
      length_(other.length_),
      kind_(other.kind_),
      fs_(other.fs_) {
  other.fd_ = -1;
}

extent_guard& extent_guard::operator=(extent_guard&& other) noexcept {
  if (this != &other) {
    (void)unlock();
    fd_ = other.fd_;
    offset_ = other.offset_;
    length_ = other.length_;
    kind_ = other.kind_;
    fs_ = other.fs_;
    other.fd_ = -1;
  }
  return *this;
}

result<void> extent_guard::unlock() noexcept {
  if (fd_ < 0) return {};
  // A handle that borrows the descriptor for the call: the guard keeps the number only.
  file_handle borrowed(fd_, fs_, {});
  fd_ = -1;
  auto r = try_once(borrowed, offset_, length_, lock_request::unlock);
  (void)borrowed.release();
  return r;
}

result<extent_guard> lock_extent(const file_handle& file, off_t offset, off_t length,
                                 lock_kind kind, deadline d) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  const lock_request r = kind == lock_kind::shared ? lock_request::shared : lock_request::exclusive;
  const auto granted = [&] { return extent_guard(file, offset, length, kind); };

  // The uncontended path is one syscall, whatever the deadline.
  auto first = try_once(file, offset, length, r);
  if (first) return granted();
  if (first.error() != std::errc::operation_would_block) return std::unexpected(first.error());
  // Every later request: waiting (F_OFD_SETLKW) or not, interrupted ones asked again.
  auto attempt = [&](bool wait) noexcept -> result<void> {
    if (wait) return file.fs().lock(file, offset, length, r, true);
    return try_once(file, offset, length, r);
  };
  const result<void> outcome = detail::wait_for_lock(file, d.start(), attempt);
  if (!outcome) return std::unexpected(outcome.error());
  return granted();
}

result<void> unlock_extent(const file_handle& file, off_t offset, off_t length) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  return try_once(file, offset, length, lock_request::unlock);
}

result<bool> extent_is_free(const file_handle& file, off_t offset, off_t length,
                            lock_kind kind) noexcept {
  if (!file.is_open()) return errc_error(std::errc::bad_file_descriptor);
  if (!valid_extent(offset, length)) return errc_error(std::errc::invalid_argument);
  return file.fs().lock_is_free(
      file, offset, length,
      kind == lock_kind::shared ? lock_request::shared : lock_request::exclusive);
}

}  // namespace keel::io
