#pragma once

#include <system_error>

namespace keel::aio {

//! Conditions keel::aio detects itself. Each compares equal to the std::errc the kernel
//! would have used (so `ec == std::errc::invalid_argument` still works), but says what is
//! wrong and what to do about it.
enum class errc {
  //! The controller is stopping or stopped: the request was not run. Start a new one.
  controller_stopped = 1,  // ≈ operation_canceled
  //! The file was closed before the request was submitted. Open it again.
  file_closed,  // ≈ bad_file_descriptor
  //! An O_DIRECT request whose offset, length or buffer address is not a multiple of the
  //! file's direct-I/O alignment (`file::alignment()`). Align them, or open without direct.
  misaligned_direct_io,  // ≈ invalid_argument
  //! The request reaches past the largest file offset, or its buffer is null.
  bad_request,  // ≈ invalid_argument
  //! A request the file was not opened for (a write on a read-only file, ...).
  not_opened_for,  // ≈ bad_file_descriptor
  //! The engine cannot do this (O_DIRECT through stdio, ...). Pick another engine.
  not_supported_by_engine,  // ≈ operation_not_supported
  //! The write-back cache was asked for on an O_DIRECT file. Open it without one of them.
  cache_needs_buffered_io,  // ≈ invalid_argument
};

const std::error_category& category() noexcept;

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), category()};
}

}  // namespace keel::aio

template <>
struct std::is_error_code_enum<keel::aio::errc> : std::true_type {};
