#pragma once
// This process's memo of the log bytes in a run of whole segments (store::impl::log_distance,
// checkpoint.cpp, owns it: no other part reads or writes it). Every commit asks how far the
// log has gone since the last checkpoint; the answer is the segments' sizes in the segment
// table, summed, and the tail's offset. The sum changes only when the run's ends move (a
// checkpoint, the tail into a new segment) or a compaction removes segments, so it is kept
// here, keyed by all three, and the table is walked again only then.
//
// A hint, like what it feeds (when a checkpoint is due, stats' unchecked bytes): an entry is
// a seqlock, read without waiting, and a writer that finds it being written leaves it.

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>

namespace keel::kv {

class segment_sum_memo {
 public:
  struct key {
    std::uint64_t first = 0;        // the run's first segment
    std::uint64_t last = 0;         // one past its last
    std::uint64_t compactions = 0;  // header::compactions when summed
    bool operator==(const key&) const = default;
  };

  //! The sum kept for `k`, if one is.
  [[nodiscard]] std::optional<std::uint64_t> find(const key& k) const noexcept {
    for (const entry& e : entries_) {
      const std::uint64_t v = e.version.load(std::memory_order_acquire);
      if (v == 0 || (v & 1) != 0) continue;
      // (Each load acquires: one that reads a writer's store sees its odd version after it,
      // so a torn read fails the check below. No fence: ThreadSanitizer has none.)
      const key seen{e.first.load(std::memory_order_acquire),
                     e.last.load(std::memory_order_acquire),
                     e.compactions.load(std::memory_order_acquire)};
      const std::uint64_t sum = e.sum.load(std::memory_order_acquire);
      if (e.version.load(std::memory_order_relaxed) == v && seen == k) return sum;
    }
    return std::nullopt;
  }

  //! Keeps `sum` for `k`, in place of the entry written longest ago.
  void keep(const key& k, std::uint64_t sum) noexcept {
    entry& e = entries_[next_.fetch_add(1, std::memory_order_relaxed) % entries_.size()];
    std::uint64_t v = e.version.load(std::memory_order_relaxed);
    if ((v & 1) != 0 || !e.version.compare_exchange_strong(v, v + 1, std::memory_order_acquire)) {
      return;  // another writer's: it keeps its own
    }
    // (Released: a reader that sees one of these sees the odd version before it.)
    e.first.store(k.first, std::memory_order_release);
    e.last.store(k.last, std::memory_order_release);
    e.compactions.store(k.compactions, std::memory_order_release);
    e.sum.store(sum, std::memory_order_release);
    e.version.store(v + 2, std::memory_order_release);
  }

 private:
  struct entry {
    std::atomic<std::uint64_t> version{0};  // odd while written; 0: never written
    std::atomic<std::uint64_t> first{0}, last{0}, compactions{0}, sum{0};
  };
  // Two: a commit asks from the last checkpoint's start and from the last attempt's.
  std::array<entry, 2> entries_{};
  std::atomic<std::uint32_t> next_{0};
};

}  // namespace keel::kv
