#pragma once
// The GIL let go around a call into keel, and taken back after it.

#include <pybind11/pybind11.h>

#include <optional>
#include <type_traits>
#include <utility>

namespace keel::python {

//! Runs `f()` without the GIL and takes it back, also when `f` throws. Not pybind11's
//! gil_scoped_release: at interpreter exit Python ends a daemon thread that takes the GIL back
//! with pthread_exit, whose forced unwind leaving a noexcept destructor (that guard's) is
//! std::terminate; from here it unwinds the thread as pthread_exit means to.
template <class F>
decltype(auto) without_gil(F&& f) {
  using R = std::invoke_result_t<F>;
  PyThreadState* state = PyEval_SaveThread();
  if constexpr (std::is_void_v<R>) {
    try {
      std::forward<F>(f)();
    } catch (...) {
      PyEval_RestoreThread(state);
      throw;
    }
    PyEval_RestoreThread(state);  // (outside the try: its forced unwind is not caught)
  } else {
    std::optional<R> r;
    try {
      r.emplace(std::forward<F>(f)());
    } catch (...) {
      PyEval_RestoreThread(state);
      throw;
    }
    PyEval_RestoreThread(state);
    return R(std::move(*r));
  }
}

}  // namespace keel::python
