// This process's supplier of fresh log pages (supplier.hpp): writers ask for the next chunk
// of the log as they cross into one (reserve.cpp), and a thread of its own faults it in.
// Changes log_supplier.

#include <chrono>
#include <exception>

#include "base/fork.hpp"
#include "base/futex.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

namespace {

// ThreadSanitizer cannot follow a thread started in a child forked from a process that has
// threads (the child dies: "starting new threads after multi-threaded fork is not
// supported"), and a store's user forks from one: under it, a forked child faults its chunks
// in itself, as every writer did before the supplier.
#if defined(__SANITIZE_THREAD__)
constexpr bool threads_in_children = false;
#else
constexpr bool threads_in_children = true;
#endif

}  // namespace

void store::impl::supply_ahead(std::uint64_t location) noexcept {
  const std::uint64_t mine = base::fork_generation() + 1;
  if ((!threads_in_children && mine != 1) ||
      (supplier.serving.load(std::memory_order_acquire) != mine && !start_supplier())) {
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
  // Never waited for: its holder may be a fork waiting for mutexes the asker's caller holds
  // (the maintenance thread's, whose joiner holds its mutex), or a close joining the thread.
  // Taken by another, this asker faults its chunk in itself.
  if (supplier.closing.load()) return false;
  if (!supplier.mutex.try_lock()) return false;
  bool started = supplier.serving.load() == mine;
  if (!started && !supplier.closing.load()) {
    try {
      supplier.thread.start([this] { serve_supply(); });
      supplier.serving.store(mine, std::memory_order_release);
      started = true;
    } catch (const std::exception&) {
      // No thread to be had: the askers fault their chunks in themselves.
    }
  }
  supplier.mutex.unlock();
  return started;
}

void store::impl::serve_supply() noexcept {
  for (;;) {
    const std::uint32_t seen = supplier.asks.load(std::memory_order_seq_cst);
    if (supplier.closing.load(std::memory_order_seq_cst)) return;
    if (const std::uint64_t at = supplier.wanted.exchange(0, std::memory_order_acq_rel)) {
      // (Only a segment mapped here, kept mapped meanwhile: this thread holds no snapshot,
      // and a compaction may have removed the segment since it was asked for.)
      mapped.with_mapped(disk::segment_of(at), [&](const segment& s) {
        s.populate(disk::offset_of(at), prefault_chunk);
      });
      continue;
    }
    // (A request or the close after the load above has moved the word: no sleep.)
    base::futex_wait(supplier.asks, seen, nullptr);
  }
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
