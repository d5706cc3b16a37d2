// keel._keel's locks: keel's shared-filesystem mutexes over sets of entities (keel.Mutex). Owns the
// guards that other threads dropped (`orphans`), until the thread that locked them lets them go.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "fork.hpp"
#include "gil.hpp"
#include "keel/lock/algorithms.hpp"
#include "thread_token.hpp"
#include "wait.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

lock::entity entity_of(const py::handle& name, bool exclusive) {
  if (py::isinstance<py::str>(name)) {
    return lock::entity::from_string(name.cast<std::string>(), exclusive);
  }
  if (py::isinstance<py::bytes>(name)) {
    return lock::entity::from_string(std::string(name.cast<py::bytes>()), exclusive);
  }
  if (py::isinstance<py::int_>(name)) {
    const auto too_large = py::int_(lock::entity::max_lockable);
    if (name < py::int_(0) || name > too_large) {
      throw py::value_error("an entity's number is from 0 to " +
                            std::to_string(lock::entity::max_lockable));
    }
    return lock::entity(name.cast<std::uint64_t>(), exclusive);
  }
  throw py::type_error("an entity is named by a str, bytes or int");
}

class mutex {
 public:
  mutex(const std::string& path, const std::string& algorithm) : path_(checked_path(path)) {
    auto m = without_gil([&] { return lock::open_mutex(algorithm, path); });
    if (!m) throw raise(m.error().about(path));
    m_ = std::move(*m);
  }
  mutex(const mutex&) = delete;
  mutex& operator=(const mutex&) = delete;
  [[nodiscard]] std::string algorithm() const { return std::string(m_->algorithm()); }
  [[nodiscard]] const std::string& path() const { return path_; }
  lock::shared_fs_mutex& get() { return *m_; }

 private:
  std::string path_;
  std::unique_ptr<lock::shared_fs_mutex> m_;
};

// A guard whose thread has ended: keel lets a set go only from the thread that locked it (it
// keeps each thread's held entities with that thread, and its descriptors), and the thread's
// end has done for its locks what the algorithm does at a thread's end (the descriptor-based
// ones let them go with its descriptors; lock_files and sysv keep them until the process
// ends). Nothing is done for them here: the guard is kept, untouched, for good.
void abandon(lock::entities_guard&& g) {
  (void)new lock::entities_guard(std::move(g));
}

// Entities a guard held when another thread dropped it. They wait here for the next keel.Mutex
// call of the thread that locked them, which lets them go; if that thread ends first, they
// are abandoned at any thread's next call. Each keeps its keel.Mutex (a Python reference)
// alive until then. Owned here, under orphans_m.
struct orphan {
  std::shared_ptr<thread_token> thread;
  lock::entities_guard guard;
  py::object owner;
};
std::mutex orphans_m;
std::vector<orphan>* orphans = new std::vector<orphan>;  // (never destroyed: see abandon)

// Lets go of what other threads dropped of this thread's, and abandons those of ended
// threads. GIL held (their owners are released here, after the mutex).
void adopt_orphans() {
  std::vector<orphan> taken;
  {
    std::lock_guard g(orphans_m);
    auto keep = std::partition(orphans->begin(), orphans->end(), [](const orphan& o) {
      return o.thread != this_thread_token() && !o.thread->ended.load();
    });
    std::move(keep, orphans->end(), std::back_inserter(taken));
    orphans->erase(keep, orphans->end());
  }
  for (auto& o : taken) {
    if (o.thread == this_thread_token()) {
      (void)o.guard.unlock();
    } else {
      abandon(std::move(o.guard));
    }
  }
}

// The entities one lock() took. Let go by the thread that locked them.
class mutex_guard {
 public:
  mutex_guard(lock::entities_guard g, py::object owner)
      : g_(std::move(g)), owner_(std::move(owner)), thread_(this_thread_token()) {}
  ~mutex_guard() {
    if (!g_.owns_lock()) return;
    if (thread_ == this_thread_token() || generation_ != fork_generation()) {
      (void)g_.unlock();  // (in a forked child, keel drops its parent's without unlocking)
      return;
    }
    if (thread_->ended.load()) {
      abandon(std::move(g_));
      return;
    }
    std::lock_guard g(orphans_m);
    orphans->push_back(orphan{thread_, std::move(g_), std::move(owner_)});
  }
  mutex_guard(const mutex_guard&) = delete;
  mutex_guard& operator=(const mutex_guard&) = delete;
  void release() {
    if (!g_.owns_lock()) throw py::value_error("the lock was released already");
    if (generation_ != fork_generation()) {
      (void)g_.unlock();  // a forked child's copy: the parent's locks are not its to let go
      return;
    }
    if (thread_ != this_thread_token()) {
      if (!thread_->ended.load()) {
        throw py::value_error("a keel.Mutex lock is released by the thread that took it");
      }
      abandon(std::move(g_));
      throw py::value_error(
          "the thread that took this lock has ended, and its locks with it (lock_files and "
          "sysv keep them until the process ends): release a lock in the thread that took it");
    }
    auto r = g_.unlock();
    adopt_orphans();
    if (!r) throw raise(r.error());
  }
  //! Whether this guard holds its entities: not once released, nor once the thread that took
  //! them has ended, nor in a forked child (its parent's locks are not the child's).
  [[nodiscard]] bool held() const {
    return g_.owns_lock() && !thread_->ended.load() && generation_ == fork_generation();
  }
  [[nodiscard]] std::size_t size() const { return g_.entities().size(); }

 private:
  lock::entities_guard g_;
  py::object owner_;  // the keel.Mutex, kept while its entities are held
  std::shared_ptr<thread_token> thread_;
  std::uint64_t generation_ = fork_generation();
};

std::unique_ptr<mutex_guard> lock_entities(py::object self, const py::handle& names, bool shared,
                                           double timeout) {
  if (py::isinstance<py::str>(names) || py::isinstance<py::bytes>(names)) {
    throw py::type_error("names is a list of names: lock([\"job-1\"]), not lock(\"job-1\")");
  }
  auto& m = self.cast<mutex&>();
  adopt_orphans();
  std::vector<lock::entity> set;
  for (const auto& n : py::iter(names))
    set.push_back(entity_of(n, !shared));
  auto g = wait_in_slices<lock::entities_guard>(
      timeout, [&](io::deadline d) { return m.get().lock(set, d); });
  if (!g) throw raise(g.error().about(m.path()), waited::for_a_lock);
  return std::make_unique<mutex_guard>(std::move(*g), std::move(self));
}

}  // namespace

void register_locks(py::module_& m) {
  py::class_<mutex_guard>(m, "MutexGuard",
                          "Entities a keel.Mutex locked, until release() or the end of a "
                          "`with` block.")
      .def("release", &mutex_guard::release, "Unlocks them (from the thread that locked them).")
      .def_property_readonly("held", &mutex_guard::held)
      .def("__len__", &mutex_guard::size)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](mutex_guard& g, const py::args&) {
        if (g.held()) g.release();
      });

  py::class_<mutex>(m, "Mutex",
                    "keel's shared-filesystem mutex: locks sets of named entities, shared or "
                    "exclusive, all or none, with a timeout, between threads and processes.")
      .def(py::init<const std::string&, const std::string&>(), py::arg("path"),
           py::arg("algorithm") = "byte_ranges")
      .def_property_readonly("algorithm", &mutex::algorithm)
      .def_property_readonly("path", &mutex::path)
      .def("lock", &lock_entities, py::arg("names"), py::arg("shared") = false,
           py::arg("timeout") = -1.0,
           "Locks every entity named (a list of str, bytes or int), waiting `timeout` seconds "
           "(< 0: for ever; 0: not at all). Raises keel.Timeout.")
      .def_static(
          "algorithms",
          [] {
            std::vector<std::string> names;
            for (auto n : lock::algorithm_names())
              names.emplace_back(n);
            return names;
          },
          "The algorithms' names.");
}

}  // namespace keel::python
