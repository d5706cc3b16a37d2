#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/lock/baselines.hpp"

namespace keel::lock {

struct fcntl_ofd::impl : detail::lock_file_per_thread {};

fcntl_ofd::fcntl_ofd(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

fcntl_ofd::~fcntl_ofd() = default;

result<std::unique_ptr<fcntl_ofd>> fcntl_ofd::open(const std::string& path,
                                                   io::filesystem& fs) noexcept {
  auto claimed = detail::open_claimed(fs, path, "fcntl");
  if (!claimed) return std::unexpected(claimed.error());
  auto id = detail::identify(*claimed);
  if (!id) return std::unexpected(id.error());
  auto p = std::make_unique<impl>();
  p->claimed = std::move(*claimed);
  p->path = path;
  p->id = *id;
  p->fs = &fs;
  return std::unique_ptr<fcntl_ofd>(new fcntl_ofd(id->dev, id->ino, std::move(p)));
}

result<std::uint64_t> fcntl_ofd::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                         bool) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  const io::file_handle& f = (*state)->file;
  for (std::size_t k = 0; k < sorted.size(); ++k) {
    const entity e = sorted[k];
    auto g = io::lock_extent(f, detail::entity_offset(e), 1,
                             e.is_exclusive() ? io::lock_kind::exclusive : io::lock_kind::shared,
                             detail::rest_of(cd));
    if (g) {
      g->release();
      continue;
    }
    (void)detail::unlock_entity_bytes(f, sorted.first(k));
    return std::unexpected(g.error());
  }
  return 0;
}

result<void> fcntl_ofd::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  return detail::unlock_entity_bytes((*state)->file, sorted);
}

}  // namespace keel::lock
