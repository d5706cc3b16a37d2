// keel._keel: the extension behind `import keel` (python/keel/__init__.py).

#include <pybind11/pybind11.h>

#include "fork.hpp"
#include "keel/version.hpp"

namespace py = pybind11;

namespace keel::python {
void register_file_lock(py::module_& m);
void register_locks(py::module_& m);
void register_store(py::module_& m);
}  // namespace keel::python

PYBIND11_MODULE(_keel, m) {
  m.doc() = "keel's extension: file locks, shared-filesystem mutexes and the store.";
  m.attr("__version__") = KEEL_VERSION_STRING;
  keel::python::register_fork_generation();
  keel::python::register_file_lock(m);
  keel::python::register_locks(m);
  keel::python::register_store(m);
}
