// keel::space::ledger: against a sequential model, then under threads and processes that
// charge at once while a back end closes and corrects deltas, then with a writer killed
// inside a delta.

#include "keel/space/ledger.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "support/process.hpp"

namespace keel::space {
namespace {

// ---- The sequential model: what every call must return, one call at a time. ----

struct model {
  struct delta {
    std::int64_t budget = 0;
    std::int64_t charged = 0;
    int writers = 0;
  };
  std::uint64_t front = 0;
  std::map<std::uint64_t, delta> deltas{{0, {}}};

  bool try_charge(std::int64_t cost) {
    if (front == 0) return false;
    delta& d = deltas[front];
    if (d.charged + cost > d.budget) return false;
    d.charged += cost;
    d.writers += 1;
    return true;
  }
  bool transition(std::int64_t provisional) {
    if (front >= 1 && deltas[front - 1].writers != 0) return false;
    front += 1;
    deltas[front] = {provisional, 0, 0};
    return true;
  }
};

// A charge that must not be refused as bad input: kept, or nullopt (over the balance).
std::optional<charge> charged_or_not(ledger& l, std::size_t who, std::int64_t cost) {
  auto r = l.try_charge(who, cost);
  if (!r) {
    ADD_FAILURE() << "try_charge(" << who << ", " << cost << "): " << r.error().message();
    return std::nullopt;
  }
  return *r;
}

TEST(SpaceLedger, EveryCallAgreesWithASequentialModel) {
  for (const std::uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    ledger_words words{};
    constexpr std::size_t writers = 64;
    std::array<writer_words, writers> pins{};
    ledger l(words, reinterpret_cast<std::byte*>(pins.data()), writers, sizeof(writer_words));
    model m;
    std::vector<std::pair<std::size_t, charge>> held;  // writer, its charge
    std::vector<std::size_t> idle(writers);
    for (std::size_t i = 0; i < writers; ++i)
      idle[i] = i;
    for (int step = 0; step < 20'000; ++step) {
      const int what = static_cast<int>(rng() % 100);
      if (what < 50 && !idle.empty()) {
        // A charge: small, or now and then one as large as a whole budget.
        const std::int64_t cost =
            rng() % 20 == 0 ? static_cast<std::int64_t>(rng() % 5000) : rng() % 300;
        const std::size_t who = idle.back();
        const bool expect = m.try_charge(cost);
        const auto got = charged_or_not(l, who, cost);
        ASSERT_EQ(got.has_value(), expect) << "step " << step << " cost " << cost;
        if (got) {
          EXPECT_EQ(got->delta, m.front);
          held.push_back({who, *got});
          idle.pop_back();
        }
      } else if (what < 80 && !held.empty()) {
        // A writer done (or given back), any of them, from either delta.
        const std::size_t i = rng() % held.size();
        const auto [who, c] = held[i];
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
        idle.push_back(who);
        model::delta& d = m.deltas[c.delta];
        d.writers -= 1;
        if (rng() % 4 == 0) {
          d.charged -= c.cost;
          ASSERT_TRUE(l.refund(who, c));
        } else {
          l.leave(who);
        }
      } else if (what < 90) {
        const std::int64_t provisional = static_cast<std::int64_t>(rng() % 4000);
        const bool expect = m.transition(provisional);
        const auto got = l.transition(provisional);
        ASSERT_EQ(got.has_value(), expect) << "step " << step;
        if (got) {
          EXPECT_EQ(*got, m.front);
        } else {
          EXPECT_EQ(got.error(), std::errc::resource_unavailable_try_again);
        }
      } else if (what >= 90 && m.front != 0) {
        model::delta& d = m.deltas[m.front];
        const std::int64_t exact = d.budget + static_cast<std::int64_t>(rng() % 500);
        ASSERT_TRUE(l.correct(exact));
        d.budget = exact;
      }
      // What the back end reads agrees too, for the front and the delta before it.
      ASSERT_EQ(l.front(), m.front);
      for (std::uint64_t d = m.front == 0 ? 0 : m.front - 1; d <= m.front; ++d) {
        EXPECT_EQ(l.quiet(d), m.deltas[d].writers == 0) << "delta " << d;
        if (m.deltas[d].writers == 0) {
          EXPECT_EQ(l.charged(d), m.deltas[d].charged);
        }
      }
      if (m.front != 0) {
        EXPECT_EQ(l.balance(), m.deltas[m.front].budget - m.deltas[m.front].charged);
      }
    }
  }
}

TEST(SpaceLedger, ZeroedWordsHaveNoBudgetUntilTheFirstTransition) {
  ledger_words words{};
  std::array<writer_words, 3> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  EXPECT_EQ(l.front(), 0u);
  EXPECT_FALSE(charged_or_not(l, 0, 0));
  EXPECT_TRUE(l.quiet(0));
  EXPECT_EQ(l.charged(0), 0);
  auto d = l.transition(100);
  ASSERT_TRUE(d);
  EXPECT_EQ(*d, 1u);
  auto c = charged_or_not(l, 0, 100);
  ASSERT_TRUE(c);
  EXPECT_EQ(pins[0].pin, 1u) << "the writer's pin names the delta it is inside";
  EXPECT_FALSE(charged_or_not(l, 1, 1)) << "the budget is spent";
  EXPECT_EQ(pins[1].pin, 0u) << "a writer whose charge failed is not inside";
  EXPECT_TRUE(charged_or_not(l, 2, 0)) << "a charge of nothing fits (with nobody backing out)";
}

TEST(SpaceLedger, BadArgumentsAreRefusedAndChangeNothing) {
  ledger_words words{};
  std::array<writer_words, 1> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  EXPECT_EQ(l.transition(-1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.transition(ledger::max_amount + 1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.front(), 0u);
  ASSERT_TRUE(l.transition(1000));
  EXPECT_EQ(l.correct(999).error(), std::errc::invalid_argument) << "a correction only raises";
  EXPECT_EQ(l.correct(ledger::max_amount + 1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.balance(), 1000);
  // Charges: a cost out of range, a writer that is not one, a second charge by one writer,
  // and a refund of a charge the writer does not hold. None changes the balance.
  EXPECT_EQ(l.try_charge(0, -1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.try_charge(0, ledger::max_amount + 1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.try_charge(0, std::numeric_limits<std::int64_t>::min()).error(),
            std::errc::invalid_argument);
  EXPECT_EQ(l.try_charge(1, 1).error(), std::errc::invalid_argument);
  EXPECT_EQ(l.refund(0, charge{1, 5}).error(), std::errc::invalid_argument) << "holds none";
  EXPECT_EQ(l.balance(), 1000);
  auto c = charged_or_not(l, 0, 10);
  ASSERT_TRUE(c);
  EXPECT_EQ(l.try_charge(0, 10).error(), std::errc::invalid_argument) << "one charge at a time";
  EXPECT_EQ(l.refund(0, charge{2, 10}).error(), std::errc::invalid_argument) << "not its delta";
  EXPECT_EQ(l.balance(), 990);
  ASSERT_TRUE(l.refund(0, *c));
  EXPECT_EQ(l.refund(0, *c).error(), std::errc::invalid_argument) << "given back already";
  EXPECT_EQ(l.balance(), 1000);
  ASSERT_TRUE(l.correct(ledger::max_amount));
  EXPECT_TRUE(charged_or_not(l, 0, ledger::max_amount));
}

// A back end killed inside correct() (the budget stored, the balance not yet raised) leaves
// the balance short, and correcting again to the same figure raises it once, not twice.
TEST(SpaceLedger, CorrectingAgainAfterAKilledCorrectionRaisesTheBalanceOnce) {
  ledger_words words{};
  std::array<writer_words, 1> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  ASSERT_TRUE(l.transition(100));
  auto c = charged_or_not(l, 0, 30);
  ASSERT_TRUE(c);
  words.budget[1] = 500;  // what correct(500) has done when it is killed
  EXPECT_EQ(l.balance(), 70) << "short, which is safe";
  ASSERT_TRUE(l.correct(500));
  EXPECT_EQ(l.balance(), 70) << "the budget was already 500: nothing more";
  ASSERT_TRUE(l.correct(600));
  EXPECT_EQ(l.balance(), 170);
  EXPECT_EQ(l.charged(1), 430) << "the lost raise counts as charged: never handed out";
}

// The states a writer killed inside try_charge leaves, built by hand: its pin set with
// nothing charged, or with its cost taken and not yet given back. Either keeps the delta
// busy until the owner leaves for it, and neither lets the delta be overdrawn.
TEST(SpaceLedger, AWriterKilledInsideTryChargeErrsOnTheSafeSide) {
  ledger_words words{};
  std::array<writer_words, 3> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  ASSERT_TRUE(l.transition(100));
  pins[0].pin = 1;  // pinned, killed before charging
  pins[1].pin = 1;  // pinned, charged 150 (over the balance), killed before backing out
  words.balance[1] -= 150;
  EXPECT_FALSE(charged_or_not(l, 2, 1)) << "the dead writer's cost still counts";
  ASSERT_TRUE(l.transition(100));
  EXPECT_FALSE(l.quiet(1));
  EXPECT_EQ(l.transition(100).error(), std::errc::resource_unavailable_try_again);
  l.leave(0);
  EXPECT_FALSE(l.quiet(1));
  l.leave(1);
  EXPECT_TRUE(l.quiet(1));
  EXPECT_EQ(l.charged(1), 150) << "charged, never handed out: safe";
  EXPECT_TRUE(l.transition(100));
}

// A delta's writers keep its words: the delta after next cannot open over them.
TEST(SpaceLedger, ADeltaWithAWriterInsideIsNotReused) {
  ledger_words words{};
  std::array<writer_words, 2> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  ASSERT_TRUE(l.transition(10));
  auto c = charged_or_not(l, 1, 4);
  ASSERT_TRUE(c);
  ASSERT_TRUE(l.transition(10));  // delta 2; delta 1 closed, not quiet
  EXPECT_FALSE(l.quiet(1));
  EXPECT_EQ(l.transition(10).error(), std::errc::resource_unavailable_try_again);
  l.leave(1);
  EXPECT_TRUE(l.quiet(1));
  EXPECT_EQ(l.charged(1), 4);
  EXPECT_TRUE(l.transition(10));
}

// A writer stopped inside a delta (SIGSTOP) would keep it from going quiet for as long as it
// stays stopped: the back end evicts it. The delta reads quiet and its words may serve the
// delta after next; the writer's cost is written off until it leaves; when it goes on, its
// refund (or leave) touches no balance and takes its cost off what is written off.
TEST(SpaceLedger, AnEvictedWritersCostIsWrittenOffUntilItLeaves) {
  for (const bool refunds : {true, false}) {
    ledger_words words{};
    std::array<writer_words, 3> pins{};
    ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
    ASSERT_TRUE(l.transition(100));
    auto c = charged_or_not(l, 1, 30);
    ASSERT_TRUE(c);
    EXPECT_FALSE(l.evict(0, 1)) << "writer 0 is inside no delta";
    EXPECT_EQ(l.written_off(), 0);
    ASSERT_TRUE(l.transition(100));  // delta 2; delta 1 closed, not quiet
    EXPECT_FALSE(l.quiet(1));
    EXPECT_FALSE(l.evict(1, 2)) << "writer 1 is not inside delta 2";
    EXPECT_TRUE(l.evict(1, 1));
    EXPECT_TRUE(l.quiet(1));
    EXPECT_EQ(l.written_off(), 30);
    EXPECT_FALSE(l.evict(1, 1)) << "evicted once";
    EXPECT_EQ(l.written_off(), 30);
    ASSERT_TRUE(l.transition(100));  // delta 3, over delta 1's words
    EXPECT_EQ(l.balance(), 100);
    auto other = charged_or_not(l, 2, 40);
    ASSERT_TRUE(other);
    // The evicted writer goes on.
    if (refunds) {
      ASSERT_TRUE(l.refund(1, *c));
    } else {
      l.leave(1);
    }
    EXPECT_EQ(l.balance(), 60) << "delta 3's balance is delta 3's alone";
    EXPECT_EQ(l.written_off(), 0);
    EXPECT_EQ(pins[1].pin, 0u);
    EXPECT_FALSE(l.refund(1, *c)) << "given back once";
    EXPECT_TRUE(charged_or_not(l, 1, 10)) << "the writer charges again";
    l.leave(1);
    l.leave(2);
  }
}

// Evicted before its charge: it may take its cost from words another delta uses by then
// (safe: that delta has less), and finding its charge refused there it leaves nothing
// written off.
TEST(SpaceLedger, AWriterEvictedBeforeItChargesLeavesNothingWrittenOff) {
  ledger_words words{};
  std::array<writer_words, 2> pins{};
  ledger l(words, reinterpret_cast<std::byte*>(pins.data()), pins.size(), sizeof(writer_words));
  ASSERT_TRUE(l.transition(100));
  // Writer 0 pinned delta 1 and stopped before charging (as try_charge leaves it).
  pins[0] = {1, 500};
  ASSERT_TRUE(l.transition(100));
  EXPECT_TRUE(l.evict(0, 1));
  EXPECT_EQ(l.written_off(), 500);
  ASSERT_TRUE(l.transition(100));
  // It goes on: its charge of 500 fails against delta 3's words, and it unpins.
  words.balance[1] -= 500;
  words.balance[1] += 500;
  l.leave(0);
  EXPECT_EQ(l.written_off(), 0);
  EXPECT_EQ(l.balance(), 100);
}

// ---- Concurrency: threads of several processes charge at once; a back end closes deltas
// when the balance runs out, waits for each closed one to go quiet and checks that what the
// ledger says was charged is exactly what the writers kept, and never over the budget.

constexpr std::uint64_t max_deltas = std::uint64_t{1} << 16;
constexpr std::size_t writers = 16;
struct shared_state {
  ledger_words words;
  struct alignas(64) pin_line {
    writer_words pin;
  };
  pin_line pins[writers];
  std::atomic<std::int64_t> kept[max_deltas];       // costs kept (less refunds), per delta
  std::atomic<std::int64_t> most_kept[max_deltas];  // the most `kept` was ever seen at
  std::atomic<std::int64_t> budget_of[max_deltas];  // the exact budget each delta ended with
  std::atomic<bool> stop;
  std::atomic<std::uint64_t> charges;
};

ledger ledger_of(shared_state& st) {
  return ledger(st.words, reinterpret_cast<std::byte*>(&st.pins[0].pin), writers,
                sizeof(shared_state::pin_line));
}

int writer(shared_state& st, std::size_t who, std::uint64_t seed) {
  ledger l = ledger_of(st);
  std::mt19937_64 rng(seed);
  while (!st.stop.load(std::memory_order_relaxed)) {
    const std::int64_t cost = 1 + static_cast<std::int64_t>(rng() % 64);
    const auto r = l.try_charge(who, cost);
    if (!r) return 1;
    const std::optional<charge>& c = *r;
    if (!c) {
      std::this_thread::yield();  // the back end closes the delta
      continue;
    }
    if (c->delta >= max_deltas) return 0;
    // `kept` counts a charge after the ledger kept it and stops before it is given back, so
    // it is never above what the ledger holds kept, which the budget must cover at every
    // moment: its highest value is checked against the budget once the delta is closed.
    const std::int64_t now = st.kept[c->delta].fetch_add(cost) + cost;
    std::int64_t most = st.most_kept[c->delta].load();
    while (now > most && !st.most_kept[c->delta].compare_exchange_weak(most, now)) {
    }
    if (rng() % 8 == 0) {
      st.kept[c->delta].fetch_sub(cost);
      if (!l.refund(who, *c)) return 2;
    } else {
      l.leave(who);
    }
    st.charges.fetch_add(1, std::memory_order_relaxed);
  }
  return 0;
}

TEST(SpaceLedger, WritersInThreadsAndProcessesNeverOverdrawADelta) {
  auto* st = static_cast<shared_state*>(::mmap(
      nullptr, sizeof(shared_state), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(st, MAP_FAILED);
  new (st) shared_state{};
  std::vector<pid_t> children;
  for (int p = 0; p < 2; ++p) {
    children.push_back(test::fork_child([&, p] {
      std::vector<std::thread> ts;
      for (int t = 0; t < 3; ++t)
        ts.emplace_back([&, t] { writer(*st, 1 + 3 * p + t, 100 + 10 * p + t); });
      for (auto& t : ts)
        t.join();
      return 0;
    }));
  }
  std::thread local([&] { writer(*st, 0, 7); });

  ledger l = ledger_of(*st);
  std::mt19937_64 rng(42);
  std::uint64_t checked = 0;
  std::int64_t final_charged = 0;  // of the delta closed last
  // Until enough has happened to show anything (not for a fixed time: on a busy machine two
  // seconds held 4 431 charges), within a cap that only keeps a broken ledger from hanging.
  const auto enough = [&] { return checked > 1'000 && st->charges.load() > 200'000; };
  const auto cap = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!enough() && std::chrono::steady_clock::now() < cap && l.front() + 1 < max_deltas) {
    if (l.front() != 0 && l.balance() > 64) {
      std::this_thread::yield();
      continue;
    }
    // Close the front; the new one gets a provisional budget, raised once the closed one
    // is quiet (as a back end does when it has measured what the closed one really took).
    const std::uint64_t closing = l.front();
    if (closing >= 2) {
      // The delta closed last time is still as it was when it went quiet: nobody charged it
      // since (this transition hands its words to the next delta).
      EXPECT_EQ(l.charged(closing - 1), final_charged) << "delta " << closing - 1;
      EXPECT_EQ(st->kept[closing - 1].load(), final_charged) << "delta " << closing - 1;
    }
    const std::int64_t provisional = 200 + static_cast<std::int64_t>(rng() % 2000);
    auto next = l.transition(provisional);
    if (!next) {
      ASSERT_EQ(next.error(), std::errc::resource_unavailable_try_again);
      std::this_thread::yield();
      continue;
    }
    while (!l.quiet(closing))
      std::this_thread::yield();
    if (closing != 0) {
      // Every writer of the closed delta has left: its accounts are final and exact.
      final_charged = l.charged(closing);
      EXPECT_EQ(final_charged, st->kept[closing].load()) << "delta " << closing;
      EXPECT_LE(st->most_kept[closing].load(), st->budget_of[closing].load())
          << "delta " << closing << " was overdrawn";
      ++checked;
    }
    // Before the correction, the provisional budget held every charge.
    EXPECT_LE(st->most_kept[*next].load(), provisional) << "delta " << *next << " overdrawn";
    const std::int64_t exact = provisional + static_cast<std::int64_t>(rng() % 200);
    ASSERT_TRUE(l.correct(exact));
    st->budget_of[*next].store(exact);
  }
  st->stop = true;
  local.join();
  for (const pid_t c : children)
    EXPECT_EQ(test::wait_exit(c), 0);
  EXPECT_GT(checked, 20u) << "too few deltas closed to show anything";
  EXPECT_GT(st->charges.load(), 10'000u);
  ::munmap(st, sizeof(shared_state));
}

// A writer killed inside a delta keeps it from going quiet (its charge may have become
// space in use); its owner, which sees it dead, leaves for it.
TEST(SpaceLedger, AWriterKilledInsideADeltaIsLeftForByItsOwner) {
  struct two_writers {
    ledger_words words;
    writer_words pins[2];
  };
  auto* sh = static_cast<two_writers*>(::mmap(nullptr, sizeof(two_writers), PROT_READ | PROT_WRITE,
                                              MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(sh, MAP_FAILED);
  *sh = {};
  const auto view = [sh] {
    return ledger(sh->words, reinterpret_cast<std::byte*>(sh->pins), 2, sizeof(writer_words));
  };
  ledger l = view();
  ASSERT_TRUE(l.transition(1000));
  test::signal_pipe ready;
  const pid_t victim = test::fork_child([&] {
    auto c = view().try_charge(1, 300);
    if (!c || !*c) return 1;
    ready.notify();
    ::pause();
    return 0;
  });
  ASSERT_NE(ready.wait(), 0);
  ::kill(victim, SIGKILL);
  EXPECT_EQ(test::wait_exit(victim), 128 + SIGKILL);
  ASSERT_TRUE(l.transition(1000));
  EXPECT_FALSE(l.quiet(1)) << "the dead writer is still inside";
  EXPECT_EQ(l.transition(1000).error(), std::errc::resource_unavailable_try_again);
  EXPECT_EQ(l.charged(1), 300);
  l.leave(1);  // what the owner does for a writer it finds dead
  EXPECT_TRUE(l.quiet(1));
  EXPECT_EQ(l.charged(1), 300) << "its cost stays charged: its space may be in use";
  EXPECT_TRUE(l.transition(1000));
  ::munmap(sh, sizeof(two_writers));
}

}  // namespace
}  // namespace keel::space
