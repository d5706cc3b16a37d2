// `keel lock`, run as a user would: exit codes, messages, status passthrough, and a lock that
// is held exactly while its command runs.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "keel/lock/algorithms.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

class KeelLock : public ::testing::TestWithParam<std::string_view> {
 protected:
  void TearDown() override { (void)keel::lock::remove_mutex_resources(GetParam(), lock_path()); }
  [[nodiscard]] std::string lock_path() const { return dir_.file("lock"); }

  keel::test::program_outcome run(std::vector<std::string> args) {
    args.insert(args.begin(), {"lock", "--algo", std::string(GetParam())});
    return keel::test::run_program(KEEL_BINARY, args, dir_.path().string());
  }

  // A background `keel lock` holding NAME until killed; returns once it holds it. `wrapper`:
  // a program (and its arguments) that runs keel (unshare, to put it in a namespace).
  pid_t hold(const std::string& name, bool shared = false,
             const std::vector<std::string>& wrapper = {}) {
    const std::string ready = dir_.file("ready." + std::to_string(runs_));
    std::vector<std::string> args = wrapper;
    if (!wrapper.empty()) args.push_back(KEEL_BINARY);
    args.insert(args.end(), {"lock", "--algo", std::string(GetParam())});
    if (shared) args.push_back("--shared");
    args.insert(args.end(), {lock_path(), name, "--", "sh", "-c",
                             "echo $$ > '" + ready + ".tmp'; mv '" + ready + ".tmp' '" + ready +
                                 "'; exec sleep 30"});
    const std::string log = dir_.file("holder." + std::to_string(runs_++));
    const std::string program = wrapper.empty() ? std::string(KEEL_BINARY) : wrapper.front();
    if (!wrapper.empty()) args.erase(args.begin());
    const pid_t pid = keel::test::start_program(program, args, log + ".out", log + ".err");
    const auto t0 = clock_type::now();
    while (!std::filesystem::exists(ready) && clock_type::now() - t0 < 10s) {
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_TRUE(std::filesystem::exists(ready)) << "the holder never got the lock";
    command_pid_ = std::atoi(keel::test::slurp(ready).c_str());  // the shell execs sleep: same pid
    return pid;
  }

  keel::test::temp_dir dir_;
  int runs_ = 0;
  pid_t command_pid_ = 0;
};

TEST_P(KeelLock, PassesTheCommandsStatusThrough) {
  EXPECT_EQ(run({lock_path(), "a", "--", "true"}).code, 0);
  EXPECT_EQ(run({lock_path(), "a", "b", "--", "sh", "-c", "exit 7"}).code, 7);
  EXPECT_EQ(run({lock_path(), "a", "--", "sh", "-c", "kill -TERM $$"}).code, 128 + SIGTERM);
  const auto missing = run({lock_path(), "a", "--", "/no/such/command"});
  EXPECT_EQ(missing.code, 127);
  EXPECT_NE(missing.err.find("cannot run"), std::string::npos) << missing.err;
}

TEST_P(KeelLock, UsageErrorsExitTwo) {
  EXPECT_EQ(run({lock_path(), "a"}).code, 2);           // no command
  EXPECT_EQ(run({lock_path(), "--", "true"}).code, 2);  // no names
  EXPECT_EQ(run({"--timeout", "-1", lock_path(), "a", "--", "true"}).code, 2);
  EXPECT_EQ(run({"--timeout", "1", "--nonblock", lock_path(), "a", "--", "true"}).code, 2);
  EXPECT_EQ(run({"--bogus", lock_path(), "a", "--", "true"}).code, 2);
}

TEST_P(KeelLock, NonblockAndTimeoutExitOneWithAMessage) {
  const pid_t holder = hold("a");
  const auto nb = run({"--nonblock", lock_path(), "a", "--", "true"});
  EXPECT_EQ(nb.code, 1);
  EXPECT_NE(nb.err.find("is locked"), std::string::npos) << nb.err;
  EXPECT_EQ(std::count(nb.err.begin(), nb.err.end(), '\n'), 1) << nb.err;

  const auto t0 = clock_type::now();
  const auto to = run({"--timeout", "0.3", lock_path(), "a", "--", "true"});
  const auto took = clock_type::now() - t0;
  EXPECT_EQ(to.code, 1);
  EXPECT_NE(to.err.find("timed out"), std::string::npos) << to.err;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 3s);
  EXPECT_EQ(run({"--nonblock", lock_path(), "other", "--", "true"}).code, 0);
  ::kill(holder, SIGTERM);  // passed on to the command; both end
  EXPECT_EQ(keel::test::wait_exit(holder), 128 + SIGTERM);
  EXPECT_EQ(run({"--nonblock", lock_path(), "a", "--", "true"}).code, 0);
}

TEST_P(KeelLock, SharedHoldersCoexist) {
  const pid_t holder = hold("s", true);
  const bool shared_is_exclusive = GetParam() == "lock_files";
  EXPECT_EQ(run({"--shared", "--nonblock", lock_path(), "s", "--", "true"}).code,
            shared_is_exclusive ? 1 : 0);
  EXPECT_EQ(run({"--nonblock", lock_path(), "s", "--", "true"}).code, 1);
  ::kill(holder, SIGTERM);
  (void)keel::test::wait_exit(holder);
}

// keel lock becomes its command: the lock holds while the command runs (a second keel lock
// is refused), and a SIGKILL to the process keel lock started ends the command and the lock
// together. (It used to kill only the wrapper: the command ran on, and a second keel lock
// got the lock at once.)
TEST_P(KeelLock, KillingKeelLockNeverLeavesItsCommandRunningUnlocked) {
  const pid_t holder = hold("k");
  EXPECT_EQ(command_pid_, holder) << "the command is not the process keel lock started";
  const auto during = run({"--nonblock", lock_path(), "k", "--", "true"});
  EXPECT_EQ(during.code, 1) << "a second holder got in while the command ran: " << during.err;
  ::kill(holder, SIGKILL);
  EXPECT_EQ(keel::test::wait_exit(holder), 128 + SIGKILL);
  EXPECT_NE(::kill(command_pid_, 0), 0) << "the command outlived the kill";
  const auto after = run({"--timeout", "10", lock_path(), "k", "--", "true"});
  EXPECT_EQ(after.code, 0) << after.err;
}

// The command is given the descriptors the lock holds (as with flock(1)): what is held
// through one holds while the command, or a child that inherited it, lives.
TEST_P(KeelLock, TheCommandIsGivenTheLocksDescriptors) {
  if (GetParam() == "sysv") GTEST_SKIP() << "sysv holds a semaphore, not a descriptor";
  const auto shown = run(
      {lock_path(), "d", "--", "sh", "-c", "for f in /proc/$$/fd/*; do readlink $f; done; true"});
  ASSERT_EQ(shown.code, 0) << shown.err;
  EXPECT_NE(shown.out.find(lock_path()), std::string::npos)
      << "the command has no descriptor of the lock:\n"
      << shown.out;
}

// Second review (issue 15, finding 8): /proc/PID/stat's start time is shifted by the
// reader's time namespace (its boottime offset). A holder in a time namespace recorded a
// start time no reader outside would ever see again, so lock_files and atomic_append judged
// it dead and let a second holder in. Start times are now read as the initial namespace
// sees them.
TEST_P(KeelLock, AHolderInAnotherTimeNamespaceIsNotJudgedDead) {
  const std::string unshare = "/usr/bin/unshare";
  const std::vector<std::string> in_time_ns = {unshare, "--time", "--boottime", "100000", "--fork"};
  if (::geteuid() != 0 || !std::filesystem::exists(unshare)) {
    GTEST_SKIP() << "needs root and unshare(1) to make a time namespace";
  }
  std::vector<std::string> probe(in_time_ns.begin() + 1, in_time_ns.end());
  probe.emplace_back("/bin/true");
  if (keel::test::run_program(unshare, probe, dir_.path().string()).code != 0) {
    GTEST_SKIP() << "this kernel or sandbox makes no time namespaces";
  }
  const pid_t holder = hold("t", false, in_time_ns);
  const auto other = run({"--timeout", "1", lock_path(), "t", "--", "true"});
  EXPECT_EQ(other.code, 1) << "a second holder got in beside one in a time namespace";
  if (command_pid_ > 0) ::kill(command_pid_, SIGKILL);  // keel lock, the command; then unshare
  EXPECT_NE(keel::test::wait_exit(holder), 0);
}

INSTANTIATE_TEST_SUITE_P(Every, KeelLock, ::testing::ValuesIn(keel::lock::algorithm_names()),
                         [](const auto& param_info) { return std::string(param_info.param); });

}  // namespace
