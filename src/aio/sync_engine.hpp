#pragma once
// The engines that run one request at a time per thread (posix, stdio, null): each says how
// to run one request; their workers (sync_engine.cpp) are alike.

#include "engine.hpp"
#include "op.hpp"

namespace keel::aio::detail {

class sync_engine : public engine {
 public:
  using engine::engine;
  //! Runs `o` (a task too) on the calling thread: the bytes transferred, or the error.
  [[nodiscard]] virtual result<std::size_t> run(op& o) noexcept = 0;
  //! Runs `o`, not a task, on the thread that submitted it (submit_here).
  [[nodiscard]] virtual result<std::size_t> run_here(op& o) noexcept { return run(o); }
  [[nodiscard]] std::unique_ptr<worker> make_worker(unsigned index) noexcept override;
  //! Runs a request on the submitting thread, then and there, if options::submit_on says
  //! so: always with submitter::caller; with adaptive, when the thread spends most of its
  //! time in keel's calls and has no other request of the file unfinished (it submits and
  //! waits, one at a time: a hand-over would only add two wake-ups to the wait).
  [[nodiscard]] std::size_t submit_here(std::span<op* const> ops) noexcept override;
};

}  // namespace keel::aio::detail
