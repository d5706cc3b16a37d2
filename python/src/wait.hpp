#pragma once
// A lock wait from Python: without the GIL, and in slices, so that Ctrl-C (or any signal
// with a Python handler) is answered within a slice while a lock is waited for.

#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>

#include "gil.hpp"
#include "keel/io/deadline.hpp"
#include "keel/result.hpp"

namespace keel::python {

//! The longest a wait goes without looking at Python's signals.
constexpr std::chrono::milliseconds wait_slice{100};

//! A timeout in seconds as Python gives it: < 0 (or above 1e9 s, infinity included) for ever,
//! 0 not at all. NaN is a ValueError.
inline double checked_timeout(double timeout) {
  if (std::isnan(timeout)) throw pybind11::value_error("timeout is NaN: give seconds, or -1");
  return timeout > 1e9 ? -1.0 : timeout;
}

//! Calls `attempt(deadline)` (GIL released) until it succeeds, fails for another reason than
//! the lock being held, or `timeout` seconds have passed (checked_timeout; 0: one try, which
//! ends with operation_would_block; else timed_out). Between slices it runs Python's signal
//! handlers: their exception (KeyboardInterrupt) ends the wait.
template <class T, class Attempt>
result<T> wait_in_slices(double timeout, Attempt&& attempt) {
  using clock = std::chrono::steady_clock;
  timeout = checked_timeout(timeout);
  if (timeout == 0) {
    return without_gil([&] { return attempt(io::deadline::zero()); });
  }
  const auto end = clock::now() + std::chrono::duration_cast<clock::duration>(
                                      std::chrono::duration<double>(timeout > 0 ? timeout : 0));
  for (;;) {
    io::deadline d = wait_slice;
    if (timeout > 0) d = std::min(end, clock::now() + wait_slice);
    result<T> r = without_gil([&] { return attempt(d); });
    if (r || r.error() != std::errc::timed_out) return r;
    if (timeout > 0 && clock::now() >= end) return r;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

}  // namespace keel::python
