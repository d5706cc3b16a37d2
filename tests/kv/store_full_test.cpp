// A full volume: a put that finds no room fails with no_space before it is visible; deletes
// and compaction still work (they draw on the spare segment the store keeps made ahead), and
// puts work again once compaction has given room back. Each test runs in a child with a
// private tmpfs of its own, so that it can fill a real filesystem.

#include <gtest/gtest.h>

#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "keel/io/filesystem.hpp"

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::small;

std::string key_of(int i) {
  return "key-" + std::to_string(i);
}

// Puts 1 KiB values under key_of(from), key_of(from + 1), ... until one fails: the key
// after the last that succeeded, or -1 when the failure is not no_space.
int fill(store& s, int from) {
  const std::string value(1024, 'v');
  for (int i = from;; ++i) {
    auto r = s.put(key_of(i), value);
    if (!r) return r.error() == std::errc::no_space_on_device ? i : -1;
  }
}

// Runs `body(path)` in a child on a private tmpfs of `mib` MiB; its exit code (0: passed).
template <class F>
void on_small_volume(std::size_t mib, F&& body) {
  temp_dir dir;
  const std::string mnt = dir.file("mnt");
  std::filesystem::create_directory(mnt);
  const pid_t child = fork_child([&] {
    if (!test::mount_private_tmpfs(mnt, mib << 20)) return test::cannot_set_up;
    return body(mnt + "/s");
  });
  const int code = wait_exit(child);
  if (code == test::cannot_set_up) GTEST_SKIP() << "cannot mount a private tmpfs here";
  EXPECT_EQ(code, 0) << "see the child's numbered checks";
}

TEST(KvFullVolume, DeletesAndCompactionWorkAndMakeRoomAgain) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    // Full: erasing nearly everything works.
    for (int i = 0; i < n - 10; ++i) {
      if (!(*s)->erase(key_of(i))) return 4;
    }
    auto c = (*s)->compact();
    if (!c || c->segments_removed == 0) return 5;
    // Room again: about as many puts fit as before.
    const int again = fill(**s, n);
    if (again < 0) return 6;
    if (again - n < n / 2) return 7;
    for (int i = n - 10; i < n; ++i) {
      if (!(*s)->get(key_of(i))) return 8;
    }
    return 0;
  });
}

// The spare is made ahead and kept: a put that finds the volume full fails even though the
// spare's room would hold it, and a store reopened when full still deletes and compacts.
TEST(KvFullVolume, PutsNeverTakeTheSpareAndAReopenedFullStoreStillFreesRoom) {
  on_small_volume(12, [](const std::string& path) {
    int n = 0;
    {
      auto s = store::open(path, small());
      if (!s) return 2;
      n = fill(**s, 0);
      if (n < 1000) return 3;
      if (!std::filesystem::exists(path + "/seg/spare")) return 4;
      // Again and again: still no_space, and nothing of the spare is used.
      for (int k = 0; k < 20; ++k) {
        auto r = (*s)->put("more", std::string(1024, 'm'));
        if (r || r.error() != std::errc::no_space_on_device) return 5;
      }
      if (std::filesystem::file_size(path + "/seg/spare") != small().segment_size) return 6;
    }
    auto s = store::open(path, small());
    if (!s) return 7;
    for (int i = 0; i < n; i += 2) {
      if (!(*s)->erase(key_of(i))) return 8;
    }
    for (int pass = 0; pass < 10; ++pass) {
      auto c = (*s)->compact();
      if (!c) return 9;
      if (c->segments_removed == 0) break;
    }
    if (fill(**s, n) <= n) return 10;
    for (int i = 1; i < n; i += 2) {
      if (!(*s)->get(key_of(i))) return 11;
    }
    return 0;
  });
}

// Once deletes have taken the spare, puts do not write into it: they wait for room for a new
// spare (else the next deletes would find neither room nor spare).
TEST(KvFullVolume, PutsDoNotUseTheRoomDeletesTook) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    int erased = 0;
    while (std::filesystem::exists(path + "/seg/spare")) {
      if (erased >= n || !(*s)->erase(key_of(erased))) return 4;
      ++erased;
    }
    // The spare is the active segment now, with room left in it: not for puts.
    auto r = (*s)->put("more", std::string(1024, 'm'));
    if (r || r.error() != std::errc::no_space_on_device) return 5;
    // Deletes go on (erase records are small: the taken spare holds thousands).
    for (int i = erased; i < erased + 2000 && i < n; ++i) {
      if (!(*s)->erase(key_of(i))) return 6;
    }
    return 0;
  });
}

// Deletes alone fill the spare they took; then compaction must still free room (a victim
// with nothing live costs nothing to move), and deletes go on.
TEST(KvFullVolume, DeletesThatFillTheTakenSpareLeaveCompactionAWayOut) {
  on_small_volume(12, [](const std::string& path) {
    auto s = store::open(path, small());
    if (!s) return 2;
    // Small values: many keys, whose erase records outgrow the spare.
    const std::string value(100, 'v');
    int n = 0;
    for (;; ++n) {
      auto r = (*s)->put(key_of(n), value);
      if (!r) {
        if (r.error() != std::errc::no_space_on_device) return 3;
        break;
      }
    }
    int erased = 0;
    for (; erased < n; ++erased) {
      auto r = (*s)->erase(key_of(erased));
      if (!r) {
        if (r.error() != std::errc::no_space_on_device) return 4;
        break;
      }
    }
    if (erased == n) return 5;  // the test needs the deletes to run out of room
    auto c = (*s)->compact();
    if (!c || c->segments_removed == 0) return 6;
    for (int i = erased; i < n; ++i) {
      if (!(*s)->erase(key_of(i))) return 7;
    }
    return 0;
  });
}

// Holds the first rename of the spare into a segment until released.
class gated_rename final : public io::filesystem_wrapper {
 public:
  gated_rename() noexcept : io::filesystem_wrapper(io::os()) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    if (std::strcmp(from, "spare") == 0) {
      std::unique_lock l(m_);
      if (!done_) {
        held_ = true;
        cv_.notify_all();
        cv_.wait(l, [&] { return released_; });
        done_ = true;
      }
    }
    return io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
  }
  void wait_held() {
    std::unique_lock l(m_);
    cv_.wait(l, [&] { return held_; });
  }
  void release() {
    std::lock_guard l(m_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool held_ = false;
  bool released_ = false;
  bool done_ = false;
};

// A put that was already waiting to move on to the next segment while an erase took the
// spare must not write into it.
TEST(KvFullVolume, APutWaitingWhileAnEraseTakesTheSpareDoesNotWriteIntoIt) {
  on_small_volume(12, [](const std::string& path) {
    gated_rename fs;
    options o = small();
    o.fs = &fs;
    auto s = store::open(path, o);
    if (!s) return 2;
    const int n = fill(**s, 0);
    if (n < 1000) return 3;
    int result = 0;
    std::thread eraser([&] {
      for (int i = 0; i < n; ++i) {
        if (!(*s)->erase(key_of(i))) {
          result = 4;
          return;
        }
        if (!std::filesystem::exists(path + "/seg/spare")) return;
      }
      result = 5;  // never took the spare
    });
    fs.wait_held();  // the eraser holds the segment lock, inside the taking of the spare
    std::thread putter([&] {
      auto r = (*s)->put("late", std::string(1024, 'p'));
      if (r || r.error() != std::errc::no_space_on_device) result = 6;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the putter waits for the lock
    fs.release();
    eraser.join();
    putter.join();
    return result;
  });
}

// Ends the process once the spare has been renamed into a segment: at once (a taker killed
// between the segment's name and its entry in the table), or at the next sync, of seg/ (one
// killed after the entry, before the tail moves into the segment).
class dies_taking_the_spare final : public io::filesystem_wrapper {
 public:
  explicit dies_taking_the_spare(bool at_sync) noexcept
      : io::filesystem_wrapper(io::os()), at_sync_(at_sync) {}
  result<void> rename(const io::file_handle* from_dir, const char* from,
                      const io::file_handle* to_dir, const char* to,
                      io::rename_mode mode) noexcept override {
    auto r = io::filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
    if (std::strcmp(from, "spare") == 0) {
      if (!r) ::_exit(43);
      if (!at_sync_) ::_exit(42);
      renamed_ = true;
    }
    return r;
  }
  result<void> sync(const io::file_handle& file, io::sync_kind kind) noexcept override {
    if (renamed_) ::_exit(42);
    return io::filesystem_wrapper::sync(file, kind);
  }

 private:
  bool at_sync_;
  bool renamed_ = false;
};

// What such a taker left holds the spare's room. Deletes on the full volume work again, in a
// store opened alone afterwards (its opener removes a segment never entered) and one another
// process has open throughout (the next segment any writer needs is the one abandoned).
class KvSpareTakerKilled : public ::testing::TestWithParam<bool> {};

TEST_P(KvSpareTakerKilled, LeavesNothingThatHoldsTheRoomForGood) {
  const bool at_sync = GetParam();
  on_small_volume(12, [at_sync](const std::string& path) {
    auto opened = store::open(path, small());
    if (!opened) return 2;
    std::unique_ptr<store> s = std::move(*opened);
    const int n = fill(*s, 0);
    if (n < 1000) return 3;
    // Entered but abandoned: the store stays open here meanwhile. Never entered: closed, so
    // that the next open is alone.
    if (!at_sync) s.reset();
    const pid_t taker = fork_child([&] {
      dies_taking_the_spare fs(at_sync);
      options o = small();
      o.fs = &fs;
      auto mine = store::open(path, o);
      if (!mine) return 2;
      for (int i = 0; i < n; ++i) {
        if (!(*mine)->erase(key_of(i))) return 3;
      }
      return 4;
    });
    if (wait_exit(taker) != 42) return 4;
    if (!s) {
      auto again = store::open(path, small());
      if (!again) return 5;
      s = std::move(*again);
    }
    for (int i = 0; i < n; ++i) {
      auto r = s->erase(key_of(i));
      if (!r && r.error() != errc::not_found) return 6;
    }
    auto c = s->compact();
    if (!c || c->segments_removed == 0) return 7;
    if (fill(*s, n) <= n) return 8;
    return 0;
  });
}

INSTANTIATE_TEST_SUITE_P(AtTheRenameOrAfterTheEntry, KvSpareTakerKilled, ::testing::Bool());

}  // namespace
}  // namespace keel::kv
