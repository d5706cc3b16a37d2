#include "keel/lock/memory_map.hpp"

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "detail/common.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/io/mapped_file.hpp"
#include "keel/lock/byte_ranges.hpp"

namespace keel::lock {
namespace {

// ---- On-disk and in-memory layouts (doc/lock-formats.md) ----

// The lock file: one page of header, and three marker bytes far beyond it.
constexpr char lockfile_magic[8] = {'K', 'E', 'E', 'L', 'M', 'M', 'L', '1'};
constexpr std::uint32_t format_version = 1;
constexpr std::size_t lockfile_page = 4096;
constexpr std::size_t lockfile_degraded_at = 16;  // u64, non-zero: use the fallback
constexpr off_t marker_base = off_t{1} << 20;
constexpr off_t in_use_byte = marker_base + 0;      // shared by every open instance
constexpr off_t map_in_use_byte = marker_base + 1;  // shared by every instance on the map
constexpr off_t init_byte = marker_base + 2;        // exclusive while opening or closing

struct lockfile_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t reserved;
  std::uint64_t degraded;
  std::uint8_t boot_id[16];
  char map_path[216];
};
static_assert(sizeof(lockfile_header) == 256);
static_assert(offsetof(lockfile_header, degraded) == lockfile_degraded_at);

// The map file: header page, user table, slot table; user liveness bytes far beyond.
constexpr char map_magic[8] = {'K', 'E', 'E', 'L', 'M', 'M', 'T', '1'};
constexpr std::size_t map_header_size = 4096;
constexpr std::size_t map_degraded_at = 64;  // u64 mirror of the lock file's flag
constexpr std::size_t user_size = 64;
constexpr std::size_t users_at = map_header_size;
constexpr std::size_t slot_size = 192;  // writer word, padding, 1024-bit reader set
constexpr std::size_t reader_words = memory_map::max_users / 64;
constexpr std::size_t slots_at = users_at + memory_map::max_users * user_size;
constexpr std::size_t map_size = slots_at + memory_map::slots * slot_size;
constexpr off_t liveness_base = off_t{1} << 40;

struct map_header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t slots;
  std::uint32_t max_users;
  std::uint32_t slot_size;
};

struct user_entry {
  std::uint32_t pid;
  std::uint32_t tid;
  std::uint64_t start_time;
};

// A slot is free when its writer word is 0 and no reader bit is set. A writer stores its
// user index + 1 (compare-and-swap from 0), then checks the reader set; a reader sets its
// bit, then checks the writer word. Each side publishes before it looks (seq_cst), so at
// least one of two racing lockers sees the other and backs off: never both inside.
struct slot_ref {
  std::uint64_t* base;
  [[nodiscard]] std::atomic_ref<std::uint64_t> writer() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[0]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> readers(std::size_t word) const noexcept {
    return std::atomic_ref<std::uint64_t>(base[8 + word]);
  }
};

std::size_t slot_of(std::uint64_t value) noexcept {
  static_assert((memory_map::slots & (memory_map::slots - 1)) == 0);
  return static_cast<std::size_t>((value * 0x9e3779b97f4a7c15ULL) >> 52) & (memory_map::slots - 1);
}

struct slot_request {
  std::uint32_t slot;
  bool exclusive;
};

// The slots a set needs, each once (exclusive wins where two entities share one). Uses
// `small` when it fits, else `big`.
std::span<slot_request> collect_slots(std::span<const entity> sorted,
                                      std::array<slot_request, 16>& small,
                                      std::vector<slot_request>& big) {
  std::span<slot_request> want;
  if (sorted.size() <= small.size()) {
    want = std::span(small.data(), sorted.size());
  } else {
    big.resize(sorted.size());
    want = big;
  }
  std::size_t n = 0;
  for (const entity e : sorted) {
    const auto s = static_cast<std::uint32_t>(slot_of(e.value));
    bool merged = false;
    for (std::size_t k = 0; k < n; ++k) {
      if (want[k].slot == s) {
        want[k].exclusive |= e.is_exclusive();
        merged = true;
        break;
      }
    }
    if (!merged) want[n++] = {s, e.is_exclusive()};
  }
  return want.first(n);
}

struct thread_user final : detail::thread_state {
  io::file_handle lock_fd;  // this thread's descriptor of the lock file (degrade probe)
  io::file_handle map_fd;   // holds this user's liveness byte; probes others'
  std::uint32_t index = 0;
  bool registered = false;
};

constexpr std::uint64_t fallback_tag = 1;

}  // namespace

struct memory_map::impl {
  std::string path;
  options opts;
  io::file_handle marker;  // the markers only: nothing else ever unlocks through it
  io::mapped_file lock_view;
  io::mapped_file map;
  std::string map_path;
  std::unique_ptr<byte_ranges> fallback;
  detail::per_thread_states threads;

  // Map guards outstanding in this instance. A locker counts itself in before it checks
  // the degraded flags; the map-in-use marker is dropped only when the flags are set and the
  // count is zero, so no map guard can be taken after the marker is gone.
  std::atomic<std::uint64_t> outstanding{0};
  std::mutex switch_mutex;
  bool map_in_use_released = false;  // under switch_mutex
  std::atomic<bool> fallback_ready{false};
  std::uint32_t creator_pid = 0;  // a forked child shares the markers' descriptor: hands off

  [[nodiscard]] bool degraded() const noexcept {
    const auto* lv = reinterpret_cast<std::uint64_t*>(lock_view.data() + lockfile_degraded_at);
    if (std::atomic_ref<std::uint64_t>(*const_cast<std::uint64_t*>(lv)).load() != 0) return true;
    if (map.size() == 0) return true;
    auto* mv = reinterpret_cast<std::uint64_t*>(map.data() + map_degraded_at);
    return std::atomic_ref<std::uint64_t>(*mv).load() != 0;
  }

  [[nodiscard]] slot_ref slot(std::size_t i) const noexcept {
    return slot_ref{reinterpret_cast<std::uint64_t*>(map.data() + slots_at + i * slot_size)};
  }
  [[nodiscard]] user_entry* user(std::size_t i) const noexcept {
    return reinterpret_cast<user_entry*>(map.data() + users_at + i * user_size);
  }

  // Removes every mark user `u` left in slot `i`.
  void clear_user_in(std::size_t i, std::uint32_t u) const noexcept {
    const slot_ref s = slot(i);
    std::uint64_t w = u + 1;
    s.writer().compare_exchange_strong(w, 0);
    s.readers(u / 64).fetch_and(~(std::uint64_t{1} << (u % 64)));
  }

  result<thread_user*> mine() noexcept {
    return threads.get<thread_user>([&]() -> result<std::unique_ptr<thread_user>> {
      auto s = std::make_unique<thread_user>();
      auto lf = io::file_handle::open(path.c_str(), io::open_flags::read_write);
      if (!lf) return std::unexpected(lf.error());
      s->lock_fd = std::move(*lf);
      return s;
    });
  }

  // Registers this thread as a user of the map: takes the first free liveness byte.
  result<void> register_user(thread_user& t) noexcept {
    auto mf = io::file_handle::open(map_path.c_str(), io::open_flags::read_write);
    if (!mf) return std::unexpected(mf.error());
    t.map_fd = std::move(*mf);
    const auto tid = static_cast<std::uint32_t>(::syscall(SYS_gettid));
    const std::size_t start = (tid * 2654435761u) % max_users;
    for (std::size_t k = 0; k < max_users; ++k) {
      const auto u = static_cast<std::uint32_t>((start + k) % max_users);
      auto g = io::try_lock_extent(t.map_fd, liveness_base + u, 1, io::lock_kind::exclusive);
      if (!g) {
        if (detail::is_contention(g.error())) continue;
        return std::unexpected(g.error());
      }
      g->release();  // held for as long as this thread's state lives
      // A previous user of this index may have died holding slots: clear its marks.
      for (std::size_t i = 0; i < slots; ++i)
        clear_user_in(i, u);
      user_entry* e = user(u);
      e->pid = detail::self().pid;
      e->tid = tid;
      e->start_time = detail::self().start_time;
      t.index = u;
      t.registered = true;
      return {};
    }
    return errno_error(EUSERS);
  }

  // Whether user `u` (not this thread) is dead: its liveness byte is free. If so, clears
  // its marks in slot `i` while holding the byte, so no new user can take the index meanwhile.
  result<bool> recover_if_dead(const thread_user& t, std::uint32_t u, std::size_t i) noexcept {
    if (u == t.index || u >= max_users) return false;
    auto g = io::try_lock_extent(t.map_fd, liveness_base + u, 1, io::lock_kind::exclusive);
    if (!g) {
      if (detail::is_contention(g.error())) return false;
      return std::unexpected(g.error());
    }
    clear_user_in(i, u);
    return true;  // the guard unlocks the byte
  }

  result<bool> recover_blockers(const thread_user& t, std::size_t i) noexcept {
    const slot_ref s = slot(i);
    bool any = false;
    const std::uint64_t w = s.writer().load();
    if (w != 0) {
      auto r = recover_if_dead(t, static_cast<std::uint32_t>(w - 1), i);
      if (!r) return r;
      any |= *r;
    }
    for (std::size_t word = 0; word < reader_words; ++word) {
      std::uint64_t bits = s.readers(word).load();
      while (bits != 0) {
        const auto b = static_cast<std::uint32_t>(__builtin_ctzll(bits));
        bits &= bits - 1;
        auto r = recover_if_dead(t, static_cast<std::uint32_t>(word * 64 + b), i);
        if (!r) return r;
        any |= *r;
      }
    }
    return any;
  }

  // Drops this instance's map-in-use marker once nothing of it is on the map any more.
  void release_map_in_use_if_idle() noexcept {
    if (detail::self().pid != creator_pid) return;  // the parent's marker, not ours
    const std::scoped_lock lock(switch_mutex);
    if (map_in_use_released || outstanding.load() != 0 || !degraded()) return;
    (void)io::unlock_extent(marker, map_in_use_byte, 1);
    map_in_use_released = true;
  }

  // Moves this instance to the fallback: waits until no user anywhere is on the map.
  result<void> switch_to_fallback(const io::countdown& cd, bool spin) noexcept {
    if (fallback_ready.load(std::memory_order_acquire)) return {};
    detail::backoff pause(spin);
    for (;;) {
      release_map_in_use_if_idle();
      {
        const std::scoped_lock lock(switch_mutex);
        if (map_in_use_released || map.size() == 0) break;
      }
      // Another thread of this instance still holds map guards.
      if (!pause.pause(cd)) return detail::contention_error(cd);
    }
    auto t = mine();
    if (!t) return std::unexpected(t.error());
    // Every user on the map holds the marker shared: getting it exclusively proves that
    // all of them have left it (and will use the fallback from now on).
    auto probe = io::lock_extent((*t)->lock_fd, map_in_use_byte, 1, io::lock_kind::exclusive,
                                 detail::rest_of(cd));
    if (!probe) return std::unexpected(probe.error());
    (void)probe->unlock();
    fallback_ready.store(true, std::memory_order_release);
    return {};
  }

  // Marks the lock degraded for every user (lock file, and the map if we can see it).
  result<void> mark_degraded() noexcept {
    const std::uint64_t one = 1;
    if (auto w = marker.write_at(lockfile_degraded_at, std::as_bytes(std::span(&one, 1))); !w) {
      return w;
    }
    if (map.size() != 0) {
      std::atomic_ref<std::uint64_t>(
          *reinterpret_cast<std::uint64_t*>(map.data() + map_degraded_at))
          .store(1);
    }
    return {};
  }
};

namespace {

result<io::mapped_file> create_map(const std::string& dir, std::string& path_out) noexcept {
  for (int attempt = 0; attempt < 16; ++attempt) {
    char name[64];
    std::snprintf(name, sizeof name, "/keel-mm-%08x%08x",
                  static_cast<unsigned>(detail::thread_rng()()),
                  static_cast<unsigned>(detail::thread_rng()()));
    const std::string p = dir + name;
    auto f = io::file_handle::open(
        p.c_str(), io::open_flags::read_write | io::open_flags::create | io::open_flags::exclusive,
        0644);
    if (!f) {
      if (f.error() == std::errc::file_exists) continue;
      return std::unexpected(f.error());
    }
    // Reserve the blocks before mapping: a full /dev/shm is an error here, never a SIGBUS.
    auto m = io::allocate_and_map(*f, map_size);
    if (!m) {
      (void)io::unlink(p.c_str());
      return std::unexpected(m.error());
    }
    map_header h{};
    std::memcpy(h.magic, map_magic, sizeof h.magic);
    h.version = format_version;
    h.slots = memory_map::slots;
    h.max_users = memory_map::max_users;
    h.slot_size = slot_size;
    std::memcpy(m->data(), &h, sizeof h);
    path_out = p;
    return m;
  }
  return errc_error(std::errc::file_exists);
}

result<io::mapped_file> open_map(const std::string& p) noexcept {
  auto f = io::file_handle::open(p.c_str(), io::open_flags::read_write);
  if (!f) return std::unexpected(f.error());
  auto size = f->size();
  if (!size) return std::unexpected(size.error());
  if (*size < static_cast<off_t>(map_size)) return errc_error(std::errc::bad_message);
  auto m = io::mapped_file::map(*f, io::map_access::read_write, map_size, 0);
  if (!m) return std::unexpected(m.error());
  map_header h{};
  std::memcpy(&h, m->data(), sizeof h);
  if (std::memcmp(h.magic, map_magic, sizeof h.magic) != 0 || h.version != format_version ||
      h.slots != memory_map::slots || h.max_users != memory_map::max_users ||
      h.slot_size != slot_size) {
    return errc_error(std::errc::protocol_not_supported);
  }
  return m;
}

}  // namespace

memory_map::memory_map(std::uint64_t dev, std::uint64_t ino, std::unique_ptr<impl> p) noexcept
    : shared_fs_mutex(dev, ino), impl_(std::move(p)) {}

result<std::unique_ptr<memory_map>> memory_map::open(const std::string& path,
                                                     options opts) noexcept {
  auto p = std::make_unique<impl>();
  p->path = path;
  p->opts = opts;
  p->creator_pid = detail::self().pid;
  auto fb = byte_ranges::open(path + ".fallback");
  if (!fb) return std::unexpected(fb.error());
  p->fallback = std::move(*fb);
  auto mk =
      io::file_handle::open(path.c_str(), io::open_flags::read_write | io::open_flags::create);
  if (!mk) return std::unexpected(mk.error());
  p->marker = std::move(*mk);
  auto id = detail::identify(p->marker);
  if (!id) return std::unexpected(id.error());

  bool must_degrade = opts.force_fallback;
  {
    // One opener or closer at a time: the first user's set-up and the last user's tear-down
    // never interleave with anyone reading the header.
    auto init = io::lock_extent(p->marker, init_byte, 1, io::lock_kind::exclusive);
    if (!init) return std::unexpected(init.error());
    auto first = io::try_lock_extent(p->marker, in_use_byte, 1, io::lock_kind::exclusive);
    if (!first && !detail::is_contention(first.error())) return std::unexpected(first.error());
    if (first) {
      first->release();
      // Nobody uses this lock. If its last users died instead of closing, their map is
      // still named in the header and belongs to nobody: remove it, then start afresh.
      lockfile_header old{};
      auto got = p->marker.read_at(0, std::as_writable_bytes(std::span(&old, 1)));
      if (got && *got == sizeof old &&
          std::memcmp(old.magic, lockfile_magic, sizeof old.magic) == 0 &&
          std::memcmp(old.boot_id, detail::self().boot_id.data(), sizeof old.boot_id) == 0) {
        old.map_path[sizeof old.map_path - 1] = '\0';
        if (std::strncmp(old.map_path, (opts.map_directory + "/keel-mm-").c_str(),
                         opts.map_directory.size() + 9) == 0) {
          (void)io::unlink(old.map_path);
        }
      }
      lockfile_header h{};
      std::memcpy(h.magic, lockfile_magic, sizeof h.magic);
      h.version = format_version;
      std::memcpy(h.boot_id, detail::self().boot_id.data(), sizeof h.boot_id);
      auto fs = io::stat_fs(p->marker);
      const bool local = fs && fs->is_local;
      if (local && !opts.force_fallback) {
        auto m = create_map(opts.map_directory, p->map_path);
        if (!m) return std::unexpected(m.error());
        p->map = std::move(*m);
        if (p->map_path.size() >= sizeof h.map_path)
          return errc_error(std::errc::filename_too_long);
        std::memcpy(h.map_path, p->map_path.c_str(), p->map_path.size() + 1);
      } else {
        h.degraded = 1;
      }
      std::vector<std::byte> page(lockfile_page);
      std::memcpy(page.data(), &h, sizeof h);
      if (auto w = p->marker.write_at(0, page); !w) return std::unexpected(w.error());
      // Converting our exclusive marker to shared keeps it held throughout.
      auto shared = io::lock_extent(p->marker, in_use_byte, 1, io::lock_kind::shared);
      if (!shared) return std::unexpected(shared.error());
      shared->release();
    } else {
      auto shared = io::lock_extent(p->marker, in_use_byte, 1, io::lock_kind::shared);
      if (!shared) return std::unexpected(shared.error());
      shared->release();
      lockfile_header h{};
      auto n = p->marker.read_at(0, std::as_writable_bytes(std::span(&h, 1)));
      if (!n) return std::unexpected(n.error());
      if (*n != sizeof h || std::memcmp(h.magic, lockfile_magic, sizeof h.magic) != 0) {
        (void)io::unlock_extent(p->marker, in_use_byte, 1);
        return errc_error(std::errc::bad_message);
      }
      if (h.version != format_version) {
        (void)io::unlock_extent(p->marker, in_use_byte, 1);
        return errc_error(std::errc::protocol_not_supported);
      }
      h.map_path[sizeof h.map_path - 1] = '\0';
      const bool same_boot = std::memcmp(h.boot_id, detail::self().boot_id.data(), 16) == 0;
      if (h.degraded == 0) {
        if (same_boot && !opts.force_fallback) {
          auto m = open_map(h.map_path);
          if (m) {
            p->map = std::move(*m);
            p->map_path = h.map_path;
          } else {
            must_degrade = true;  // the memory is not ours to share
          }
        } else {
          must_degrade = true;
        }
      }
    }
    if (p->map.size() != 0) {
      auto miu = io::lock_extent(p->marker, map_in_use_byte, 1, io::lock_kind::shared);
      if (!miu) return std::unexpected(miu.error());
      miu->release();
    }
    auto size = p->marker.size();
    if (!size) return std::unexpected(size.error());
    if (*size < static_cast<off_t>(lockfile_page)) return errc_error(std::errc::bad_message);
    auto view = io::mapped_file::map(p->marker, io::map_access::read_only, lockfile_page, 0);
    if (!view) return std::unexpected(view.error());
    p->lock_view = std::move(*view);
    if (must_degrade) {
      if (auto d = p->mark_degraded(); !d) return std::unexpected(d.error());
    }
  }
  if (p->map.size() == 0) p->map_in_use_released = true;
  auto m = std::unique_ptr<memory_map>(new memory_map(id->dev, id->ino, std::move(p)));
  if (must_degrade) {
    // Outside the init lock: users leaving the map must be able to close meanwhile.
    if (auto s = m->impl_->switch_to_fallback(io::deadline().start(), false); !s) {
      return std::unexpected(s.error());
    }
  }
  return m;
}

memory_map::~memory_map() {
  impl& p = *impl_;
  if (detail::self().pid != p.creator_pid) return;  // the parent's markers, not ours
  // Leave the map first (so a degrader waiting for it is not held up by our init wait).
  if (!p.map_in_use_released) (void)io::unlock_extent(p.marker, map_in_use_byte, 1);
  auto init = io::lock_extent(p.marker, init_byte, 1, io::lock_kind::exclusive);
  (void)io::unlock_extent(p.marker, in_use_byte, 1);
  auto last = io::try_lock_extent(p.marker, in_use_byte, 1, io::lock_kind::exclusive);
  if (init && last) {
    // The last user: remove the map and reset the lock file for the next first user.
    if (!p.map_path.empty()) (void)io::unlink(p.map_path.c_str());
    std::vector<std::byte> zeros(lockfile_page);
    (void)p.marker.write_at(0, zeros);
  }
}

bool memory_map::is_degraded() const noexcept {
  return impl_->fallback_ready.load(std::memory_order_acquire);
}

result<std::uint64_t> memory_map::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                          bool spin) noexcept {
  impl& p = *impl_;
  if (!p.fallback_ready.load(std::memory_order_acquire)) {
    p.outstanding.fetch_add(1);  // seq_cst: counted in before the flags are read
    if (!p.degraded()) {
      auto t = p.mine();
      if (!t) {
        p.outstanding.fetch_sub(1);
        return std::unexpected(t.error());
      }
      thread_user& me = **t;
      if (!me.registered) {
        if (auto r = p.register_user(me); !r) {
          p.outstanding.fetch_sub(1);
          return std::unexpected(r.error());
        }
      }
      std::array<slot_request, 16> small{};
      std::vector<slot_request> big;
      std::span<slot_request> want = collect_slots(sorted, small, big);

      const std::uint64_t my_bit = std::uint64_t{1} << (me.index % 64);
      const std::size_t my_word = me.index / 64;
      const auto take = [&](const slot_request& r) noexcept {
        const slot_ref s = p.slot(r.slot);
        if (r.exclusive) {
          std::uint64_t expected = 0;
          if (!s.writer().compare_exchange_strong(expected, me.index + 1)) return false;
          for (std::size_t w = 0; w < reader_words; ++w) {
            if (s.readers(w).load() != 0) {
              s.writer().store(0, std::memory_order_release);
              return false;
            }
          }
          return true;
        }
        s.readers(my_word).fetch_or(my_bit);
        if (s.writer().load() == 0) return true;
        s.readers(my_word).fetch_and(~my_bit, std::memory_order_release);
        return false;
      };
      const auto give_back = [&](const slot_request& r) noexcept {
        const slot_ref s = p.slot(r.slot);
        if (r.exclusive) {
          s.writer().store(0, std::memory_order_release);
        } else {
          s.readers(my_word).fetch_and(~my_bit, std::memory_order_release);
        }
      };

      unsigned attempts = 0;
      auto next_recovery = std::chrono::steady_clock::time_point{};
      detail::backoff sleeper(spin, std::chrono::microseconds(1000));
      for (;;) {
        std::size_t k = 0;
        while (k < want.size() && take(want[k]))
          ++k;
        if (k == want.size()) return 0;
        for (std::size_t j = 0; j < k; ++j)
          give_back(want[j]);
        if (cd.is_zero()) {
          p.outstanding.fetch_sub(1);
          if (p.degraded()) p.release_map_in_use_if_idle();
          return errc_error(std::errc::operation_would_block);
        }
        // The contended slot first next time, the rest reshuffled.
        std::swap(want[0], want[k]);
        if (want.size() > 2) std::shuffle(want.begin() + 1, want.end(), detail::thread_rng());
        ++attempts;
        if (attempts < 64) {
          for (unsigned i = 0; i < (1u << std::min(attempts, 6u)); ++i)
            _mm_pause();
          if (!cd.is_infinite() && cd.expired()) break;
          continue;
        }
        // Kept out a while: maybe the holder is dead (checked every 10 ms at most).
        const auto now = std::chrono::steady_clock::now();
        if (now >= next_recovery) {
          next_recovery = now + std::chrono::milliseconds(10);
          auto rec = p.recover_blockers(me, want[0].slot);
          if (!rec) {
            p.outstanding.fetch_sub(1);
            return std::unexpected(rec.error());
          }
          if (*rec) continue;
        }
        if (p.degraded()) break;  // go and join the others on the fallback
        if (attempts < 80 || spin) {
          if (!cd.is_infinite() && cd.expired()) break;
          std::this_thread::yield();
          continue;
        }
        if (!sleeper.pause(cd)) break;
      }
      p.outstanding.fetch_sub(1);
      if (!p.degraded()) return detail::contention_error(cd);
      p.release_map_in_use_if_idle();
      if (!cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
    } else {
      p.outstanding.fetch_sub(1);
    }
  }
  // Degraded: the fallback lock, once every user has left the map.
  if (auto s = p.switch_to_fallback(cd, spin); !s) return std::unexpected(s.error());
  auto g = p.fallback->lock(sorted, detail::rest_of(cd), spin);
  if (!g) return std::unexpected(g.error());
  auto* held = new entities_guard(std::move(*g));
  return reinterpret_cast<std::uint64_t>(held) | fallback_tag;
}

result<void> memory_map::do_unlock(std::span<const entity> sorted, std::uint64_t token) noexcept {
  impl& p = *impl_;
  if ((token & fallback_tag) != 0) {
    auto* held = reinterpret_cast<entities_guard*>(token & ~fallback_tag);
    auto r = held->unlock();
    delete held;
    return r;
  }
  auto t = p.mine();
  if (!t) return std::unexpected(t.error());
  const thread_user& me = **t;
  const std::uint64_t my_bit = std::uint64_t{1} << (me.index % 64);
  const std::size_t my_word = me.index / 64;
  std::array<slot_request, 16> small{};
  std::vector<slot_request> big;
  for (const slot_request& r : collect_slots(sorted, small, big)) {
    const slot_ref s = p.slot(r.slot);
    if (r.exclusive) {
      s.writer().store(0, std::memory_order_release);
    } else {
      s.readers(my_word).fetch_and(~my_bit, std::memory_order_release);
    }
  }
  if (p.outstanding.fetch_sub(1) == 1 && p.degraded()) p.release_map_in_use_if_idle();
  return {};
}

}  // namespace keel::lock
