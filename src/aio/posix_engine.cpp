// The posix engine: pread/pwrite/fsync on the worker's thread, one request at a time, through
// the seam (io::filesystem): the one engine a fault-injecting filesystem can fail.

#include <sys/types.h>

#include <new>

#include "detail.hpp"
#include "sync_engine.hpp"

namespace keel::aio::detail {
namespace {

class posix_engine final : public sync_engine {
 public:
  posix_engine() noexcept : sync_engine(engine_kind::posix) {}

  // Through the file's handle, so through the controller's filesystem (options::fs): the
  // handle continues short transfers and retries EINTR; its errors name the file.
  result<std::size_t> run(op& o) noexcept override {
    const io::file_handle& h = o.file->handle;
    const auto at = static_cast<off_t>(o.offset);
    switch (o.kind) {
      case op_kind::read: {
        auto n = h.read_at(at, std::span(o.buffer, o.length));
        if (!n) return std::unexpected(n.error());
        o.done = *n;  // fewer only at end of file
        return *n;
      }
      case op_kind::write:
        if (auto w = h.write_at(at, std::span<const std::byte>(o.buffer, o.length)); !w) {
          return std::unexpected(w.error());
        }
        o.done = o.length;
        return o.length;
      case op_kind::fsync:
        if (auto s = h.sync_all(); !s) return std::unexpected(s.error());  // never retried
        return 0;
      case op_kind::fdatasync:
        if (auto s = h.sync_data(); !s) return std::unexpected(s.error());
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
