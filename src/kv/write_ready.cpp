// Writes through the maps where the filesystem may refuse them (store_impl.hpp,
// writes_refusable): the pages a call will write are faulted in writable before it changes
// anything, so that btrfs's refusal (no room for the reservation it makes at every write
// fault) is an error the call returns, not a SIGBUS at a store instruction.

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <thread>

#include "kv/store_impl.hpp"

namespace keel::kv {
namespace {

// The store call this thread is in (call_scope), and when its waits for a refusing volume end.
thread_local const store::impl* call_store = nullptr;
thread_local io::countdown::clock::time_point call_end{};

}  // namespace

call_scope::call_scope(const store::impl& s) noexcept
    : outer_store_(call_store), outer_expiry_(call_end) {
  if (call_store == &s || !s.writes_refusable.load(std::memory_order_relaxed)) return;
  call_store = &s;
  call_end = io::deadline(s.opts.lock_timeout).start().expiry();
}

call_scope::~call_scope() {
  call_store = outer_store_;
  call_end = outer_expiry_;
}

io::countdown::clock::time_point store::impl::call_expiry() const noexcept {
  if (call_store == this) return call_end;
  return io::deadline(opts.lock_timeout).start().expiry();
}

error store::impl::why_writes_refused(std::string_view file) noexcept {
  // A page written to a file of our own asks for the same room a write fault does: its error
  // is the volume's (or the qgroup's) answer. Anonymous where the filesystem allows (btrfs
  // does), so nothing is left should we be killed here.
  auto t = io::make_temp_file(dir.dir, ".probe.", io::open_flags::read_write, 0600);
  if (!t && out_of_room(t.error())) return t.error().about(path);
  if (!t) return error(std::make_error_code(std::errc::bad_address)).about(file);
  static const std::array<std::byte, disk::page_size> page{};
  auto w = t->file.write_at(0, page);
  (void)t->remove_name(dir.dir);
  if (!w) return w.error().about(file);
  return error(std::make_error_code(std::errc::bad_address)).about(file);
}

result<void> store::impl::write_ready(const io::mapped_file& map, const void* p, std::size_t n,
                                      std::string_view file, bool patient) noexcept {
  if (!writes_refusable.load(std::memory_order_relaxed) || n == 0) return {};
  const auto offset = static_cast<std::size_t>(static_cast<const std::byte*>(p) - map.data());
  // (So that EINVAL below can only be the kernel not knowing the advice: a map we may not
  // write, or a range outside it, gets it too, and touching those would crash.)
  if (map.access() != io::map_access::read_write || offset > map.size() ||
      n > map.size() - offset) {
    return std::unexpected(error(std::make_error_code(std::errc::invalid_argument)).about(file));
  }
  if (no_populate_write.load(std::memory_order_relaxed)) {
    return touch_writable(map, offset, n, file, patient);
  }
  const auto until = call_expiry();
  auto pause = std::chrono::milliseconds(1);
  for (;;) {
    auto r = map.advise(io::map_advice::populate_write, offset, n);
    if (r) return {};
    if (r.error() == std::errc::invalid_argument) {
      // A kernel before 5.14: the pages are touched instead from now on. (Before, this turned
      // the escapes off too; then it said yes to every page, and the stores that rely on
      // having asked met a refusal with no escape: SIGBUS at the guard's give-up.)
      no_populate_write.store(true, std::memory_order_relaxed);
      return touch_writable(map, offset, n, file, patient);
    }
    if (r.error() == std::errc::interrupted) continue;
    if (r.error() != std::errc::bad_address) return std::unexpected(r.error().about(file));
    // Refused for room: that is the answer. A page written elsewhere went through: btrfs
    // refused the fault for a moment (its reservations being flushed) and is asked again,
    // backing off, until the call's deadline (what the map guard would have done).
    error why = why_writes_refused(file);
    if (why != std::errc::bad_address) return std::unexpected(why);
    if (!patient || std::chrono::steady_clock::now() >= until) {
      return std::unexpected(why);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::milliseconds>(2 * pause, std::chrono::milliseconds(50));
  }
}

result<void> store::impl::touch_writable(const io::mapped_file& map, std::size_t offset,
                                         std::size_t n, std::string_view file,
                                         bool patient) noexcept {
  // Each page's first word is stored with itself: an atomic add of 0, which loses no store
  // another user makes to it meanwhile. (The map is page-aligned: the first page's start is in
  // it, before `offset` perhaps.) A touch the volume refuses escapes at the call's deadline,
  // or, not patient, as soon as the guard lets it: then what the volume says, as above.
  constexpr std::uintptr_t page = disk::page_size;
  std::uintptr_t at = reinterpret_cast<std::uintptr_t>(map.data() + offset) & ~(page - 1);
  const auto end = reinterpret_cast<std::uintptr_t>(map.data() + offset + n);
  const auto until = patient ? call_expiry() : io::countdown::clock::now();
  if (io::map_guard::run_escapable(until, [&] {
        for (; at < end; at += page) {
          std::atomic_ref(*reinterpret_cast<std::uint64_t*>(at))
              .fetch_add(0, std::memory_order_relaxed);
        }
      })) {
    return {};
  }
  return std::unexpected(why_writes_refused(file));
}

result<void> store::impl::slot_write_ready(std::uint32_t u, bool patient) noexcept {
  if (!writes_refusable.load(std::memory_order_relaxed)) return {};
  const std::byte* at = base() + slot_first_page * disk::page_size + std::size_t{u} * slot_size;
  auto r = write_ready(index_map, base(), disk::page_size, {}, patient);
  if (r) r = write_ready(index_map, at, slot_size, {}, patient);
  if (!r) return std::unexpected(r.error().about(path + "/index"));
  return {};
}

result<void> store::impl::alone_write_ready() noexcept {
  if (!writes_refusable.load(std::memory_order_relaxed)) return {};
  auto r = write_ready(index_map, base(), first_free_page * disk::page_size, {});
  if (!r) return std::unexpected(r.error().about(path + "/index"));
  return {};
}

result<void> store::impl::index_write_ready(std::uint64_t p) noexcept {
  if (!writes_refusable.load(std::memory_order_relaxed)) return {};
  auto r = write_ready(index_map, base() + p * disk::page_size, disk::page_size, {});
  if (!r) return std::unexpected(r.error().about(path + "/index", p * disk::page_size));
  return {};
}

result<void> store::impl::segment_write_ready(std::uint64_t location, std::size_t n,
                                              bool patient) noexcept {
  if (!writes_refusable.load(std::memory_order_relaxed)) return {};
  auto s = segment_at(disk::segment_of(location));
  if (!s) return std::unexpected(s.error());
  const std::uint64_t off = disk::offset_of(location);
  if (off >= (*s)->size || n > (*s)->size - off) return keel_error(errc::corrupt);
  return write_ready((*s)->map, (*s)->map.data() + off, n, (*s)->path.view(), patient);
}

}  // namespace keel::kv
