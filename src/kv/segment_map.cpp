// The process's map of segments: see segment_map.hpp.

#include "kv/segment_map.hpp"

namespace keel::kv {

void segment_map::forget(std::uint64_t number) noexcept {
  const base::lock_guard g(mutex_);
  auto* chunk = chunks_[chunk_of(number)].load();
  if (chunk == nullptr) return;
  auto& cell = chunk[cell_of(number)];
  segment* s = cell.load();
  if (s == nullptr) return;
  cell.store(nullptr, std::memory_order_release);
  (void)s->map.unmap();  // the object stays (see forget_removed)
}

}  // namespace keel::kv
