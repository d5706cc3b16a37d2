#include "keel/lock/byte_ranges.hpp"

#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"

namespace keel::lock {
struct byte_ranges::impl : detail::lock_file_per_thread {};

byte_ranges::byte_ranges(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

byte_ranges::~byte_ranges() = default;

result<std::unique_ptr<byte_ranges>> byte_ranges::open(const std::string& path,
                                                       io::filesystem& fs) noexcept {
  auto claimed = detail::open_claimed(fs, path, "byte_ranges");
  if (!claimed) return std::unexpected(claimed.error());
  auto id = detail::identify(*claimed);
  if (!id) return std::unexpected(id.error());
  auto p = std::make_unique<impl>();
  p->claimed = std::move(*claimed);
  p->path = path;
  p->id = *id;
  p->fs = &fs;
  return std::unique_ptr<byte_ranges>(new byte_ranges(id->dev, id->ino, std::move(p)));
}

result<std::uint64_t> byte_ranges::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                           bool spin) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  if (auto r = detail::lock_entity_bytes((*state)->file, sorted, cd, spin); !r) {
    return std::unexpected(r.error());
  }
  return 0;
}

result<void> byte_ranges::do_unlock(std::span<const entity> sorted, std::uint64_t) noexcept {
  auto state = impl_->mine();
  if (!state) return std::unexpected(state.error());
  return detail::unlock_entity_bytes((*state)->file, sorted);
}

}  // namespace keel::lock
