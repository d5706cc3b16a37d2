#include "keel/io/mapped_file.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include <pthread.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>

#include "io/map_guard.hpp"
#include "support/process.hpp"

namespace keel::io {

using keel::test::temp_dir;

namespace {

file_handle open_rw(const std::string& path) {
  auto f = file_handle::open(path.c_str(), open_flags::read_write | open_flags::create);
  if (!f) std::abort();
  return std::move(*f);
}

void fill(const file_handle& f, std::size_t size, char c) {
  std::vector<std::byte> data(size, std::byte(c));
  if (!f.write_at(0, data)) std::abort();
}

constexpr int sigbus_seen = 42;

// Allocates page after page until the filesystem says it is full.
void fill_up(const std::string& path) {
  file_handle filler = open_rw(path);
  const auto page = static_cast<off_t>(page_size());
  for (off_t at = 0; filler.allocate(at, page); at += page) {
  }
}

// The guard's tests run in a child: its handler is installed once per process, and a
// SIGBUS it does not catch kills. `body(f, m)` gets a file of `pages` pages and a writable
// map of it; the child's exit code comes back, cannot_set_up when the guard is off.
template <class Body>
int in_guarded_child(const temp_dir& dir, std::size_t pages, Body&& body) {
  const std::string path = dir.path().string() + "/map";
  return keel::test::wait_exit(keel::test::fork_child([&] {
    file_handle f = open_rw(path);
    fill(f, pages * page_size(), 'a');
    auto m = mapped_file::map(f, map_access::read_write);  // installs the guard
    if (!m) return 2;
    if (!map_guard::installed()) return keel::test::cannot_set_up;
    return body(f, *m);
  }));
}

constexpr const char* guard_off =
    "SIGBUS already had a handler (a sanitizer's), so keel's guard stays out";

// Cuts `f` to nothing, and grows it back to `size` bytes after `delay` on another thread:
// a write fault in between is refused (BUS_ADRERR) until then, as btrfs refuses one until
// it has room.
std::thread cut_for_a_moment(const file_handle& f, std::size_t size,
                             std::chrono::milliseconds delay) {
  if (!f.truncate(0)) std::abort();
  return std::thread([&f, size, delay] {
    std::this_thread::sleep_for(delay);
    (void)f.truncate(static_cast<off_t>(size));
  });
}

}  // namespace

TEST(MappedFile, ReadOnlySeesTheFile) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  fill(f, 10'000, 'r');
  auto m = mapped_file::map(f, map_access::read_only);
  ASSERT_TRUE(m) << m.error().message();
  ASSERT_EQ(m->size(), 10'000u);
  EXPECT_EQ(m->bytes()[9'999], std::byte{'r'});
  // Later writes through the file show through a shared map.
  const std::byte z{'z'};
  ASSERT_TRUE(f.write_at(5, std::span(&z, 1)));
  EXPECT_EQ(m->bytes()[5], z);
}

TEST(MappedFile, ReadWriteReachesTheFileCopyOnWriteDoesNot) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  fill(f, 3 * page_size(), 'a');
  {
    auto shared = mapped_file::map(f, map_access::read_write);
    ASSERT_TRUE(shared);
    std::memcpy(shared->data() + 100, "shared", 6);
    ASSERT_TRUE(shared->sync(100, 6));
    ASSERT_TRUE(shared->sync());
    ASSERT_TRUE(shared->sync(0, 0, false));
  }
  {
    auto priv = mapped_file::map(f, map_access::copy_on_write);
    ASSERT_TRUE(priv);
    std::memcpy(priv->data() + 200, "private", 7);
    EXPECT_EQ(std::memcmp(priv->data() + 100, "shared", 6), 0);
  }
  std::vector<std::byte> back(7);
  ASSERT_TRUE(f.read_at(100, back));
  EXPECT_EQ(std::memcmp(back.data(), "shared", 6), 0);
  ASSERT_TRUE(f.read_at(200, back));
  EXPECT_EQ(back, std::vector<std::byte>(7, std::byte{'a'}));
}

TEST(MappedFile, OffsetAndLengthAndEmptyFiles) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  auto empty = mapped_file::map(f, map_access::read_only);
  ASSERT_TRUE(empty);
  EXPECT_EQ(empty->size(), 0u);
  EXPECT_TRUE(empty->bytes().empty());
  fill(f, 4 * page_size(), 'x');
  std::byte marker{'m'};
  ASSERT_TRUE(f.write_at(static_cast<off_t>(2 * page_size()), std::span(&marker, 1)));
  auto part =
      mapped_file::map(f, map_access::read_only, page_size(), static_cast<off_t>(2 * page_size()));
  ASSERT_TRUE(part);
  EXPECT_EQ(part->size(), page_size());
  EXPECT_EQ(part->bytes()[0], marker);
  EXPECT_EQ(mapped_file::map(f, map_access::read_only, 0, 100).error(),
            std::errc::invalid_argument);
  EXPECT_EQ(mapped_file::map(f, map_access::read_only, 0, -4096).error(),
            std::errc::invalid_argument);
  EXPECT_FALSE(mapped_file::map(file_handle{}, map_access::read_only));
}

TEST(MappedFile, WritableMapOfReadOnlyDescriptorIsRefused) {
  temp_dir dir;
  fill(open_rw(dir.file("a")), 4096, 'a');
  auto ro = file_handle::open(dir.file("a").c_str(), open_flags::read);
  ASSERT_TRUE(ro);
  auto m = mapped_file::map(*ro, map_access::read_write);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error(), std::errc::permission_denied);
  EXPECT_TRUE(mapped_file::map(*ro, map_access::copy_on_write));  // private writes are fine
}

TEST(MappedFile, GrowAndRemapKeepsContent) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  auto m = allocate_and_map(f, page_size());
  ASSERT_TRUE(m) << m.error().message();
  std::memcpy(m->data(), "keep me", 7);
  ASSERT_TRUE(allocate_and_remap(f, *m, 64 * page_size()));
  EXPECT_EQ(m->size(), 64 * page_size());
  EXPECT_EQ(f.size().value(), static_cast<off_t>(64 * page_size()));
  EXPECT_EQ(std::memcmp(m->data(), "keep me", 7), 0);
  m->data()[64 * page_size() - 1] = std::byte{'!'};  // the new last page is writable
  ASSERT_TRUE(m->remap(page_size()));                // shrinking works too
  EXPECT_EQ(m->size(), page_size());
  EXPECT_EQ(allocate_and_map(f, 0).error(), std::errc::invalid_argument);

  mapped_file none;
  EXPECT_EQ(none.remap(4096).error(), std::errc::invalid_argument);
  ASSERT_TRUE(allocate_and_remap(f, none, 2 * page_size()));  // maps afresh
  EXPECT_EQ(std::memcmp(none.data(), "keep me", 7), 0);
}

TEST(MappedFile, SubRangesAreChecked) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  auto m = allocate_and_map(f, 2 * page_size());
  ASSERT_TRUE(m);
  EXPECT_TRUE(m->advise(map_advice::random));
  EXPECT_TRUE(m->advise(map_advice::will_need, 10, 100));
  EXPECT_EQ(m->advise(map_advice::normal, 3 * page_size()).error(), std::errc::invalid_argument);
  EXPECT_EQ(m->sync(page_size(), 2 * page_size()).error(), std::errc::invalid_argument);
  EXPECT_TRUE(m->unmap());
  EXPECT_EQ(m->size(), 0u);
  EXPECT_TRUE(m->unmap());  // twice is harmless
}

TEST(MappedFile, MoveTransfersTheMap) {
  temp_dir dir;
  file_handle f = open_rw(dir.file("a"));
  auto m = allocate_and_map(f, page_size());
  ASSERT_TRUE(m);
  std::byte* p = m->data();
  mapped_file other = std::move(*m);
  EXPECT_EQ(other.data(), p);
  EXPECT_EQ(m->data(), nullptr);
  mapped_file third;
  third = std::move(other);
  EXPECT_EQ(third.data(), p);
  third.data()[0] = std::byte{1};
}

// On a full filesystem: allocate_and_map reports no space as an error; a plain map of a
// hole raises SIGBUS on the first store, which is the pitfall the header documents.
TEST(MappedFile, FullFilesystemIsAnErrorNotASignal) {
  temp_dir dir;
  const std::string mnt = dir.path().string();
  const std::size_t fs_size = 64 * page_size();

  const pid_t child = keel::test::fork_child([&] {
    if (!keel::test::mount_private_tmpfs(mnt, fs_size)) return keel::test::cannot_set_up;
    fill_up(mnt + "/filler");
    file_handle f = open_rw(mnt + "/map");
    auto m = allocate_and_map(f, 8 * page_size());
    if (m) return 1;
    if (m.error() != std::errc::no_space_on_device) return 2;
    return 0;
  });
  const int code = keel::test::wait_exit(child);
  if (code == keel::test::cannot_set_up) {
    GTEST_SKIP() << "cannot mount a private tmpfs here (needs CAP_SYS_ADMIN and unshare)";
  }
  EXPECT_EQ(code, 0);

  const pid_t pitfall = keel::test::fork_child([&] {
    if (!keel::test::mount_private_tmpfs(mnt, fs_size)) return keel::test::cannot_set_up;
    fill_up(mnt + "/filler");
    file_handle f = open_rw(mnt + "/map");
    if (!f.truncate(static_cast<off_t>(8 * page_size()))) return 3;  // a hole, no blocks
    auto m = mapped_file::map(f, map_access::read_write);
    if (!m) return 4;
    // Report the signal as an exit code (sanitizers would otherwise turn it into a report).
    struct sigaction sa {};
    sa.sa_handler = [](int) { ::_exit(sigbus_seen); };
    ::sigaction(SIGBUS, &sa, nullptr);
    m->data()[0] = std::byte{1};  // no block can back this page
    return 5;
  });
  EXPECT_EQ(keel::test::wait_exit(pitfall), sigbus_seen);
}

// The guard over writable maps (io/map_guard.hpp): a write fault the kernel refuses for a
// moment is retried, not a death. A file cut short under its map stands in for btrfs
// refusing a page fault's reservation: both raise SIGBUS with BUS_ADRERR, and both go away
// once the cause does (here, the file grown back).
TEST(MapGuard, AWriteFaultRefusedForAMomentIsWaitedOut) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 8, [](const file_handle& f, mapped_file& m) {
    std::thread grow = cut_for_a_moment(f, 8 * page_size(), std::chrono::milliseconds(200));
    const std::uint64_t before = map_guard::retried();
    const auto start = std::chrono::steady_clock::now();
    m.data()[5 * page_size()] = std::byte{'z'};  // past the end until `grow` runs
    const auto waited = std::chrono::steady_clock::now() - start;
    grow.join();
    if (map_guard::retried() == before) return 4;
    if (waited < std::chrono::milliseconds(150)) return 5;
    std::byte b{};
    if (!f.read_at(static_cast<off_t>(5 * page_size()), std::span(&b, 1))) return 6;
    return b == std::byte{'z'} ? 0 : 7;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 0) << "128 + 7: killed by SIGBUS, the guard did not wait";
}

// A refusal that lasts is not waited out for ever: after the give-up time (20 s, shortened
// here) the default action kills, as without the guard.
TEST(MapGuard, ARefusalThatLastsStillKillsInTheEnd) {
  temp_dir dir;
  const auto start = std::chrono::steady_clock::now();
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::milliseconds(300));
    if (!f.truncate(0)) return 3;
    m.data()[page_size()] = std::byte{'z'};
    return 4;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 128 + SIGBUS);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300));
}

// An armed escape (map_guard::arm): a refusal that lasts past the call's deadline jumps back
// to where the call armed it, instead of the default action after the give-up time; the
// process lives on, SIGBUS unblocked, so a later refusal is waited out again.
TEST(MapGuard, ARefusalPastAnArmedDeadlineEscapesInsteadOfKilling) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::seconds(60));  // the escape must come first
    if (!f.truncate(0)) return 3;
    const std::uint64_t before = map_guard::escaped();
    static map_guard::escape e;
    const auto start = std::chrono::steady_clock::now();
    if (sigsetjmp(e.at, 0) == 0) {
      map_guard::arm(e, start + std::chrono::milliseconds(200));
      std::atomic_ref(m.data()[page_size()]).store(std::byte{'z'});  // refused while cut
      map_guard::disarm();
      return 4;  // the store went through: nothing was refused
    }
    const auto waited = std::chrono::steady_clock::now() - start;
    if (map_guard::escaped() != before + 1) return 5;
    if (waited < std::chrono::milliseconds(200)) return 6;
    // SIGBUS is not left blocked, and the escape is spent: a refusal now is waited out.
    sigset_t mask;
    if (::pthread_sigmask(SIG_SETMASK, nullptr, &mask) != 0 || sigismember(&mask, SIGBUS)) {
      return 7;
    }
    std::thread grow = cut_for_a_moment(f, 2 * page_size(), std::chrono::milliseconds(100));
    m.data()[page_size()] = std::byte{'y'};
    grow.join();
    return map_guard::escaped() == before + 1 ? 0 : 8;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 0) << "128 + 7: killed by SIGBUS, the escape was not taken";
}

// run_escapable inside an armed escape leaves that one armed: before, it replaced it and
// disarmed it after, so a refusal later in the outer call was waited out and killed (a
// compaction's escapable counters, run from inside a commit's escape, would do that).
TEST(MapGuard, RunEscapableInsideAnArmedEscapeLeavesItArmed) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::milliseconds(300));
    static map_guard::escape e;
    if (sigsetjmp(e.at, 0) != 0) return map_guard::escape_in_force() ? 3 : 0;  // escaped
    map_guard::arm(e, std::chrono::steady_clock::now());
    const bool ran = map_guard::run_escapable(std::chrono::steady_clock::now(), [&] {
      std::atomic_ref(m.data()[0]).store(std::byte{'x'});  // room: it goes through
    });
    if (!ran || !map_guard::escape_in_force()) return 4;
    if (!f.truncate(0)) return 5;
    m.data()[page_size()] = std::byte{'z'};  // refused: jumps to `e`
    return 6;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 0) << "128 + 7: killed by SIGBUS, the outer escape was gone";
}

// run_escapable inside a no_escape takes its own escape (the jump lands in its own frame,
// inside the scope, which stays whole), and the scope holds back any other after it: a slot
// taken under a mutex stores escapably so (store::impl::take_slot).
TEST(MapGuard, RunEscapableInsideANoEscapeTakesItsOwn) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::seconds(60));  // the escape must come first
    const map_guard::no_escape held;
    if (!f.truncate(0)) return 3;
    const bool ran = map_guard::run_escapable(std::chrono::steady_clock::now(), [&] {
      std::atomic_ref(m.data()[page_size()]).store(std::byte{'z'});  // refused while cut
    });
    if (ran) return 4;                            // the store went through: nothing was refused
    return map_guard::escape_in_force() ? 0 : 5;  // still held back
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 0) << "128 + 7: killed by SIGBUS, the escape was not taken";
}

// Inside a no_escape scope the escape is not taken: the refusal is waited out and given up
// on as without one (the code there holds something a jump would leave held).
TEST(MapGuard, ANoEscapeScopeKeepsTheEscapeShut) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::milliseconds(300));
    if (!f.truncate(0)) return 3;
    static map_guard::escape e;
    if (sigsetjmp(e.at, 0) != 0) return 4;  // escaped: the scope did not hold it back
    map_guard::arm(e, std::chrono::steady_clock::now());
    const map_guard::no_escape held;
    m.data()[page_size()] = std::byte{'z'};
    return 5;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 128 + SIGBUS);
}

// Faults that each clear at once do not add up to the give-up time: a hot word faults again
// after every write-back, and a long-lived writer must not be killed for it.
TEST(MapGuard, FaultsThatEachClearDoNotAddUpToTheGiveUpTime) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file& m) {
    map_guard::set_give_up(std::chrono::milliseconds(500));
    for (int round = 0; round < 5; ++round) {  // 5 faults of 100 ms in 2.5 s, at one address
      std::thread grow = cut_for_a_moment(f, 2 * page_size(), std::chrono::milliseconds(100));
      m.data()[page_size()] = std::byte{'z'};
      grow.join();
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
    return 0;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 0) << "128 + 7: killed by SIGBUS, the faults were added up";
}

// A SIGBUS at an address that is not in one of keel's writable maps still kills, as it
// would without keel: the guard hands it to the default action.
TEST(MapGuard, ASigbusOutsideKeelsMapsStillKills) {
  temp_dir dir;
  const int code = in_guarded_child(dir, 2, [](const file_handle& f, mapped_file&) {
    void* raw = ::mmap(nullptr, 2 * page_size(), PROT_READ | PROT_WRITE, MAP_SHARED, f.fd(), 0);
    if (raw == MAP_FAILED) return 3;
    if (!f.truncate(0)) return 4;
    static_cast<volatile char*>(raw)[page_size()] = 'z';
    return 5;
  });
  if (code == keel::test::cannot_set_up) GTEST_SKIP() << guard_off;
  EXPECT_EQ(code, 128 + SIGBUS);

  // Sent, not a fault: returning would not repeat it, so the guard must not swallow it.
  const int sent = in_guarded_child(dir, 1, [](const file_handle&, mapped_file&) {
    ::kill(::getpid(), SIGBUS);
    return 3;
  });
  EXPECT_EQ(sent, 128 + SIGBUS);
}

}  // namespace keel::io
