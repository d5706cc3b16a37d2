#include "keel/lock/memory_map.hpp"

#include <immintrin.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
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
constexpr std::uint32_t map_version = 2;
constexpr std::size_t map_header_size = 4096;
constexpr std::size_t map_degraded_at = 64;   // u64 mirror of the lock file's flag
constexpr std::size_t map_next_user_at = 72;  // u64: where the next registrant starts looking
constexpr std::size_t user_size = 64;
constexpr std::size_t users_at = map_header_size;
constexpr std::size_t bitset_words = memory_map::max_users / 64;
// Writer word and waiter count on one cache line, then the reader set, then the waiter set.
constexpr std::size_t slot_size = 64 + 2 * bitset_words * 8;
constexpr std::size_t slots_at = users_at + memory_map::max_users * user_size;
constexpr std::size_t map_size = slots_at + memory_map::slots * slot_size;
constexpr off_t liveness_base = off_t{1} << 40;
constexpr std::uint32_t no_slot = 0xffffffffu;
constexpr std::uint32_t wants_exclusive = 0x80000000u;

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
  std::uint32_t wake;   // futex word: bumped by whoever wakes this user
  std::uint32_t wants;  // the slot it sleeps on (| wants_exclusive), or no_slot
  std::uint32_t clean;  // non-zero: the last user of this index left no mark in any slot
  std::uint32_t reserved;
  std::uint64_t waiting_since_ns;  // CLOCK_MONOTONIC when it started waiting on `wants`
};
static_assert(sizeof(user_entry) <= user_size);

// A slot is free when its writer word is 0 and no reader bit is set. A writer stores its
// user index + 1 (compare-and-swap from 0), then checks the reader set; a reader sets its
// bit, then checks the writer word. Each side publishes before it looks (seq_cst), so at
// least one of two racing lockers sees the other and backs off: never both inside.
//
// Waiters sleep on their own futex word (user_entry::wake) after setting their bit in the
// slot's waiter set and counting themselves in. A releaser that finds waiters hands the slot
// to the next one after itself in user order (round robin, so every waiter gets its turn):
// an exclusive waiter gets the writer word set to its index + 1 before it is woken, so a
// releaser that comes straight back cannot take the slot again in front of it.
struct slot_ref {
  std::uint64_t* base;
  [[nodiscard]] std::atomic_ref<std::uint64_t> writer() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[0]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> waiter_count() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[1]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> spinners() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[2]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> spin_budget_ns() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[3]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> woken() const noexcept {
    return std::atomic_ref<std::uint64_t>(base[4]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> readers(std::size_t word) const noexcept {
    return std::atomic_ref<std::uint64_t>(base[8 + word]);
  }
  [[nodiscard]] std::atomic_ref<std::uint64_t> waiters(std::size_t word) const noexcept {
    return std::atomic_ref<std::uint64_t>(base[8 + bitset_words + word]);
  }
  //! Whether any reader other than user `u` is in.
  [[nodiscard]] bool other_readers(std::uint32_t u) const noexcept {
    std::uint64_t any = 0;
    for (std::size_t w = 0; w < bitset_words; ++w)
      any |= readers(w).load();
    if (any == 0) return false;  // the common case: one pass, no branch per word
    for (std::size_t w = 0; w < bitset_words; ++w) {
      std::uint64_t bits = readers(w).load();
      if (w == u / 64) bits &= ~(std::uint64_t{1} << (u % 64));
      if (bits != 0) return true;
    }
    return false;
  }
};

// A sleeper that has waited this long is handed the slot; before, a release only wakes it
// and anyone may take the slot first (short holds then run back to back without a
// hand-over, and a long wait always ends in one).
constexpr std::uint64_t hand_over_after_ns = 1'000'000;

std::uint64_t monotonic_ns() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000 +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

std::size_t slot_of(std::uint64_t value) noexcept {
  static_assert((memory_map::slots & (memory_map::slots - 1)) == 0);
  return static_cast<std::size_t>((value * 0x9e3779b97f4a7c15ULL) >> 52) & (memory_map::slots - 1);
}

void futex_wake(std::uint32_t* word) noexcept {
  ::syscall(SYS_futex, word, FUTEX_WAKE, 1, nullptr, nullptr, 0);
}

// Sleeps while *word == expected, at most `for_at_most`.
void futex_wait(std::uint32_t* word, std::uint32_t expected,
                std::chrono::nanoseconds for_at_most) noexcept {
  const auto ns = std::max<std::int64_t>(for_at_most.count(), 1000);
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  ::syscall(SYS_futex, word, FUTEX_WAIT, expected, &ts, nullptr, 0);
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
  if (sorted.size() == 1) {  // the common case, without the merging loop
    small[0] = {static_cast<std::uint32_t>(slot_of(sorted[0].value)), sorted[0].is_exclusive()};
    return std::span(small.data(), 1);
  }
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

struct thread_user final : base::thread_state {
  io::file_handle lock_fd;  // this thread's descriptor of the lock file (degrade probe)
  io::file_handle map_fd;   // holds this user's liveness byte; probes others'
  std::uint32_t index = 0;
  bool registered = false;
  // How many times this thread holds each slot (two entities of its sets may share one).
  std::vector<std::uint32_t> exclusive_holds;
  std::vector<std::uint32_t> shared_holds;
  user_entry* entry = nullptr;  // in the map, which outlives this state
  std::uint32_t pid = 0;

  thread_user() = default;
  thread_user(const thread_user&) = delete;
  thread_user& operator=(const thread_user&) = delete;
  // Leaving with nothing held (not even a released guard's slots) spares the next user of
  // this index the sweep of every slot. A forked child's copy is the parent's: hands off.
  ~thread_user() override {
    if (entry == nullptr || pid != base::self().pid) return;
    const auto none = [](const std::vector<std::uint32_t>& v) {
      return std::all_of(v.begin(), v.end(), [](std::uint32_t n) { return n == 0; });
    };
    if (none(exclusive_holds) && none(shared_holds)) {
      std::atomic_ref<std::uint32_t>(entry->clean).store(1);
    }
  }
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
  base::per_thread_states threads;

  // The map-in-use marker is dropped only when the degraded flags are set and no slot
  // carries a mark of this instance's users. A locker checks the flags again after it took
  // its slots (both sides publish, then look: seq_cst), so no map guard outlives the marker.
  std::mutex switch_mutex;
  bool map_in_use_released = false;     // under switch_mutex
  std::vector<std::uint32_t> my_users;  // under switch_mutex: indexes this instance registered
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

  [[nodiscard]] std::atomic_ref<std::uint32_t> wake_word(std::uint32_t u) const noexcept {
    return std::atomic_ref<std::uint32_t>(user(u)->wake);
  }
  [[nodiscard]] std::atomic_ref<std::uint32_t> wants_word(std::uint32_t u) const noexcept {
    return std::atomic_ref<std::uint32_t>(user(u)->wants);
  }
  void wake(std::uint32_t u) const noexcept {
    wake_word(u).fetch_add(1);
    futex_wake(&user(u)->wake);
  }

  // The first waiter of slot `s` after user `from` in circular user order, not `from`.
  static std::uint32_t next_waiter(const slot_ref& s, std::uint32_t from) noexcept {
    const std::uint32_t start = (from + 1) % max_users;
    const std::uint64_t from_start = ~std::uint64_t{0} << (start % 64);
    for (std::size_t k = 0; k <= bitset_words; ++k) {
      const std::size_t w = (start / 64 + k) % bitset_words;
      std::uint64_t bits = s.waiters(w).load();
      if (k == 0) bits &= from_start;
      if (k == bitset_words) bits &= ~from_start;  // the wrap-around: before `start`
      if (w == from / 64) bits &= ~(std::uint64_t{1} << (from % 64));
      if (bits != 0) return static_cast<std::uint32_t>(w * 64 + __builtin_ctzll(bits));
    }
    return no_slot;
  }

  // Called by user `from` after it released slot `i` (or backed off from it; seq_cst): if the
  // slot is free and someone sleeps on it, hands it to the next waiter. Exclusive waiters get
  // the writer word; shared waiters are woken to take their bits.
  void hand_on(std::size_t i, std::uint32_t from) const noexcept {
    const slot_ref s = slot(i);
    if (s.waiter_count().load() == 0) return;
    if (s.writer().load() != 0) return;    // taken again: its holder hands on
    if (s.other_readers(no_slot)) return;  // the last reader out hands on
    const std::uint32_t target = next_waiter(s, from);
    if (target == no_slot) return;
    const auto slot_index = static_cast<std::uint32_t>(i);
    if (wants_word(target).load() == (slot_index | wants_exclusive)) {
      const std::uint64_t since =
          std::atomic_ref<std::uint64_t>(user(target)->waiting_since_ns).load();
      if (monotonic_ns() - since < hand_over_after_ns) {
        // Not waited long: wake it to compete, unless a woken sleeper is on its way already
        // (one wake-up per round, not one per release).
        std::uint64_t none = 0;
        if (s.woken().compare_exchange_strong(none, target + 1)) wake(target);
        return;
      }
      std::uint64_t expected = 0;
      if (!s.writer().compare_exchange_strong(expected, target + 1)) return;
      // The target may have given up meanwhile; then its grant is withdrawn by it or here.
      if ((s.waiters(target / 64).load() & (std::uint64_t{1} << (target % 64))) == 0) {
        withdraw_grant(i, target);
        return;
      }
      wake(target);
      return;
    }
    for (std::size_t w = 0; w < bitset_words; ++w) {
      std::uint64_t bits = s.waiters(w).load();
      while (bits != 0) {
        const auto u = static_cast<std::uint32_t>(w * 64 + __builtin_ctzll(bits));
        bits &= bits - 1;
        if (wants_word(u).load() != (slot_index | wants_exclusive)) wake(u);
      }
    }
  }

  // Takes back a grant to `u` that nobody will collect, and hands the slot on.
  void withdraw_grant(std::size_t i, std::uint32_t u) const noexcept {
    std::uint64_t granted = u + 1;
    if (slot(i).writer().compare_exchange_strong(granted, 0)) hand_on(i, u);
  }

  // Removes every mark user `u` left in slot `i`, and hands the slot on if that freed it.
  void clear_user_in(std::size_t i, std::uint32_t u) const noexcept {
    const slot_ref s = slot(i);
    const std::uint64_t bit = std::uint64_t{1} << (u % 64);
    if ((s.waiters(u / 64).fetch_and(~bit) & bit) != 0) s.waiter_count().fetch_sub(1);
    std::uint64_t was_woken = u + 1;
    s.woken().compare_exchange_strong(was_woken, 0);
    std::uint64_t w = u + 1;
    bool freed = s.writer().compare_exchange_strong(w, 0);
    freed |= (s.readers(u / 64).fetch_and(~bit) & bit) != 0;
    if (freed) hand_on(i, u);
  }

  // One attempt at slot `r` for `me`; counts the hold on success.
  bool take(thread_user& me, const slot_request& r) const noexcept {
    const slot_ref s = slot(r.slot);
    const std::uint32_t u = me.index;
    if (r.exclusive) {
      std::uint32_t& held = me.exclusive_holds[r.slot];
      if (held != 0) {
        ++held;
        return true;
      }
      std::uint64_t expected = 0;
      // A writer word already naming us is a hand-over from the last holder.
      if (!s.writer().compare_exchange_strong(expected, u + 1) && expected != u + 1) return false;
      if (s.other_readers(u)) {
        s.writer().store(0);
        hand_on(r.slot, u);
        return false;
      }
      ++held;
      return true;
    }
    std::uint32_t& held = me.shared_holds[r.slot];
    if (held != 0) {
      ++held;
      return true;
    }
    const std::uint64_t bit = std::uint64_t{1} << (u % 64);
    s.readers(u / 64).fetch_or(bit);
    const std::uint64_t w = s.writer().load();
    if (w == 0 || (w == u + 1 && me.exclusive_holds[r.slot] != 0)) {
      ++held;
      return true;
    }
    s.readers(u / 64).fetch_and(~bit);
    hand_on(r.slot, u);  // our bit may have turned a writer away
    return false;
  }

  // Releases one hold of slot `r` by `me`.
  void give(thread_user& me, const slot_request& r) const noexcept {
    const slot_ref s = slot(r.slot);
    if (r.exclusive) {
      if (--me.exclusive_holds[r.slot] != 0) return;
      s.writer().store(0);  // seq_cst: published before the waiter count is read
    } else {
      if (--me.shared_holds[r.slot] != 0) return;
      s.readers(me.index / 64).fetch_and(~(std::uint64_t{1} << (me.index % 64)));
    }
    hand_on(r.slot, me.index);
  }

  // Spins for slot `r` while nobody sleeps on it, one spinner per slot at a time, for an
  // adaptive budget: doubled when a spin ends in the slot (holds are short: spinning beats
  // a sleep and a wake-up), halved when it runs out (holds are long: sleep at once).
  bool spin_for(thread_user& me, const slot_request& r, const io::countdown& cd) const noexcept {
    using std::chrono::nanoseconds;
    constexpr std::uint64_t least = 1'000, most = 200'000, initial = 20'000;
    const slot_ref s = slot(r.slot);
    if (s.waiter_count().load() != 0) return false;
    if (s.spinners().fetch_add(1) != 0) {
      s.spinners().fetch_sub(1);
      return false;
    }
    std::uint64_t budget = s.spin_budget_ns().load(std::memory_order_relaxed);
    if (budget == 0) budget = initial;
    const auto until = std::chrono::steady_clock::now() + nanoseconds(budget);
    bool got = false;
    for (unsigned i = 1;; ++i) {
      const std::uint64_t w = s.writer().load(std::memory_order_relaxed);
      if ((w == 0 || w == me.index + 1) && take(me, r)) {
        got = true;
        break;
      }
      _mm_pause();
      if (i % 16 == 0) {
        if (s.waiter_count().load(std::memory_order_relaxed) != 0) break;
        const auto now = std::chrono::steady_clock::now();
        if (now >= until || (!cd.is_infinite() && now >= cd.expiry())) break;
      }
    }
    budget = got ? std::min(budget * 2, most) : std::max(budget / 2, least);
    s.spin_budget_ns().store(budget, std::memory_order_relaxed);
    s.spinners().fetch_sub(1);
    return got;
  }

  enum class wait_outcome { taken, expired, degraded };

  result<std::optional<std::uint64_t>> lock_on_map(std::span<const entity> sorted,
                                                   const io::countdown& cd, bool spin) noexcept;

  // How long a sleeper waits before it looks for dead holders again: its own doubling
  // interval, but no less than 5 ms per sleeper on the slot (together they look about 200
  // times a second however many they are, not in bursts that would delay the live holder),
  // jittered by ±50 % so they spread out.
  static std::chrono::nanoseconds recovery_pause(std::chrono::milliseconds own,
                                                 std::uint64_t sleepers) noexcept {
    const auto base = std::max<std::chrono::nanoseconds>(
        own, std::chrono::milliseconds(5) *
                 static_cast<std::int64_t>(std::min<std::uint64_t>(sleepers, 1000)));
    std::uniform_int_distribution<std::int64_t> jitter(base.count() / 2, base.count() * 3 / 2);
    return std::chrono::nanoseconds(jitter(base::thread_rng()));
  }

  // Sleeps until slot `r` is `me`'s (taken), the deadline passes, or the lock degrades.
  // Holders that died are looked for every `recovery` (doubling up to 320 ms).
  result<wait_outcome> wait_for(thread_user& me, const slot_request& r, const io::countdown& cd,
                                std::chrono::milliseconds& recovery) const noexcept {
    const slot_ref s = slot(r.slot);
    const std::uint32_t u = me.index;
    const std::uint64_t bit = std::uint64_t{1} << (u % 64);
    std::atomic_ref<std::uint64_t>(user(u)->waiting_since_ns).store(monotonic_ns());
    wants_word(u).store(r.slot | (r.exclusive ? wants_exclusive : 0));
    s.waiters(u / 64).fetch_or(bit);
    s.waiter_count().fetch_add(1);  // after the bit: a releaser that counts us finds us
    const auto leave = [&]() noexcept {
      s.waiters(u / 64).fetch_and(~bit);
      s.waiter_count().fetch_sub(1);
      wants_word(u).store(no_slot);
      std::uint64_t me_woken = u + 1;
      s.woken().compare_exchange_strong(me_woken, 0);
    };
    auto next_recovery =
        std::chrono::steady_clock::now() + recovery_pause(recovery, s.waiter_count().load());
    for (;;) {
      const std::uint32_t seen = wake_word(u).load();
      if (take(me, r)) {
        leave();
        return wait_outcome::taken;
      }
      if (degraded() || cd.expired()) {
        leave();
        // Handed the slot as we left: pass it on.
        if (r.exclusive && me.exclusive_holds[r.slot] == 0) withdraw_grant(r.slot, u);
        return degraded() ? wait_outcome::degraded : wait_outcome::expired;
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_recovery) {
        auto rec = recover_blockers(me, r.slot);
        if (!rec) {
          leave();
          if (r.exclusive && me.exclusive_holds[r.slot] == 0) withdraw_grant(r.slot, u);
          return std::unexpected(rec.error());
        }
        recovery = std::min(recovery * 2, std::chrono::milliseconds(320));
        next_recovery = now + recovery_pause(recovery, s.waiter_count().load());
        if (*rec) continue;
      }
      auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(next_recovery - now);
      if (!cd.is_infinite()) nap = std::min(nap, cd.remaining());
      futex_wait(&user(u)->wake, seen, nap);
      std::uint64_t me_woken = u + 1;  // on our way: the next release may wake another
      s.woken().compare_exchange_strong(me_woken, 0);
    }
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
    // Registrants take indexes in turn, so each usually gets the first one it tries.
    const std::size_t start = std::atomic_ref<std::uint64_t>(
                                  *reinterpret_cast<std::uint64_t*>(map.data() + map_next_user_at))
                                  .fetch_add(1) %
                              max_users;
    for (std::size_t k = 0; k < max_users; ++k) {
      const auto u = static_cast<std::uint32_t>((start + k) % max_users);
      auto g = io::try_lock_extent(t.map_fd, liveness_base + u, 1, io::lock_kind::exclusive);
      if (!g) {
        if (detail::is_contention(g.error())) continue;
        return std::unexpected(g.error());
      }
      g->release();  // held for as long as this thread's state lives
      user_entry* e = user(u);
      // A previous user of this index may have died holding slots: clear its marks.
      if (e->pid != 0 && std::atomic_ref<std::uint32_t>(e->clean).load() == 0) {
        for (std::size_t i = 0; i < slots; ++i)
          clear_user_in(i, u);
      }
      std::atomic_ref<std::uint32_t>(e->clean).store(0);
      e->pid = base::self().pid;
      e->tid = tid;
      e->start_time = base::self().start_time;
      wants_word(u).store(no_slot);
      t.exclusive_holds.assign(slots, 0);
      t.shared_holds.assign(slots, 0);
      {
        const std::scoped_lock lock(switch_mutex);
        if (std::find(my_users.begin(), my_users.end(), u) == my_users.end()) {
          my_users.push_back(u);
        }
      }
      t.index = u;
      t.entry = e;
      t.pid = base::self().pid;
      t.registered = true;
      return {};
    }
    return errno_error(EUSERS);
  }

  // Whether user `u` (not this thread) is dead: its liveness byte is free. If so, clears
  // its marks in slot `i` while holding the byte, so no new user can take the index meanwhile.
  result<bool> recover_if_dead(const thread_user& t, std::uint32_t u,
                               std::size_t i) const noexcept {
    if (u == t.index || u >= max_users) return false;
    auto g = io::try_lock_extent(t.map_fd, liveness_base + u, 1, io::lock_kind::exclusive);
    if (!g) {
      if (detail::is_contention(g.error())) return false;
      return std::unexpected(g.error());
    }
    clear_user_in(i, u);
    return true;  // the guard unlocks the byte
  }

  result<bool> recover_blockers(const thread_user& t, std::size_t i) const noexcept {
    const slot_ref s = slot(i);
    bool any = false;
    const std::uint64_t w = s.writer().load();
    if (w != 0) {
      auto r = recover_if_dead(t, static_cast<std::uint32_t>(w - 1), i);
      if (!r) return r;
      any |= *r;
    }
    for (std::size_t word = 0; word < bitset_words; ++word) {
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

  // Whether any slot is held by (or handed to) a user of this instance. Under switch_mutex.
  [[nodiscard]] bool marks_of_my_users() const noexcept {
    for (std::size_t i = 0; i < slots; ++i) {
      const slot_ref s = slot(i);
      const std::uint64_t w = s.writer().load();
      for (const std::uint32_t u : my_users) {
        if (w == u + 1) return true;
        if ((s.readers(u / 64).load() & (std::uint64_t{1} << (u % 64))) != 0) return true;
      }
    }
    return false;
  }

  // Drops this instance's map-in-use marker once nothing of it is on the map any more.
  void release_map_in_use_if_idle() noexcept {
    if (base::self().pid != creator_pid) return;  // the parent's marker, not ours
    const std::scoped_lock lock(switch_mutex);
    if (map_in_use_released || !degraded()) return;
    if (map.size() != 0 && marks_of_my_users()) return;
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
                  static_cast<unsigned>(base::thread_rng()()),
                  static_cast<unsigned>(base::thread_rng()()));
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
    h.version = map_version;
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
  if (std::memcmp(h.magic, map_magic, sizeof h.magic) != 0 || h.version != map_version ||
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
  p->creator_pid = base::self().pid;
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
          std::memcmp(old.boot_id, base::self().boot_id.data(), sizeof old.boot_id) == 0) {
        old.map_path[sizeof old.map_path - 1] = '\0';
        if (std::strncmp(old.map_path, (opts.map_directory + "/keel-mm-").c_str(),
                         opts.map_directory.size() + 9) == 0) {
          (void)io::unlink(old.map_path);
        }
      }
      lockfile_header h{};
      std::memcpy(h.magic, lockfile_magic, sizeof h.magic);
      h.version = format_version;
      std::memcpy(h.boot_id, base::self().boot_id.data(), sizeof h.boot_id);
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
      const bool same_boot = std::memcmp(h.boot_id, base::self().boot_id.data(), 16) == 0;
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
  if (base::self().pid != p.creator_pid) return;  // the parent's markers, not ours
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

// On the map: the token for do_unlock; nullopt: the lock degraded, use the fallback.
result<std::optional<std::uint64_t>> memory_map::impl::lock_on_map(std::span<const entity> sorted,
                                                                   const io::countdown& cd,
                                                                   bool spin) noexcept {
  auto t = mine();
  if (!t) return std::unexpected(t.error());
  thread_user& me = **t;
  if (!me.registered) {
    if (auto r = register_user(me); !r) return std::unexpected(r.error());
  }
  std::array<slot_request, 16> small;  // filled by collect_slots: no zeroing
  std::vector<slot_request> big;
  std::span<slot_request> want = collect_slots(sorted, small, big);

  bool spun = false;        // a lock call spins at most once before it sleeps
  bool have_first = false;  // want[0] was handed to us while we slept
  auto recovery = std::chrono::milliseconds(10);
  auto next_recovery = std::chrono::steady_clock::time_point{};
  for (;;) {
    std::size_t k = have_first ? 1 : 0;
    while (k < want.size() && take(me, want[k]))
      ++k;
    if (k == want.size() && !degraded()) return reinterpret_cast<std::uint64_t>(&me);
    for (std::size_t j = 0; j < k; ++j)
      give(me, want[j]);
    have_first = false;
    if (degraded()) break;  // go and join the others on the fallback
    if (cd.is_zero()) return errc_error(std::errc::operation_would_block);
    // The contended slot first next time, the rest reshuffled.
    std::swap(want[0], want[k]);
    if (want.size() > 2) std::shuffle(want.begin() + 1, want.end(), base::thread_rng());
    if (!spin) {
      if (!spun) {
        spun = true;
        if (spin_for(me, want[0], cd)) {
          have_first = true;
          continue;
        }
      }
      auto w = wait_for(me, want[0], cd, recovery);
      if (!w) return std::unexpected(w.error());
      if (*w == wait_outcome::expired) return detail::contention_error(cd);
      if (*w == wait_outcome::taken) have_first = true;
      continue;
    }
    // Spinning: yield between attempts; now and then look for dead holders.
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_recovery) {
      next_recovery = now + std::chrono::milliseconds(10);
      auto rec = recover_blockers(me, want[0].slot);
      if (!rec) return std::unexpected(rec.error());
      if (*rec) continue;
    }
    if (!cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
    std::this_thread::yield();
  }
  release_map_in_use_if_idle();
  if (!cd.is_infinite() && cd.expired()) return detail::contention_error(cd);
  return std::nullopt;
}

result<std::uint64_t> memory_map::do_lock(std::span<const entity> sorted, const io::countdown& cd,
                                          bool spin) noexcept {
  impl& p = *impl_;
  if (!p.fallback_ready.load(std::memory_order_acquire) && !p.degraded()) {
    auto on_map = p.lock_on_map(sorted, cd, spin);
    if (!on_map) {
      if (p.degraded()) p.release_map_in_use_if_idle();
      return std::unexpected(on_map.error());
    }
    if (*on_map) return **on_map;
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
  // This thread's user (unlocks happen on the locking thread, which keeps its state).
  thread_user& me = *reinterpret_cast<thread_user*>(token);
  std::array<slot_request, 16> small;  // filled by collect_slots: no zeroing
  std::vector<slot_request> big;
  for (const slot_request& r : collect_slots(sorted, small, big))
    p.give(me, r);
  if (p.degraded()) p.release_map_in_use_if_idle();
  return {};
}

}  // namespace keel::lock
