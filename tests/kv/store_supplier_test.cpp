// Fresh log pages supplied ahead of the writers (src/kv/supplier.hpp): the chunk after the
// one the log has crossed into is faulted in by a thread of the process's own, also in a
// forked child (the parent's thread is not there), and the thread ends when the store closes.

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;

constexpr std::uint64_t mib = std::uint64_t{1} << 20;

std::size_t threads_here() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task"))
    ++n;
  return n;
}

// The store's log segment (of `size` bytes; there is one).
std::string log_segment(const std::string& path, std::uint64_t size) {
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    const std::string name = e.path().filename().string();
    if (name.size() == 16 && e.file_size() == size) return e.path().string();
  }
  return "";
}

// Whether every page of [from, from + length) of the file is in memory, waiting for it up
// to a minute (the supplier is a thread of its own: it comes when the machine lets it).
bool comes_into_memory(const std::string& file, std::uint64_t size, std::uint64_t from,
                       std::uint64_t length) {
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return false;
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in(length / page);
  bool all = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (!all && std::chrono::steady_clock::now() < until) {
    if (::mincore(static_cast<char*>(map) + from, length, in.data()) != 0) break;
    all = std::ranges::all_of(in, [](unsigned char c) { return (c & 1) != 0; });
    if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::munmap(map, size);
  return all;
}

// Puts 1 KiB values until the log's records take `bytes` (the log's tail is then past that
// offset of its one segment, and short of it by a block header a put, under a tenth more).
void fill_to(store& s, int& next, std::uint64_t bytes) {
  const std::string value(1024, 'v');
  for (;;) {
    auto st = s.stats();
    ASSERT_TRUE(st);
    if (st->live_bytes + st->dead_bytes >= bytes) return;
    for (const int end = next + 64; next < end; ++next)
      ASSERT_TRUE(s.put("key-" + std::to_string(next), value));
  }
}

TEST(KvSupplier, TheChunkAheadOfTheWritersIsFaultedInAlsoInAChildAndTheThreadEndsAtClose) {
  // On tmpfs: no readahead brings pages in beside those the store faults (on ext4 the
  // chunk came into memory with none supplied).
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm (tmpfs) here";
  temp_dir dir("/dev/shm");
  const std::string path = dir.file("s");
  // (A thread first, come and gone: a sanitizer's runtime starts one of its own at the first.)
  std::thread([] {}).join();
  const std::size_t threads_before = threads_here();
  {
    options o;
    o.segment_size = 16 * mib;
    o.compact_dead_fraction = 0;
    auto s = test_support::open_ok(path, o);
    ASSERT_TRUE(s);
    int next = 0;
    // Into the second chunk (of a MiB): the third is asked for, and nothing writes there.
    fill_to(*s, next, mib + mib / 16);
    const std::string seg = log_segment(path, o.segment_size);
    ASSERT_FALSE(seg.empty());
    EXPECT_TRUE(comes_into_memory(seg, o.segment_size, 2 * mib, mib));
    // A child writes on through the store it inherited, into the fifth chunk: the sixth is
    // its own thread's to supply.
    const pid_t child = fork_child([&] {
      int mine = next;
      fill_to(*s, mine, 4 * mib + mib / 16);
      if (::testing::Test::HasFailure()) return 2;
      return comes_into_memory(seg, o.segment_size, 5 * mib, mib) ? 0 : 3;
    });
    EXPECT_EQ(test::wait_status(child), 0);
  }
  // (The maintenance thread ended too: none of the store's is left.)
  EXPECT_EQ(threads_here(), threads_before);
}

}  // namespace
}  // namespace keel::kv
