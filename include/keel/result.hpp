#pragma once

#include <cerrno>
#include <expected>
#include <system_error>

#include "keel/error.hpp"

//! keel's error convention: every public call that can fail is `noexcept` and returns
//! `result<T>`. An error is a `keel::error`: a `std::error_code` (codes that come from the
//! kernel keep their errno in `std::system_category()`, so `e == std::errc::timed_out` and
//! `e.value() == ETIMEDOUT` both work; keel's own conditions are `keel::errc`), plus, where
//! known, the file and offset it is about. keel never turns an I/O error into "busy, try
//! again".
namespace keel {

template <class T>
using result = std::expected<T, error>;

//! The one place an errno becomes an error: the value is kept, the category is the system's.
[[nodiscard]] inline std::unexpected<error> errno_error(int errnum) noexcept {
  return std::unexpected(error(std::error_code(errnum, std::system_category())));
}

//! The same for an error keel detects itself that the kernel has a name for (bad input, a
//! deadline that passed): it is reported with the errno the kernel would have used.
[[nodiscard]] inline std::unexpected<error> errc_error(std::errc code) noexcept {
  return errno_error(static_cast<int>(code));
}

//! One of keel's own conditions.
[[nodiscard]] inline std::unexpected<error> keel_error(errc code) noexcept {
  return std::unexpected(error(make_error_code(code)));
}

//! The current thread's errno as an error. Call it straight after the failing syscall.
[[nodiscard]] inline std::unexpected<error> last_errno_error() noexcept {
  return errno_error(errno);
}

}  // namespace keel
