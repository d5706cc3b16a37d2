// This process's supplier of fresh log pages (supplier.hpp): writers ask for the next chunk
// of the log as they cross into one (reserve.cpp), and a thread of its own faults it in.
// Changes log_supplier.

#include <chrono>
#include <exception>

#include "base/fork.hpp"
#include "base/futex.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

void store::impl::supply_ahead(std::uint64_t location) noexcept {
  const std::uint64_t mine = base::fork_generation() + 1;
  if (supplier.serving.load(std::memory_order_acquire) != mine && !start_supplier()) {
    // No thread to be had (this process may start none): the asker faults it in itself.
    prefault(disk::segment_of(location), disk::offset_of(location));
    return;
  }
  supplier.wanted.store(location, std::memory_order_release);
  supplier.asks.fetch_add(1, std::memory_order_seq_cst);
  base::futex_wake(supplier.asks, 1);
}

bool store::impl::start_supplier() noexcept {
  const std::uint64_t mine = base::fork_generation() + 1;
  base::lock_guard g(supplier.mutex);
  if (supplier.serving.load() == mine) return true;
  if (supplier.closing.load()) return false;
  try {
    supplier.thread.start([this] {
      for (;;) {
        const std::uint32_t seen = supplier.asks.load(std::memory_order_seq_cst);
        if (supplier.closing.load(std::memory_order_seq_cst)) return;
        if (const std::uint64_t at = supplier.wanted.exchange(0, std::memory_order_acq_rel)) {
          prefault(disk::segment_of(at), disk::offset_of(at));
          continue;
        }
        // (A request or the close after the load above has moved the word: no sleep.)
        base::futex_wait(supplier.asks, seen, nullptr);
      }
    });
  } catch (const std::exception&) {
    return false;
  }
  supplier.serving.store(mine, std::memory_order_release);
  return true;
}

void store::impl::join_supplier() noexcept {
  supplier.closing.store(true, std::memory_order_seq_cst);
  supplier.asks.fetch_add(1, std::memory_order_seq_cst);
  base::futex_wake(supplier.asks);
  base::lock_guard g(supplier.mutex);
  supplier.thread.join();
  supplier.serving.store(0);  // (an asker after this faults its chunk in itself)
}

}  // namespace keel::kv
