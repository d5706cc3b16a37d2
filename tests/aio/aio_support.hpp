#pragma once
// What the aio tests share.

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "keel/aio/controller.hpp"
#include "support/process.hpp"

namespace keel::aio::test_support {

//! Opens `path` through `c` for reading and writing, made if missing; a closed file (and a
//! test failure) if it cannot.
inline file open_rw(controller& c, const std::string& path) {
  open_options how;
  how.write = true;
  how.create = true;
  auto f = c.open(path, how);
  if (!f) ADD_FAILURE() << "open " << path << ": " << f.error().message();
  return f ? std::move(*f) : file();
}

//! The descriptors this process has open on `path` (found in /proc/self/fd).
inline std::vector<int> descriptors_on(const std::string& path) {
  std::vector<int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string() == path) {
      out.push_back(std::stoi(e.path().filename().string()));
    }
  }
  return out;
}

//! A descriptor this process has open on `path`, or -1.
inline int descriptor_of(const std::string& path) {
  const std::vector<int> fds = descriptors_on(path);
  return fds.empty() ? -1 : fds.front();
}

//! Why engine `k` cannot be had here (empty: it can): KEEL_AIO_ENGINE forcing another one on
//! every controller, or io_uring forbidden or missing (a seccomp filter, as Docker's default
//! profile has; kernel.io_uring_disabled; an old kernel).
inline std::string unavailable(engine_kind k) {
  if (const char* env = std::getenv("KEEL_AIO_ENGINE");
      env != nullptr && *env != '\0' && std::string_view(env) != to_string(k)) {
    return std::string("KEEL_AIO_ENGINE=") + env + " forces every controller's engine";
  }
  if (k != engine_kind::io_uring) return {};
  static const std::string why = [] {
    options o;
    o.engine = engine_kind::io_uring;
    o.workers = 1;
    auto c = controller::start(o);
    return c ? std::string() : "io_uring cannot start here: " + c.error().message();
  }();
  return why;
}

//! Why a test that needs its requests queued for a controller's workers cannot have that
//! here (empty: it can).
inline std::string workers_forced_away() {
  const char* env = std::getenv("KEEL_AIO_SUBMIT_ON");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "workers") return {};
  return std::string("KEEL_AIO_SUBMIT_ON=") + env +
         " forces where requests start: this needs them queued for a worker";
}

//! Runs `body` in a forked child given 20 s, and expects it to exit 0: what these tests look
//! for is a hang.
inline void expect_ends_in_a_child(const std::function<int()>& body) {
  const pid_t child = test::fork_child([&] {
    ::alarm(20);
    return body();
  });
  EXPECT_EQ(test::wait_exit(child), 0) << "128 + " << SIGALRM << ": it hung";
}

//! Waits for `r` without running anything itself (a wait with a deadline does not), up to
//! `seconds`: the test's own wait must not rescue the thread it tests.
inline bool ends_on_its_own(const receipt& r, int seconds) {
  for (int i = 0; i < seconds * 100 && !r.ready(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return r.ready();
}

//! One controller of engine `k`, one worker, requests queued for it: where a completion or
//! task on that worker that waits finds its own thread is the only one that can run what it
//! waits for. Null if it cannot start.
inline std::unique_ptr<controller> one_worker(engine_kind k, bool cache = false) {
  options o;
  o.engine = k;
  o.workers = 1;
  o.submit_on = submitter::workers;
  if (!cache) o.cache_hard_limit = o.cache_soft_limit = 0;
  o.cache_idle_round = std::chrono::seconds(60);
  o.cache_write_behind = 0;
  auto c = controller::start(o);
  return c ? std::move(*c) : nullptr;
}

//! Holds a worker of `h`'s controller with a task on `h` until `go` is set: requests queued
//! for that worker meanwhile wait behind it. With `running`, the task sets it once it runs:
//! a task behind an earlier request of `h` reaches its worker only when that request's end
//! lets it go, which can be after the request's receipt is ready.
inline receipt hold_until(file& h, const std::atomic<bool>& go,
                          std::atomic<bool>* running = nullptr) {
  return h.submit([&go, running]() -> result<std::size_t> {
    if (running != nullptr) running->store(true);
    while (!go.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    return 0;
  });
}

}  // namespace keel::aio::test_support

//! A test of what engine `k` itself does skips, with the reason, where it cannot be had.
#define KEEL_NEED_ENGINE(k)                                                                        \
  do {                                                                                             \
    if (const std::string why_not = ::keel::aio::test_support::unavailable(k); !why_not.empty()) { \
      GTEST_SKIP() << why_not;                                                                     \
    }                                                                                              \
  } while (false)
