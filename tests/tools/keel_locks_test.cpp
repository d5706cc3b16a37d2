// keel locks, run as a user would: holders and waiters of a keel lock for each kind of
// algorithm, lock_files' dead owners as stale, what cannot be shown, and usage errors.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using namespace std::chrono_literals;
using keel::test::run_program;
using nlohmann::json;

json locks_of(const std::string& path, const std::string& cwd,
              const std::vector<std::string>& more = {}) {
  std::vector<std::string> args = {"locks", path, "--json"};
  args.insert(args.end(), more.begin(), more.end());
  const auto r = run_program(KEEL_BINARY, args, cwd);
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? json::parse(r.out) : json::object();
}

// `keel locks` until `seen` holds of it, within a bound (a waiter is asleep in the kernel
// only some time after it starts: polled, not assumed).
json locks_until(const std::string& path, const std::string& cwd,
                 const std::function<bool(const json&)>& seen,
                 const std::vector<std::string>& more = {}) {
  const auto until = std::chrono::steady_clock::now() + 30s;
  std::vector<std::string> args = {"locks", path, "--json"};
  args.insert(args.end(), more.begin(), more.end());
  json doc = {{"holders", json::array()}};
  do {
    // The file may not be made yet (66): asked again.
    const auto r = run_program(KEEL_BINARY, args, cwd);
    if (r.code == 0) doc = json::parse(r.out);
    if (r.code == 0 && seen(doc)) return doc;
    std::this_thread::sleep_for(10ms);  // polling a state, bounded
  } while (std::chrono::steady_clock::now() < until);
  return doc;
}

std::vector<json> with_state(const json& doc, const std::string& state) {
  std::vector<json> out;
  for (const auto& h : doc["holders"])
    if (h["state"] == state) out.push_back(h);
  return out;
}

// A process that opens `algo` on `path`, locks `name` (waiting for it as long as it takes)
// and holds it until killed.
pid_t holder(const std::string& algo, const std::string& path, const std::string& name,
             keel::test::signal_pipe& holding) {
  return keel::test::fork_child([&] {
    auto m = keel::lock::open_mutex(algo, path);
    if (!m) return 1;
    auto g = (*m)->lock({keel::lock::entity::from_string(name)});
    if (!g) return 2;
    holding.notify('h');
    for (;;)
      ::pause();
  });
}

void kill_and_reap(pid_t pid) {
  ::kill(pid, SIGKILL);
  (void)keel::test::wait_exit(pid);
}

TEST(KeelLocks, ByteRangesHolderAndWaiterByName) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string(), path = dir.file("lock");
  keel::test::signal_pipe held, never;
  const pid_t a = holder("byte_ranges", path, "job", held);
  keel::test::killed_on_failure ga{a};
  ASSERT_EQ(held.wait(), 'h');
  const pid_t b = holder("fcntl", path, "job", never);
  keel::test::killed_on_failure gb{b};
  const json doc = locks_until(
      path, d, [](const json& j) { return !with_state(j, "waits").empty(); }, {"-N", "job"});
  EXPECT_EQ(doc["open_with"], json::array({"byte_ranges or fcntl"}));
  const auto holds = with_state(doc, "holds");
  ASSERT_EQ(holds.size(), 1u) << doc.dump();
  EXPECT_EQ(holds[0]["pid"], a);
  EXPECT_EQ(holds[0]["name"], "job");
  EXPECT_TRUE(holds[0]["exclusive"].get<bool>());
  EXPECT_GT(holds[0]["process_started"].get<std::uint64_t>(), 0u);
  const auto waits = with_state(doc, "waits");
  ASSERT_EQ(waits.size(), 1u) << doc.dump();
  EXPECT_EQ(waits[0]["pid"], b);
  EXPECT_EQ(waits[0]["name"], "job");
  const auto users = doc["users"].get<std::vector<int>>();
  EXPECT_NE(std::find(users.begin(), users.end(), a), users.end());
  EXPECT_NE(std::find(users.begin(), users.end(), b), users.end());
  kill_and_reap(b);
  gb.pid = 0;
  kill_and_reap(a);
  ga.pid = 0;
  const json after = locks_of(path, d);
  EXPECT_TRUE(after["holders"].empty()) << after.dump();
  EXPECT_TRUE(after["open_with"].empty()) << after.dump();
}

TEST(KeelLocks, LockFilesShowsALiveHolderAndADeadOneAsStale) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string(), path = dir.file("locks");
  keel::test::signal_pipe held1, held2;
  const pid_t live = holder("lock_files", path, "alive", held1);
  keel::test::killed_on_failure gl{live};
  ASSERT_EQ(held1.wait(), 'h');
  const pid_t dead = holder("lock_files", path, "dead", held2);
  ASSERT_EQ(held2.wait(), 'h');
  kill_and_reap(dead);
  const json doc = locks_of(path, d, {"-N", "alive", "-N", "dead"});
  EXPECT_TRUE(doc["directory"].get<bool>());
  const auto holds = with_state(doc, "holds");
  ASSERT_EQ(holds.size(), 1u) << doc.dump();
  EXPECT_EQ(holds[0]["pid"], live);
  EXPECT_EQ(holds[0]["name"], "alive");
  EXPECT_EQ(holds[0]["algorithm"], "lock_files");
  EXPECT_FALSE(holds[0]["host"].get<std::string>().empty());
  const auto stale = with_state(doc, "stale");
  ASSERT_EQ(stale.size(), 1u) << doc.dump();
  EXPECT_EQ(stale[0]["pid"], dead);
  EXPECT_EQ(stale[0]["name"], "dead");
  kill_and_reap(live);
  gl.pid = 0;
}

TEST(KeelLocks, FlockDirectoryAndTheWholeFileForm) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  keel::test::signal_pipe held;
  const pid_t a = holder("flock", dir.file("flockdir"), "x", held);
  keel::test::killed_on_failure ga{a};
  ASSERT_EQ(held.wait(), 'h');
  const json doc = locks_of(dir.file("flockdir"), d, {"-N", "x"});
  const auto holds = with_state(doc, "holds");
  ASSERT_EQ(holds.size(), 1u) << doc.dump();
  EXPECT_EQ(holds[0]["algorithm"], "flock");
  EXPECT_EQ(holds[0]["name"], "x");
  EXPECT_EQ(holds[0]["pid"], a);
  kill_and_reap(a);
  ga.pid = 0;
  // `keel lock FILE -- cmd`: flock(1) on the file; the command (the same process) holds it.
  const std::string file = dir.file("whole");
  const pid_t cmd = keel::test::start_program(KEEL_BINARY, {"lock", file, "--", "sleep", "60"},
                                              dir.file("out"), dir.file("err"));
  keel::test::killed_on_failure gc{cmd};
  const json whole =
      locks_until(file, d, [](const json& j) { return !with_state(j, "holds").empty(); });
  const auto wh = with_state(whole, "holds");
  ASSERT_EQ(wh.size(), 1u) << whole.dump();
  EXPECT_TRUE(wh[0]["whole_file"].get<bool>());
  EXPECT_EQ(wh[0]["pid"], cmd);
  kill_and_reap(cmd);
  gc.pid = 0;
}

// A process that opens `algo` on `path` and locks `name` shared, holding it until killed.
pid_t shared_holder(const std::string& algo, const std::string& path, const std::string& name,
                    keel::test::signal_pipe& holding) {
  return keel::test::fork_child([&] {
    auto m = keel::lock::open_mutex(algo, path);
    if (!m) return 1;
    auto g = (*m)->lock({keel::lock::entity::from_string(name, false)});
    if (!g) return 2;
    holding.notify('h');
    for (;;)
      ::pause();
  });
}

std::string bytes_of(const std::string& path) {
  std::string out;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[65536];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;)
    out.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  return out;
}

// Whether a row is of the entity named `name`: by name, or a slot's that holds that name.
bool is_of(const json& h, const std::string& name) {
  if (h.contains("name")) return h["name"] == name;
  if (!h.contains("names_in_slot")) return false;
  for (const auto& n : h["names_in_slot"])
    if (n == name) return true;
  return false;
}

// The algorithms that keep their holders in their own structures (a log, a shared map, a
// semaphore set): holders, shared holders, waiters and dead owners, read from them. Before,
// `keel locks` only said that it could not show them.
class KeelLocksOwnStructures : public ::testing::TestWithParam<std::string> {};

TEST_P(KeelLocksOwnStructures, HoldersWaitersAndTheDead) {
  const std::string algo = GetParam();
  keel::test::temp_dir dir;
  const std::string d = dir.path().string(), path = dir.file("lock");
  keel::test::signal_pipe held, shared_held, never;
  const pid_t a = holder(algo, path, "job", held);
  keel::test::killed_on_failure ga{a};
  ASSERT_EQ(held.wait(), 'h');
  const pid_t s = shared_holder(algo, path, "other", shared_held);
  keel::test::killed_on_failure gs{s};
  ASSERT_EQ(shared_held.wait(), 'h');
  const pid_t w = holder(algo, path, "job", never);
  keel::test::killed_on_failure gw{w};
  const std::vector<std::string> names = {"-N", "job", "-N", "other"};
  const json doc = locks_until(
      path, d, [](const json& j) { return !with_state(j, "waits").empty(); }, names);
  EXPECT_EQ(doc["open_with"], json::array({algo})) << doc.dump();
  for (const auto& n : doc["not_shown"]) {
    EXPECT_EQ(n.get<std::string>().find("locks keel does not take"), std::string::npos)
        << "its own bytes taken for foreign locks: " << doc.dump();
  }
  const auto holds = with_state(doc, "holds");
  ASSERT_EQ(holds.size(), 2u) << doc.dump();
  const json& excl = holds[0]["exclusive"].get<bool>() ? holds[0] : holds[1];
  const json& shrd = holds[0]["exclusive"].get<bool>() ? holds[1] : holds[0];
  EXPECT_TRUE(excl["exclusive"].get<bool>()) << doc.dump();
  EXPECT_FALSE(shrd["exclusive"].get<bool>()) << doc.dump();
  EXPECT_EQ(excl["pid"], a) << doc.dump();
  EXPECT_TRUE(is_of(excl, "job")) << doc.dump();
  EXPECT_GT(excl["process_started"].get<std::uint64_t>(), 0u) << doc.dump();
  EXPECT_TRUE(is_of(shrd, "other")) << doc.dump();
  // sysv's kernel counts shared holders and names none.
  EXPECT_EQ(shrd["pid"], algo == "sysv" ? 0 : s) << doc.dump();
  const auto waits = with_state(doc, "waits");
  ASSERT_EQ(waits.size(), 1u) << doc.dump();
  EXPECT_EQ(waits[0]["pid"], w) << doc.dump();
  if (algo != "sysv") {  // what a semop waits for is in its memory
    EXPECT_TRUE(is_of(waits[0], "job")) << doc.dump();
    EXPECT_TRUE(waits[0]["exclusive"].get<bool>()) << doc.dump();
  }

  // Through a symlink to the lock file, as flock(1) and `keel lock` with no NAME resolve it.
  const std::string link = dir.file("link");
  ASSERT_EQ(::symlink("lock", link.c_str()), 0);
  EXPECT_EQ(with_state(locks_of(link, d), "holds").size(), 2u) << "lost through a link";

  // It only reads: the lock file is as it was.
  const std::string before = bytes_of(path);
  (void)locks_of(path, d);
  EXPECT_EQ(bytes_of(path), before);

  // Killed, the waiter and the holder leave marks (a chunk, a slot) that their death makes
  // stale, never held; sysv's kernel undoes theirs.
  kill_and_reap(w);
  gw.pid = 0;
  kill_and_reap(a);
  ga.pid = 0;
  const json after = locks_of(path, d, names);
  for (const auto& h : after["holders"]) {
    if (h["pid"] == a || h["pid"] == w) {
      EXPECT_EQ(h["state"], "stale") << "a dead process shown holding: " << after.dump();
    }
  }
  if (algo != "sysv") {
    const auto stale = with_state(after, "stale");
    EXPECT_TRUE(std::ranges::any_of(stale, [&](const json& h) { return h["pid"] == a; }))
        << after.dump();
  }
  const auto still = with_state(after, "holds");
  ASSERT_EQ(still.size(), 1u) << after.dump();
  EXPECT_TRUE(is_of(still[0], "other")) << after.dump();
  kill_and_reap(s);
  gs.pid = 0;
  (void)keel::lock::remove_mutex_resources(algo, path);
}

INSTANTIATE_TEST_SUITE_P(Each, KeelLocksOwnStructures,
                         ::testing::Values("atomic_append", "memory_map", "sysv"));

// Review findings: the marks an earlier algorithm left in the file (a log, a map) hid the
// holder of the algorithm that has it open now; a FIFO at the path was opened, letting its
// writer through.
TEST(KeelLocks, AnEarlierUseOfTheFileHidesNoHolder) {
  for (const std::string earlier : {"atomic_append", "memory_map"}) {
    keel::test::temp_dir dir;
    const std::string d = dir.path().string(), path = dir.file("lock");
    // `keel lock` becomes its command: exiting, it leaves its mark for the next locker.
    ASSERT_EQ(run_program(KEEL_BINARY, {"lock", "-a", earlier, path, "job", "--", "true"}, d).code,
              0);
    keel::test::signal_pipe held;
    const pid_t a = holder("byte_ranges", path, "job", held);
    keel::test::killed_on_failure ga{a};
    ASSERT_EQ(held.wait(), 'h');
    const json doc = locks_of(path, d);
    const auto holds = with_state(doc, "holds");
    ASSERT_EQ(holds.size(), 1u) << earlier << ": " << doc.dump();
    EXPECT_EQ(holds[0]["pid"], a);
    EXPECT_EQ(holds[0]["algorithm"], "byte_ranges or fcntl");
    kill_and_reap(a);
    ga.pid = 0;
    (void)keel::lock::remove_mutex_resources(earlier, path);
  }
}

TEST(KeelLocks, AFifoAtThePathIsNotOpened) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string(), fifo = dir.file("fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const pid_t writer = keel::test::fork_child([&] {
    const int fd = ::open(fifo.c_str(), O_WRONLY | O_CLOEXEC);  // waits for a reader
    return fd < 0 ? 1 : 0;
  });
  keel::test::killed_on_failure gw{writer};
  const auto in_open = [&] {
    std::ifstream f("/proc/" + std::to_string(writer) + "/syscall");
    long nr = -1;
    return static_cast<bool>(f >> nr) && nr == SYS_openat;
  };
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (!in_open() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);  // sampling a state, bounded
  ASSERT_TRUE(in_open());
  (void)run_program(KEEL_BINARY, {"locks", fifo}, d);
  EXPECT_TRUE(in_open()) << "keel locks opened the FIFO: its writer went through";
}

// Review findings: a waiter's mode was the first blocked line's; locks keel does not take
// (a POSIX range) were shown as entity holders; a file named like PATH.fallback of another
// lock was shown as memory_map's; a path that is a symlink missed the whole-file holder; a
// name that is not UTF-8 crashed --json.
TEST(KeelLocks, WhatIsNotAnEntityIsNotShownAsOne) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string(), path = dir.file("lock");
  keel::test::signal_pipe held, never, never2, other;
  const pid_t a = holder("byte_ranges", path, "\xff", held);
  keel::test::killed_on_failure ga{a};
  ASSERT_EQ(held.wait(), 'h');
  // A shared waiter and an exclusive one on one entity: the mode of each cannot be told.
  const pid_t w1 = keel::test::fork_child([&] {
    auto m = keel::lock::open_mutex("byte_ranges", path);
    if (!m) return 1;
    auto g = (*m)->lock({keel::lock::entity::from_string("\xff", false)});
    never.notify('x');
    return 0;
  });
  keel::test::killed_on_failure g1{w1};
  const pid_t w2 = holder("byte_ranges", path, "\xff", never2);
  keel::test::killed_on_failure g2{w2};
  // Another lock whose file is named like this one's fallback.
  const pid_t o = holder("byte_ranges", path + ".fallback", "o", other);
  keel::test::killed_on_failure go{o};
  ASSERT_EQ(other.wait(), 'h');
  const json doc = locks_until(
      path, d, [](const json& j) { return with_state(j, "waits").size() == 2; }, {"-N", "\xff"});
  const auto waits = with_state(doc, "waits");
  ASSERT_EQ(waits.size(), 2u) << doc.dump();
  for (const auto& w : waits)
    EXPECT_TRUE(w["exclusive"].is_null()) << "a mode told that cannot be: " << doc.dump();
  for (const auto& h : doc["holders"])
    EXPECT_NE(h["pid"], o) << "another lock's holder shown: " << doc.dump();
  const auto holds = with_state(doc, "holds");
  ASSERT_EQ(holds.size(), 1u) << doc.dump();
  EXPECT_EQ(holds[0]["pid"], a);
  for (const pid_t p : {w1, w2, o, a})
    kill_and_reap(p);
  g1.pid = g2.pid = go.pid = ga.pid = 0;

  // A POSIX lock of bytes 100-109 on a file nobody locks with keel.
  const std::string plain = dir.file("plain");
  keel::test::signal_pipe locked, done;
  const pid_t posix = keel::test::fork_child([&] {
    const int fd = ::open(plain.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 100;
    fl.l_len = 10;
    if (fd < 0 || ::fcntl(fd, F_SETLK, &fl) != 0) return 1;
    locked.notify('l');
    (void)done.wait();
    return 0;
  });
  keel::test::killed_on_failure gp{posix};
  ASSERT_EQ(locked.wait(), 'l');
  const json p = locks_of(plain, d);
  EXPECT_TRUE(p["holders"].empty()) << p.dump();
  done.notify('d');
  EXPECT_EQ(keel::test::wait_exit(posix), 0);
  gp.pid = 0;

  // Through a symlink, as flock(1) locks.
  const std::string link = dir.file("link");
  ASSERT_EQ(::symlink("plain", link.c_str()), 0);
  const pid_t cmd = keel::test::start_program(KEEL_BINARY, {"lock", link, "--", "sleep", "60"},
                                              dir.file("out"), dir.file("err"));
  keel::test::killed_on_failure gc{cmd};
  const json whole =
      locks_until(link, d, [](const json& j) { return !with_state(j, "holds").empty(); });
  ASSERT_EQ(with_state(whole, "holds").size(), 1u) << whole.dump();
  kill_and_reap(cmd);
  gc.pid = 0;
}

TEST(KeelLocks, UsageAndMissingPaths) {
  keel::test::temp_dir dir;
  const std::string d = dir.path().string();
  EXPECT_EQ(run_program(KEEL_BINARY, {"locks"}, d).code, 2);
  const auto missing = run_program(KEEL_BINARY, {"locks", dir.file("nope")}, d);
  EXPECT_EQ(missing.code, 66);
  EXPECT_NE(missing.err.find("keel locks:"), std::string::npos) << missing.err;
  EXPECT_NE(missing.err.find("nope"), std::string::npos) << missing.err;
  const auto table = run_program(KEEL_BINARY, {"locks", d}, d);
  EXPECT_EQ(table.code, 0) << table.err;
  EXPECT_NE(table.out.find("no holders"), std::string::npos) << table.out;
  const auto help = run_program(KEEL_BINARY, {"locks", "--help"}, d);
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("--json"), std::string::npos);
}

}  // namespace
