#pragma once
// All an engine and its workers see of the controller they serve: its options, the two ends
// of a request's life in a worker, the hand-over of a request to a worker, whether it stops,
// and the open file descriptions it can spare. The controller's insides (detail.hpp) are its
// own: no engine includes them. One per controller, owned by it (controller::impl::context).

#include <cstdint>
#include <optional>

#include "keel/aio/controller.hpp"
#include "keel/result.hpp"

namespace keel::aio::detail {

struct op;

//! How a request that reached a worker ends before its engine sees it (before_engine).
struct early_end {
  result<std::size_t> outcome;
  bool cancelled = false;
};

class engine_context {
 public:
  explicit engine_context(controller::impl& c) noexcept : c_(c) {}
  engine_context(const engine_context&) = delete;
  engine_context& operator=(const engine_context&) = delete;

  //! The controller's options (options::engine and submit_on as chosen when it started).
  [[nodiscard]] const options& opts() const noexcept;
  //! With submitter::adaptive, the id under which the submitting threads' calls on this
  //! controller are timed (caller_clock.hpp); 0 otherwise.
  [[nodiscard]] std::uint64_t timed_callers() const noexcept;
  //! Whether the controller is stopping (relaxed: a hint for a spin).
  [[nodiscard]] bool stopping_hint() const noexcept;
  //! Whether a worker may end: the controller stops and no request of it is left.
  [[nodiscard]] bool may_exit() const noexcept;
  //! What a worker does first with a request: nothing (the engine runs it), or end it here
  //! (cancelled while stopping; finished by the write-back cache).
  [[nodiscard]] std::optional<early_end> before_engine(op& o) noexcept;
  //! The end of a request: publishes `outcome` (or cancellation), runs the completion,
  //! wakes waiters, and hands on the requests of its stream that waited for it.
  void finish(op* o, result<std::size_t> outcome, bool cancelled = false) noexcept;
  //! Hands a ready request to a worker (round robin from `next_worker`).
  void dispatch(op* o, unsigned& next_worker) noexcept;
  //! Runs requests queued for the workers on the calling thread: whether it ran any.
  bool help() noexcept;
  //! Takes one of the open file descriptions of threads' own the controller may still make
  //! (options::reader_descriptions): false when none is left.
  [[nodiscard]] bool take_reader_description() noexcept;
  //! Gives back one taken and not kept.
  void give_back_reader_description() noexcept;

 private:
  controller::impl& c_;
};

}  // namespace keel::aio::detail
