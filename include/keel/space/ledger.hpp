#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "keel/result.hpp"

//! keel::space::ledger: out-of-space accounting for writers that commit in groups, after
//! Tux3's scheme. A writer that will need space *charges* a provable worst-case cost against
//! the *front delta* (the group of commits being taken now) before anything of its commit
//! is visible; the back end, which makes room (allocates, flushes, measures), closes deltas
//! and gives each a *budget*. When a charge would take the front delta's *balance* below
//! zero, the writer backs it out, the back end closes the delta early and the writer tries
//! again in the next one: deltas shrink as the volume fills. When even an empty delta's
//! budget is below a cost, the writer fails with no_space before any visible change.
//!
//! **The invariant.** For every delta, the costs charged to it and not refunded never add
//! up to more than its budget. A charge is one atomic add that returns the balance after
//! it; the writer keeps the charge only if that balance is not negative. Every other change
//! to the balance either gives back a charge (a back-out or a refund) or raises the budget
//! (a correction, which may only raise it). So when a charge is kept, the charges kept
//! before it plus its own are at most the budget, less whatever others had charged and are
//! about to back out; and nothing afterwards can lower the budget under them.
//!
//! **The correction** (the post's "few lines of code and some pencil pushing"). At a
//! transition the back end does not yet know what the closed delta will really take, so it
//! gives the new front delta a *provisional* budget that assumes the worst (every cost
//! charged to the closed delta used in full). The front delta is charged from that moment
//! on. Once the closed delta is *quiet* (every writer in it has left) and flushed, the back
//! end knows the exact budget the front delta should have had at transition, and adds the
//! difference to its balance in one atomic add: the same, for every writer, as if the
//! balance had been set to the exact budget at transition, which no lock-free writer could
//! have let it do.
//!
//! **Who is inside a delta.** Each writer has a *pin*, a word of its own in the shared
//! memory, where it writes the delta it enters before it charges and clears when it leaves;
//! a writer holds one charge at a time. It enters only if the delta is still the front after
//! its pin is written; the back end moves the front on before it reads the pins (both
//! sequentially consistent), so once no pin names a closed delta, no writer is inside it and
//! none will ever touch its balance again: its charges are final (*quiet*). (A writer that
//! read the front before it moved on may still write the old number into its pin for a
//! moment, find the front moved and go on to the new delta: a quiet delta can look busy
//! again for that moment, never be charged.) A writer killed at any point leaves at most its
//! pin set and its cost charged, which errs on the safe side; its owner, which notices the
//! death (keel::kv's user slots), clears the pin (`leave`).
//!
//! **A writer that stops inside a delta** (SIGSTOP, a debugger) would keep it from ever
//! being quiet, and so the delta after next from ever opening: every writer would wait for
//! it. The back end may *evict* it instead (`evict`): its pin is marked, so the delta reads
//! quiet, and its cost (which it wrote beside its pin before pinning) is added to the
//! *written off* word: room the owner must hold back from every budget it gives
//! (`written_off`), since the evicted writer may still use it. When the writer goes on and
//! leaves (or refunds, or finds its charge refused), it finds its pin marked, touches no
//! balance (the delta's words may serve another by then) and takes its cost off *written
//! off*: what it used is in the room the owner measures from then on.
//!
//! **Deciding no_space.** A charge can fail while the balance would cover it: another writer
//! backing out lowers it for a moment. So a failed charge only means "close the delta"; the
//! owner reports no_space when the budget it gives an empty delta is below the cost.
//!
//! **Cost.** A writer makes a sequentially consistent store (its pin: an exchange on x86)
//! and an atomic add (the charge), and a plain store to leave. No lock is shared with the
//! back end.
//!
//! **Sharing.** The words and the pins live in memory every user maps, zeroed before first
//! use, so threads and processes share one ledger; only 64-bit atomic operations touch them
//! (address-free). Zeroed words are delta 0, which has no budget: the first charge fails,
//! and the back end's first transition opens delta 1.
//!
//! Thread-safe: a writer (one pin) is used by one thread at a time, any number of writers at
//! once; the back-end calls (`transition`, `correct`) from one thread at a time, which the
//! owner ensures.
namespace keel::space {

//! The ledger's shared words: 64 bytes, 8-byte aligned, zero before first use.
struct ledger_words {
  std::uint64_t front;       //!< the front delta's number
  std::int64_t balance[2];   //!< delta d's balance, at d % 2
  std::int64_t budget[2];    //!< delta d's budget, at d % 2: set at transition, raised by correct
  std::int64_t written_off;  //!< the costs of evicted writers that have not left yet
  std::uint64_t reserved[2];
};
static_assert(sizeof(ledger_words) == 64);

//! A writer's words in the shared memory: its pin (the delta it is inside, 0: none; with
//! ledger::evicted set: evicted from it) and the cost it charges there.
struct writer_words {
  std::uint64_t pin;
  std::int64_t cost;
};
static_assert(sizeof(writer_words) == 16);

//! A kept charge: the delta and the cost.
struct charge {
  std::uint64_t delta = 0;
  std::int64_t cost = 0;
};

class ledger {
 public:
  //! The largest cost of one charge, and the largest budget: 2^48 (bytes, or whatever unit
  //! the owner counts in).
  static constexpr std::int64_t max_amount = std::int64_t{1} << 48;
  //! The most writers (pins): all of them backing out a charge of max_amount at once keep
  //! the balance in range.
  static constexpr std::size_t max_writers = std::size_t{1} << 14;

  //! A pin's mark: its writer was evicted from the delta it names.
  static constexpr std::uint64_t evicted = std::uint64_t{1} << 63;

  //! A view of `words`, and of `writers` (at most max_writers) writer_words, the first at
  //! `pins` (8-byte aligned), each `stride` bytes (a multiple of 8, at least 16) after the
  //! one before (a field of the owner's per-writer records). Not owned: they outlive the
  //! ledger.
  ledger(ledger_words& words, std::byte* pins, std::size_t writers, std::size_t stride) noexcept
      : w_(&words), pins_(pins), writers_(writers), stride_(stride) {}

  // ---- front end (writer `who`, one thread at a time per writer) ----

  //! Enters the front delta and charges it `cost`. The charge, held until `leave` or
  //! `refund`; nullopt when it would take the balance below zero (nothing is charged, and the
  //! writer is not inside): the caller has the back end close the delta, or fails with
  //! no_space if even an empty delta's budget is below `cost`, and tries again. Errors:
  //! invalid_argument (`cost` outside 0 to max_amount, `who` not a writer, or the writer
  //! already holds a charge); nothing changes.
  [[nodiscard]] result<std::optional<charge>> try_charge(std::size_t who,
                                                         std::int64_t cost) noexcept;
  //! The writer is done: its space is in use (or accounted by the owner). Also what the
  //! owner calls for a writer it finds dead, whatever it was doing. An evicted writer's cost
  //! comes off *written off*.
  void leave(std::size_t who) noexcept;
  //! The writer did not use its space after all (it failed or was aborted before writing):
  //! the cost goes back to the balance (unless it was evicted: then off *written off*), and
  //! the writer leaves. Errors: invalid_argument (`c` is not the charge `who` holds);
  //! nothing changes.
  [[nodiscard]] result<void> refund(std::size_t who, const charge& c) noexcept;

  // ---- back end (one thread at a time) ----

  //! The front delta's number.
  [[nodiscard]] std::uint64_t front() const noexcept;
  //! The front delta's balance now (a hint: writers move it all the time).
  [[nodiscard]] std::int64_t balance() const noexcept;
  //! Closes the front delta d and opens d + 1 with budget `provisional` (0 to max_amount),
  //! which must assume the worst of d. d + 1 takes over the words of d − 1, which must be
  //! quiet, and whose charges the caller has read. Returns d + 1. Errors: invalid_argument
  //! (`provisional` out of range), resource_unavailable_try_again (a writer is still inside
  //! d − 1).
  [[nodiscard]] result<std::uint64_t> transition(std::int64_t provisional) noexcept;
  //! Whether no writer is inside delta `d` (for a closed delta: its charges are final).
  [[nodiscard]] bool quiet(std::uint64_t d) const noexcept;
  //! Evicts writer `who` from delta `d` if it is inside it (the owner finds it too slow to
  //! wait for: stopped): `d` no longer waits for it, and its cost is written off until it
  //! leaves. Returns whether it was inside `d`.
  bool evict(std::size_t who, std::uint64_t d) noexcept;
  //! The costs of evicted writers that have not left: room they may still use, which the
  //! owner holds back from the budgets it gives (never negative).
  [[nodiscard]] std::int64_t written_off() const noexcept;
  //! The costs charged to delta `d` and not refunded: final once it is quiet (for d the
  //! front delta or the one before it).
  [[nodiscard]] std::int64_t charged(std::uint64_t d) const noexcept;
  //! Delta `d`'s budget: the most its kept charges can ever add up to (for d the front delta
  //! or the one before it). What a transition assumes of a delta not yet quiet.
  [[nodiscard]] std::int64_t budget_of(std::uint64_t d) const noexcept;
  //! Sets the front delta's budget to `exact`, as if it had had it since its transition,
  //! while its writers go on charging it. A back end killed part-way leaves the balance
  //! short (safe), and calling it again with the same `exact` raises nothing twice. Errors:
  //! invalid_argument when `exact` is below its budget now (a correction may only raise it:
  //! the provisional budget assumed the worst) or above max_amount.
  [[nodiscard]] result<void> correct(std::int64_t exact) noexcept;

 private:
  [[nodiscard]] std::atomic_ref<std::uint64_t> front_word() const noexcept;
  [[nodiscard]] std::atomic_ref<std::uint64_t> pin(std::size_t who) const noexcept;
  [[nodiscard]] std::atomic_ref<std::int64_t> cost(std::size_t who) const noexcept;
  //! Clears `who`'s pin; if it was evicted, its cost comes off written_off. Returns the pin
  //! as it was.
  std::uint64_t unpin(std::size_t who, std::memory_order order) noexcept;
  [[nodiscard]] std::atomic_ref<std::int64_t> balance(std::uint64_t d) const noexcept;
  [[nodiscard]] std::atomic_ref<std::int64_t> budget(std::uint64_t d) const noexcept;
  ledger_words* w_;
  std::byte* pins_;
  std::size_t writers_;
  std::size_t stride_;
};

}  // namespace keel::space
