#include "torture.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <thread>

#include "cache_workload.hpp"
#include "keel/io/fault_filesystem.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/lock/atomic_append.hpp"
#include "keel/lock/memory_map.hpp"
#include "kv_workload.hpp"
#include "process.hpp"

namespace keel::torture {

using namespace std::chrono_literals;
using lock::entity;

std::string_view to_string(mode m) noexcept {
  switch (m) {
    case mode::kill:
      return "kill";
    case mode::powerloss:
      return "powerloss";
    case mode::io_errors:
      return "io-errors";
    case mode::corrupt:
      return "corrupt";
    case mode::fork:
      return "fork";
    case mode::mixed:
      return "mixed";
  }
  return "?";
}

std::string_view to_string(workload w) noexcept {
  switch (w) {
    case workload::atomic_append:
      return "atomic_append";
    case workload::memory_map:
      return "memory_map";
    case workload::cache:
      return "cache";
    case workload::kv:
      return "kv";
  }
  return "?";
}

bool applies(mode m, workload w) noexcept {
  if (m == mode::fork || m == mode::mixed) return w == workload::cache;
  return !(m == mode::corrupt && w == workload::cache);
}

std::vector<mode> all_modes() {
  return {mode::kill, mode::powerloss, mode::io_errors, mode::corrupt, mode::fork, mode::mixed};
}
std::vector<workload> all_workloads() {
  return {workload::atomic_append, workload::memory_map, workload::cache, workload::kv};
}

bool mode_from(std::string_view s, mode& out) noexcept {
  for (mode m : all_modes()) {
    if (to_string(m) == s) {
      out = m;
      return true;
    }
  }
  return false;
}

bool workload_from(std::string_view s, workload& out) noexcept {
  for (workload w : all_workloads()) {
    if (to_string(w) == s) {
      out = w;
      return true;
    }
  }
  return false;
}

namespace {

using detail::exit_status;
using detail::spawn;
using detail::wait_for;

constexpr std::uint32_t entity_count = 4;
using failure_text = std::optional<std::string>;

failure_text fail(const char* format, ...) __attribute__((format(printf, 1, 2)));
failure_text fail(const char* format, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buf, sizeof buf, format, ap);
  va_end(ap);
  return std::string(buf);
}

// ---- The oracle: what every process of a cycle knows about who holds what ----

// In memory shared by the processes of a cycle (an anonymous shared map made before they
// fork). A process that a lock call let in marks each entity with its pid; finding another
// live process's mark there means two holders at once.
struct shared_oracle {
  std::atomic<std::uint32_t> holder[entity_count];
  std::atomic<std::uint32_t> doomed[8];  // pids about to be killed (their marks may linger)
  std::atomic<std::uint32_t> stop;
  std::atomic<std::uint32_t> freeze;  // the pid that stops once it holds a set, to be killed
  std::atomic<std::uint32_t> frozen;  // it has stopped holding one
  std::atomic<std::uint32_t> violations;
  std::atomic<std::uint64_t> acquisitions;
  std::atomic<std::uint32_t> message_taken;
  char message[512];

  void report(const char* format, ...) __attribute__((format(printf, 2, 3))) {
    violations.fetch_add(1);
    if (message_taken.exchange(1) != 0) return;
    va_list ap;
    va_start(ap, format);
    std::vsnprintf(message, sizeof message, format, ap);
    va_end(ap);
  }
  bool is_doomed(std::uint32_t pid) const noexcept {
    for (const auto& d : doomed) {
      if (d.load() == pid) return true;
    }
    return false;
  }
  void doom(std::uint32_t pid) noexcept {
    for (auto& d : doomed) {
      std::uint32_t none = 0;
      if (d.compare_exchange_strong(none, pid)) return;
    }
  }
  // After a lock call returned `set` to `me`: nobody else alive may hold any of it.
  bool enter(std::span<const entity> set, std::uint32_t me) noexcept {
    for (const entity e : set) {
      const std::uint32_t was = holder[e.value].exchange(me);
      if (was != 0 && !is_doomed(was)) {
        report("two holders of entity %llu at once: pids %u and %u",
               static_cast<unsigned long long>(e.value), was, me);
        return false;
      }
    }
    acquisitions.fetch_add(1);
    return true;
  }
  bool leave(std::span<const entity> set, std::uint32_t me) noexcept {
    for (const entity e : set) {
      std::uint32_t mine = me;
      if (!holder[e.value].compare_exchange_strong(mine, 0)) {
        report("entity %llu was taken from pid %u by pid %u while held",
               static_cast<unsigned long long>(e.value), me, mine);
        return false;
      }
    }
    return true;
  }
};

class oracle_map {
 public:
  oracle_map() {
    void* p = ::mmap(nullptr, sizeof(shared_oracle), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    o_ = new (p) shared_oracle{};
  }
  ~oracle_map() { ::munmap(o_, sizeof(shared_oracle)); }
  oracle_map(const oracle_map&) = delete;
  oracle_map& operator=(const oracle_map&) = delete;
  shared_oracle& operator*() const noexcept { return *o_; }
  shared_oracle* operator->() const noexcept { return o_; }

 private:
  shared_oracle* o_;
};

// ---- The lock under test ----

struct places {
  std::string dir;      // the lock's files
  std::string map_dir;  // memory_map's maps
};

// Empties both places (between cycles whose users are all gone: their maps are garbage).
void start_afresh(const places& at) {
  std::filesystem::remove_all(at.dir);
  std::filesystem::remove_all(at.map_dir);
  std::filesystem::create_directories(at.dir);
  std::filesystem::create_directories(at.map_dir);
}

result<std::unique_ptr<lock::shared_fs_mutex>> open_lock(workload w, const places& at,
                                                         io::filesystem& fs) {
  const std::string path = at.dir + "/lock";
  if (w == workload::atomic_append) {
    auto m = lock::atomic_append::open(path, fs);
    if (!m) return std::unexpected(m.error());
    return std::unique_ptr<lock::shared_fs_mutex>(std::move(*m));
  }
  lock::memory_map::options o;
  o.map_directory = at.map_dir;
  o.fs = &fs;
  auto m = lock::memory_map::open(path, o);
  if (!m) return std::unexpected(m.error());
  return std::unique_ptr<lock::shared_fs_mutex>(std::move(*m));
}

std::vector<entity> random_set(std::mt19937_64& rng) {
  std::vector<entity> set;
  const std::uint32_t first = static_cast<std::uint32_t>(rng() % entity_count);
  set.emplace_back(first);
  if (rng() % 2 == 0) set.emplace_back((first + 1 + rng() % (entity_count - 1)) % entity_count);
  return set;
}

std::vector<entity> every_entity() {
  std::vector<entity> set;
  for (std::uint32_t e = 0; e < entity_count; ++e)
    set.emplace_back(e);
  return set;
}

void hold_for_a_moment(std::mt19937_64& rng) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(rng() % 150);
  while (std::chrono::steady_clock::now() < until) {
  }
}

// A user that locks random sets until told to stop (or `rounds` times), checking the
// oracle inside each hold. Exit codes: 0 fine, 3 open failed, 4 lock failed, 5 two holders.
//
// `errors_expected`: its own I/O fails on purpose, so its lock calls may fail.
// `timeouts_allowed`: another user's I/O fails; an unlock that failed may keep that user's
// entities locked until it exits (entities_guard::unlock), so a wait may time out.
int hammer(workload w, const places& at, shared_oracle& o, std::uint64_t seed, io::filesystem& fs,
           int rounds, bool errors_expected, bool timeouts_allowed = false) {
  auto m = open_lock(w, at, fs);
  if (!m) {
    if (errors_expected) return 0;
    o.report("a user could not open the lock: %s", m.error().message().c_str());
    return 3;
  }
  std::mt19937_64 rng(seed);
  const auto me = static_cast<std::uint32_t>(::getpid());
  for (int i = 0; o.stop.load() == 0 && (rounds < 0 || i < rounds); ++i) {
    const std::vector<entity> set = random_set(rng);
    auto g = (*m)->lock(set, 5s);
    if (!g) {
      if (errors_expected || (timeouts_allowed && g.error() == std::errc::timed_out)) continue;
      o.report("lock failed: %s", g.error().message().c_str());
      return 4;
    }
    if (!o.enter(set, me)) return 5;
    if (o.freeze.load() == me) {
      o.frozen.store(1);
      for (;;)
        ::pause();  // until the SIGKILL (or the alarm) comes
    }
    hold_for_a_moment(rng);
    if (!o.leave(set, me)) return 5;
    (void)g->unlock();
  }
  return 0;
}

// After recovery: a new user gets every entity within `limit` (nothing lost), and while it
// holds them, no live process is marked as holding any (nothing doubled).
failure_text check_recovered(workload w, const places& at, shared_oracle* o,
                             lock::shared_fs_mutex* existing, std::chrono::milliseconds limit) {
  std::unique_ptr<lock::shared_fs_mutex> own;
  if (existing == nullptr) {
    auto m = open_lock(w, at, io::os());
    if (!m) return fail("reopening after recovery failed: %s", m.error().message().c_str());
    own = std::move(*m);
    existing = own.get();
  }
  auto g = existing->lock(every_entity(), limit);
  if (!g) {
    return fail("a lock was lost: a new user could not get every entity within %lld ms: %s",
                static_cast<long long>(limit.count()), g.error().message().c_str());
  }
  if (o != nullptr) {
    for (std::uint32_t e = 0; e < entity_count; ++e) {
      const std::uint32_t h = (*o).holder[e].load();
      if (h != 0 && !o->is_doomed(h)) {
        return fail("a lock was doubled: entity %u is held by pid %u and by the checker", e, h);
      }
      (*o).holder[e].store(0);
    }
  }
  return std::nullopt;
}

// ---- kill ----

// Three users hammer the lock; one is killed, in half the cycles while it holds a set, in the
// others at a random moment once the users are at work; then a fresh user must get
// everything, and the survivors must have seen no double.
failure_text kill_cycle(const config& c, const places& at, std::uint64_t seed,
                        lock::shared_fs_mutex& checker) {
  std::mt19937_64 rng(seed);
  oracle_map o;
  std::array<pid_t, 3> users{};
  for (std::size_t k = 0; k < users.size(); ++k) {
    const std::uint64_t s = rng();
    users[k] = spawn([&] { return hammer(c.what, at, *o, s, io::os(), -1, false); });
  }
  const std::size_t victim = rng() % users.size();
  const auto victim_pid = static_cast<std::uint32_t>(users[victim]);
  o->doom(victim_pid);
  if (rng() % 2 == 0) {
    o->freeze.store(victim_pid);
    (void)detail::wait_until(
        users[victim], [&] { return o->frozen.load() != 0; }, 60s);
  } else {
    const std::uint64_t after = 1 + rng() % 50;
    (void)detail::wait_until(
        users[victim], [&] { return o->acquisitions.load() >= after; }, 60s);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
  }
  ::kill(users[victim], SIGKILL);
  (void)wait_for(users[victim], 10s);
  failure_text f = check_recovered(c.what, at, &*o, &checker, 5s);
  o->stop.store(1);
  for (std::size_t k = 0; k < users.size(); ++k) {
    if (k == victim) continue;
    const exit_status s = wait_for(users[k], 15s);
    if (!s.clean() && !f) f = fail("a surviving user %s", s.describe().c_str());
  }
  if (o->violations.load() != 0 && !f) f = std::string(o->message);
  return f;
}

// ---- powerloss ----

// A user works on the fault seam until the power goes at a random operation (or it runs
// out of work, and the power goes then); the files are rebuilt as they would survive (torn
// in half the cycles); a new user must reopen them and get everything.
failure_text powerloss_cycle(const config& c, const places& at, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const std::string root = at.dir + "/root";
  const std::string shadow = at.dir + "/shadow";
  start_afresh(at);
  std::filesystem::create_directories(root);
  if (rng() % 2 == 0) {
    // A lock file that exists already (durable, empty): its first header is then all that
    // tells it from a stranger's file after a power cut.
    (void)io::file_handle::open((root + "/lock").c_str(),
                                io::open_flags::write | io::open_flags::create);
  }
  const places inside{root, at.map_dir};
  const std::uint64_t nth = 1 + rng() % 120;
  const std::uint64_t child_seed = rng();
  const pid_t pid = spawn([&] {
    io::fault_filesystem fs(io::os(), child_seed);
    if (!fs.track(root, shadow)) return 6;
    io::fault_filesystem::fault crash;
    crash.crash = true;
    crash.nth = nth;
    fs.inject(crash);
    oracle_map o;
    (void)hammer(c.what, inside, *o, child_seed, fs, 40, true);
    fs.crash_now();
  });
  const exit_status s = wait_for(pid, 30s);
  if (!(s.signal == SIGKILL)) return fail("the user that lost power %s", s.describe().c_str());
  io::fault_filesystem::crash_options how;
  how.torn = rng() % 2 == 0;
  how.seed = rng();
  auto r = io::fault_filesystem::restore(root, shadow, how);
  if (!r) return fail("restore failed: %s", r.error().message().c_str());
  failure_text f = check_recovered(c.what, inside, nullptr, nullptr, 5s);
  if (f) *f += how.torn ? " (torn writes kept)" : " (unsynced writes lost)";
  return f;
}

// ---- io-errors ----

// A witness hammers the lock on the real filesystem while a user on the fault seam has its
// N-th operation fail (once, or from then on; EIO or ENOSPC). The faulty user may see
// errors, but it must not crash or hang, and the oracle must see no double; after the fault
// clears, a new user gets everything.
failure_text io_errors_cycle(const config& c, const places& at, std::uint64_t seed,
                             std::uint64_t cycle) {
  std::mt19937_64 rng(seed);
  oracle_map o;
  io::fault_filesystem::fault bad;
  // Every N from 1 to 240 in turn (the faulty user's 20 rounds make about 200 operations),
  // each once and then forever.
  bad.nth = 1 + (cycle / 2) % 240;
  bad.repeat = cycle % 2 == 0 ? io::fault_filesystem::fault::repeat::once
                              : io::fault_filesystem::fault::repeat::forever;
  bad.error = rng() % 3 == 0 ? ENOSPC : EIO;
  const std::uint64_t s1 = rng(), s2 = rng();
  const pid_t witness =
      spawn([&] { return hammer(c.what, at, *o, s1, io::os(), -1, false, true); });
  const pid_t faulty = spawn([&] {
    io::fault_filesystem fs(io::os(), s2);
    fs.inject(bad);
    return hammer(c.what, at, *o, s2, fs, 20, true);
  });
  const exit_status fs = wait_for(faulty, 30s);
  o->stop.store(1);
  const exit_status ws = wait_for(witness, 30s);
  const char* how = bad.repeat == io::fault_filesystem::fault::repeat::once ? "once" : "forever";
  const auto where = [&](failure_text f) {
    if (f) {
      *f += " (operation " + std::to_string(bad.nth) + " failing " + how + " with " +
            std::strerror(bad.error) + ")";
    }
    return f;
  };
  if (o->violations.load() != 0) return where(std::string(o->message));
  if (!fs.clean()) return where(fail("the user whose I/O failed %s", fs.describe().c_str()));
  if (!ws.clean()) return where(fail("the witness %s", ws.describe().c_str()));
  return where(check_recovered(c.what, at, &*o, nullptr, 5s));
}

// ---- corrupt ----

bool is_clear_error(const error& e) {
  return (e == keel::errc::corrupt || e == keel::errc::not_keel_file ||
          e == keel::errc::unsupported_version) &&
         !e.path().empty();
}

// A live user holds entity 0; others have come and gone (released and dead records). Then
// one of the lock's files is damaged: bits flipped, a range zeroed, or the file cut short.
// A new user must either be refused with a clear error naming the file, or wait for the
// holder: never get entity 0 while the holder lives where checksums guard the format, and
// never crash or hang.
failure_text corrupt_cycle(const config& c, const places& at, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  start_afresh(at);
  {
    // History: released records, and a dead user's.
    oracle_map o;
    const pid_t gone = spawn([&] {
      auto m = open_lock(c.what, at, io::os());
      if (!m) return 3;
      auto g = (*m)->lock({entity(2), entity(3)});
      if (!g) return 4;
      g->release();
      ::kill(::getpid(), SIGKILL);
      return 0;
    });
    (void)wait_for(gone, 10s);
  }
  int ready[2];
  int done[2];
  if (::pipe(ready) != 0 || ::pipe(done) != 0) return fail("pipe: %s", std::strerror(errno));
  const pid_t holder = spawn([&] {
    ::close(ready[0]);
    ::close(done[1]);  // or it would never see the end of `done`
    auto m = open_lock(c.what, at, io::os());
    if (!m) return 3;
    for (int i = 0; i < 3; ++i) {
      auto g = (*m)->lock({entity(1)});
      if (!g) return 4;
    }
    auto g = (*m)->lock({entity(0)});
    if (!g) return 4;
    char byte = 1;
    if (::write(ready[1], &byte, 1) != 1) return 7;
    if (::read(done[0], &byte, 1) < 0) return 7;
    return 0;
  });
  ::close(ready[1]);
  ::close(done[0]);
  char byte = 0;
  const bool holding = ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  failure_text f;
  if (!holding) {
    f = fail("the holder could not take its lock before the damage");
  } else {
    // The files keel wrote for this lock.
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(at.dir)) {
      if (e.is_regular_file()) files.push_back(e.path().string());
    }
    for (const auto& e : std::filesystem::directory_iterator(at.map_dir)) {
      if (e.is_regular_file()) files.push_back(e.path().string());
    }
    std::sort(files.begin(), files.end());
    const std::string victim = files[rng() % files.size()];
    const auto size = static_cast<std::uint64_t>(std::filesystem::file_size(victim));
    std::string damage;
    auto file = io::file_handle::open(victim.c_str(), io::open_flags::read_write);
    if (!file) return fail("open %s: %s", victim.c_str(), file.error().message().c_str());
    const std::uint64_t kind = size == 0 ? 2 : rng() % 3;
    if (kind == 0) {
      const int flips = 1 + static_cast<int>(rng() % 3);
      for (int k = 0; k < flips; ++k) {
        // Half the flips land in the last 512 bytes, where the live records are (a file
        // of mostly header would otherwise rarely be hit where it matters).
        const std::uint64_t tail = std::min<std::uint64_t>(size, 512);
        const std::uint64_t at_byte = rng() % 2 == 0 ? size - tail + rng() % tail : rng() % size;
        std::byte b{};
        (void)file->read_at(static_cast<off_t>(at_byte), std::span(&b, 1));
        b ^= std::byte{static_cast<unsigned char>(1u << (rng() % 8))};
        (void)file->write_at(static_cast<off_t>(at_byte), std::span(&b, 1));
        damage += "bit flipped at " + std::to_string(at_byte) + "; ";
      }
    } else if (kind == 1) {
      const std::uint64_t from = rng() % size;
      const std::uint64_t len = 1 + rng() % std::min<std::uint64_t>(size - from, 600);
      std::vector<std::byte> zeros(len);
      (void)file->write_at(static_cast<off_t>(from), zeros);
      damage = "zeroed [" + std::to_string(from) + ", " + std::to_string(from + len) + ")";
    } else {
      const std::uint64_t to = size == 0 ? 0 : rng() % size;
      (void)file->truncate(static_cast<off_t>(to));
      damage = "cut to " + std::to_string(to) + " bytes";
    }
    const std::string what = std::filesystem::path(victim).filename().string() + ": " + damage;
    // Checksums guard atomic_append's records; a truncation can remove a record whole.
    const bool must_refuse = c.what == workload::atomic_append && kind != 2;
    oracle_map verdict;
    const pid_t checker = spawn([&] {
      auto m = open_lock(c.what, at, io::os());
      if (!m) {
        if (is_clear_error(m.error())) return 0;
        verdict->report("opening the damaged lock: unclear error: %s", m.error().message().c_str());
        return 5;
      }
      auto g = (*m)->lock({entity(0)}, 100ms);
      if (g) {
        if (!must_refuse) return 0;
        verdict->report("entity 0 granted while its holder lives: a wrong answer");
        return 5;
      }
      if (g.error() == std::errc::timed_out || is_clear_error(g.error())) return 0;
      verdict->report("locking on the damaged lock: unclear error: %s",
                      g.error().message().c_str());
      return 5;
    });
    const exit_status s = wait_for(checker, 20s);
    if (verdict->violations.load() != 0) {
      f = std::string(verdict->message) + " (" + what + ")";
    } else if (!s.clean()) {
      f = "the user of the damaged lock " + s.describe() + " (" + what + ")";
    }
  }
  ::close(done[1]);
  (void)wait_for(holder, 10s);
  return f;
}

// ---- the write-back cache ----

// kill: the writer is killed at a random moment; what its successful fsyncs covered must be
// in the file. powerloss: the power goes at a random operation of the writer (torn writes in
// half the cycles); the same must survive. io-errors: the writer's N-th operation fails, once
// or from then on; a failed write-out must come back from the next fsync, so what a
// successful one covered is in the file.
failure_text cache_cycle(const config& c, const places& at, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  start_afresh(at);
  const std::string root = at.dir + "/root";
  const std::string shadow = at.dir + "/shadow";
  std::filesystem::create_directories(root);
  const std::string data = root + "/data";
  detail::cache_run run;
  const std::uint64_t child_seed = rng();
  std::string how;
  if (c.how == mode::fork) {
    detail::aio_writer w = detail::random_writer(rng());
    w.window = std::max(w.window, 2u);
    w.fork_every = 1 + static_cast<int>(rng() % 40);
    how = "fork every " + std::to_string(w.fork_every) + " writes, " +
          std::string(aio::to_string(w.engine)) + (w.cache ? " with the cache" : "");
    const pid_t pid = spawn([&] { return run.write(data, io::os(), child_seed, 400, w); });
    const exit_status s = wait_for(pid, 60s);
    if (!s.clean()) return fail("the forking writer %s (%s)", s.describe().c_str(), how.c_str());
    failure_text f = run.check(data, true);
    if (f) *f += " (" + how + ")";
    return f;
  }
  if (c.how == mode::mixed) {
    // Two writers, each its own engine and settings, on the two halves of the blocks.
    std::vector<pid_t> pids;
    for (std::uint32_t half = 0; half < 2; ++half) {
      detail::aio_writer w = detail::random_writer(rng());
      w.first_block = half * 32;
      w.block_count = 32;
      how += std::string(half == 0 ? "" : " and ") + std::string(aio::to_string(w.engine)) +
             (w.cache ? "+cache" : "") + " window " + std::to_string(w.window);
      const std::uint64_t seed_of_writer = rng();
      pids.push_back(spawn([&] { return run.write(data, io::os(), seed_of_writer, 2000, w); }));
    }
    const bool killing = rng() % 4 != 0;
    if (killing) {
      for (const pid_t pid : pids) {
        std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 20000));
        ::kill(pid, SIGKILL);
      }
    }
    for (const pid_t pid : pids) {
      const exit_status s = wait_for(pid, 60s);
      if (!killing && !s.clean())
        return fail("a writer %s (%s)", s.describe().c_str(), how.c_str());
    }
    how += killing ? ", killed" : ", finished";
    failure_text f = run.check(data, !killing);
    if (f) *f += " (" + how + ")";
    return f;
  }
  if (c.how == mode::kill) {
    const pid_t pid = spawn([&] { return run.write(data, io::os(), child_seed, 4000); });
    std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 20000));
    ::kill(pid, SIGKILL);
    (void)wait_for(pid, 10s);
    how = "killed";
  } else {
    io::fault_filesystem::fault bad;
    bad.nth = 1 + rng() % 300;
    if (c.how == mode::powerloss) {
      bad.crash = true;
      how = "power cut at operation " + std::to_string(bad.nth);
    } else {
      bad.repeat = rng() % 2 == 0 ? io::fault_filesystem::fault::repeat::once
                                  : io::fault_filesystem::fault::repeat::forever;
      bad.error = rng() % 3 == 0 ? ENOSPC : EIO;
      bad.partial = rng() % 4 == 0;
      how = "operation " + std::to_string(bad.nth) + " failing " +
            (bad.repeat == io::fault_filesystem::fault::repeat::once ? "once" : "forever") +
            " with " + std::strerror(bad.error) + (bad.partial ? " after a short transfer" : "");
    }
    const pid_t pid = spawn([&] {
      io::fault_filesystem fs(io::os(), child_seed);
      if (!fs.track(root, shadow)) return 6;
      fs.inject(bad);
      const int code = run.write(data, fs, child_seed, 200);
      if (c.how == mode::powerloss) fs.crash_now();
      return code;
    });
    const exit_status s = wait_for(pid, 60s);
    if (c.how == mode::powerloss) {
      if (s.signal != SIGKILL) return fail("the writer that lost power %s", s.describe().c_str());
      io::fault_filesystem::crash_options cut;
      cut.torn = rng() % 2 == 0;
      cut.seed = rng();
      auto r = io::fault_filesystem::restore(root, shadow, cut);
      if (!r) return fail("restore failed: %s", r.error().message().c_str());
      how += cut.torn ? ", torn writes kept" : ", unsynced writes lost";
    } else if (!s.clean()) {
      return fail("the writer whose I/O failed %s (%s)", s.describe().c_str(), how.c_str());
    }
  }
  failure_text f = run.check(data);
  if (f) *f += " (" + how + ")";
  return f;
}

}  // namespace

outcome run(const config& c, const std::function<void(std::uint64_t)>& progress) {
  base::planted.store(c.plant);
  outcome out;
  const std::string name = "keel-torture-" + std::to_string(::getpid()) + "-" +
                           std::string(to_string(c.how)) + "-" + std::string(to_string(c.what));
  const places at{c.directory + "/" + name, c.map_directory + "/" + name};
  std::filesystem::remove_all(at.dir);
  std::filesystem::create_directories(at.dir);
  std::filesystem::create_directories(at.map_dir);
  if (!applies(c.how, c.what)) return out;
  std::unique_ptr<lock::shared_fs_mutex> checker;
  if (c.how == mode::kill && c.what != workload::cache && c.what != workload::kv) {
    auto m = open_lock(c.what, at, io::os());
    if (!m) {
      out.failures.push_back({c.seed, "opening the lock failed: " + m.error().message()});
      return out;
    }
    checker = std::move(*m);
  }
  for (std::uint64_t i = 0; i < c.cycles; ++i) {
    const std::uint64_t seed = c.seed + i;
    failure_text f;
    if (c.what == workload::cache) {
      f = cache_cycle(c, at, seed);
    } else if (c.what == workload::kv) {
      start_afresh(at);
      f = detail::kv_cycle(c.how, at.dir, at.map_dir, seed);
    } else {
      switch (c.how) {
        case mode::kill:
          f = kill_cycle(c, at, seed, *checker);
          break;
        case mode::powerloss:
          f = powerloss_cycle(c, at, seed);
          break;
        case mode::io_errors:
          f = io_errors_cycle(c, at, seed, seed);
          break;
        case mode::corrupt:
          f = corrupt_cycle(c, at, seed);
          break;
        case mode::fork:
        case mode::mixed:
          break;  // keel::aio's (applies)
      }
    }
    ++out.cycles;
    if (progress) progress(out.cycles);
    if (f) {
      out.failures.push_back({seed, *f});
      if (c.stop_at_first_failure) break;
    }
  }
  checker.reset();
  base::planted.store(base::planted_bug::none);
  std::error_code ignored;
  std::filesystem::remove_all(at.dir, ignored);
  std::filesystem::remove_all(at.map_dir, ignored);
  return out;
}

}  // namespace keel::torture
