#include "keel/io/file_handle.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

namespace keel::io {
namespace {

constexpr off_t max_offset = std::numeric_limits<off_t>::max();

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
  return f;
}

bool valid_flags(open_flags flags) noexcept {
  if (!has(flags, open_flags::read) && !has(flags, open_flags::write)) return false;
  if (has(flags, open_flags::exclusive) && !has(flags, open_flags::create)) return false;
  return true;
}

// A transfer of `size` bytes at `offset` must stay within the largest file offset.
bool valid_range(off_t offset, std::size_t size) noexcept {
  return offset >= 0 && size <= static_cast<std::size_t>(max_offset - offset);
}

result<file_handle> open_impl(int dirfd, const char* path, open_flags flags, mode_t mode) noexcept {
  if (path == nullptr || !valid_flags(flags)) return errc_error(std::errc::invalid_argument);
  for (;;) {
    const int fd = ::openat(dirfd, path, to_posix_flags(flags), mode);
    if (fd >= 0) return file_handle(fd);
    if (errno != EINTR) return last_errno_error();
  }
}

// Vectored transfer with a moving window over the caller's (unmodified) iovec array, so short
// transfers resume mid-buffer.
template <bool is_read>
result<std::size_t> transfer_vectored(int fd, off_t offset,
                                      std::span<const iovec> buffers) noexcept {
  std::size_t total = 0;
  for (const iovec& b : buffers) {
    if (b.iov_len > std::numeric_limits<std::size_t>::max() - total) {
      return errc_error(std::errc::invalid_argument);
    }
    total += b.iov_len;
  }
  if (!valid_range(offset, total)) return errc_error(std::errc::invalid_argument);

  constexpr std::size_t window_size = 64;
  std::array<iovec, window_size> window{};
  std::size_t index = 0;  // first buffer not yet complete
  std::size_t skip = 0;   // bytes of buffers[index] already transferred
  std::size_t done = 0;
  while (done < total) {
    std::size_t count = 0;
    for (std::size_t j = index; j < buffers.size() && count < window_size; ++j) {
      const std::size_t already = j == index ? skip : 0;
      if (buffers[j].iov_len == already) continue;
      window[count++] = {static_cast<char*>(buffers[j].iov_base) + already,
                         buffers[j].iov_len - already};
    }
    const off_t at = offset + static_cast<off_t>(done);
    const int n_iov = static_cast<int>(count);
    const ssize_t n =
        is_read ? ::preadv(fd, window.data(), n_iov, at) : ::pwritev(fd, window.data(), n_iov, at);
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_errno_error();
    }
    if (n == 0) {
      if (is_read) break;                      // end of file
      return errc_error(std::errc::io_error);  // a write that makes no progress
    }
    done += static_cast<std::size_t>(n);
    auto left = static_cast<std::size_t>(n);
    while (left > 0) {
      const std::size_t rest = buffers[index].iov_len - skip;
      if (left >= rest) {
        left -= rest;
        ++index;
        skip = 0;
      } else {
        skip += left;
        left = 0;
      }
    }
  }
  return done;
}

std::uint64_t random_u64() noexcept {
  std::uint64_t v = 0;
  if (::getrandom(&v, sizeof v, GRND_NONBLOCK) != static_cast<ssize_t>(sizeof v)) {
    v = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
        (static_cast<std::uint64_t>(::getpid()) << 32);
  }
  return v;
}

}  // namespace

file_handle& file_handle::operator=(file_handle&& other) noexcept {
  if (this != &other) {
    (void)close();
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

file_handle::~file_handle() {
  (void)close();
}

result<file_handle> file_handle::open(const char* path, open_flags flags, mode_t mode) noexcept {
  return open_impl(AT_FDCWD, path, flags, mode);
}

result<file_handle> file_handle::open_at(const file_handle& dir, const char* name, open_flags flags,
                                         mode_t mode) noexcept {
  if (!dir.is_open()) return errc_error(std::errc::bad_file_descriptor);
  return open_impl(dir.fd(), name, flags, mode);
}

result<file_handle> file_handle::open_directory(const char* path) noexcept {
  if (path == nullptr) return errc_error(std::errc::invalid_argument);
  const int fd = ::open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return last_errno_error();
  return file_handle(fd);
}

result<file_handle> file_handle::temp_file(const char* dir, open_flags flags,
                                           mode_t mode) noexcept {
  if (dir == nullptr || !has(flags, open_flags::write)) {
    return errc_error(std::errc::invalid_argument);
  }
  const int posix = (to_posix_flags(flags) & ~(O_CREAT | O_EXCL | O_TRUNC)) | O_TMPFILE;
  const int fd = ::open(dir, posix, mode);
  if (fd < 0) return last_errno_error();
  return file_handle(fd);
}

int file_handle::release() noexcept {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

result<void> file_handle::close() noexcept {
  if (fd_ < 0) return {};
  const int fd = release();
  // On Linux the descriptor is released even when close(2) fails with EINTR, so that case is
  // not an error the caller could act on; anything else (EIO from NFS, say) is reported.
  if (::close(fd) != 0 && errno != EINTR) return last_errno_error();
  return {};
}

result<std::size_t> file_handle::read_at(off_t offset, std::span<std::byte> buffer) const noexcept {
  if (!valid_range(offset, buffer.size())) return errc_error(std::errc::invalid_argument);
  std::size_t done = 0;
  while (done < buffer.size()) {
    const ssize_t n =
        ::pread(fd_, buffer.data() + done, buffer.size() - done, offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_errno_error();
    }
    if (n == 0) break;  // end of file
    done += static_cast<std::size_t>(n);
  }
  return done;
}

result<void> file_handle::write_at(off_t offset, std::span<const std::byte> data) const noexcept {
  if (!valid_range(offset, data.size())) return errc_error(std::errc::invalid_argument);
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n =
        ::pwrite(fd_, data.data() + done, data.size() - done, offset + static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_errno_error();
    }
    if (n == 0) return errc_error(std::errc::io_error);  // no progress: never spin
    done += static_cast<std::size_t>(n);
  }
  return {};
}

result<std::size_t> file_handle::read_at(off_t offset,
                                         std::span<const iovec> buffers) const noexcept {
  return transfer_vectored<true>(fd_, offset, buffers);
}

result<void> file_handle::write_at(off_t offset, std::span<const iovec> buffers) const noexcept {
  auto r = transfer_vectored<false>(fd_, offset, buffers);
  if (!r) return std::unexpected(r.error());
  return {};
}

result<void> file_handle::sync_data() const noexcept {
  if (::fdatasync(fd_) != 0) return last_errno_error();
  return {};
}

result<void> file_handle::sync_all() const noexcept {
  if (::fsync(fd_) != 0) return last_errno_error();
  return {};
}

result<void> file_handle::truncate(off_t length) const noexcept {
  if (length < 0) return errc_error(std::errc::invalid_argument);
  while (::ftruncate(fd_, length) != 0) {
    if (errno != EINTR) return last_errno_error();
  }
  return {};
}

result<void> file_handle::allocate(off_t offset, off_t length) const noexcept {
  if (offset < 0 || length <= 0 || length > max_offset - offset) {
    return errc_error(std::errc::invalid_argument);
  }
  for (;;) {
    if (::fallocate(fd_, 0, offset, length) == 0) return {};
    if (errno == EINTR) continue;
    if (errno != EOPNOTSUPP) return last_errno_error();
    break;
  }
  // This filesystem cannot reserve blocks directly: glibc writes into every block instead.
  const int e = ::posix_fallocate(fd_, offset, length);
  if (e != 0) return errno_error(e);
  return {};
}

result<off_t> file_handle::size() const noexcept {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) return last_errno_error();
  return st.st_size;
}

result<void> file_handle::link_at(const file_handle& dir, const char* name) const noexcept {
  if (name == nullptr || fd_ < 0) return errc_error(std::errc::invalid_argument);
  const int dirfd = dir.is_open() ? dir.fd() : AT_FDCWD;
  // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH on most kernels; the /proc route does not.
  if (::linkat(fd_, "", dirfd, name, AT_EMPTY_PATH) == 0) return {};
  if (errno != ENOENT && errno != EPERM) return last_errno_error();
  std::array<char, 64> proc{};
  std::snprintf(proc.data(), proc.size(), "/proc/self/fd/%d", fd_);
  if (::linkat(AT_FDCWD, proc.data(), dirfd, name, AT_SYMLINK_FOLLOW) != 0) {
    return last_errno_error();
  }
  return {};
}

result<void> unlink(const char* path) noexcept {
  if (path == nullptr) return errc_error(std::errc::invalid_argument);
  if (::unlink(path) != 0) return last_errno_error();
  return {};
}

result<void> unlink_at(const file_handle& dir, const char* name) noexcept {
  if (name == nullptr) return errc_error(std::errc::invalid_argument);
  if (::unlinkat(dir.is_open() ? dir.fd() : AT_FDCWD, name, 0) != 0) return last_errno_error();
  return {};
}

result<void> sync_directory(const char* path) noexcept {
  auto dir = file_handle::open_directory(path);
  if (!dir) return std::unexpected(dir.error());
  return dir->sync_all();
}

result<void> atomic_replace(const char* path, std::span<const std::byte> content,
                            const replace_options& options) noexcept {
  if (path == nullptr || *path == '\0') return errc_error(std::errc::invalid_argument);
  const auto step = [&](replace_step s) noexcept {
    if (options.hook != nullptr) options.hook(s, options.hook_context);
  };
  // std::string may throw only on allocation failure, which keel treats as fatal, as the
  // standard library does inside noexcept functions.
  const std::string full(path);
  const auto slash = full.rfind('/');
  const std::string dir_path = slash == std::string::npos ? std::string(".")
                               : slash == 0               ? "/"
                                                          : full.substr(0, slash);
  const std::string base = slash == std::string::npos ? full : full.substr(slash + 1);
  if (base.empty()) return errc_error(std::errc::is_a_directory);

  auto dir = file_handle::open_directory(dir_path.c_str());
  if (!dir) return std::unexpected(dir.error());

  const auto temp_name = [&] {
    char suffix[17];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(random_u64()));
    return "." + base + ".keel-tmp." + suffix;
  };

  step(replace_step::create_temp);
  std::string name;  // the temporary's name once it has one
  const int tmp_fd = ::openat(dir->fd(), ".", O_TMPFILE | O_WRONLY | O_CLOEXEC, options.mode);
  file_handle temp(tmp_fd);
  if (tmp_fd < 0) {
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) return last_errno_error();
    // No O_TMPFILE here: create a named temporary with a fresh random name.
    for (int attempt = 0; !temp.is_open(); ++attempt) {
      name = temp_name();
      auto f = file_handle::open_at(*dir, name.c_str(),
                                    open_flags::write | open_flags::create | open_flags::exclusive,
                                    options.mode);
      if (f) {
        temp = std::move(*f);
      } else if (f.error() != std::errc::file_exists || attempt > 16) {
        return std::unexpected(f.error());
      }
    }
  }
  const auto fail = [&](const error& ec) noexcept -> result<void> {
    if (!name.empty()) (void)::unlinkat(dir->fd(), name.c_str(), 0);
    return std::unexpected(ec);
  };

  step(replace_step::write);
  if (auto r = temp.write_at(0, content); !r) return fail(r.error());
  step(replace_step::sync_temp);
  if (auto r = temp.sync_data(); !r) return fail(r.error());
  if (name.empty()) {
    step(replace_step::link_temp);
    for (int attempt = 0; name.empty(); ++attempt) {
      std::string candidate = temp_name();
      auto r = temp.link_at(*dir, candidate.c_str());
      if (r) {
        name = std::move(candidate);
      } else if (r.error() != std::errc::file_exists || attempt > 16) {
        return std::unexpected(r.error());
      }
    }
  }
  step(replace_step::rename);
  if (::renameat(dir->fd(), name.c_str(), dir->fd(), base.c_str()) != 0) {
    const auto e = last_errno_error();
    return fail(e.error());
  }
  step(replace_step::sync_directory);
  return dir->sync_all();
}

}  // namespace keel::io
