#include "errors.hpp"

#include <system_error>

#include "keel/result.hpp"

namespace py = pybind11;

namespace keel::python {

py::error_already_set raise(const keel::error& e, waited w) {
  // The errno a C caller would see: the kernel's, or the one keel's condition stands for
  // (corrupt is EBADMSG); None for keel's own (not_found, conflict, budget_reached).
  py::object errnum = py::none();
  if (e.category() == std::system_category() || e.category() == std::generic_category()) {
    errnum = py::int_(e.value());
  } else if (const auto cond = e.default_error_condition();
             cond.category() == std::generic_category()) {
    errnum = py::int_(cond.value());
  }
  const bool is_conflict = e == keel::errc::conflict;
  const bool is_timeout = w == waited::for_a_lock &&
                          (e == std::errc::timed_out || e == std::errc::operation_would_block);
  py::object path =
      e.path().empty() ? py::object(py::none()) : py::object(py::str(std::string(e.path())));
  py::object offset = e.has_offset() ? py::object(py::int_(e.offset())) : py::object(py::none());
  const char* kind = is_conflict ? "conflict" : is_timeout ? "timeout" : "error";
  // Kept for the process's life: never released after the interpreter is gone.
  static const auto* make = new py::object(py::module_::import("keel._errors").attr("_make"));
  py::object exc = (*make)(kind, errnum, e.message(), path, offset);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  return py::error_already_set();
}

const std::string& checked_path(const std::string& path) {
  if (path.find('\0') != std::string::npos) throw py::value_error("a path has no NUL byte");
  return path;
}

py::error_already_set key_error(std::string_view key) {
  py::object k = py::bytes(key.data(), key.size());
  PyErr_SetObject(PyExc_KeyError, k.ptr());
  return py::error_already_set();
}

}  // namespace keel::python
