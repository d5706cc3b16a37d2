#pragma once

#include <cerrno>
#include <expected>
#include <system_error>

//! keel's error convention: every public call that can fail is `noexcept` and returns
//! `result<T>`. An error is a `std::error_code`; codes that come from the kernel keep their
//! errno in `std::system_category()`, so `ec == std::errc::timed_out` and `ec.value() == ETIMEDOUT`
//! both work. keel never turns an I/O error into "busy, try again".
namespace keel {

template <class T>
using result = std::expected<T, std::error_code>;

//! The one place an errno becomes an error: the value is kept, the category is the system's.
[[nodiscard]] inline std::unexpected<std::error_code> errno_error(int errnum) noexcept {
  return std::unexpected(std::error_code(errnum, std::system_category()));
}

//! The same for an error keel detects itself (bad input, a deadline that passed): it is
//! reported with the errno the kernel would have used, so callers test one kind of value.
[[nodiscard]] inline std::unexpected<std::error_code> errc_error(std::errc code) noexcept {
  return errno_error(static_cast<int>(code));
}

//! The current thread's errno as an error. Call it straight after the failing syscall.
[[nodiscard]] inline std::unexpected<std::error_code> last_errno_error() noexcept {
  return errno_error(errno);
}

}  // namespace keel
