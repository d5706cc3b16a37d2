#include "common.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <numeric>
#include <thread>
#include <vector>

#include "keel/io/byte_lock.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::lock::detail {

std::atomic<test_hook_fn> test_hook{nullptr};

result<void> check_same_file(const io::file_handle& f, file_id id,
                             const std::string& path) noexcept {
  auto got = identify(f);
  if (!got) return std::unexpected(got.error());
  if (got->dev == id.dev && got->ino == id.ino) return {};
  return std::unexpected(error(std::error_code(ESTALE, std::generic_category())).about(path));
}

result<io::file_handle> reopen(io::filesystem& fs, const std::string& path, io::open_flags flags,
                               file_id id) noexcept {
  // Never blocking on (or letting through) a FIFO someone put at the name meanwhile.
  auto f = open_lock_file(fs, nullptr, path.c_str(), path,
                          flags | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) {
    if (f.error() == std::errc::no_such_file_or_directory) {
      return std::unexpected(error(std::error_code(ESTALE, std::generic_category())).about(path));
    }
    return std::unexpected(f.error());
  }
  if (auto same = check_same_file(*f, id, path); !same) return std::unexpected(same.error());
  return f;
}

namespace {

struct family {
  std::string_view algorithm;
  off_t byte;
  std::string_view named;  // as the error names it
};
constexpr std::array<family, 7> families = {{
    {"lock_files", algorithm_bytes + 0, "lock_files"},
    {"byte_ranges", algorithm_bytes + 1, "byte_ranges or fcntl"},
    {"fcntl", algorithm_bytes + 1, "byte_ranges or fcntl"},
    {"atomic_append", algorithm_bytes + 2, "atomic_append"},
    {"memory_map", algorithm_bytes + 3, "memory_map"},
    {"flock", algorithm_bytes + 4, "flock"},
    {"sysv", algorithm_bytes + 5, "sysv"},
}};

}  // namespace

result<void> claim(const io::file_handle& f, std::string_view algorithm,
                   const std::string& path) noexcept {
  const auto mine = std::ranges::find(families, algorithm, &family::algorithm);
  if (mine == families.end()) return errc_error(std::errc::invalid_argument);
  // Ours first, then the others looked at: of two openers of different families at once,
  // the second to look sees the first (the kernel orders lock requests on one file).
  auto held = io::try_lock_extent(f, mine->byte, 1, io::lock_kind::shared);
  if (!held) return std::unexpected(held.error().about(path));
  held->release();  // held while `f` stays open
  for (const family& other : families) {
    if (other.byte == mine->byte) continue;
    auto free = io::extent_is_free(f, other.byte, 1, io::lock_kind::exclusive);
    if (free && *free) continue;
    (void)io::unlock_extent(f, mine->byte, 1);
    if (!free) return std::unexpected(free.error().about(path));
    return std::unexpected(error(make_error_code(errc::used_by_another_algorithm),
                                 path + " (" + std::string(algorithm) + " asked; " +
                                     std::string(other.named) + " has it open)"));
  }
  return {};
}

namespace {

bool is_special(std::uint32_t mode) noexcept {
  return S_ISFIFO(mode) || S_ISSOCK(mode) || S_ISCHR(mode) || S_ISBLK(mode);
}

}  // namespace

result<io::file_handle> open_lock_file(io::filesystem& fs, const io::file_handle* dir,
                                       const char* name, const std::string& about,
                                       io::open_flags flags) noexcept {
  const auto not_ours = [&] {
    return std::unexpected(error(make_error_code(errc::not_keel_file)).about(about));
  };
  // Looked at before the open, which a FIFO would notice; and after, in case one was put
  // there between the two (then at least it is not used).
  if (auto st = fs.stat_at(dir, name, false); st && is_special(st->mode)) return not_ours();
  auto f = dir != nullptr ? io::file_handle::open_at(*dir, name, flags)
                          : io::file_handle::open(fs, name, flags);
  if (!f) return std::unexpected(f.error());
  auto st = f->status();
  if (!st) return std::unexpected(st.error());
  if (is_special(st->mode)) return not_ours();
  return f;
}

result<io::file_handle> open_claimed(io::filesystem& fs, const std::string& path,
                                     std::string_view algorithm) noexcept {
  auto f = open_lock_file(fs, nullptr, path.c_str(), path);
  if (!f) return std::unexpected(f.error());
  if (auto c = claim(*f, algorithm, path); !c) return std::unexpected(c.error());
  return f;
}

result<io::file_handle> claim_directory(const io::file_handle& d, const std::string& dir,
                                        std::string_view algorithm) noexcept {
  // Read-only: a shared lock and a look need no more, and users other than the one who made
  // the file (mode 0644) must be able to open it.
  auto f = open_lock_file(d.fs(), &d, ".keel-algorithm", dir + "/.keel-algorithm",
                          io::open_flags::read | io::open_flags::create |
                              io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!f) return std::unexpected(f.error());
  if (auto c = claim(*f, algorithm, dir); !c) return std::unexpected(c.error());
  return f;
}

result<file_id> identify_lock_file(io::filesystem& fs, const std::string& path) noexcept {
  auto f = open_lock_file(fs, nullptr, path.c_str(), path);
  if (!f) return std::unexpected(f.error());
  return identify(*f);
}

result<void> refuse_unless_local(io::filesystem& fs, const std::string& path,
                                 std::string_view algorithm) noexcept {
  auto where = io::stat_fs_of_path_or_parent(fs, path);
  if (!where) return std::unexpected(where.error());
  if (where->is_local) return {};
  return std::unexpected(
      error(make_error_code(errc::needs_local_filesystem),
            path + " (" + std::string(algorithm) + " on " + std::string(where->type_name()) + ")"));
}

result<io::file_handle> open_lock_directory(io::filesystem& fs, const std::string& dir) noexcept {
  auto d = fs.open(nullptr, dir.c_str(),
                   io::open_flags::read | io::open_flags::directory | io::open_flags::no_follow, 0);
  if (!d) return std::unexpected(d.error().about(dir));
  auto st = d->status();
  if (!st) return std::unexpected(st.error());
  if (st->owner != ::geteuid() && st->owner != 0) {
    return std::unexpected(
        error(std::make_error_code(std::errc::operation_not_permitted)).about(dir));
  }
  return d;
}

result<file_id> identify_lock_directory(io::filesystem& fs, const std::string& dir) noexcept {
  for (int attempt = 0;; ++attempt) {
    auto m = fs.make_directory(nullptr, dir.c_str(), 0755);
    if (!m && m.error() != std::errc::file_exists) return std::unexpected(m.error().about(dir));
    auto d = open_lock_directory(fs, dir);
    // mkdir found the directory and the open did not: a network filesystem's client that
    // still remembers the name as absent (seen once on GlusterFS). Both again, a few times.
    if (!d && !m && d.error() == std::errc::no_such_file_or_directory && attempt < 8) continue;
    if (!d) return std::unexpected(d.error());
    return identify(*d);
  }
}

result<thread_file*> thread_file_of(base::per_thread_states& threads, io::filesystem& fs,
                                    const std::string& path, file_id id) noexcept {
  return threads.get<thread_file>([&]() -> result<std::unique_ptr<thread_file>> {
    auto f = reopen(fs, path, io::open_flags::read_write, id);
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

result<void> lock_entity_bytes(const io::file_handle& f, std::span<const entity> sorted,
                               const io::countdown& cd, bool spin) noexcept {
  std::vector<std::uint32_t> order(sorted.size());
  std::iota(order.begin(), order.end(), 0u);
  std::size_t taken = 0;
  const auto release_taken = [&] {
    for (std::size_t k = 0; k < taken; ++k) {
      (void)io::unlock_extent(f, entity_offset(sorted[order[k]]), 1);
    }
    taken = 0;
  };
  backoff pause(spin);
  for (;;) {
    std::size_t contended = sorted.size();
    for (std::size_t k = 0; k < sorted.size(); ++k) {
      const entity e = sorted[order[k]];
      // Only the first entity is waited for: nothing else is held then, so no waiter ever
      // holds one entity while sleeping on another (no deadlock, whatever the orders).
      const io::deadline d = k == 0 && !spin ? rest_of(cd) : io::deadline::zero();
      auto g =
          io::lock_extent(f, entity_offset(e), 1,
                          e.is_exclusive() ? io::lock_kind::exclusive : io::lock_kind::shared, d);
      if (g) {
        g->release();  // held until do_unlock; the guard would unlock it now
        ++taken;
        continue;
      }
      release_taken();
      if (!is_contention(g.error())) return std::unexpected(g.error());
      contended = k;
      break;
    }
    if (contended == sorted.size()) return {};
    if (cd.is_zero()) return contention_error(cd);
    if (cd.expired()) return errc_error(std::errc::timed_out);
    contended_first(order, contended);
    if (spin || contended != 0) {
      if (!pause.pause(cd)) return contention_error(cd);
    }
  }
}

}  // namespace keel::lock::detail
