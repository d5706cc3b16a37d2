// The posix engine: pread/pwrite/fsync on the worker's thread, one request at a time.

#include <unistd.h>

#include <new>

#include "detail.hpp"
#include "sync_engine.hpp"

namespace keel::aio::detail {
namespace {

class posix_engine final : public sync_engine {
 public:
  posix_engine() noexcept : sync_engine(engine_kind::posix) {}

  result<std::size_t> run(op& o) noexcept override {
    const int fd = o.file->fd;
    switch (o.kind) {
      case op_kind::read:
        while (o.done < o.length) {
          const ssize_t n = ::pread(fd, o.buffer + o.done, o.length - o.done,
                                    static_cast<off_t>(o.offset + o.done));
          if (n < 0) {
            if (errno == EINTR) continue;
            return last_errno_error();
          }
          if (n == 0) break;  // end of file
          o.done += static_cast<std::size_t>(n);
        }
        return o.done;
      case op_kind::write:
        while (o.done < o.length) {
          const ssize_t n = ::pwrite(fd, o.buffer + o.done, o.length - o.done,
                                     static_cast<off_t>(o.offset + o.done));
          if (n < 0) {
            if (errno == EINTR) continue;
            return last_errno_error();
          }
          if (n == 0) return errc_error(std::errc::io_error);  // no progress: never spin
          o.done += static_cast<std::size_t>(n);
        }
        return o.done;
      case op_kind::fsync:
        if (::fsync(fd) != 0) return last_errno_error();  // never retried: the error is the news
        return 0;
      case op_kind::fdatasync:
        if (::fdatasync(fd) != 0) return last_errno_error();
        return 0;
      case op_kind::task:
        return o.task();
    }
    return errc_error(std::errc::invalid_argument);
  }
};

}  // namespace

std::unique_ptr<engine> make_posix_engine() noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) posix_engine);
}

}  // namespace keel::aio::detail
