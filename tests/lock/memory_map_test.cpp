// What only memory_map has: a map file with a first and a last user, and the safe degrade.

#include "keel/lock/memory_map.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <thread>
#include <vector>

#include "keel/io/file_handle.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using namespace std::chrono_literals;
using test::fork_child;
using test::temp_dir;
using test::wait_exit;

// Maps a test's users create, in a map directory of the test's own (tests run in parallel).
std::size_t maps_in(const std::string& map_dir) {
  std::size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(map_dir)) {
    if (e.path().filename().string().rfind("keel-mm-", 0) == 0) ++n;
  }
  return n;
}

void increment(const io::file_handle& f) {
  std::uint64_t v = 0;
  (void)f.read_at(0, std::as_writable_bytes(std::span(&v, 1)));
  std::this_thread::yield();
  ++v;
  if (!f.write_at(0, std::as_bytes(std::span(&v, 1)))) std::abort();
}

TEST(MemoryMap, FirstUserCreatesTheMapLastUserRemovesIt) {
  temp_dir dir;
  temp_dir maps("/dev/shm");
  memory_map::options o;
  o.map_directory = maps.path().string();
  {
    auto a = memory_map::open(dir.file("lock"), o);
    ASSERT_TRUE(a) << a.error().message();
    EXPECT_FALSE((*a)->is_degraded());
    EXPECT_EQ(maps_in(o.map_directory), 1u);
    {
      auto b = memory_map::open(dir.file("lock"), o);
      ASSERT_TRUE(b);
      EXPECT_EQ(maps_in(o.map_directory), 1u);  // the second user shares it
      auto g = (*a)->lock({entity(1)});
      ASSERT_TRUE(g);
      std::thread([&] { EXPECT_FALSE((*b)->try_lock({entity(1)})); }).join();
    }
    EXPECT_EQ(maps_in(o.map_directory), 1u);  // a is still there
  }
  EXPECT_EQ(maps_in(o.map_directory), 0u);
}

// Users that die instead of closing leave their map behind; the next first user removes it.
TEST(MemoryMap, MapOfKilledUsersIsRemovedByTheNextFirstUser) {
  temp_dir dir;
  temp_dir maps("/dev/shm");
  memory_map::options o;
  o.map_directory = maps.path().string();
  test::signal_pipe ready;
  const pid_t child = fork_child([&] {
    auto m = memory_map::open(dir.file("lock"), o);
    if (!m) return 1;
    auto g = (*m)->lock({entity(1)});
    ready.notify();
    std::this_thread::sleep_for(30s);
    return 0;
  });
  ASSERT_EQ(ready.wait(), '!');
  ::kill(child, SIGKILL);
  EXPECT_EQ(wait_exit(child), 128 + SIGKILL);
  EXPECT_EQ(maps_in(o.map_directory), 1u);
  {
    auto m = memory_map::open(dir.file("lock"), o);
    ASSERT_TRUE(m);
    EXPECT_TRUE((*m)->try_lock({entity(1)}));  // a fresh map: the dead holder is gone too
    EXPECT_EQ(maps_in(o.map_directory), 1u);
  }
  EXPECT_EQ(maps_in(o.map_directory), 0u);
}

TEST(MemoryMap, ForcedFallbackAloneUsesNoMap) {
  temp_dir dir;
  temp_dir maps("/dev/shm");
  memory_map::options o;
  o.map_directory = maps.path().string();
  o.force_fallback = true;
  auto m = memory_map::open(dir.file("lock"), o);
  ASSERT_TRUE(m) << m.error().message();
  EXPECT_TRUE((*m)->is_degraded());
  EXPECT_EQ(maps_in(o.map_directory), 0u);
  auto g = (*m)->lock({entity(3), entity(4, false)});
  ASSERT_TRUE(g);
  auto plain = memory_map::open(dir.file("lock"));  // joins the degraded lock
  ASSERT_TRUE(plain);
  std::thread([&] {
    auto r = (*plain)->try_lock({entity(3)});
    EXPECT_FALSE(r);
    EXPECT_TRUE((*plain)->is_degraded());
  }).join();
}

// Users hammer one entity on the map; midway a user that asks for the fallback appears.
// Every user must move over without two holders ever being inside at once (the counter
// would lose updates), and nobody may get stuck.
TEST(MemoryMap, DegradeUnderLoadKeepsExclusion) {
  temp_dir dir;
  const std::string lock = dir.file("lock");
  const std::string counter = dir.file("counter");
  (void)io::file_handle::open(counter.c_str(), io::open_flags::read_write | io::open_flags::create);
  constexpr int users = 4;
  constexpr int rounds = 400;
  constexpr int degrader_rounds = 100;
  std::vector<pid_t> pids;
  for (int u = 0; u < users; ++u) {
    pids.push_back(fork_child([&] {
      auto m = memory_map::open(lock);
      if (!m) return 1;
      auto f = io::file_handle::open(counter.c_str(), io::open_flags::read_write);
      if (!f) return 2;
      for (int i = 0; i < rounds; ++i) {
        auto g = (*m)->lock({entity(1)}, 20s);
        if (!g) return 3;
        increment(*f);
        if (i % 4 == 0) std::this_thread::sleep_for(1ms);  // spread the run over ~100 ms
      }
      return (*m)->is_degraded() ? 0 : 4;
    }));
  }
  std::this_thread::sleep_for(20ms);
  pids.push_back(fork_child([&] {
    memory_map::options o;
    o.force_fallback = true;
    auto m = memory_map::open(lock, o);
    if (!m) return 5;
    auto f = io::file_handle::open(counter.c_str(), io::open_flags::read_write);
    if (!f) return 6;
    for (int i = 0; i < degrader_rounds; ++i) {
      auto g = (*m)->lock({entity(1)}, 20s);
      if (!g) return 7;
      increment(*f);
    }
    return 0;
  }));
  for (pid_t p : pids)
    EXPECT_EQ(wait_exit(p), 0);
  auto f = io::file_handle::open(counter.c_str(), io::open_flags::read);
  std::uint64_t v = 0;
  ASSERT_EQ(f->read_at(0, std::as_writable_bytes(std::span(&v, 1))).value(), sizeof v);
  EXPECT_EQ(v, std::uint64_t{users * rounds + degrader_rounds});
}

TEST(MemoryMap, ThreadsRegisterAsSeparateUsers) {
  temp_dir dir;
  auto m = memory_map::open(dir.file("lock"));
  ASSERT_TRUE(m);
  // A shared holder in one thread and another in a second thread: both in; an exclusive
  // request from a third is kept out until both leave.
  auto a = (*m)->lock({entity(9, false)});
  ASSERT_TRUE(a);
  std::thread([&] {
    auto b = (*m)->try_lock({entity(9, false)});
    EXPECT_TRUE(b);
    std::thread([&] { EXPECT_FALSE((*m)->try_lock({entity(9, true)})); }).join();
  }).join();
  std::thread([&] { EXPECT_FALSE((*m)->try_lock({entity(9, true)})); }).join();
  ASSERT_TRUE(a->unlock());
  std::thread([&] { EXPECT_TRUE((*m)->try_lock({entity(9, true)})); }).join();
}

}  // namespace
}  // namespace keel::lock
