// keel::aio::file: a batch of requests handed over at once.

#include <new>
#include <vector>

#include "caller_clock.hpp"
#include "keel/aio/file.hpp"
#include "request.hpp"

namespace keel::aio {

using detail::chain;
using detail::finished_as_shut;
using detail::make_op;
using detail::op;
using detail::op_kind;
using detail::receipt_access;
using detail::refusal;
using detail::refuse;
using detail::stream;
using detail::submit_one;

void file::submit(std::span<request> requests, std::span<receipt> out) noexcept {
  const auto make = [](request& q) {
    const op_kind k = q.what == request::kind::read    ? op_kind::read
                      : q.what == request::kind::write ? op_kind::write
                      : q.what == request::kind::fsync ? op_kind::fsync
                                                       : op_kind::fdatasync;
    return make_op(k, q.offset, q.buffer.data(), q.buffer.size(), std::move(q.on_done));
  };
  const auto give = [&](std::size_t i, receipt r) {
    if (i < out.size()) out[i] = std::move(r);
  };
  // A cached file finishes requests one by one as they come (cache_handle).
  if (!state_ || state_->cache || requests.size() < 2) {
    for (std::size_t i = 0; i < requests.size(); ++i)
      give(i, submit_one(state_, make(requests[i])));
    return;
  }
  // The batch in one piece: one count, one turn of the stream's lock, one hand-over per
  // worker.
  detail::file_state& f = *state_;
  controller::impl& c = *f.owner;
  const detail::timed_call timed(c.timed_callers);
  // Local, not thread_local: a completion run here (a refusal, a shut file) may submit a
  // batch of its own on this thread.
  std::vector<op*> accepted;
  std::vector<op*> ready;
  chain* ch = nullptr;  // io_uring: requests that wait for one another in a worker
  op* chain_head = nullptr;
  op* chain_tail = nullptr;
  try {
    accepted.reserve(requests.size());
    ready.reserve(requests.size());
  } catch (const std::bad_alloc&) {
    for (std::size_t i = 0; i < requests.size(); ++i)
      give(i, submit_one(state_, make(requests[i])));
    return;
  }
  for (std::size_t i = 0; i < requests.size(); ++i) {
    op* o = make(requests[i]);
    o->file = state_;
    if (const error why = refusal(&f, *o)) {
      give(i, refuse(o, why));
      continue;
    }
    give(i, receipt_access::make(o));
    accepted.push_back(o);
  }
  if (accepted.empty()) return;
  const unsigned shard = base::sharded_count::shard_of_this_thread();
  for (op* o : accepted)
    o->shard = shard;
  f.in_flight.add(shard, accepted.size());
  c.outstanding.add(shard, accepted.size());
  if (f.closed.load() || c.stopping.load()) {
    for (op* o : accepted)
      (void)finished_as_shut(c, f, o);
    return;
  }
  const auto mine = f.stream_of_this_thread();
  if (!mine) {
    for (op* o : accepted)
      c.finish(o, std::unexpected(mine.error()));
    return;
  }
  stream& s = **mine;
  // With io_uring, a request that must follow only earlier ones of this batch waits for
  // them in their worker (one chain, one ring), where the other engines hold it back here
  // until they have finished and hand it over then.
  const bool may_chain = c.engine->chains_batches();
  unsigned first_worker = 0;
  {
    const base::lock_guard lock(s.mutex);
    const std::size_t first = s.unfinished.size();
    bool chained = false;
    for (op* o : accepted) {
      o->owner = &s;
      if (s.append(*o)) {
        o->dispatched = true;
        ready.push_back(o);
      } else if (may_chain && (ch != nullptr || (ch = new (std::nothrow) chain)) &&
                 s.chainable(first)) {
        o->dispatched = true;
        o->barrier = true;
        ready.push_back(o);
        chained = true;
      } else {
        ++s.held_back;
      }
    }
    if (chained) {
      // The chain: every request marked, in submission order; the rest of `ready` goes
      // round robin.
      std::size_t kept = 0;
      for (op* o : ready) {
        if (o->chained) {
          o->chained = false;
          o->in_chain = ch;
          ++ch->refs;
          o->next = nullptr;
          (chain_tail != nullptr ? chain_tail->next : chain_head) = o;
          chain_tail = o;
        } else {
          ready[kept++] = o;
        }
      }
      ready.resize(kept);
    }
    first_worker = s.next_worker;
    s.next_worker += static_cast<unsigned>(ready.size() + (chain_head != nullptr ? 1 : 0));
  }
  if (ch != nullptr && ch->refs == 0) delete ch;
  const std::size_t n_workers = c.workers.size();
  if (chain_head != nullptr) c.workers[first_worker++ % n_workers]->push(chain_head, chain_tail);
  // What the submitting thread starts itself (io_uring: options::submit_on) goes first.
  const std::size_t here = c.engine->submit_here(ready);
  ready.erase(ready.begin(), ready.begin() + static_cast<std::ptrdiff_t>(here));
  // Round robin as one by one would, as one chain per worker.
  for (std::size_t w = 0; w < n_workers; ++w) {
    const std::size_t start = (w + n_workers - first_worker % n_workers) % n_workers;
    op* head = nullptr;
    op* tail = nullptr;
    for (std::size_t j = start; j < ready.size(); j += n_workers) {
      ready[j]->next = nullptr;
      (tail != nullptr ? tail->next : head) = ready[j];
      tail = ready[j];
    }
    if (head != nullptr) c.workers[w]->push(head, tail);
  }
  c.engine->settle_here();  // the requests the ring did not take are handed over first
}

}  // namespace keel::aio
