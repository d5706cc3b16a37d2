// keel.FileLock's state, in C++ so that no Python signal handler (KeyboardInterrupt, an alarm)
// can come between its steps: which thread of this process holds it and how many times, the
// turn other threads wait for, and the descriptor holding the file's flock(2). Owns them; each
// call comes with the GIL, which guards them, except the turn (its own mutex: it is waited for
// without the GIL).

#include <pybind11/pybind11.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "errors.hpp"
#include "fork.hpp"
#include "keel/io/file_lock.hpp"
#include "thread_token.hpp"
#include "wait.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

// Held by the thread that holds (or is taking) the file's lock through one FileLock: the
// others of this process wait here, not on the file (a second flock of the same file from this
// process would wait for the first: each open is its own holder).
struct turn {
  std::mutex m;
  std::condition_variable cv;
  bool taken = false;  // guarded by m
};

class file_lock_core {
 public:
  explicit file_lock_core(const std::string& path) : path_(checked_path(path)) {}
  file_lock_core(const file_lock_core&) = delete;
  file_lock_core& operator=(const file_lock_core&) = delete;
  ~file_lock_core() {
    if (current() && f_.is_open()) (void)io::unlock_private_file(f_);
    if (!current()) (void)f_.release();  // (the child's copy was closed at the fork)
  }

  // Takes it, waiting `timeout` seconds (< 0: for ever; 0: one try). Re-entrant in the
  // holding thread. Raises keel.Timeout, or keel.Error for the file.
  void acquire(double timeout) {
    timeout = checked_timeout(timeout);
    forget_parents();
    const auto& me = this_thread_token();
    if (count_ > 0 && owner_ == me) {
      ++count_;
      return;
    }
    using clock = std::chrono::steady_clock;
    const auto end = clock::now() + std::chrono::duration_cast<clock::duration>(
                                        std::chrono::duration<double>(timeout > 0 ? timeout : 0));
    std::shared_ptr<turn> t = turn_;  // (kept: a fork meanwhile replaces turn_ in the child)
    auto took = wait_in_slices<void>(timeout, [&](io::deadline d) { return take(*t, d); });
    if (!took) throw raise(took.error().about(path_), waited::for_a_lock);
    double left = timeout;
    if (timeout > 0) left = std::chrono::duration<double>(end - clock::now()).count();
    if (timeout > 0 && left <= 0) {
      give(*t);
      throw raise(error(std::make_error_code(std::errc::timed_out)).about(path_),
                  waited::for_a_lock);
    }
    const auto kind = io::lock_kind::exclusive;
    result<io::file_handle> f;
    try {
      f = wait_in_slices<io::file_handle>(
          left, [&](io::deadline d) { return io::lock_file_privately(path_, kind, d); });
    } catch (...) {  // (a signal handler's exception, between slices)
      give(*t);
      throw;
    }
    if (!f) {
      give(*t);
      throw raise(f.error().about(path_), waited::for_a_lock);
    }
    // From here to the end no Python code runs: the hold is whole or absent.
    f_ = std::move(*f);
    generation_ = fork_generation();
    owner_ = me;
    count_ = 1;
  }

  // Undoes one acquire (`force`: every one); the last lets the file go. From any thread.
  void release(bool force) {
    forget_parents();
    if (count_ == 0) return;
    count_ = force ? 0 : count_ - 1;
    if (count_ > 0) return;
    owner_ = {};
    auto r = io::unlock_private_file(f_);
    give(*turn_);
    if (!r) throw raise(r.error().about(path_));
  }

  [[nodiscard]] int count() {
    forget_parents();
    return count_;
  }

 private:
  [[nodiscard]] bool current() const noexcept { return generation_ == fork_generation(); }

  // In a forked child: its parent's hold is not its own (the descriptor was closed at the fork,
  // io::lock_file_privately), nor its parent's turn (a parent's thread may have held its mutex).
  void forget_parents() {
    if (current()) return;
    (void)f_.release();
    owner_ = {};
    count_ = 0;
    // The parent's turn is left as it was, never destroyed (its condition variable may have
    // had waiters, parent threads, whose wake-up its destruction would wait for).
    (void)new std::shared_ptr<turn>(std::move(turn_));
    turn_ = std::make_shared<turn>();
    generation_ = fork_generation();
  }

  static result<void> take(turn& t, io::deadline d) {
    const io::countdown cd = d.start();
    std::unique_lock l(t.m);
    while (t.taken) {
      if (cd.is_zero()) return errc_error(std::errc::operation_would_block);
      if (cd.is_infinite()) {
        t.cv.wait(l);
      } else if (t.cv.wait_until(l, cd.expiry()) == std::cv_status::timeout && t.taken) {
        return errc_error(std::errc::timed_out);
      }
    }
    t.taken = true;
    return {};
  }
  static void give(turn& t) {
    {
      const std::lock_guard l(t.m);
      t.taken = false;
    }
    t.cv.notify_one();
  }

  std::string path_;
  std::shared_ptr<turn> turn_ = std::make_shared<turn>();
  io::file_handle f_;  // holds the lock while count_ > 0 (io::lock_file_privately's)
  std::uint64_t generation_ = fork_generation();
  std::shared_ptr<thread_token> owner_;  // (a token, not an id: ids of ended threads are reused)
  int count_ = 0;
};

}  // namespace

void register_file_lock(py::module_& m) {
  py::class_<file_lock_core>(m, "_FileLockCore",
                             "keel.FileLock's state: its holder in this process and the "
                             "descriptor holding the file's flock(2).")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def("acquire", &file_lock_core::acquire, py::arg("timeout"),
           "Takes it, waiting `timeout` seconds (< 0: for ever; 0: one try); re-entrant in the "
           "holding thread. Raises keel.Timeout.")
      .def("release", &file_lock_core::release, py::arg("force") = false,
           "Undoes one acquire (force: every one); the last lets the file go.")
      .def_property_readonly("count", &file_lock_core::count,
                             "How many acquires are not released yet.");
}

}  // namespace keel::python
