// atomic_append over a whole lock log of any content: the input is a few bytes of request
// (how to lock, which entities), then the file, written to a fresh log on tmpfs that
// atomic_append::open and one lock call then use as they would a log on disk.
//
// Asserts: it returns, within its deadline (a hang is a libFuzzer timeout); open fails only
// with not_keel_file, unsupported_version or corrupt (a header without a whole page), naming
// the file; the lock call fails only with
// contention (would_block, timed_out) or corrupt naming the file and an offset in it; after a
// lock succeeds, another instance's try of the same entities (exclusive) finds them held;
// the unlock succeeds.

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fuzz.hpp"
#include "keel/lock/atomic_append.hpp"

namespace {

using namespace keel;
using namespace std::chrono_literals;
using keel::lock::entity;

// One directory per process on tmpfs (where logs live in practice, and no disk is worn),
// removed at exit.
const std::string& log_path() {
  static const std::string path = [] {
    std::string dir = "/dev/shm/keel-fuzz.XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) std::abort();
    static const std::string keep = dir;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return dir + "/log";
  }();
  return path;
}

void write_file(const std::string& path, std::span<const std::uint8_t> bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) std::abort();
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) std::abort();
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

bool is_contention(const error& e) {
  return e == std::errc::operation_would_block || e == std::errc::timed_out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::input in(data, size);
  // The request: how, and 1 to 32 entities of 8 values (those of the seeds' records), each
  // shared or exclusive.
  const std::uint8_t how = in.byte();
  std::vector<entity> set(1 + in.byte() % 32);
  for (entity& e : set) {
    const std::uint8_t b = in.byte();
    e = entity(b % 8, (b & 0x80) != 0);
  }
  const std::string& path = log_path();
  // A user that has the log open while its content is replaced: the opener below is then
  // not the first user, which would start the log afresh instead of reading it.
  std::filesystem::remove(path);
  auto resident = lock::atomic_append::open(path);
  KEEL_FUZZ_CHECK(resident);
  write_file(path, in.rest());

  auto m = lock::atomic_append::open(path);
  if (!m) {
    const error& e = m.error();
    KEEL_FUZZ_CHECK(e == errc::not_keel_file || e == errc::unsupported_version ||
                    e == errc::corrupt);
    KEEL_FUZZ_CHECK(e.path() == path);
    return 0;
  }
  const bool spin = (how & 2) != 0;
  // A try, or a short wait (spinning or sleeping) for records that look live.
  const io::deadline d = (how & 1) != 0 ? io::deadline(5ms) : io::deadline::zero();
  auto g = (*m)->lock(set, d, spin);
  if (!g) {
    const error& e = g.error();
    if (is_contention(e)) return 0;
    KEEL_FUZZ_CHECK(e == errc::corrupt);
    KEEL_FUZZ_CHECK(e.path() == path && e.has_offset());
    KEEL_FUZZ_CHECK(e.offset() < std::filesystem::file_size(path));
    return 0;
  }
  // Held: another instance (on another thread: a thread may not ask twice) cannot have them.
  std::vector<entity> exclusive;
  for (const entity e : set)
    exclusive.push_back(entity(e.value, true));
  std::thread([&] {
    auto other = lock::atomic_append::open(path);
    KEEL_FUZZ_CHECK(other);
    auto o = (*other)->try_lock(exclusive);
    KEEL_FUZZ_CHECK(!o && o.error() == std::errc::operation_would_block);
  }).join();
  KEEL_FUZZ_CHECK(g->unlock());
  return 0;
}
