#include "common.hpp"

#include <sys/stat.h>

#include "keel/io/byte_lock.hpp"

namespace keel::lock::detail {

result<file_id> identify_lock_file(const std::string& path) noexcept {
  auto f = io::file_handle::open(path.c_str(), io::open_flags::read_write | io::open_flags::create);
  if (!f) return std::unexpected(f.error());
  return identify(*f);
}

result<file_id> identify_lock_directory(const std::string& dir) noexcept {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return last_errno_error();
  auto d = io::file_handle::open_directory(dir.c_str());
  if (!d) return std::unexpected(d.error());
  return identify(*d);
}

result<thread_file*> thread_file_of(per_thread_states& threads, const std::string& path) noexcept {
  return threads.get<thread_file>([&]() -> result<std::unique_ptr<thread_file>> {
    auto f =
        io::file_handle::open(path.c_str(), io::open_flags::read_write | io::open_flags::create);
    if (!f) return std::unexpected(f.error());
    auto s = std::make_unique<thread_file>();
    s->file = std::move(*f);
    return s;
  });
}

result<void> unlock_entity_bytes(const io::file_handle& file,
                                 std::span<const entity> set) noexcept {
  result<void> r;
  for (const entity e : set) {
    auto u = io::unlock_extent(file, entity_offset(e), 1);
    if (!u && r) r = u;
  }
  return r;
}

}  // namespace keel::lock::detail
