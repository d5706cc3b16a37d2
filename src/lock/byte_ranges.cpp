#include "keel/lock/byte_ranges.hpp"

#include <numeric>
#include <vector>

#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"

namespace keel::lock {
struct byte_ranges::impl : detail::lock_file_per_thread {};

byte_ranges::byte_ranges(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

byte_ranges::~byte_ranges() = default;

result<std::unique_ptr<byte_ranges>> byte_ranges::open(const std::string& path,
                                                       io::filesystem& fs) noexcept {
  auto id = detail::identify_lock_file(fs, path);
  if (!id) return std::unexpected(id.error());
  auto p = std::make_unique<impl>();
  p->path = path;
  p->fs = &fs;
  return std::unique_ptr<byte_ranges>(new byte_ranges(id->dev, id->ino, std::move(p)));
}

result<std::uint64_t> byte_ranges::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                           bool spin) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  const io::file_handle& f = (*state)->file;

  std::vector<std::uint32_t> order(sorted.size());
  std::iota(order.begin(), order.end(), 0u);
  std::size_t taken = 0;
  const auto release_taken = [&] {
    for (std::size_t k = 0; k < taken; ++k) {
      (void)io::unlock_extent(f, detail::entity_offset(sorted[order[k]]), 1);
    }
    taken = 0;
  };
  detail::backoff pause(spin);
  for (;;) {
    std::size_t contended = sorted.size();
    for (std::size_t k = 0; k < sorted.size(); ++k) {
      const entity e = sorted[order[k]];
      // Only the first entity is waited for: nothing else is held then, so no waiter ever
      // holds one entity while sleeping on another (no deadlock, whatever the orders).
      const io::deadline d = k == 0 && !spin ? detail::rest_of(cd) : io::deadline::zero();
      auto g =
          io::lock_extent(f, detail::entity_offset(e), 1,
                          e.is_exclusive() ? io::lock_kind::exclusive : io::lock_kind::shared, d);
      if (g) {
        g->release();  // held until do_unlock; the guard would unlock it now
        ++taken;
        continue;
      }
      release_taken();
      if (!detail::is_contention(g.error())) return std::unexpected(g.error());
      contended = k;
      break;
    }
    if (contended == sorted.size()) return 0;
    if (cd.is_zero()) return detail::contention_error(cd);
    if (cd.expired()) return errc_error(std::errc::timed_out);
    detail::contended_first(order, contended);
    if (spin || contended != 0) {
      if (!pause.pause(cd)) return detail::contention_error(cd);
    }
  }
}

result<void> byte_ranges::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  return detail::unlock_entity_bytes((*state)->file, sorted);
}

}  // namespace keel::lock
