// What only lock_files has: owner records, and breaking the files of dead owners.

#include "keel/lock/lock_files.hpp"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "io/process.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"
#include "lock/detail/common.hpp"
#include "support/process.hpp"

namespace keel::lock {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;

// A lock directory with entity 5's file left by a holder that died (its guard never ran).
struct dead_holder {
  temp_dir dir;
  std::string path = dir.file("locks");
  std::string name = path + "/0000000000000005";
  dead_holder() {
    const pid_t child = fork_child([&] {
      auto m = lock_files::open(path);
      if (!m) return 2;
      auto g = (*m)->lock({entity(5)});
      if (!g) return 3;
      ::_exit(0);  // no unlock: the file stays, its owner gone
    });
    if (wait_exit(child) != 0) std::abort();
  }
};

std::string content_of(const std::string& path) {
  auto f = io::file_handle::open(path.c_str(), io::open_flags::read);
  if (!f) return {};
  std::string text(256, '\0');
  auto n = f->read_at(0, std::as_writable_bytes(std::span(text.data(), text.size())));
  text.resize(n ? *n : 0);
  return text;
}

TEST(LockFiles, ADeadHoldersFileIsBroken) {
  dead_holder d;
  auto m = lock_files::open(d.path);
  ASSERT_TRUE(m);
  EXPECT_TRUE((*m)->try_lock({entity(5)}));
}

// Adversarial review of issue 15: the breaker opened the file at an entity's name without
// O_NONBLOCK, so a FIFO someone made there (the directory may be shared) blocked even a try,
// forever, while it held the breakers' turn. What is not a regular file is never judged.
TEST(LockFiles, AFifoAtAnEntitysNameNeverBlocksATry) {
  temp_dir dir;
  const std::string path = dir.file("locks");
  {
    auto m = lock_files::open(path);  // makes the directory
    ASSERT_TRUE(m);
  }
  // Planted as another user would: by another program (keel's own calls make regular files).
  const std::string fifo = path + "/0000000000000005";
  const pid_t planter = fork_child([&] {
    ::execlp("mkfifo", "mkfifo", fifo.c_str(), static_cast<char*>(nullptr));
    return 127;
  });
  const int planted = wait_exit(planter);
  if (planted == 127) GTEST_SKIP() << "no mkfifo program here to plant the FIFO with";
  ASSERT_EQ(planted, 0);
  test::signal_pipe returned;
  const pid_t child = fork_child([&] {
    auto m = lock_files::open(path);
    if (!m) return 1;
    auto g = (*m)->try_lock({entity(5)});
    returned.notify();
    return !g && g.error() == std::errc::operation_would_block ? 0 : 2;
  });
  const bool back = returned.ready_within(std::chrono::seconds(5));
  if (!back) ::kill(child, SIGKILL);
  EXPECT_TRUE(back) << "the try blocked on the FIFO";
  EXPECT_EQ(wait_exit(child), back ? 0 : 128 + SIGKILL);
  EXPECT_TRUE(std::filesystem::is_fifo(fifo)) << "a foreign file removed";
}

// Review of issue 40: a socket bound at an entity's name made the breaker's open fail with
// ENXIO, and the lock call failed with it (keel lock exited 71) instead of waiting.
TEST(LockFiles, ASocketAtAnEntitysNameIsWaitedOnNotAnError) {
  temp_dir dir;
  const std::string path = dir.file("locks");
  auto m = lock_files::open(path);
  ASSERT_TRUE(m);
  const std::string name = path + "/0000000000000005";
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(s, 0);
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  ASSERT_LT(name.size(), sizeof a.sun_path);
  std::memcpy(a.sun_path, name.c_str(), name.size() + 1);
  ASSERT_EQ(::bind(s, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0) << std::strerror(errno);
  auto g = (*m)->lock({entity(5)}, std::chrono::milliseconds(50));
  ASSERT_FALSE(g);
  EXPECT_EQ(g.error(), std::errc::timed_out) << g.error().message();
  EXPECT_TRUE(std::filesystem::is_socket(name)) << "a foreign file removed";
  ::close(s);
}

// Review finding (issue 15 #3): the breaker read the owner record, judged the owner dead,
// and removed the name, which by then could be another holder's freshly linked file.
std::string replaced_name;
void replace_the_name(std::string_view point) {
  if (point != "lock_files.judged_stale") return;
  std::filesystem::remove(replaced_name);
  std::ofstream(replaced_name) << "a live holder's file";
}

TEST(LockFiles, ABreakerNeverRemovesAFileMadeAfterItsJudgement) {
  dead_holder d;
  auto m = lock_files::open(d.path);
  ASSERT_TRUE(m);
  replaced_name = d.name;
  detail::test_hook.store(&replace_the_name);
  auto g = (*m)->try_lock({entity(5)});
  detail::test_hook.store(nullptr);
  EXPECT_FALSE(g) << "locked beside the holder whose file the breaker removed";
  EXPECT_EQ(content_of(d.name), "a live holder's file");
}

// Review finding (issue 15 #4): an owner whose liveness cannot be read (here: a record from
// another pid namespace, as a container's process would leave) was judged dead.
TEST(LockFiles, AnOwnerThatCannotBeJudgedIsAlive) {
  temp_dir dir;
  const std::string path = dir.file("locks");
  {
    auto m = lock_files::open(path);
    ASSERT_TRUE(m);
  }
  // Entity 6's file, written as a process of another namespace: its pid means nothing here.
  std::string rec(104, '\0');
  std::memcpy(rec.data(), "KEELLF02", 8);
  const std::uint32_t pid = 999999, ns = io::self().pid_ns + 1;
  std::memcpy(rec.data() + 8, &pid, 4);
  std::memcpy(rec.data() + 12, &ns, 4);
  std::memcpy(rec.data() + 24, io::self().boot_id.data(), 16);
  std::memcpy(rec.data() + 40, io::self().machine_id.data(), 16);
  std::ofstream(path + "/0000000000000006", std::ios::binary) << rec;
  auto m = lock_files::open(path);
  ASSERT_TRUE(m);
  EXPECT_FALSE((*m)->try_lock({entity(6)})) << "an owner in another namespace judged dead";
}

// A filesystem that says it is NFS: what a lock directory on a network share looks like.
struct network_share final : io::filesystem_wrapper {
  network_share() noexcept : io::filesystem_wrapper(io::os()) {}
  static result<io::fs_info> as_nfs(result<io::fs_info> i) noexcept {
    if (i) {
      i->type = io::fs_type::nfs;
      i->is_local = false;
    }
    return i;
  }
  // The seam's own statfs, overridden: no raw call.
  result<io::fs_info> statfs(const char* path) noexcept override {
    // Through the seam it wraps.
    return as_nfs(filesystem_wrapper::statfs(path));
  }
  // The seam's own statfs, overridden: no raw call.
  result<io::fs_info> statfs(const io::file_handle& file) noexcept override {
    // Through the seam it wraps.
    return as_nfs(filesystem_wrapper::statfs(file));
  }
};

// Entity 7's file, written by a process of another boot of a machine with our machine id.
void write_other_boot_owner(const std::string& path) {
  std::string rec(104, '\0');
  std::memcpy(rec.data(), "KEELLF02", 8);
  const std::uint32_t pid = 1, ns = io::self().pid_ns;
  std::memcpy(rec.data() + 8, &pid, 4);
  std::memcpy(rec.data() + 12, &ns, 4);
  std::array<std::uint8_t, 16> boot = io::self().boot_id;
  boot[0] ^= 0xff;
  std::memcpy(rec.data() + 24, boot.data(), 16);
  std::memcpy(rec.data() + 40, io::self().machine_id.data(), 16);
  std::ofstream(path + "/0000000000000007", std::ios::binary) << rec;
}

// Review finding (issue 15, second review #9): "another boot of this machine, so dead" was
// judged by machine id alone. Machines cloned from one image share it, and on a network
// share the other boot may be another machine running now: its lock was broken. Only a lock
// directory on a local filesystem (no running machine but this one writes there) proves it.
TEST(LockFiles, AnotherBootWithOurMachineIdIsDeadOnlyOnALocalFilesystem) {
  temp_dir dir;
  const std::string path = dir.file("locks");
  {
    auto m = lock_files::open(path);
    ASSERT_TRUE(m);
  }
  write_other_boot_owner(path);
  network_share nfs;
  auto shared = lock_files::open(path, nfs);
  ASSERT_TRUE(shared);
  EXPECT_FALSE((*shared)->try_lock({entity(7)}))
      << "on a network share, another boot with our machine id was judged dead";
  auto local = lock_files::open(path);
  ASSERT_TRUE(local);
  EXPECT_TRUE((*local)->try_lock({entity(7)})) << "on a local filesystem, a reboot ends owners";
}

}  // namespace
}  // namespace keel::lock
