// The workers' inboxes (worker.hpp).

#include "worker.hpp"

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

bool worker::help_waiting(engine_context* c) noexcept {
  if (c != nullptr && c->help()) return true;
  worker* own = this_threads_;
  return own != nullptr && &own->ctx_ != c && own->help();
}

bool worker::spin_for_work() noexcept {
  return idle_spin_.spin([&] { return !inbox_empty() || ctx_.stopping_hint(); });
}

bool worker::may_exit() const noexcept {
  return ctx_.may_exit();
}

}  // namespace keel::aio::detail
