#include "keel/io/file_handle.hpp"

#include <fcntl.h>
#include <sys/random.h>
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

// A transfer of `size` bytes at `offset` must stay within the largest file offset.
bool valid_range(off_t offset, std::size_t size) noexcept {
  return offset >= 0 && size <= static_cast<std::size_t>(max_offset - offset);
}

// The error of an operation on `f` at `offset`, naming the file.
std::unexpected<error> about(const file_handle& f, const error& e,
                             std::uint64_t offset = error::no_offset) noexcept {
  return std::unexpected(e.about(f.shared_path(), offset));
}

// One call of the seam at `at`, repeated while interrupted: the bytes it moved (0 only at
// end of file), or the error, naming the file. A write that moves nothing is an error: a
// loop that retried it would spin.
template <bool is_read>
result<std::size_t> step(const file_handle& f, off_t at, std::span<const iovec> iov) noexcept {
  filesystem& fs = f.fs();
  for (;;) {
    const auto n = is_read ? fs.read(f, at, iov) : fs.write(f, at, iov);
    if (n && (*n != 0 || is_read)) return n;
    if (!n && n.error() == std::errc::interrupted) continue;
    const error e = n ? error(std::make_error_code(std::errc::io_error)) : n.error();
    return about(f, e, static_cast<std::uint64_t>(at));
  }
}

// One buffer, continuing short transfers: the common case, kept free of the vectored
// bookkeeping below.
template <bool is_read>
result<std::size_t> transfer_one(const file_handle& f, off_t offset, std::byte* data,
                                 std::size_t size) noexcept {
  if (!valid_range(offset, size)) return errc_error(std::errc::invalid_argument);
  if (!f.is_open()) return errc_error(std::errc::bad_file_descriptor);
  std::size_t done = 0;
  while (done < size) {
    const iovec rest{data + done, size - done};
    const auto n = step<is_read>(f, offset + static_cast<off_t>(done), std::span(&rest, 1));
    if (!n) return n;
    if (*n == 0) break;  // end of file
    done += *n;
  }
  return done;
}

// Vectored transfer through the seam with a moving window over the caller's (unmodified)
// iovec array, so short transfers resume mid-buffer.
template <bool is_read>
result<std::size_t> transfer(const file_handle& f, off_t offset,
                             std::span<const iovec> buffers) noexcept {
  if (buffers.size() == 1) {
    return transfer_one<is_read>(f, offset, static_cast<std::byte*>(buffers[0].iov_base),
                                 buffers[0].iov_len);
  }
  std::size_t total = 0;
  for (const iovec& b : buffers) {
    if (b.iov_len > std::numeric_limits<std::size_t>::max() - total) {
      return errc_error(std::errc::invalid_argument);
    }
    total += b.iov_len;
  }
  if (!valid_range(offset, total)) return errc_error(std::errc::invalid_argument);
  if (!f.is_open()) return errc_error(std::errc::bad_file_descriptor);

  constexpr std::size_t window_size = 64;
  std::array<iovec, window_size> window;  // only the first `count` are set and read
  std::size_t index = 0;                  // first buffer not yet complete
  std::size_t skip = 0;                   // bytes of buffers[index] already transferred
  std::size_t done = 0;
  while (done < total) {
    std::size_t count = 0;
    for (std::size_t j = index; j < buffers.size() && count < window_size; ++j) {
      const std::size_t already = j == index ? skip : 0;
      if (buffers[j].iov_len == already) continue;
      window[count++] = {static_cast<char*>(buffers[j].iov_base) + already,
                         buffers[j].iov_len - already};
    }
    const auto n =
        step<is_read>(f, offset + static_cast<off_t>(done), std::span(window.data(), count));
    if (!n) return n;
    if (*n == 0) break;  // end of file
    done += *n;
    auto left = *n;
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

// Whether an O_TMPFILE failure means "this filesystem cannot" (then a named temporary will
// do) rather than a real error.
bool no_tmpfile_here(const error& e) noexcept {
  return e == std::errc::operation_not_supported || e == std::errc::is_a_directory ||
         e == std::errc::invalid_argument;
}

}  // namespace

file_handle& file_handle::operator=(file_handle&& other) noexcept {
  if (this != &other) {
    (void)close();
    fd_ = other.fd_;
    fs_ = other.fs_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

file_handle::~file_handle() {
  (void)close();
}

result<file_handle> file_handle::open(const char* path, open_flags flags, mode_t mode) noexcept {
  return os().open(nullptr, path, flags, mode);
}

result<file_handle> file_handle::open(filesystem& fs, const char* path, open_flags flags,
                                      mode_t mode) noexcept {
  return fs.open(nullptr, path, flags, mode);
}

result<file_handle> file_handle::open_at(const file_handle& dir, const char* name, open_flags flags,
                                         mode_t mode) noexcept {
  if (!dir.is_open()) return errc_error(std::errc::bad_file_descriptor);
  return dir.fs().open(&dir, name, flags, mode);
}

result<file_handle> file_handle::open_directory(const char* path) noexcept {
  return open_directory(os(), path);
}

result<file_handle> file_handle::open_directory(filesystem& fs, const char* path) noexcept {
  return fs.open(nullptr, path, open_flags::read | open_flags::directory, 0);
}

result<file_handle> file_handle::temp_file(const char* dir, open_flags flags,
                                           mode_t mode) noexcept {
  if (dir == nullptr || !has(flags, open_flags::write)) {
    return errc_error(std::errc::invalid_argument);
  }
  return os().open(nullptr, dir, flags | open_flags::temporary, mode);
}

int file_handle::release() noexcept {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

result<void> file_handle::close() noexcept {
  if (fd_ < 0) return {};
  auto r = fs().close(*this);
  fd_ = -1;  // gone either way
  if (!r) return about(*this, r.error());
  return {};
}

result<std::size_t> file_handle::read_at(off_t offset, std::span<std::byte> buffer) const noexcept {
  return transfer_one<true>(*this, offset, buffer.data(), buffer.size());
}

result<void> file_handle::write_at(off_t offset, std::span<const std::byte> data) const noexcept {
  // The seam only reads from a write's buffers.
  auto r = transfer_one<false>(*this, offset, const_cast<std::byte*>(data.data()), data.size());
  if (!r) return std::unexpected(r.error());
  return {};
}

result<std::size_t> file_handle::read_at(off_t offset,
                                         std::span<const iovec> buffers) const noexcept {
  return transfer<true>(*this, offset, buffers);
}

result<void> file_handle::write_at(off_t offset, std::span<const iovec> buffers) const noexcept {
  auto r = transfer<false>(*this, offset, buffers);
  if (!r) return std::unexpected(r.error());
  return {};
}

result<appended> file_handle::append(std::span<const std::byte> data) const noexcept {
  if (!is_open()) return errc_error(std::errc::bad_file_descriptor);
  const iovec one{const_cast<std::byte*>(data.data()), data.size()};
  for (;;) {
    auto r = fs().append(*this, std::span(&one, 1));
    if (r) return r;
    if (r.error() != std::errc::interrupted) return about(*this, r.error());
  }
}

result<void> file_handle::sync_data() const noexcept {
  if (auto r = fs().sync(*this, sync_kind::data); !r) return about(*this, r.error());
  return {};
}

result<void> file_handle::sync_all() const noexcept {
  if (auto r = fs().sync(*this, sync_kind::all); !r) return about(*this, r.error());
  return {};
}

result<void> file_handle::sync_filesystem() const noexcept {
  if (auto r = fs().sync(*this, sync_kind::filesystem); !r) return about(*this, r.error());
  return {};
}

result<void> file_handle::truncate(off_t length) const noexcept {
  if (length < 0) return errc_error(std::errc::invalid_argument);
  for (;;) {
    auto r = fs().truncate(*this, length);
    if (r) return {};
    if (r.error() != std::errc::interrupted) return about(*this, r.error());
  }
}

result<void> file_handle::allocate(off_t offset, off_t length) const noexcept {
  if (offset < 0 || length <= 0 || length > max_offset - offset) {
    return errc_error(std::errc::invalid_argument);
  }
  for (;;) {
    auto r = fs().allocate(*this, offset, length, false);
    if (r) return {};
    if (r.error() == std::errc::interrupted) continue;
    if (r.error() != std::errc::operation_not_supported) {
      return about(*this, r.error(), static_cast<std::uint64_t>(offset));
    }
    break;
  }
  // This filesystem cannot reserve blocks directly: write a zero into every block of the
  // range that reads as zero (so data already there is kept), as glibc's posix_fallocate
  // does, then the size.
  auto st = status();
  if (!st) return std::unexpected(st.error());
  const off_t block = 4096;
  const auto size = static_cast<off_t>(st->size);
  const std::byte zero{0};
  // The last byte of every block of the range, so the file ends up at offset + length.
  const off_t end = offset + length;
  for (off_t at = offset - offset % block; at < end; at += block) {
    const off_t where = std::min(at + block, end) - 1;
    if (where < size) {
      std::byte b{1};
      auto n = read_at(where, std::span(&b, 1));
      if (!n) return std::unexpected(n.error());
      if (*n == 1 && b != zero) continue;
    }
    if (auto w = write_at(where, std::span(&zero, 1)); !w) return w;
  }
  return {};
}

result<void> file_handle::drop_cached(off_t offset, off_t length) const noexcept {
  if (offset < 0 || length < 0) return errc_error(std::errc::invalid_argument);
  return fs().drop_cached(*this, offset, length);
}

result<void> file_handle::punch_hole(off_t offset, off_t length) const noexcept {
  if (offset < 0 || length <= 0 || length > max_offset - offset) {
    return errc_error(std::errc::invalid_argument);
  }
  for (;;) {
    auto r = fs().punch_hole(*this, offset, length);
    if (r) return {};
    if (r.error() != std::errc::interrupted) {
      return about(*this, r.error(), static_cast<std::uint64_t>(offset));
    }
  }
}

result<off_t> file_handle::size() const noexcept {
  auto st = status();
  if (!st) return std::unexpected(st.error());
  return static_cast<off_t>(st->size);
}

result<file_status> file_handle::status() const noexcept {
  if (!is_open()) return errc_error(std::errc::bad_file_descriptor);
  auto st = fs().stat(*this);
  if (!st) return about(*this, st.error());
  return st;
}

result<void> file_handle::link_at(const file_handle& dir, const char* name) const noexcept {
  if (name == nullptr || fd_ < 0) return errc_error(std::errc::invalid_argument);
  return fs().link(*this, dir.is_open() ? &dir : nullptr, name);
}

result<void> unlink(const char* path) noexcept {
  return os().unlink(nullptr, path, false);
}

result<void> unlink(filesystem& fs, const char* path) noexcept {
  return fs.unlink(nullptr, path, false);
}

result<void> unlink_at(const file_handle& dir, const char* name) noexcept {
  return dir.fs().unlink(dir.is_open() ? &dir : nullptr, name, false);
}

result<void> sync_directory(const char* path) noexcept {
  return sync_directory(os(), path);
}

result<void> sync_directory(filesystem& fs, const char* path) noexcept {
  auto dir = file_handle::open_directory(fs, path);
  if (!dir) return std::unexpected(dir.error());
  return dir->sync_all();
}

result<void> temp_file::link_as(const file_handle& dir, const char* to) const noexcept {
  if (name.empty()) return file.link_at(dir, to);
  return dir.fs().link_at(&dir, name.c_str(), &dir, to);
}

result<void> temp_file::remove_name(const file_handle& dir) noexcept {
  if (name.empty()) return {};
  auto r = unlink_at(dir, name.c_str());
  name.clear();
  return r;
}

result<temp_file> make_temp_file(const file_handle& dir, std::string_view prefix, open_flags flags,
                                 mode_t mode) noexcept {
  if (!has(flags, open_flags::write)) return errc_error(std::errc::invalid_argument);
  filesystem& fs = dir.fs();
  temp_file t;
  auto anon = fs.open(&dir, ".", flags | open_flags::temporary, mode);
  if (anon) {
    t.file = std::move(*anon);
    return t;
  }
  if (!no_tmpfile_here(anon.error())) return std::unexpected(anon.error());
  // No O_TMPFILE here: a named temporary with a fresh random name.
  for (int attempt = 0;; ++attempt) {
    char suffix[17];
    std::snprintf(suffix, sizeof suffix, "%016llx", static_cast<unsigned long long>(random_u64()));
    // Allocation failure is fatal, as in the standard library's noexcept functions.
    std::string name = std::string(prefix) + suffix;
    auto f =
        fs.open(&dir, name.c_str(),
                flags | open_flags::create | open_flags::exclusive | open_flags::no_follow, mode);
    if (f) {
      t.file = std::move(*f);
      t.name = std::move(name);
      return t;
    }
    if (f.error() != std::errc::file_exists || attempt > 16) return std::unexpected(f.error());
  }
}

result<void> atomic_replace(const char* path, std::span<const std::byte> content,
                            const replace_options& options) noexcept {
  if (path == nullptr || *path == '\0') return errc_error(std::errc::invalid_argument);
  filesystem& fs = options.fs != nullptr ? *options.fs : os();
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

  auto dir = file_handle::open_directory(fs, dir_path.c_str());
  if (!dir) return std::unexpected(dir.error());
  const std::string prefix = "." + base + ".keel-tmp.";

  step(replace_step::create_temp);
  auto temp = make_temp_file(*dir, prefix, open_flags::write, options.mode);
  if (!temp) return std::unexpected(temp.error());
  const auto fail = [&](const error& ec) noexcept -> result<void> {
    (void)temp->remove_name(*dir);
    return std::unexpected(ec);
  };

  step(replace_step::write);
  if (auto r = temp->file.write_at(0, content); !r) return fail(r.error());
  step(replace_step::sync_temp);
  if (auto r = temp->file.sync_data(); !r) return fail(r.error());
  if (temp->name.empty()) {
    // An anonymous file gets a temporary name first: rename, unlike link, replaces.
    step(replace_step::link_temp);
    for (int attempt = 0; temp->name.empty(); ++attempt) {
      char suffix[17];
      std::snprintf(suffix, sizeof suffix, "%016llx",
                    static_cast<unsigned long long>(random_u64()));
      std::string candidate = prefix + suffix;
      auto r = temp->file.link_at(*dir, candidate.c_str());
      if (r) {
        temp->name = std::move(candidate);
      } else if (r.error() != std::errc::file_exists || attempt > 16) {
        return std::unexpected(r.error());
      }
    }
  }
  step(replace_step::rename);
  if (auto r = fs.rename(&*dir, temp->name.c_str(), &*dir, base.c_str(), rename_mode::replace);
      !r) {
    return fail(r.error());
  }
  temp->name.clear();
  step(replace_step::sync_directory);
  return dir->sync_all();
}

}  // namespace keel::io
