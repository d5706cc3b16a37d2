// The engines' view of their controller (engine_context.hpp): each call is the controller's.

#include "engine_context.hpp"

#include "detail.hpp"

namespace keel::aio::detail {

const options& engine_context::opts() const noexcept {
  return c_.opts;
}

std::uint64_t engine_context::timed_callers() const noexcept {
  return c_.timed_callers;
}

bool engine_context::stopping_hint() const noexcept {
  return c_.stopping.load(std::memory_order_relaxed);
}

bool engine_context::may_exit() const noexcept {
  return c_.stopping.load() && c_.outstanding.sum() == 0;
}

std::optional<early_end> engine_context::before_engine(op& o) noexcept {
  return c_.before_engine(o);
}

void engine_context::finish(op* o, result<std::size_t> outcome, bool cancelled) noexcept {
  c_.finish(o, std::move(outcome), cancelled);
}

void engine_context::dispatch(op* o, unsigned& next_worker) noexcept {
  c_.dispatch(o, next_worker);
}

bool engine_context::help() noexcept {
  return c_.help();
}

bool engine_context::take_reader_description() noexcept {
  unsigned left = c_.readers_left.load(std::memory_order_relaxed);
  do {
    if (left == 0) return false;
  } while (!c_.readers_left.compare_exchange_weak(left, left - 1, std::memory_order_relaxed));
  return true;
}

void engine_context::give_back_reader_description() noexcept {
  c_.readers_left.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace keel::aio::detail
