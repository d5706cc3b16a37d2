#pragma once
// The C API's errors (include/keel/keel.h): a keel::error as the int the API returns, kept
// with its file and offset for the calling thread. Owns the thread's last error.

#include <exception>
#include <new>
#include <stdexcept>
#include <utility>

#include "keel/error.hpp"
#include "keel/result.hpp"

namespace keel::capi {

//! `e` as the C API's code (see keel.h), kept as the calling thread's last error.
int fail(const error& e) noexcept;

//! Runs `body` (returning an int code), turning an exception (an allocation's) into ENOMEM:
//! nothing crosses into C.
template <class F>
int guarded(F&& body) noexcept {
  try {
    return std::forward<F>(body)();
  } catch (const std::bad_alloc&) {
    return fail(std::make_error_code(std::errc::not_enough_memory));
  } catch (const std::length_error&) {
    // A count no container can hold (a caller's slip): bad input.
    return fail(std::make_error_code(std::errc::invalid_argument));
  } catch (...) {
    return fail(std::make_error_code(std::errc::state_not_recoverable));
  }
}

//! 0 for a success, else fail(its error).
template <class T>
int code_of(const result<T>& r) noexcept {
  return r ? 0 : fail(r.error());
}

}  // namespace keel::capi
