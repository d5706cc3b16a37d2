// Readers that may not write the store's files, as LMDB's MDB_RDONLY serves them: a store on a
// read-only mount, or one whose directory and files the reader may only read. Such a reader
// builds an index of its own and changes nothing; a writer that comes later leaves what it
// reads whole, and while another user has the store open it stands aside with a clear error.

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include "keel/io/fault_filesystem.hpp"
#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "kv/store_impl.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::signal_pipe;
using test::temp_dir;
using test::wait_exit;
using test_support::open_ok;

std::string value_of(int i, char fill, std::size_t size) {
  std::string v = std::to_string(i) + ":";
  v.resize(size, fill);
  return v;
}

// Every file under `dir` with its bytes: what "nothing changed" compares.
std::map<std::string, std::string> contents(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) {
      out[e.path().string()] = "(not a file)";
      continue;
    }
    std::ifstream f(e.path(), std::ios::binary);
    std::ostringstream bytes;
    bytes << f.rdbuf();
    out[e.path().string()] = bytes.str();
  }
  return out;
}

// In a forked child only: `view` shows `from` read-only (a bind mount, remounted read-only, in
// a mount namespace of the child's own). False where privileges do not allow it.
bool read_only_view(const std::string& from, const std::string& view) {
  std::filesystem::create_directories(view);
  if (::unshare(CLONE_NEWNS) != 0) return false;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return false;
  if (::mount(from.c_str(), view.c_str(), nullptr, MS_BIND, nullptr) != 0) return false;
  return ::mount(nullptr, view.c_str(), nullptr, MS_REMOUNT | MS_BIND | MS_RDONLY, nullptr) == 0;
}

// A store of `keys` keys (values of `size` bytes, over several 1 MiB segments), closed.
void make_store(const std::string& path, int keys, std::size_t size) {
  auto s = open_ok(path, test_support::manual_compaction());
  ASSERT_TRUE(s);
  for (int i = 0; i < keys; ++i)
    ASSERT_TRUE(s->put("k" + std::to_string(i), value_of(i, 'a', size)));
  ASSERT_TRUE(s->erase("k0"));
}

// Reads every key of a store made by make_store: 0, or the number of the failed check.
int reads_as_made(store& s, int keys, std::size_t size) {
  if (auto v = s.get("k0"); v || v.error() != errc::not_found) return 20;
  for (int i = 1; i < keys; ++i) {
    auto v = s.get("k" + std::to_string(i));
    if (!v) return 21;
    if (*v != value_of(i, 'a', size)) return 22;
  }
  auto t = s.begin();
  if (!t) return 23;
  std::size_t seen = 0;
  std::string cursor;
  for (;;) {
    auto page = t->scan(cursor, 64);
    if (!page) return 24;
    seen += page->items.size();
    if (page->done) break;
    cursor = page->cursor;
  }
  return seen == static_cast<std::size_t>(keys - 1) ? 0 : 25;
}

// Runs `body(view)` in a child that sees `d`'s data/ read-only at `view` (the store at
// view + "/s"), and expects it to return 0 (a numbered check's failure otherwise); skips where
// the view cannot be made. `body` may set up more first (returning cannot_set_up skips).
template <class F>
void expect_in_read_only_view(const temp_dir& d, F&& body) {
  const pid_t child = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    return body(d.file("view"));
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot make a read-only view here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

// A store made by make_store at data/s in `d` (data/ is what a read-only view shows).
std::string store_under_data(const temp_dir& d, int keys, std::size_t size) {
  std::filesystem::create_directories(d.file("data"));
  make_store(d.file("data/s"), keys, size);
  return d.file("data/s");
}

options read_only_options() {
  options o = test_support::small();
  o.read_only = true;
  o.create_if_missing = false;
  return o;
}

TEST(KvReadOnlyReader, ReadsAStoreOnAReadOnlyMountAndChangesNothing) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount needs root";
  temp_dir d;
  const std::string path = store_under_data(d, 300, 8000);
  const auto before = contents(d.file("data"));
  const pid_t child = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    const std::string view = d.file("view/s");
    // An opener that would write is refused, saying why.
    auto w = store::open(view, test_support::small());
    if (w || w.error() != std::errc::read_only_file_system) return 2;
    auto s = store::open(view, read_only_options());
    if (!s) return 3;
    if (const int r = reads_as_made(**s, 300, 8000); r != 0) return r;
    if (auto p = (*s)->put("k1", "x"); p || p.error() != errc::read_only) return 4;
    if ((*s)->compact() || (*s)->checkpoint()) return 5;
    if (!(*s)->stats() || !(*s)->verify()) return 6;
    // Two at once, and another after them.
    auto second = store::open(view, read_only_options());
    if (!second || reads_as_made(**second, 300, 8000) != 0) return 7;
    s->reset();
    second->reset();
    auto third = store::open(view, read_only_options());
    if (!third || reads_as_made(**third, 300, 8000) != 0) return 8;
    return 0;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
  EXPECT_TRUE(contents(d.file("data")) == before) << "a read-only reader changed the store";
}

TEST(KvReadOnlyReader, ReadsAStoreWhoseDirectoryItMayOnlyRead) {
  if (::geteuid() != 0) GTEST_SKIP() << "becoming another user (nobody) needs root";
  temp_dir d;
  const std::string path = d.file("s");
  make_store(path, 100, 3000);
  std::filesystem::permissions(d.path(), std::filesystem::perms(0755));
  const auto before = contents(d.path().string());
  const pid_t child = fork_child([&] {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return test::cannot_set_up;
    auto w = store::open(path, test_support::small());
    if (w || w.error() != std::errc::permission_denied) return 2;
    auto s = store::open(path, read_only_options());
    if (!s) return 3;
    if (const int r = reads_as_made(**s, 100, 3000); r != 0) return r;
    return 0;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot become nobody here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
  EXPECT_TRUE(contents(d.path().string()) == before) << "a read-only reader changed the store";
}

// A volume at its quota, or full, refuses every write (btrfs refuses even a rewrite in place
// under a qgroup at its limit, issue 46): a reader needs none. It read nothing before (it
// failed "lock at offset 0: Disk quota exceeded"); now it builds its index of its own, as on
// a read-only mount.
TEST(KvReadOnlyReader, ReadsAStoreOnAVolumeThatRefusesEveryWrite) {
  struct refusal {
    int error;
    bool rebooted;      // its lock and index to make (else both there)
    const char* where;  // the files refused (their paths contain it)
  };
  for (const refusal& f : {refusal{EDQUOT, true, ""}, refusal{ENOSPC, true, ""},
                           refusal{EDQUOT, false, ""}, refusal{EDQUOT, true, "/index"}}) {
    SCOPED_TRACE(std::to_string(f.error) + (f.rebooted ? " rebooted " : " ") + f.where);
    temp_dir d;
    const std::string path = d.file("s");
    make_store(path, 100, 3000);
    if (f.rebooted) {
      // As after a reboot: the next opener makes them.
      std::filesystem::remove(path + "/lock");
      std::filesystem::remove(path + "/index");
    }
    io::fault_filesystem fs(io::os());
    fs.inject({.on = io::fs_ops::mutating(),
               .repeat = io::fault_filesystem::fault::repeat::forever,
               .error = f.error,
               .path_contains = path + f.where});
    options o = read_only_options();
    o.fs = &fs;
    {
      auto s = store::open(path, o);
      ASSERT_TRUE(s) << s.error().message();
      EXPECT_EQ(reads_as_made(**s, 100, 3000), 0);
    }
    // A writer is refused with what the volume says.
    options w = test_support::small();
    w.fs = &fs;
    auto writer = store::open(path, w);
    ASSERT_FALSE(writer);
    EXPECT_EQ(writer.error(), std::error_code(f.error, std::system_category()))
        << writer.error().message();
  }
}

// The reader opens; a writer then opens, overwrites every key and compacts the old segments
// away: the reader still reads the store as it was, from maps of files compaction only
// unlinked (zeroed or truncated, they would read as damage, or fault).
TEST(KvReadOnlyReader, AWriterThatComesLaterLeavesItsViewWhole) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount needs root";
  temp_dir d;
  const std::string path = store_under_data(d, 400, 10000);  // about four segments
  signal_pipe opened;
  signal_pipe go;
  const pid_t child = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    auto s = store::open(d.file("view/s"), read_only_options());
    opened.notify(s ? '!' : 'x');
    if (!s) return 2;
    if (go.wait() != '!') return 3;
    if (const int r = reads_as_made(**s, 400, 10000); r != 0) return r;
    // Its verify walks what it reads: the segments its index has, unlinked or not.
    verify_report rep;
    if (auto v = (*s)->verify(&rep); !v) return 4;
    return 0;
  });
  test::killed_on_failure guard{child};
  const char c = opened.wait();
  if (c == 0) {
    guard.pid = 0;
    ASSERT_EQ(wait_exit(child), test::cannot_set_up);
    GTEST_SKIP() << "cannot make a read-only bind mount here";
  }
  ASSERT_EQ(c, '!') << "the reader could not open";
  {
    auto w = open_ok(path, test_support::manual_compaction());
    ASSERT_TRUE(w);
    for (int i = 0; i < 400; ++i)
      ASSERT_TRUE(w->put("k" + std::to_string(i), value_of(i, 'b', 10000)));
    std::uint64_t removed = 0;
    for (int round = 0; round < 3; ++round) {
      auto st = w->compact();
      ASSERT_TRUE(st) << st.error().message();
      removed += st->segments_removed;
    }
    EXPECT_GE(removed, 3u) << "compaction removed too little for the test to mean anything";
    for (int i = 0; i < 400; i += 37)
      ASSERT_EQ(*w->get("k" + std::to_string(i)), value_of(i, 'b', 10000));
  }
  go.notify();
  guard.pid = 0;
  EXPECT_EQ(wait_exit(child), 0) << "the reader's view broke (128 + 7: it faulted)";
}

TEST(KvReadOnlyReader, StandsAsideWhileAnotherUserHasTheStoreOpen) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount needs root";
  temp_dir d;
  const std::string path = store_under_data(d, 10, 100);
  auto w = open_ok(path);
  ASSERT_TRUE(w);
  const pid_t child = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    auto s = store::open(d.file("view/s"), read_only_options());
    if (s) return 2;
    return s.error() == std::errc::device_or_resource_busy ? 0 : 3;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
  w.reset();
  // Once it has gone, the reader opens.
  const pid_t again = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    auto s = store::open(d.file("view/s"), read_only_options());
    return s && reads_as_made(**s, 10, 100) == 0 ? 0 : 4;
  });
  EXPECT_EQ(wait_exit(again), 0);
}

// So too while that user goes on through an index removed from the path by hand (no index
// file: the index's open byte cannot say it is there; its byte of the store file does).
TEST(KvReadOnlyReader, StandsAsideWhileAUserHasTheStoreOpenThroughARemovedIndex) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount needs root";
  temp_dir d;
  const std::string path = store_under_data(d, 10, 100);
  auto w = open_ok(path);
  ASSERT_TRUE(w);
  ASSERT_TRUE(std::filesystem::remove(path + "/index"));
  const pid_t child = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    auto s = store::open(d.file("view/s"), read_only_options());
    if (s) return 2;
    return s.error() == std::errc::device_or_resource_busy ? 0 : 3;
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

// A byte of the store file held shared, as a reader that builds its index holds its opening
// byte; let go when it goes.
class held_byte {
 public:
  held_byte(const std::string& store, off_t byte)
      : fd_(::open((store + "/keel-kv").c_str(), O_RDONLY | O_CLOEXEC)), byte_(byte) {
    if (fd_ < 0 || !set(F_RDLCK)) std::abort();
  }
  ~held_byte() { ::close(fd_); }
  held_byte(const held_byte&) = delete;
  held_byte& operator=(const held_byte&) = delete;
  void release() { (void)set(F_UNLCK); }
  // Whether anyone (this one excepted) holds `byte` of `store`'s store file.
  static bool held_by_others(const std::string& store, off_t byte) {
    const int fd = ::open((store + "/keel-kv").c_str(), O_RDONLY | O_CLOEXEC);
    struct flock q {};
    q.l_type = F_WRLCK;
    q.l_whence = SEEK_SET;
    q.l_start = byte;
    q.l_len = 1;
    const bool held = fd >= 0 && ::fcntl(fd, F_OFD_GETLK, &q) == 0 && q.l_type != F_UNLCK;
    ::close(fd);
    return held;
  }

 private:
  bool set(short type) {
    struct flock l {};
    l.l_type = type;
    l.l_whence = SEEK_SET;
    l.l_start = byte_;
    l.l_len = 1;
    return ::fcntl(fd_, F_OFD_SETLK, &l) == 0;
  }
  int fd_;
  off_t byte_;
};

// What a reader that builds its index holds (private_opening_byte, on the store file): an
// opener that would write waits for it, so the log does not move under the build.
TEST(KvReadOnlyReader, AnOpenerWaitsWhileAReaderBuildsItsIndex) {
  temp_dir d;
  const std::string path = d.file("s");
  make_store(path, 10, 100);
  held_byte building(path, private_opening_byte);
  options o = test_support::small();
  o.lock_timeout = std::chrono::milliseconds(300);
  auto waited = store::open(path, o);
  ASSERT_FALSE(waited);
  EXPECT_EQ(waited.error(), std::errc::timed_out);
  building.release();
  auto s = store::open(path, o);
  ASSERT_TRUE(s) << s.error().message();
  EXPECT_EQ(reads_as_made(**s, 10, 100), 0);
}

// A writer's forked child uses the store on its own once its parent has closed it: its first
// call waits for a build as an opener does (it could start while the child held nothing).
TEST(KvReadOnlyReader, AWritersForkedChildWaitsForABuildToo) {
  temp_dir d;
  const std::string path = d.file("s");
  make_store(path, 10, 100);
  options o = test_support::small();
  o.lock_timeout = std::chrono::milliseconds(300);
  auto w = open_ok(path, o);
  ASSERT_TRUE(w);
  signal_pipe parent_closed;
  signal_pipe first_done;
  signal_pipe released;
  const pid_t child = fork_child([&] {
    if (parent_closed.wait() != '!') return 2;
    auto waited = w->put("k1", "x");
    first_done.notify();
    if (waited || waited.error() != std::errc::timed_out) {
      std::fprintf(stderr, "the child's first put: %s\n",
                   waited ? "done" : waited.error().message().c_str());
      return 3;
    }
    if (released.wait() != '!') return 4;
    return w->put("k1", "y") ? 0 : 5;
  });
  test::killed_on_failure guard{child};
  w.reset();
  held_byte building(path, private_opening_byte);
  parent_closed.notify();
  ASSERT_EQ(first_done.wait(), '!');
  building.release();
  released.notify();
  guard.pid = 0;
  EXPECT_EQ(wait_exit(child), 0) << "see the child's numbered checks";
}

// An opener that waits for a build says so: a reader that comes meanwhile stands aside, so a
// stream of readers cannot keep writers out.
TEST(KvReadOnlyReader, AReaderStandsAsideForAnOpenerThatWaits) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount needs root";
  temp_dir d;
  const std::string path = store_under_data(d, 10, 100);
  held_byte building(path, private_opening_byte);
  const pid_t writer = fork_child([&] {
    options o = test_support::small();
    o.lock_timeout = std::chrono::seconds(60);
    auto s = store::open(path, o);
    return s && (*s)->put("k1", "z") ? 0 : 2;
  });
  test::killed_on_failure guard{writer};
  while (!held_byte::held_by_others(path, opener_waiting_byte)) {
    ASSERT_EQ(::waitpid(writer, nullptr, WNOHANG), 0) << "the writer ended without waiting";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const pid_t reader = fork_child([&] {
    if (!read_only_view(d.file("data"), d.file("view"))) return test::cannot_set_up;
    auto s = store::open(d.file("view/s"), read_only_options());
    return !s && s.error() == std::errc::device_or_resource_busy ? 0 : 3;
  });
  const int code = wait_exit(reader);
  building.release();
  guard.pid = 0;
  EXPECT_EQ(wait_exit(writer), 0);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot make a read-only bind mount here";
  EXPECT_EQ(code, 0) << "the reader did not stand aside";
}

// The waiting byte goes when the wait ends: an idle forked child, which shares the store
// file's descriptor, does not keep it held after its parent closed the store.
TEST(KvReadOnlyReader, AnOpenerLetsTheWaitingByteGoOnceIn) {
  temp_dir d;
  const std::string path = d.file("s");
  make_store(path, 10, 100);
  held_byte building(path, private_opening_byte);
  std::thread builder([&] {
    // (The build ends once the opener waits for it.)
    while (!held_byte::held_by_others(path, opener_waiting_byte))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    building.release();
  });
  options o = test_support::small();
  o.lock_timeout = std::chrono::seconds(60);
  auto w = open_ok(path, o);
  builder.join();
  ASSERT_TRUE(w);
  signal_pipe done;
  const pid_t idle = fork_child([&] { return done.wait() == '!' ? 0 : 2; });
  test::killed_on_failure guard{idle};
  w.reset();
  EXPECT_FALSE(held_byte::held_by_others(path, opener_waiting_byte));
  done.notify();
  guard.pid = 0;
  EXPECT_EQ(wait_exit(idle), 0);
}

// Opened with the rights it had, a reader keeps reading after it drops them (as a daemon
// that opens as root and then becomes another user).
TEST(KvReadOnlyReader, KeepsReadingAfterItDropsItsRights) {
  if (::geteuid() != 0) GTEST_SKIP() << "a read-only bind mount and setuid need root";
  temp_dir d;
  store_under_data(d, 50, 500);
  expect_in_read_only_view(d, [](const std::string& view) {
    auto s = store::open(view + "/s", read_only_options());
    if (!s) return 2;
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) return test::cannot_set_up;
    return reads_as_made(**s, 50, 500);
  });
}

// Its index goes to /dev/shm, and where that has no room for it, to $TMPDIR.
TEST(KvReadOnlyReader, BuildsItsIndexInTmpdirWhenDevShmIsFull) {
  if (::geteuid() != 0) GTEST_SKIP() << "mounts need root";
  temp_dir d;
  store_under_data(d, 2000, 100);
  std::filesystem::create_directories(d.file("tmp"));
  expect_in_read_only_view(d, [&](const std::string& view) {
    if (::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=64k") != 0) return test::cannot_set_up;
    ::setenv("TMPDIR", d.file("tmp").c_str(), 1);
    auto s = store::open(view + "/s", read_only_options());
    if (!s) return 2;
    return reads_as_made(**s, 2000, 100);
  });
  EXPECT_TRUE(std::filesystem::is_empty(d.file("tmp"))) << "the index left a file behind";
}

// A FIFO where the store file goes is somebody's: refused, never waited on.
TEST(KvReadOnlyReader, AFifoAtTheStoreFileIsRefusedNotWaitedOn) {
  temp_dir d;
  const std::string path = d.file("s");
  std::filesystem::create_directories(path);
  ASSERT_EQ(::mkfifo((path + "/keel-kv").c_str(), 0644), 0);
  for (const bool read_only : {false, true}) {
    const pid_t child = fork_child([&] {
      ::alarm(30);
      options o = read_only_options();
      o.read_only = read_only;
      auto s = store::open(path, o);
      // (pread on a FIFO: ESPIPE, naming the file.)
      return !s && s.error().message().find("keel-kv") != std::string::npos ? 0 : 2;
    });
    EXPECT_EQ(wait_exit(child), 0) << "128 + 14: it waited on the FIFO";
  }
}

}  // namespace
}  // namespace keel::kv
