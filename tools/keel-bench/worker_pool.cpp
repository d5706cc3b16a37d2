#include "worker_pool.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <span>
#include <stdexcept>
#include <thread>

#include "keel/io/file_handle.hpp"

namespace keel::tools {

void worker_context::fail(const std::string& message) {
  control_->failures.fetch_add(1);
  if (control_->error_claimed.exchange(1) == 0) {
    std::snprintf(control_->first_error, sizeof control_->first_error, "worker %zu: %s", index_,
                  message.c_str());
  }
}

std::uint64_t run_result::total() const {
  return std::accumulate(counts.begin(), counts.end(), std::uint64_t{0});
}
std::uint64_t run_result::min() const {
  return counts.empty() ? 0 : *std::min_element(counts.begin(), counts.end());
}
std::uint64_t run_result::max() const {
  return counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end());
}
double run_result::mean() const {
  return counts.empty() ? 0.0 : static_cast<double>(total()) / static_cast<double>(counts.size());
}
double run_result::stddev() const {
  if (counts.size() < 2) return 0.0;
  const double m = mean();
  double sum = 0;
  for (auto c : counts)
    sum += (static_cast<double>(c) - m) * (static_cast<double>(c) - m);
  return std::sqrt(sum / static_cast<double>(counts.size()));
}

run_result run_workers(const run_options& options,
                       const std::function<void(worker_context&)>& body) {
  const std::size_t n = options.workers;
  const std::size_t bytes = sizeof(shared_control) + n * sizeof(std::atomic<std::uint64_t>) +
                            options.groups * sizeof(std::atomic<std::int64_t>) + 64;
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error(std::string("mmap: ") + std::strerror(errno));
  auto* control = new (mem) shared_control;
  auto* counters = reinterpret_cast<std::atomic<std::uint64_t>*>(static_cast<char*>(mem) +
                                                                 sizeof(shared_control));
  auto* holders = reinterpret_cast<std::atomic<std::int64_t>*>(counters + n);
  for (std::size_t i = 0; i < n; ++i)
    new (&counters[i]) std::atomic<std::uint64_t>(0);
  for (std::size_t g = 0; g < options.groups; ++g)
    new (&holders[g]) std::atomic<std::int64_t>(0);

  // Workers wait for the start by reading a pipe the parent then closes: all wake at once,
  // and none burns CPU polling meanwhile.
  int start_pipe[2];
  if (::pipe2(start_pipe, O_CLOEXEC) != 0) {
    ::munmap(mem, bytes);
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  }
  std::vector<pid_t> pids;
  pids.reserve(n);
  const auto kill_all = [&] {
    for (pid_t p : pids)
      ::kill(p, SIGKILL);
  };
  // Set-up failed: take down the workers forked so far and report why.
  const auto abandon = [&](const std::string& why) {
    ::close(start_pipe[0]);
    ::close(start_pipe[1]);
    kill_all();
    for (pid_t p : pids)
      ::waitpid(p, nullptr, 0);
    ::munmap(mem, bytes);
    throw std::runtime_error(why);
  };
  for (std::size_t i = 0; i < n; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) abandon(fmt::format("fork of worker {}: {}", i, std::strerror(errno)));
    if (pid == 0) {
      ::close(start_pipe[1]);
      worker_context ctx(control, i, &counters[i], &holders[options.group_of(i)]);
      if (options.setup) options.setup(ctx);
      control->ready.fetch_add(1);
      char c = 0;
      while (::read(start_pipe[0], &c, 1) < 0 && errno == EINTR) {
      }
      // What was spent getting here is not the run's: record it to subtract later.
      rusage ru{};
      ::getrusage(RUSAGE_SELF, &ru);
      control->start_user_us.fetch_add(ru.ru_utime.tv_sec * 1'000'000 + ru.ru_utime.tv_usec);
      control->start_system_us.fetch_add(ru.ru_stime.tv_sec * 1'000'000 + ru.ru_stime.tv_usec);
      body(ctx);
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  // Everyone forked and waiting: start together.
  const auto setup_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (control->ready.load() < n) {
    if (std::chrono::steady_clock::now() > setup_deadline) {
      abandon("workers did not start within 60 s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ::close(start_pipe[0]);
  const auto t0 = std::chrono::steady_clock::now();
  ::close(start_pipe[1]);
  const auto end =
      t0 + std::chrono::duration_cast<std::chrono::steady_clock::duration>(options.duration);
  auto next_progress = t0 + std::chrono::seconds(1);
  while (std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_until(std::min(end, next_progress));
    const auto now = std::chrono::steady_clock::now();
    if (now < next_progress) continue;
    // Always moves on, with or without a progress callback: a past wake-up time would make
    // this loop spin on a core the workers need.
    next_progress += std::chrono::seconds(1);
    if (options.progress && now < end) {
      options.progress(
          fmt::format("{:.0f} s left", std::chrono::duration<double>(end - now).count()));
    }
  }
  control->stop.store(1);
  const auto t1 = std::chrono::steady_clock::now();
  run_result r;
  r.workers = n;
  r.seconds = std::chrono::duration<double>(t1 - t0).count();
  r.counts.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    r.counts[i] = counters[i].load();
  // Read before the kills: a worker killed inside its critical section leaves the holder
  // count raised, and whoever gets the lock after that is no evidence of anything.
  r.violations = control->violations.load();
  r.failures = control->failures.load();
  // Workers finish their round and exit by themselves; only those still running after a grace
  // period (asleep in a lock nobody lets go) are killed. A worker killed inside a lock request
  // to a network filesystem can wedge it: GlusterFS 10.3 stopped answering, every run.
  std::vector<bool> reaped(n, false);
  std::size_t left = n;
  const auto reap = [&](std::size_t i, int flags) {
    int status = 0;
    rusage ru{};
    pid_t got = 0;
    while ((got = ::wait4(pids[i], &status, flags, &ru)) < 0 && errno == EINTR) {
    }
    if (got != pids[i]) return;
    reaped[i] = true;
    --left;
    r.user_cpu += static_cast<double>(ru.ru_utime.tv_sec) + ru.ru_utime.tv_usec / 1e6;
    r.system_cpu += static_cast<double>(ru.ru_stime.tv_sec) + ru.ru_stime.tv_usec / 1e6;
  };
  const auto grace_end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (left > 0 && std::chrono::steady_clock::now() < grace_end) {
    for (std::size_t i = 0; i < n; ++i)
      if (!reaped[i]) reap(i, WNOHANG);
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));  // polling exits
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!reaped[i]) ::kill(pids[i], SIGKILL);
  for (std::size_t i = 0; i < n; ++i)
    if (!reaped[i]) reap(i, 0);
  r.user_cpu -= static_cast<double>(control->start_user_us.load()) / 1e6;
  r.system_cpu -= static_cast<double>(control->start_system_us.load()) / 1e6;
  r.first_error = control->first_error;
  ::munmap(mem, bytes);
  return r;
}

child_outcome run_in_child(const std::function<std::string()>& body,
                           const std::string& result_file) {
  child_outcome out;
  const pid_t pid = ::fork();
  if (pid < 0) {
    out.error = fmt::format("fork: {}", std::strerror(errno));
    return out;
  }
  if (pid == 0) {
    // First byte: '1' for output, '0' for an error message; then the text.
    std::string message;
    try {
      message = "1" + body();
    } catch (const std::exception& e) {
      message = std::string("0") + e.what();
    }
    auto f =
        io::file_handle::open(result_file.c_str(), io::open_flags::write | io::open_flags::create |
                                                       io::open_flags::truncate);
    const bool written = f && f->write_at(0, std::as_bytes(std::span(message)));
    ::_exit(written ? 0 : 3);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::string got;
  if (auto f = io::file_handle::open(result_file.c_str(), io::open_flags::read)) {
    if (auto size = f->size(); size && *size > 0) {
      got.resize(static_cast<std::size_t>(*size));
      auto n = f->read_at(0, std::as_writable_bytes(std::span(got)));
      got.resize(n ? *n : 0);
    }
  }
  (void)io::unlink(result_file.c_str());
  if (WIFSIGNALED(status)) {
    out.error =
        fmt::format("killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  } else if (got.empty() || WEXITSTATUS(status) != 0) {
    out.error = fmt::format("exited with status {}", WEXITSTATUS(status));
  } else if (got[0] != '1') {
    out.error = got.substr(1);
  } else {
    out.ok = true;
    out.output = got.substr(1);
  }
  return out;
}

}  // namespace keel::tools
