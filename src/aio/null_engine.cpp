// The null engine: completes every request at once without I/O, to measure the framework's
// own cost. Tasks still run.

#include <new>

#include "file_state.hpp"
#include "sync_engine.hpp"

namespace keel::aio::detail {
namespace {

class null_engine final : public sync_engine {
 public:
  explicit null_engine(engine_context& c) noexcept : sync_engine(engine_kind::null, c) {}

  result<std::size_t> run(op& o) noexcept override {
    switch (o.kind) {
      case op_kind::task:
        return o.task();
      case op_kind::read:
      case op_kind::write:
        return o.length;
      case op_kind::fsync:
      case op_kind::fdatasync:
        break;
    }
    return 0;
  }

  result<void> write_out(file_state& f, std::uint64_t offset,
                         std::span<const iovec> data) noexcept override {
    (void)f;
    (void)offset;
    (void)data;
    return {};
  }
};

}  // namespace

std::unique_ptr<engine> make_null_engine(engine_context& c) noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) null_engine(c));
}

}  // namespace keel::aio::detail
