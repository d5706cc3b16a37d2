// keel._keel's locks: flock(2) on a whole file (keel.FileLock is built on it, in Python) and
// keel's shared-filesystem mutexes over sets of entities (keel.Mutex). Owns the guards that
// other threads dropped (`orphans`), until the thread that locked them lets them go.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "errors.hpp"
#include "gil.hpp"
#include "keel/io/file_lock.hpp"
#include "keel/lock/algorithms.hpp"
#include "wait.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

// A path from Python: a NUL in it would cut it short at the kernel.
const std::string& checked_path(const std::string& path) {
  if (path.find('\0') != std::string::npos) throw py::value_error("a path has no NUL byte");
  return path;
}

// flock(2) on `path` (opened as flock(1) opens it, and opened again if the path is replaced
// while it waits); the descriptor that holds it.
int flock_acquire(const std::string& path, bool exclusive, double timeout) {
  const auto kind = exclusive ? io::lock_kind::exclusive : io::lock_kind::shared;
  auto f = wait_in_slices<io::file_handle>(
      timeout, [&](io::deadline d) { return io::open_and_lock_file(checked_path(path), kind, d); });
  if (!f) throw raise(f.error().about(path), waited::for_a_lock);
  return f->release();
}

// Unlocks `fd` and closes it (closing alone would let the lock go too: the unlock is first so
// that a descriptor dup()ed meanwhile holds nothing).
void flock_release(int fd) {
  io::file_handle f(fd);
  auto r = io::unlock_file(f);
  if (!r) throw raise(r.error());
}

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

// Entities a guard held when another thread dropped it: keel unlocks a set only from the
// thread that locked it (it keeps each thread's held entities with that thread, and some
// algorithms' descriptors too). They wait here for that thread's next keel.Mutex call; a
// thread that ends first takes its descriptors' locks with it, and the rest last until the
// process ends. Each keeps its keel.Mutex (a Python reference) alive.
struct orphan {
  lock::entities_guard guard;
  py::object owner;
};
std::mutex orphans_m;
std::multimap<std::thread::id, orphan>* orphans = new std::multimap<std::thread::id, orphan>;

// Unlocks what other threads dropped of this thread's. GIL held.
void adopt_orphans() {
  std::vector<orphan> mine;
  {
    std::lock_guard g(orphans_m);
    auto [first, last] = orphans->equal_range(std::this_thread::get_id());
    for (auto it = first; it != last; ++it)
      mine.push_back(std::move(it->second));
    orphans->erase(first, last);
  }
  for (auto& o : mine)
    (void)o.guard.unlock();
}

// The entities one lock() took. Unlocked by the thread that locked them.
class mutex_guard {
 public:
  mutex_guard(lock::entities_guard g, py::object owner)
      : g_(std::move(g)), owner_(std::move(owner)), thread_(std::this_thread::get_id()) {}
  ~mutex_guard() {
    if (!g_.owns_lock()) return;
    if (std::this_thread::get_id() == thread_) {
      (void)g_.unlock();
      return;
    }
    std::lock_guard g(orphans_m);
    orphans->emplace(thread_, orphan{std::move(g_), std::move(owner_)});
  }
  mutex_guard(const mutex_guard&) = delete;
  mutex_guard& operator=(const mutex_guard&) = delete;
  void release() {
    if (!g_.owns_lock()) throw py::value_error("the lock was released already");
    if (std::this_thread::get_id() != thread_) {
      throw py::value_error("a keel.Mutex lock is released by the thread that took it");
    }
    auto r = g_.unlock();
    adopt_orphans();
    if (!r) throw raise(r.error());
  }
  [[nodiscard]] bool held() const { return g_.owns_lock(); }
  [[nodiscard]] std::size_t size() const { return g_.entities().size(); }

 private:
  lock::entities_guard g_;
  py::object owner_;  // the keel.Mutex, kept while its entities are held
  std::thread::id thread_;
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
  m.def("flock_acquire", &flock_acquire, py::arg("path"), py::arg("exclusive"), py::arg("timeout"),
        "flock(2) on the file at `path` (made if missing), waiting `timeout` seconds (< 0: "
        "for ever; 0: not at all). Returns the descriptor holding it; raises keel.Timeout.");
  m.def("flock_release", &flock_release, py::arg("fd"),
        "Unlocks and closes a descriptor flock_acquire returned.");

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
