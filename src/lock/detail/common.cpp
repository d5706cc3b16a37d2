#include "common.hpp"

#include <thread>

#include "keel/io/byte_lock.hpp"

namespace keel::lock::detail {

result<file_id> identify_lock_file(io::filesystem& fs, const std::string& path) noexcept {
  auto f =
      io::file_handle::open(fs, path.c_str(), io::open_flags::read_write | io::open_flags::create);
  if (!f) return std::unexpected(f.error());
  return identify(*f);
}

result<file_id> identify_lock_directory(io::filesystem& fs, const std::string& dir) noexcept {
  if (auto m = fs.make_directory(nullptr, dir.c_str(), 0755);
      !m && m.error() != std::errc::file_exists) {
    return std::unexpected(m.error().about(dir));
  }
  auto d = io::file_handle::open_directory(fs, dir.c_str());
  if (!d) return std::unexpected(d.error());
  return identify(*d);
}

result<thread_file*> thread_file_of(base::per_thread_states& threads, io::filesystem& fs,
                                    const std::string& path) noexcept {
  return threads.get<thread_file>([&]() -> result<std::unique_ptr<thread_file>> {
    auto f = io::file_handle::open(fs, path.c_str(),
                                   io::open_flags::read_write | io::open_flags::create);
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

bool backoff::pause(const io::countdown& cd) noexcept {
  if (cd.is_zero()) return false;
  if (cd.expired()) return false;
  if (spin_) {
    std::this_thread::yield();
    return true;
  }
  // Jitter in [next/2, next) so waiters that collided do not collide again in step.
  const auto base_ns = next_.count();
  const auto jitter =
      static_cast<std::int64_t>(base::thread_rng()() % static_cast<std::uint64_t>(base_ns / 2 + 1));
  auto wait = std::chrono::nanoseconds(base_ns / 2 + jitter);
  wait = std::min<std::chrono::nanoseconds>(wait, cd.remaining());
  std::this_thread::sleep_for(wait);
  next_ = std::min<std::chrono::nanoseconds>(next_ * 2, cap_);
  return true;  // one more attempt after every sleep, even the one that reaches the deadline
}

}  // namespace keel::lock::detail
