// The stdio engine: <cstdio> (fseeko/fread/fwrite, fflush+fsync), for comparison. Each file
// gets a FILE stream of its own descriptor (a dup), used under the file's mutex.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <new>

#include "base/thread_safety.hpp"
#include "file_state.hpp"
#include "keel/aio/errors.hpp"
#include "sync_engine.hpp"

namespace keel::aio::detail {
namespace {

struct stdio_file final : engine_file {
  base::mutex mutex;
  std::FILE* stream KEEL_PT_GUARDED_BY(mutex) = nullptr;
  ~stdio_file() override {
    if (stream != nullptr) std::fclose(stream);
  }
};

stdio_file& of(file_state& f) noexcept {
  return static_cast<stdio_file&>(*f.engine_data);
}

class stdio_engine final : public sync_engine {
 public:
  explicit stdio_engine(engine_context& c) noexcept : sync_engine(engine_kind::stdio, c) {}

  result<void> accepts(const open_options& how) const noexcept override {
    if (how.direct) return std::unexpected(make_error_code(errc::not_supported_by_engine));
    return {};
  }

  result<void> opened(file_state& f, const open_options& how) noexcept override {
    auto sf = std::unique_ptr<stdio_file>(new (std::nothrow) stdio_file);
    if (!sf) return errc_error(std::errc::not_enough_memory);
    // <cstdio> does its own I/O on a descriptor of its own: it cannot go through a
    // filesystem other than the OS's (the controller refuses stdio with one), so this
    // engine's calls bypass the seam.
    const int dup_fd = ::fcntl(f.handle.fd(), F_DUPFD_CLOEXEC, 0);  // bypasses the seam
    if (dup_fd < 0) return last_errno_error();
    // A FILE of its own (stdio bypasses the seam).
    sf->stream = ::fdopen(dup_fd, how.read && how.write ? "r+" : how.write ? "w" : "r");
    if (sf->stream == nullptr) {
      const int e = errno;
      ::close(dup_fd);  // the dup above, outside the seam
      return errno_error(e);
    }
    // Unbuffered: every request is its own read or write at its own offset, and no bytes
    // wait in the stream. A buffered one kept read-ahead whose end a forked child's exit()
    // gave back to the kernel (glibc seeks every stream's descriptor back to its logical
    // position at exit), moving the offset the parent's next write went to, through the
    // description parent and child share.
    std::setvbuf(sf->stream, nullptr, _IONBF, 0);
    f.engine_data = std::move(sf);
    return {};
  }

  result<void> closing(file_state& f) noexcept override {
    stdio_file& sf = of(f);
    result<void> r;
    if (std::fclose(sf.stream) != 0) r = last_errno_error();
    sf.stream = nullptr;
    return r;
  }

  result<std::size_t> run(op& o) noexcept override {
    stdio_file& sf = of(*o.file);
    if (o.kind == op_kind::task) {
      // A task sees the file as the thread's earlier requests left it: what they wrote
      // through the stdio buffer is flushed first (the task runs without the lock).
      {
        const base::lock_guard lock(sf.mutex);
        if (std::fflush(sf.stream) != 0) return last_errno_error();
      }
      return o.task();
    }
    const base::lock_guard lock(sf.mutex);
    std::FILE* s = sf.stream;
    // A positioning call between reads and writes, as C requires, before every request.
    const auto seek = [&]() -> result<void> {
      if (::fseeko(s, static_cast<off_t>(o.offset), SEEK_SET) != 0) return last_errno_error();
      return {};
    };
    switch (o.kind) {
      case op_kind::read: {
        if (auto r = seek(); !r) {
          // Past the largest offset the filesystem allows, lseek refuses (EINVAL) where a
          // pread finds the end of the file: what the other engines report.
          if (r.error() == std::errc::invalid_argument) return 0;
          return std::unexpected(r.error());
        }
        errno = 0;
        const std::size_t n = std::fread(o.buffer, 1, o.length, s);
        if (n < o.length && std::ferror(s) != 0) {
          const int e = errno != 0 ? errno : EIO;  // fread's errno (EISDIR, EIO, ...)
          std::clearerr(s);
          return errno_error(e);
        }
        std::clearerr(s);  // end of file is not sticky for the next request
        return n;
      }
      case op_kind::write: {
        // Done only once the bytes are in the kernel, as pwrite's are: flushed from the
        // stream's buffer now, so that a refused write fails here, in its own receipt. Left
        // in the buffer, it would be acknowledged, then fail in the next request's flush,
        // which glibc answers by dropping the buffer: a lost write nobody was told about.
        if (auto r = seek(); !r) return std::unexpected(past_the_largest_offset(r.error()));
        if (auto w = put(s, o.buffer, o.length); !w) return std::unexpected(w.error());
        return o.length;
      }
      case op_kind::fsync:
      case op_kind::fdatasync:
        if (std::fflush(s) != 0) return last_errno_error();
        // The stream's descriptor is a dup of the file's: syncing the file through the seam
        // syncs what the stream wrote.
        if (auto r =
                o.kind == op_kind::fsync ? o.file->handle.sync_all() : o.file->handle.sync_data();
            !r) {
          return std::unexpected(r.error());
        }
        return 0;
      case op_kind::task:
        break;
    }
    return errc_error(std::errc::invalid_argument);
  }

  // Through the stream, so that its reads see the bytes and its buffer never holds older
  // ones.
  result<void> write_out(file_state& f, std::uint64_t offset,
                         std::span<const iovec> data) noexcept override {
    stdio_file& sf = of(f);
    const base::lock_guard lock(sf.mutex);
    if (::fseeko(sf.stream, static_cast<off_t>(offset), SEEK_SET) != 0) {
      return std::unexpected(past_the_largest_offset(last_errno_error().error()));
    }
    for (const iovec& v : data) {
      if (auto w = put(sf.stream, static_cast<const std::byte*>(v.iov_base), v.iov_len); !w) {
        return w;
      }
    }
    return {};
  }

 private:
  // lseek refuses an offset past the largest the filesystem allows with EINVAL, where the
  // write there gets EFBIG (the posix engine's, io_uring's): the write's errno. (Offsets
  // past what an off_t holds never get here: refused as bad_request.)
  static error past_the_largest_offset(const error& e) noexcept {
    if (e == std::errc::invalid_argument) return std::error_code(EFBIG, std::system_category());
    return e;
  }

  // Writes `n` bytes at the stream's position and flushes them to the kernel: the write's
  // own errno when it fails (EFBIG, ENOSPC, ...). The buffer is empty afterwards either way.
  static result<void> put(std::FILE* s, const std::byte* p, std::size_t n) noexcept {
    errno = 0;
    if (std::fwrite(p, 1, n, s) != n || std::fflush(s) != 0) {
      const int e = errno != 0 ? errno : EIO;
      std::clearerr(s);
      return errno_error(e);
    }
    return {};
  }
};

}  // namespace

std::unique_ptr<engine> make_stdio_engine(engine_context& c) noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) stdio_engine(c));
}

}  // namespace keel::aio::detail
