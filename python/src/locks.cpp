// keel._keel's locks: flock(2) on a whole file (keel.FileLock is built on it, in Python) and
// keel's shared-filesystem mutexes over sets of entities (keel.Mutex).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "errors.hpp"
#include "keel/io/file_lock.hpp"
#include "keel/lock/algorithms.hpp"
#include "wait.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

// flock(2) on `path` (opened as flock(1) opens it) through `fd` when it is one (a descriptor
// an earlier call returned, kept open), else a new one; the descriptor that holds it. On
// failure nothing is locked, and `fd` is closed (the caller forgets it).
int flock_acquire(const std::string& path, bool exclusive, double timeout, int fd) {
  const auto kind = exclusive ? io::lock_kind::exclusive : io::lock_kind::shared;
  io::file_handle f(fd);
  auto r = wait_in_slices<void>(timeout,
                                [&](io::deadline d) { return io::lock_file_at(f, path, kind, d); });
  if (!r) throw raise(r.error().about(path), waited::for_a_lock);
  return f.release();
}

// Unlocks `fd`, and closes it when asked (else it stays open for the next flock_acquire).
void flock_release(int fd, bool close) {
  io::file_handle f(fd);
  auto r = io::unlock_file(f);
  if (!close) (void)f.release();
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
    const auto v = name.cast<long long>();
    if (v < 0) throw py::value_error("an entity's number is from 0 to 2**63 - 18");
    return lock::entity(static_cast<std::uint64_t>(v), exclusive);
  }
  throw py::type_error("an entity is named by a str, bytes or int");
}

class mutex_guard;

class mutex {
 public:
  mutex(const std::string& path, const std::string& algorithm) : path_(path) {
    auto m = lock::open_mutex(algorithm, path);
    if (!m) throw raise(m.error().about(path));
    m_ = std::move(*m);
  }
  [[nodiscard]] std::string algorithm() const { return std::string(m_->algorithm()); }
  [[nodiscard]] const std::string& path() const { return path_; }
  lock::shared_fs_mutex& get() { return *m_; }

 private:
  std::string path_;
  std::unique_ptr<lock::shared_fs_mutex> m_;
};

// The entities one lock() took. Unlocked by the thread that locked them (keel's deadlock
// detection keeps each thread's held entities with that thread).
class mutex_guard {
 public:
  mutex_guard(lock::entities_guard g, py::object owner)
      : g_(std::move(g)), owner_(std::move(owner)), thread_(std::this_thread::get_id()) {}
  ~mutex_guard() { (void)g_.unlock(); }
  void release() {
    if (!g_.owns_lock()) throw py::value_error("the lock was released already");
    if (std::this_thread::get_id() != thread_) {
      throw py::value_error("a keel.Mutex lock is released by the thread that took it");
    }
    auto r = g_.unlock();
    if (!r) throw raise(r.error());
  }
  [[nodiscard]] bool held() const { return g_.owns_lock(); }
  [[nodiscard]] std::size_t size() const { return g_.entities().size(); }

 private:
  lock::entities_guard g_;
  py::object owner_;  // the keel.Mutex, kept while its entities are held
  std::thread::id thread_;
};

std::unique_ptr<mutex_guard> lock_entities(py::object self, const py::iterable& names, bool shared,
                                           double timeout) {
  auto& m = self.cast<mutex&>();
  std::vector<lock::entity> set;
  for (const auto& n : names)
    set.push_back(entity_of(n, !shared));
  auto g = wait_in_slices<lock::entities_guard>(
      timeout, [&](io::deadline d) { return m.get().lock(set, d); });
  if (!g) throw raise(g.error().about(m.path()), waited::for_a_lock);
  return std::make_unique<mutex_guard>(std::move(*g), std::move(self));
}

}  // namespace

void register_locks(py::module_& m) {
  m.def("flock_acquire", &flock_acquire, py::arg("path"), py::arg("exclusive"), py::arg("timeout"),
        py::arg("fd") = -1,
        "flock(2) on the file at `path` (made if missing), waiting `timeout` seconds (< 0: "
        "for ever; 0: not at all), through `fd` (one it returned before) or a new "
        "descriptor. Returns the descriptor holding it; raises keel.Timeout (and closes "
        "`fd`).");
  m.def("flock_release", &flock_release, py::arg("fd"), py::arg("close") = true,
        "Unlocks a descriptor flock_acquire returned, and closes it unless `close` is False.");

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
           "Locks every entity named (str, bytes or int), waiting `timeout` seconds (< 0: for "
           "ever; 0: not at all). Raises keel.Timeout.")
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
