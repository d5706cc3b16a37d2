// The io_uring engine: the engine itself, which the controller makes, and the indexes of the
// files in its rings' tables (uring.hpp says how its parts divide the work).

#include "uring.hpp"

#include <new>

namespace keel::aio::detail {
namespace uring {

uring_file::~uring_file() {
  if (slot >= 0) owner.release_slot(*this);
}

void uring_engine::release_slot(uring_file& f) noexcept {
  forget_in_workers(f);
  forget_in_callers(f);
  const base::lock_guard lock(slots_mutex_);
  free_slots_.push_back(f.slot);  // reserved for every slot at start
  f.slot = -1;
}

}  // namespace uring

std::unique_ptr<engine> make_uring_engine(engine_context& c,
                                          std::vector<std::span<std::byte>> buffers) noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) uring::uring_engine(c, std::move(buffers)));
}

}  // namespace keel::aio::detail
