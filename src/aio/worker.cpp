// The workers' inboxes (worker.hpp), and how the controller hands requests to them.

#include "worker.hpp"

#include "detail.hpp"

namespace keel::aio::detail {

void worker::push(op* first, op* last) noexcept {
  // The inbox is a stack (newest first); the chain arrives oldest first: reverse it so that
  // take_all, which reverses the whole stack, gives everything back oldest first.
  op* reversed = nullptr;
  for (op* o = first;;) {
    op* next = o->next;
    o->next = reversed;
    reversed = o;
    if (o == last) break;
    o = next;
  }
  op* head = inbox_.load(std::memory_order_relaxed);
  do {
    first->next = head;  // `first` is the tail of the reversed chain
  } while (!inbox_.compare_exchange_weak(head, reversed, std::memory_order_seq_cst,
                                         std::memory_order_relaxed));
  if (sleeping_.load(std::memory_order_seq_cst)) wake();
}

op* worker::take_all() noexcept {
  op* o = inbox_.exchange(nullptr, std::memory_order_seq_cst);
  op* fifo = nullptr;
  while (o != nullptr) {
    op* next = o->next;
    o->next = fifo;
    fifo = o;
    o = next;
  }
  return fifo;
}

thread_local worker* worker::this_threads_ = nullptr;

bool worker::help_waiting(controller::impl* c) noexcept {
  if (c != nullptr && c->help()) return true;
  worker* own = this_threads_;
  return own != nullptr && &own->ctl_ != c && own->help();
}

bool worker::spin_for_work() noexcept {
  return idle_spin_.spin(
      [&] { return !inbox_empty() || ctl_.stopping.load(std::memory_order_relaxed); });
}

bool worker::may_exit() const noexcept {
  return ctl_.stopping.load() && ctl_.outstanding.sum() == 0;
}

}  // namespace keel::aio::detail

namespace keel::aio {

bool controller::impl::help() noexcept {
  for (auto& w : workers) {
    if (w->help()) return true;
  }
  return false;
}

void controller::impl::dispatch(detail::op* o, unsigned& next_worker) noexcept {
  detail::worker& w = *workers[next_worker++ % workers.size()];
  o->next = nullptr;
  w.push(o, o);
}

}  // namespace keel::aio
