// `keel lock`, run as a user would: exit codes, messages, status passthrough, and a lock that
// is held exactly while its command runs.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <map>
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

// With no NAME, keel lock is flock(1) on the file: what flock(1), Python's filelock and
// portalocker (fcntl.flock on Unix) take on the same file.
class KeelLockFile : public ::testing::Test {
 protected:
  [[nodiscard]] std::string file() const { return dir_.file("f"); }
  keel::test::program_outcome run(const std::string& program, std::vector<std::string> args) {
    return keel::test::run_program(program, args, dir_.path().string());
  }
  keel::test::program_outcome keel(std::vector<std::string> args) {
    args.insert(args.begin(), "lock");
    return run(KEEL_BINARY, args);
  }
  keel::test::program_outcome sh(const std::string& script) {
    return run("/bin/sh", {"-c", script});
  }
  // `program args... sh -c <mark ready; exec sleep 30>` in the background; returns once the
  // command runs (so holds the lock). The mark is the shell's own write (no child of it
  // holds the lock's descriptor once the holder is ended), complete once it ends its line.
  pid_t hold(const std::string& program, std::vector<std::string> args) {
    const std::string ready = dir_.file("ready." + std::to_string(runs_++));
    args.insert(args.end(), {"sh", "-c", "echo $$ > '" + ready + "'; exec sleep 30"});
    const pid_t pid = keel::test::start_program(program, args, ready + ".out", ready + ".err");
    const auto marked = [&] {
      const std::string s = keel::test::slurp(ready);
      return !s.empty() && s.back() == '\n';
    };
    const auto t0 = clock_type::now();
    while (!marked() && clock_type::now() - t0 < 60s) {
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_TRUE(marked()) << "the holder never got the lock";
    if (const pid_t command = std::atoi(keel::test::slurp(ready).c_str()); command > 0) {
      commands_.emplace(pid, keel::test::watched_process(command));  // alive: it sleeps
    }
    return pid;
  }
  // Ends the holder and its command (flock(1)'s runs as its child, holding the lock too).
  void end(pid_t pid) {
    if (auto c = commands_.find(pid); c != commands_.end()) c->second.kill_and_await_exit();
    ::kill(pid, SIGKILL);
    (void)keel::test::wait_exit(pid);
  }
  std::map<pid_t, keel::test::watched_process> commands_;
  keel::test::temp_dir dir_;
  int runs_ = 0;
};

TEST_F(KeelLockFile, ExcludesAndIsExcludedByFlock1) {
  if (!std::filesystem::exists("/usr/bin/flock")) GTEST_SKIP() << "no flock(1) (util-linux)";
  const pid_t k = hold(KEEL_BINARY, {"lock", file(), "--"});
  EXPECT_EQ(run("/usr/bin/flock", {"-n", file(), "true"}).code, 1) << "flock(1) got in";
  end(k);
  EXPECT_EQ(run("/usr/bin/flock", {"-n", file(), "true"}).code, 0);
  const pid_t f = hold("/usr/bin/flock", {file()});
  const auto busy = keel({"-n", file(), "--", "true"});
  EXPECT_EQ(busy.code, 1) << "keel lock got in beside flock(1)";
  EXPECT_NE(busy.err.find("keel lock: "), std::string::npos) << busy.err;
  EXPECT_EQ(keel({"-n", "--shared", file(), "--", "true"}).code, 1);
  end(f);
  EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 0);
}

TEST_F(KeelLockFile, ExcludesPythonsFlockAsFilelockAndPortalockerTakeIt) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3";
  const std::string take =
      "import fcntl, sys\n"
      "f = open(sys.argv[1], 'a')\n"
      "try:\n"
      "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
      "except BlockingIOError:\n"
      "    sys.exit(1)\n";
  const pid_t k = hold(KEEL_BINARY, {"lock", file(), "--"});
  EXPECT_EQ(run("/usr/bin/python3", {"-c", take, file()}).code, 1) << "Python's flock got in";
  end(k);
  EXPECT_EQ(run("/usr/bin/python3", {"-c", take, file()}).code, 0);
}

// The libraries themselves, where Debian's packages are installed (scripts/deps.sh installs
// them): each is kept out while keel lock holds the file, and keeps keel lock out.
TEST_F(KeelLockFile, FilelockAndPortalockerThemselvesExcludeAndAreExcluded) {
  const std::string py = "/usr/bin/python3";
  if (!std::filesystem::exists(py) || run(py, {"-c", "import filelock, portalocker"}).code != 0) {
    GTEST_SKIP() << "python3-filelock or python3-portalocker is not installed "
                    "(scripts/deps.sh installs them)";
  }
  const std::string try_both =
      "import filelock, portalocker, sys\n"
      "try:\n"
      "    filelock.FileLock(sys.argv[1]).acquire(timeout=0)\n"
      "    sys.exit(2)\n"
      "except filelock.Timeout:\n"
      "    pass\n"
      "f = open(sys.argv[1], 'a')\n"
      "try:\n"
      "    portalocker.lock(f, portalocker.LOCK_EX | portalocker.LOCK_NB)\n"
      "    sys.exit(3)\n"
      "except portalocker.exceptions.LockException:\n"
      "    pass\n";
  const pid_t k = hold(KEEL_BINARY, {"lock", file(), "--"});
  const auto r = run(py, {"-c", try_both, file()});
  EXPECT_EQ(r.code, 0) << (r.code == 2   ? "filelock got in"
                           : r.code == 3 ? "portalocker got in"
                                         : r.err);
  end(k);
  for (const std::string lib : {"filelock", "portalocker"}) {
    // The library takes the file, then runs the ready mark while it holds it.
    const std::string take = lib == "filelock" ? "import filelock, subprocess, sys\n"
                                                 "l = filelock.FileLock(sys.argv[1])\n"
                                                 "l.acquire()\n"
                                                 "subprocess.run(sys.argv[2:])\n"
                                               : "import portalocker, subprocess, sys\n"
                                                 "f = open(sys.argv[1], 'a')\n"
                                                 "portalocker.lock(f, portalocker.LOCK_EX)\n"
                                                 "subprocess.run(sys.argv[2:])\n";
    const pid_t p = hold(py, {"-c", take, file()});
    EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 1) << lib << " held it; keel lock got in";
    end(p);
  }
  EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 0);
}

TEST_F(KeelLockFile, BusyIsNotCannotOpen) {
  const std::string missing = dir_.file("no/such/dir/f");
  const auto whole = keel({missing, "--", "true"});
  EXPECT_EQ(whole.code, 66) << whole.err;
  EXPECT_NE(whole.err.find("No such file or directory"), std::string::npos) << whole.err;
  EXPECT_EQ(keel({missing, "name", "--", "true"}).code, 66);
  const pid_t k = hold(KEEL_BINARY, {"lock", file(), "--"});
  EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 1);
  EXPECT_EQ(keel({"-n", "-E", "9", file(), "--", "true"}).code, 9);
  EXPECT_EQ(keel({"-w", "0.2", "-E", "9", file(), "--", "true"}).code, 9);
  end(k);
}

TEST_F(KeelLockFile, TheDescriptorFormLocksTheShellsDescriptor) {
  const std::string k = KEEL_BINARY;
  // Locked by keel lock, which has exited; held by the shell's descriptor until it closes.
  const auto inside = sh("( '" + k + "' lock -n 9 || exit 5; '" + k + "' lock -n '" + file() +
                         "' -- true; echo $? ) 9>'" + file() + "'");
  EXPECT_EQ(inside.code, 0) << inside.err;
  EXPECT_EQ(inside.out, "1\n") << "the descriptor was not locked: " << inside.err;
  EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 0) << "still locked after the shell closed it";
  const auto closed = keel({"-n", "7"});
  EXPECT_EQ(closed.code, 66) << closed.err;
}

TEST_F(KeelLockFile, DashCRunsAShellCommand) {
  const auto r = keel({file(), "-c", "echo $((6 * 7)); exit 3"});
  EXPECT_EQ(r.code, 3);
  EXPECT_EQ(r.out, "42\n");
}

TEST_F(KeelLockFile, BadInputGetsOneShortLine) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--timeout", "-1", file(), "--", "true"},
        {"--timeout", "1e400", file(), "--", "true"},
        {"--bogus", file(), "--", "true"},
        {file()},
        {file(), "--"},
        {"-E", "300", file(), "--", "true"},
        {file(), "-c", "true", "--", "true"},
        {"--algo", "memory_map", file(), "--", "true"},
        {"-w", "", file(), "--", "true"},
        {"--algo", std::string(100000, 'x'), file(), "--", "true"}}) {
    const auto r = keel(args);
    EXPECT_EQ(r.code, 2) << args.front();
    EXPECT_TRUE(r.err.starts_with("keel lock: ")) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_LT(r.err.size(), 200u) << r.err;
  }
}

// Review of the flock form (issue 40): a timeout shorter than the time to start the wait
// fired before flock(2) waited, which then waited for the holder (6 of 6 at 1 us); and one
// started with SIGALRM blocked (as a parent may leave it) ignored the timeout.
TEST_F(KeelLockFile, ATimeoutHoldsHoweverShortAndWithSigalrmBlocked) {
  const pid_t k = hold(KEEL_BINARY, {"lock", file(), "--"});
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(keel({"-w", "0.000001", file(), "--", "true"}).code, 1) << "waited for the holder";
  }
  if (std::filesystem::exists("/usr/bin/python3")) {
    const std::string blocked =
        "import os, signal, sys\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n";
    const auto r = run("/usr/bin/python3",
                       {"-c", blocked, KEEL_BINARY, "lock", "-w", "0.3", file(), "--", "true"});
    EXPECT_EQ(r.code, 1) << "with SIGALRM blocked: " << r.err;
  }
  end(k);
}

// A command started with stdout closed: the lock's files were opened at descriptor 1, and
// the command's output went into the lock file, which every later keel lock then refused.
TEST_F(KeelLockFile, ACommandWithStdoutClosedWritesNothingIntoTheLock) {
  const std::string k = KEEL_BINARY;
  for (const std::string algo : {"memory_map", "atomic_append", "byte_ranges"}) {
    const std::string path = dir_.file("closed." + algo);
    const auto r = sh("'" + k + "' lock --algo " + algo + " '" + path +
                      "' n -- sh -c 'echo GARBAGE' >&- 2>/dev/null; '" + k + "' lock --algo " +
                      algo + " '" + path + "' n -- true");
    EXPECT_EQ(r.code, 0) << algo << ": " << r.err;
    EXPECT_EQ(keel::test::slurp(path).find("GARBAGE"), std::string::npos) << algo;
  }
}

// Where there is no /proc to list descriptors with, the lock's are found all the same: a
// command run that way holds its lock (it ran unlocked).
TEST_F(KeelLockFile, WithoutProcTheCommandStillHoldsTheLock) {
  if (::geteuid() != 0 || !std::filesystem::exists("/usr/bin/unshare")) {
    GTEST_SKIP() << "needs root and unshare(1) to hide /proc";
  }
  const std::string ready = dir_.file("ready.noproc");
  const pid_t k = keel::test::start_program(
      "/usr/bin/unshare",
      {"-m", "sh", "-c",
       "mount -t tmpfs none /proc || exit 77; exec '" + std::string(KEEL_BINARY) + "' lock '" +
           file() + "' -- sh -c \"touch '" + ready + "'; exec sleep 30\""},
      ready + ".out", ready + ".err");
  const auto t0 = clock_type::now();
  while (!std::filesystem::exists(ready) && clock_type::now() - t0 < 10s) {
    if (::kill(k, 0) != 0) break;
    std::this_thread::sleep_for(5ms);
  }
  if (!std::filesystem::exists(ready)) {
    const int code = keel::test::wait_exit(k);
    if (code == 77) GTEST_SKIP() << "cannot mount over /proc here";
    FAIL() << "the holder never ran: " << code << " " << keel::test::slurp(ready + ".err");
  }
  EXPECT_EQ(keel({"-n", file(), "--", "true"}).code, 1) << "the command ran unlocked";
  ::kill(k, SIGKILL);
  (void)keel::test::wait_exit(k);
}

// A file named like a descriptor is a file when a command follows (as for flock(1)).
TEST_F(KeelLockFile, ANumberWithACommandIsAFile) {
  const auto r =
      sh("cd '" + dir_.path().string() + "' && '" + std::string(KEEL_BINARY) + "' lock 5 -- true");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(dir_.file("5")));
}

INSTANTIATE_TEST_SUITE_P(Every, KeelLock, ::testing::ValuesIn(keel::lock::algorithm_names()),
                         [](const auto& param_info) { return std::string(param_info.param); });

}  // namespace
