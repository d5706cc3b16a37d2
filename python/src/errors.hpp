#pragma once
// keel's errors as Python exceptions: the one place a keel::error becomes one. The classes
// are keel._errors' (Python); this raises them with the errno, the message and the file.

#include <pybind11/pybind11.h>

#include <string>
#include <string_view>

#include "keel/error.hpp"

namespace keel::python {

//! What a lock's "held until the deadline" means to its caller: keel.Timeout.
enum class waited : bool { no, for_a_lock };

//! Sets the Python exception for `e` (keel.Conflict, keel.Timeout, or keel.Error joined with
//! the OSError subclass of its errno, so `except FileNotFoundError` works) and returns the
//! pybind11 exception that carries it back to Python: `throw raise(e);`.
[[nodiscard]] pybind11::error_already_set raise(const keel::error& e, waited w = waited::no);

//! `path` as given, or a ValueError where a NUL byte would cut it short at the kernel.
const std::string& checked_path(const std::string& path);

//! KeyError(key), for a key a mapping does not hold.
[[nodiscard]] pybind11::error_already_set key_error(std::string_view key);

}  // namespace keel::python
