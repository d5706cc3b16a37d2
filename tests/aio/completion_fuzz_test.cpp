// Completions attacked at random: callbacks that submit more requests, wait for others (with
// and without deadlines; never two for each other, which no library could end), close files,
// or do nothing, on every engine, with and without the cache, from several threads. Every request
// must end, with its outcome or a refusal keel names (a closed file), nothing hangs (each
// seed runs in a child with a time limit) and nothing crashes. A completion that throws ends
// the process (std::terminate), as documented.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "aio_support.hpp"
#include "keel/aio/controller.hpp"
#include "keel/aio/errors.hpp"
#include "support/process.hpp"

namespace keel::aio {
namespace {

using namespace std::chrono_literals;
using test::temp_dir;

struct fuzz_case {
  engine_kind engine;
  bool cache;
};

// The shared state of one run: its files, the receipts its completions made, the buffers
// they use (kept to the end), and what went wrong.
struct fuzz_run {
  std::vector<file> files;
  std::mutex mutex;
  std::vector<receipt> receipts;
  std::vector<std::unique_ptr<std::vector<std::byte>>> buffers;
  std::atomic<std::uint64_t> draws{0};
  std::uint64_t seed = 0;
  std::atomic<int> made{0};
  std::atomic<int> wrong{0};
  std::atomic<int> first_wrong{0};  // 1: an error keel did not name; 2: a wait that failed

  std::uint64_t draw() {
    std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (draws.fetch_add(1) + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  void note(int why) {
    if (wrong.fetch_add(1) == 0) first_wrong = why;
  }
  std::atomic<bool> stopping{false};  // the run's end: callbacks may still submit
  // Whether `e` is an outcome a request here may have: a file closed by a completion, a
  // deadline that passed, and once the controller stops, a request submitted meanwhile.
  bool expected(const keel::error& e) const {
    return e == keel::errc::file_closed || e == std::errc::timed_out ||
           (stopping.load() && e == keel::errc::controller_stopped);
  }

  // A request on file `which` (-1: any) whose completion does what `role` says:
  //  root    waits for a request made by a completion (with a deadline or without), or
  //          submits more, or has a file-0 request submitted whose completion closes file 2;
  //  inner   submits more (listed: roots wait for them), or nothing; never blocks;
  //  closer  closes file 2 (so that no callback waits for one that waits for it).
  enum class role { root, inner, closer };
  receipt submit(role as, int depth, int which = -1) {
    file& f = files[which >= 0 ? static_cast<std::size_t>(which) : draw() % files.size()];
    const std::uint64_t block = draw() % 16;
    auto buf = std::make_unique<std::vector<std::byte>>(
        4096, std::byte{static_cast<unsigned char>(block)});
    std::byte* data = buf->data();
    {
      const std::lock_guard lock(mutex);
      buffers.push_back(std::move(buf));
    }
    ++made;
    const auto on_done = [this, as, depth](const result<std::size_t>& r) {
      if (!r && !expected(r.error())) note(1);
      act(as, depth + 1);
    };
    switch (draw() % 5) {
      case 0:
        return f.read(block * 4096, std::span(data, 4096), on_done);
      case 1:
      case 2:
        return f.write(block * 4096, std::span(data, 4096), on_done);
      case 3:
        return f.fsync(on_done);
      default:
        return f.submit([]() -> result<std::size_t> { return 1; }, on_done);
    }
  }

  void submit_listed(int depth) {
    if (depth >= 4 || made.load() >= 3000) return;
    receipt r = submit(role::inner, depth);
    const std::lock_guard lock(mutex);
    receipts.push_back(std::move(r));
  }

  // What a completion does.
  void act(role as, int depth) {
    if (as == role::closer) {
      (void)files[2].close();
      return;
    }
    const std::uint64_t pick = draw() % 8;
    if (as == role::inner) {
      if (pick < 3) submit_listed(depth);
      return;
    }
    if (pick < 2) {
      submit_listed(depth);
    } else if (pick < 5) {
      receipt r;
      {
        const std::lock_guard lock(mutex);
        if (!receipts.empty()) r = receipts[draw() % receipts.size()];
      }
      if (r.valid()) {
        const bool deadline = draw() % 2 == 0;
        const auto got = deadline ? r.wait(io::deadline(1ms)) : r.wait();
        if (!got && !expected(got.error())) note(2);
      }
    } else if (pick == 5 && draw() % 8 == 0) {
      (void)submit(role::closer, depth, 0);
    }
  }
};

class CompletionFuzz : public ::testing::TestWithParam<fuzz_case> {};

TEST_P(CompletionFuzz, EveryRequestEndsAndNothingHangs) {
  const auto [engine, cache] = GetParam();
  KEEL_NEED_ENGINE(engine);
  temp_dir dir;
  // KEEL_FUZZ_SEEDS=N runs seeds 1..N (12 by default): a longer hunt by hand.
  std::uint64_t seeds = 12;
  if (const char* n = std::getenv("KEEL_FUZZ_SEEDS"); n != nullptr && std::atoll(n) > 0) {
    seeds = static_cast<std::uint64_t>(std::atoll(n));
  }
  for (std::uint64_t seed = 1; seed <= seeds; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const pid_t child = test::fork_child([&] {
      ::alarm(60);
      fuzz_run run;
      run.seed = seed;
      options o;
      o.engine = engine;
      o.workers = 1 + static_cast<unsigned>(seed % 2);
      const submitter subs[] = {submitter::adaptive, submitter::caller, submitter::workers};
      o.submit_on = subs[seed % 3];
      o.cache_soft_limit = 16 << 10;  // tight: the flusher and the hard limit take part
      o.cache_hard_limit = 64 << 10;
      auto c = controller::start(o);
      if (!c) return 3;
      for (int i = 0; i < 3; ++i) {
        open_options how;
        how.write = true;
        how.create = true;
        how.cache = cache;
        auto f = (*c)->open(dir.file("f" + std::to_string(seed) + "-" + std::to_string(i)), how);
        if (!f) return 4;
        run.files.push_back(std::move(*f));
      }
      std::vector<std::thread> threads;
      std::vector<std::vector<receipt>> roots(3);
      for (int t = 0; t < 3; ++t) {
        threads.emplace_back([&, t] {
          for (int i = 0; i < 100; ++i)
            roots[t].push_back(run.submit(fuzz_run::role::root, 0));
        });
      }
      for (auto& t : threads)
        t.join();
      for (const auto& rs : roots) {
        for (const receipt& r : rs) {
          const auto got = r.wait();
          if (!got && !run.expected(got.error())) run.note(1);
        }
      }
      std::vector<receipt> rest;
      {
        const std::lock_guard lock(run.mutex);
        rest = run.receipts;
      }
      for (const receipt& r : rest)
        (void)r.wait();
      run.stopping = true;
      c->reset();
      {
        const std::lock_guard lock(run.mutex);
        for (const receipt& r : run.receipts) {
          if (!r.ready()) return 5;
        }
      }
      return run.wrong.load() == 0 ? 0 : 10 + run.first_wrong.load();
    });
    ASSERT_EQ(test::wait_exit(child), 0)
        << "142: hung; 128+6: aborted; 11: an error keel did not name; 12: a wait failed";
  }
}

// Completions that close each other's files while other threads do too: each write's
// completion may close its own file, the next file, and write to a third and wait. Closes
// nest (a close waits, runs a completion that closes another file) on several threads at
// once, in every order. Every close and every request must end.
TEST_P(CompletionFuzz, CompletionsMayCloseEachOthersFiles) {
  const auto [engine, cache] = GetParam();
  KEEL_NEED_ENGINE(engine);
  temp_dir dir;
  const pid_t child = test::fork_child([&] {
    ::alarm(60);
    options o;
    o.engine = engine;
    o.workers = 2;
    auto c = controller::start(o);
    if (!c) return 3;
    const std::vector<std::byte> data(4096, std::byte{'d'});
    constexpr int n = 4;
    for (int round = 0; round < 20; ++round) {
      std::vector<file> fs;
      for (int i = 0; i < n; ++i) {
        open_options how;
        how.write = true;
        how.create = true;
        how.cache = cache;
        auto f = (*c)->open(dir.file("each-" + std::to_string(i)), how);
        if (!f) return 4;
        fs.push_back(std::move(*f));
      }
      std::mutex mutex;
      std::vector<receipt> all;
      const auto work = [&](int t) {
        std::vector<receipt> mine;
        for (int k = 0; k < 20; ++k) {
          const int i = (t + k) % n;
          mine.push_back(fs[i].write(4096 * (k % 3), data, [&, i, k](const result<std::size_t>&) {
            if (k % 5 == 0) (void)fs[i].close();
            if (k % 7 == 0) (void)fs[(i + 1) % n].close();
            if (k % 3 == 0) (void)fs[(i + 2) % n].write(0, data).wait();
          }));
        }
        for (const receipt& r : mine)
          (void)r.wait();
        const std::lock_guard lock(mutex);
        all.insert(all.end(), mine.begin(), mine.end());
      };
      std::vector<std::thread> threads;
      for (int t = 0; t < 3; ++t)
        threads.emplace_back(work, t);
      std::thread closer([&] {
        for (int i = n - 1; i >= 0; --i)
          (void)fs[i].close();
      });
      for (auto& t : threads)
        t.join();
      closer.join();
      for (auto& f : fs)
        (void)f.close();
      for (const receipt& r : all) {
        if (!r.ready()) return 5;
      }
    }
    c->reset();
    return 0;
  });
  ASSERT_EQ(test::wait_exit(child), 0) << "142: hung; 128+6: aborted; 5: a request never ended";
}

std::vector<fuzz_case> fuzz_cases() {
  std::vector<fuzz_case> out;
  for (const auto k :
       {engine_kind::io_uring, engine_kind::posix, engine_kind::stdio, engine_kind::null}) {
    out.push_back({k, false});
    out.push_back({k, true});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Engines, CompletionFuzz, ::testing::ValuesIn(fuzz_cases()),
                         [](const auto& p) {
                           return std::string(to_string(p.param.engine)) +
                                  (p.param.cache ? "Cache" : "");
                         });

// A completion that throws: the exception cannot cross keel's noexcept calls, so the process
// ends through std::terminate (SIGABRT), on every engine, rather than going on in a state
// nobody knows.
TEST(CompletionFuzz, ACompletionThatThrowsEndsTheProcess) {
  temp_dir dir;
  for (const auto k :
       {engine_kind::io_uring, engine_kind::posix, engine_kind::stdio, engine_kind::null}) {
    if (!test_support::unavailable(k).empty()) continue;
    SCOPED_TRACE(std::string(to_string(k)));
    const pid_t child = test::fork_child([&] {
      ::alarm(20);
      auto c = test_support::one_worker(k);
      if (!c) return 1;
      file f = test_support::open_rw(*c, dir.file("throws"));
      std::vector<std::byte> buf(10);
      receipt r =
          f.write(0, buf, [](const result<std::size_t>&) { throw std::runtime_error("x"); });
      (void)r.wait();
      return 2;  // not reached: terminate
    });
    EXPECT_EQ(test::wait_exit(child), 128 + SIGABRT);
  }
}

}  // namespace
}  // namespace keel::aio
