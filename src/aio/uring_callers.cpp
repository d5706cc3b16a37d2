// A thread that submits and then waits may start its requests on a ring of its own instead
// (caller_ring, options::submit_on): it submits them itself, at once, and reaps its ring
// when it waits. A page-cache read then completes inside the submission, with no hand-over
// to a worker and back. The ring is not SINGLE_ISSUER: when the thread is away (computing,
// or waiting on something else) and a completion lands on its ring, the ring's eventfd (a
// worker's wake-up eventfd) wakes that worker, which reaps it under the ring's mutex. The
// thread turns the eventfd off while it is in the ring itself.

#include "uring.hpp"

#include <new>

namespace keel::aio::detail::uring {

//! A submitting thread's own ring (options::submit_on). Its thread submits to it and reaps
//! it; a worker reaps it when the thread is away. Ends with its thread (after waiting for
//! its requests: the kernel would cancel them) or with the engine.
class caller_ring final : public base::thread_state {
 public:
  explicit caller_ring(uring_engine& e) noexcept : engine_(e) {}
  caller_ring(const caller_ring&) = delete;
  caller_ring& operator=(const caller_ring&) = delete;
  ~caller_ring() override {
    if (counted_) engine_.uncount_ring();
    if (!ok_) return;
    closing_ = true;
    // Its requests end before the thread does; their completions are settled here (with
    // the eventfd on: one may wait for another, which its worker then reaps).
    for (;;) {
      std::array<reaped, reap_batch> got{};
      std::size_t n = 0;
      {
        const base::lock_guard lock(mutex);
        if (in_flight == 0) break;
        n = reap_or_wait(got);
      }
      engine_.settle(std::span(got.data(), n));
    }
    engine_.unlist(*this);
    {  // the files first (ring_files::drop)
      const base::lock_guard lock(table_mutex);
      files.drop(ring);
    }
    exit_ring(ring);
  }

  //! Counted among the engine's caller rings (max_caller_rings).
  void counted() noexcept { counted_ = true; }

  //! Sets the ring up (the thread's first request): whether it can be used.
  bool start(unsigned depth, unsigned slots) noexcept {
    depth_ = depth;
    if (::io_uring_queue_init(depth, &ring, 0) < 0) return false;
    ring_made();
    // No IORING_CQ_EVENTFD_DISABLED (before Linux 5.8), or a ring that cannot be entered.
    if (ring.cq.kflags == nullptr || probe(ring) < 0) {
      exit_ring(ring);
      return false;
    }
    try {
      given_back.reserve(depth);
    } catch (const std::bad_alloc&) {
      exit_ring(ring);
      return false;
    }
    {
      const base::lock_guard lock(table_mutex);
      (void)files.start(ring, slots);
    }
    ok_ = true;
    if (!engine_.list(*this)) {
      ok_ = false;
      exit_ring(ring);
    }
    return ok_;
  }

  //! Sends the completions of this ring to worker `w`'s eventfd (while the thread is away).
  bool notify(unsigned w, int fd) noexcept {
    worker = w;
    if (::io_uring_register_eventfd(&ring, fd) < 0) return false;
    (void)::io_uring_cq_eventfd_toggle(&ring, false);  // the thread is in it: off
    return true;
  }

  //! The thread is in the ring: completions need not wake its worker.
  void quiet() noexcept KEEL_REQUIRES(mutex) { (void)::io_uring_cq_eventfd_toggle(&ring, false); }
  //! The thread leaves the ring: with requests still running, their completions wake its
  //! worker; one that came before the eventfd was on wakes it now.
  void leave() noexcept KEEL_REQUIRES(mutex) {
    if (in_flight == 0) {
      away.store(false, std::memory_order_relaxed);
      return;
    }
    (void)::io_uring_cq_eventfd_toggle(&ring, true);
    // A full barrier (a locked exchange: a fence the sanitizers cannot follow) between the
    // flag's store and the look at the tail: the kernel posts, then reads the flag.
    (void)away.exchange(true, std::memory_order_seq_cst);
    if (::io_uring_cq_ready(&ring) != 0) engine_.kick(worker);
  }

  //! Submits what is queued (all of it: EINTR, EAGAIN and EBUSY go round again). Where the
  //! ring cannot be entered any more (ring_is_dead), what the kernel did not take is taken
  //! back into `given_back`, for the workers, and the thread stops using the ring.
  void submit() noexcept KEEL_REQUIRES(mutex) {
    while (::io_uring_sq_ready(&ring) != 0) {
      const int r = ::io_uring_submit(&ring);
      if (r < 0 && ring_is_dead(r)) {
        closing_ = true;  // usable() no more: the thread's requests go to the workers
        // (Called at once, under `mutex` still, which the analysis cannot follow into it.)
        take_back_unsubmitted(ring, [&](op& o) KEEL_NO_THREAD_SAFETY_ANALYSIS {
          o.ring = nullptr;
          o.in_ring = false;
          --in_flight;
          given_back.push_back(&o);  // reserved for the whole ring
        });
        return;
      }
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) return;  // next enter tries
    }
  }
  //! The thread in the ring: takes the completions there, or sleeps in the ring until one
  //! comes (or a signal) and takes those; then leaves. How many it took.
  std::size_t reap_or_wait(std::span<reaped> out) noexcept KEEL_REQUIRES(mutex) {
    quiet();
    std::size_t n = reap(out);
    if (n == 0) {
      (void)::io_uring_submit_and_wait(&ring, 1);
      n = reap(out);
    }
    leave();
    return n;
  }

  //! Takes up to out.size() completions off the ring.
  std::size_t reap(std::span<reaped> out) noexcept KEEL_REQUIRES(mutex) {
    std::size_t n = 0;
    unsigned head = 0;
    io_uring_cqe* cqe = nullptr;
    io_uring_for_each_cqe(&ring, head, cqe) {
      if (n == out.size()) break;
      op* o = static_cast<op*>(::io_uring_cqe_get_data(cqe));
      o->in_ring = false;
      out[n++] = {o, cqe->res};
    }
    ::io_uring_cq_advance(&ring, static_cast<unsigned>(n));
    in_flight -= static_cast<unsigned>(n);
    if (in_flight == 0) away.store(false, std::memory_order_relaxed);
    return n;
  }

  //! Queues `o`: whether there was room.
  bool queue(op& o) noexcept KEEL_REQUIRES(mutex) {
    if (in_flight >= depth_) return false;  // the completion queue (twice this) never overflows
    io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
    if (sqe == nullptr) return false;
    const bool registered = use_registered(*o.file);
    prepare_sqe(sqe, o, registered ? of(*o.file).slot : o.file->handle.fd(), registered, -1);
    o.ring = this;
    o.in_ring = true;
    ++in_flight;
    count(started);
    if (registered) count(on_registered_files);
    return true;
  }

  //! Lets go of file `id` at table index `slot` if this ring registered it (any thread).
  void forget(int slot, std::uint64_t id) noexcept KEEL_EXCLUDES(table_mutex) {
    const base::lock_guard lock(table_mutex);
    files.forget(ring, slot, id);
  }

  [[nodiscard]] bool usable() const noexcept { return ok_ && !closing_; }

  io_uring ring{};
  unsigned worker = 0;  // the worker that reaps what the thread leaves
  // The thread left requests running here: its worker looks in now and then too (a
  // wake-up lost between the eventfd and the thread's last look costs a delay, not a hang).
  std::atomic<bool> away{false};
  // What the thread's submission found ended, settled once it has handed the rest over
  // (settle_here): the thread's own.
  std::array<reaped, reap_batch> stash{};
  std::size_t stashed = 0;
  // Requests taken back out of the ring when it could not be entered (submit), for the
  // workers: the thread's own.
  std::vector<op*> given_back;
  // Held by the thread while it submits or reaps (also while it sleeps in the ring for a
  // completion), by a worker only to reap (try_lock): never waited for by a worker.
  base::mutex mutex;
  unsigned in_flight KEEL_GUARDED_BY(mutex) = 0;
  // Counts for engine_stats: `started` written by the thread, `reaped_by_worker` by workers
  // under `mutex`.
  std::atomic<std::uint64_t> started{0};
  std::atomic<std::uint64_t> on_registered_files{0};
  std::atomic<std::uint64_t> reaped_by_worker{0};
  static void count(std::atomic<std::uint64_t>& n, std::uint64_t k = 1) noexcept {
    n.store(n.load(std::memory_order_relaxed) + k, std::memory_order_relaxed);
  }

 private:
  // The file's table index in this ring, registering it now if need be; false: go by
  // descriptor.
  bool use_registered(file_state& f) noexcept KEEL_EXCLUDES(table_mutex) {
    const base::lock_guard lock(table_mutex);
    bool fresh = false;
    return files.use(ring, f, fresh) >= 0;
  }

  uring_engine& engine_;
  unsigned depth_ = 0;
  bool ok_ = false;
  bool counted_ = false;
  bool closing_ = false;  // the thread is leaving: new requests go to the workers
  // The ring's table of files; close() lets go of a file from its own thread, so the
  // thread's mutex is not the one.
  base::mutex table_mutex;
  ring_files files KEEL_GUARDED_BY(table_mutex);
};

caller_ring* uring_engine::ring_of_this_thread(bool make) noexcept {
  if (!make) return rings_of_threads_.existing<caller_ring>();
  auto r = rings_of_threads_.get<caller_ring>([&]() -> result<std::unique_ptr<caller_ring>> {
    auto made = std::unique_ptr<caller_ring>(new (std::nothrow) caller_ring(*this));
    if (!made) return errc_error(std::errc::not_enough_memory);
    // A thread whose ring cannot start keeps it unstarted: it uses the workers, without
    // trying again on every request.
    if (lists_ && caller_rings_.fetch_add(1) < max_caller_rings) {
      made->counted();
      (void)made->start(context().opts().queue_depth, file_slots_);
    } else if (lists_) {
      caller_rings_.fetch_sub(1);
    }
    return made;
  });
  return r && (*r)->usable() ? *r : nullptr;
}

bool uring_engine::list(caller_ring& r) noexcept {
  const unsigned w = next_list_.fetch_add(1) % static_cast<unsigned>(workers_.size());
  if (!r.notify(w, worker_wake_fd(w))) return false;
  ring_list& l = lists_[w];
  const base::lock_guard lock(l.mutex);
  try {
    l.rings.push_back(&r);
  } catch (const std::bad_alloc&) {
    return false;
  }
  l.count.fetch_add(1);
  return true;
}

void uring_engine::unlist(caller_ring& r) noexcept {
  ring_list& l = lists_[r.worker];
  const base::lock_guard lock(l.mutex);
  std::erase(l.rings, &r);
  l.count.store(static_cast<unsigned>(l.rings.size()));
  retired_started_.fetch_add(r.started.load());
  retired_registered_.fetch_add(r.on_registered_files.load());
  retired_reaped_.fetch_add(r.reaped_by_worker.load());
}

void uring_engine::uncount_ring() noexcept {
  caller_rings_.fetch_sub(1);
}

bool uring_engine::rings_away(unsigned w) noexcept {
  if (!lists_) return false;
  ring_list& l = lists_[w];
  if (l.count.load(std::memory_order_relaxed) == 0) return false;
  const base::lock_guard lock(l.mutex);
  for (const caller_ring* r : l.rings) {
    if (r->away.load(std::memory_order_relaxed)) return true;
  }
  return false;
}

std::size_t uring_engine::submit_here(std::span<op* const> ops) noexcept {
  const submitter policy = context().opts().submit_on;
  if (running_here != nullptr || policy == submitter::workers || !lists_) return 0;
  if (policy == submitter::adaptive && !waiting_bound(context().timed_callers())) return 0;
  caller_ring* r = ring_of_this_thread(true);
  if (r == nullptr) return 0;
  std::size_t taken = 0;
  // Buffered writes the kernel would hand to a thread of its own, from the front: written
  // here, outside the ring's lock (a write may block, and a worker reaping the ring must not
  // wait for it), and settled with what the ring ended. Not inside a completion's own
  // submission. The first of a file finds out which kind it is; what that wrote is its end,
  // or its rest goes to a worker, as a short transfer's does.
  for (; taken < ops.size(); ++taken) {
    op* o = ops[taken];
    // (What it writes must fit a completion's count, as a ring's chunk does.)
    if (for_the_cache(*o) || completions_running != 0 || r->stashed == r->stash.size() ||
        !buffered_write(*o) || buffer_of(*o) >= 0 || o->length - o->done > max_chunk) {
      break;
    }
    if (const std::size_t n = learn_buffered_writes(*o); n > 0) {
      r->stash[r->stashed++] = {o, static_cast<int>(n)};
      continue;
    }
    if (!written_by_a_thread(*o)) break;
    const std::size_t rest = o->length - o->done;
    const auto w = write_here(*o);
    r->stash[r->stashed++] = {o, w ? static_cast<int>(rest) : -w.error().value()};
    wrote_one();
  }
  const std::size_t written = taken;
  {
    const base::lock_guard lock(r->mutex);
    r->quiet();
    for (op* o : ops.subspan(written)) {
      // Registered buffers are the workers' rings' (registering them again per thread
      // would pin the memory again); chains wait in a worker; so do requests that must
      // meet the cache there, and buffered writes a thread writes or that find out what
      // their file is (after the first of the batch that was not written above).
      if (o->in_chain != nullptr || o->kind == op_kind::task || for_the_cache(*o) ||
          !rings_may_take(*o) ||
          ((o->kind == op_kind::read || o->kind == op_kind::write) &&
           (o->length == 0 || buffer_of(*o) >= 0)) ||
          !r->queue(*o)) {
        break;
      }
      ++taken;
    }
    if (taken != written) r->submit();
    // Page-cache reads and writes ended inside the submission: settled by settle_here, once
    // the caller has handed over what the ring did not take. Not inside a completion's own
    // submission: the worker reaps those.
    if (completions_running == 0) r->stashed += r->reap(std::span(r->stash).subspan(r->stashed));
    r->leave();
  }
  // Taken, then given back by a ring that could not be entered: started by the workers.
  unsigned next = 0;
  for (op* o : r->given_back)
    context().dispatch(o, next);
  r->given_back.clear();
  return taken;
}

void uring_engine::settle_here() noexcept {
  if (completions_running != 0) return;
  caller_ring* r = ring_of_this_thread(false);
  if (r == nullptr || r->stashed == 0) return;
  std::array<reaped, reap_batch> got = r->stash;
  const std::size_t n = std::exchange(r->stashed, 0);
  settle(std::span(got.data(), n));
}

bool uring_engine::wait_here(op& o) noexcept {
  if (completions_running != 0) return false;  // (see running_completions)
  caller_ring* r = ring_of_this_thread(false);
  if (r == nullptr || o.ring != r) return false;
  std::array<reaped, reap_batch> got{};
  std::size_t n = 0;
  {
    const base::lock_guard lock(r->mutex);
    if (!o.in_ring) return false;  // reaped by a worker: its end is on the way
    n = r->reap_or_wait(got);
  }
  settle(std::span(got.data(), n));
  return true;
}

bool uring_engine::reap_left(unsigned w) noexcept {
  if (!lists_) return false;
  ring_list& l = lists_[w];
  if (l.count.load(std::memory_order_relaxed) == 0) return false;
  bool busy = false;
  std::array<reaped, reap_batch> got{};
  for (;;) {
    std::size_t n = 0;
    {
      const base::lock_guard lock(l.mutex);
      for (caller_ring* r : l.rings) {
        if (n == got.size()) break;
        if (!completions_waiting(r->ring)) continue;
        if (!r->mutex.try_lock()) {
          busy = true;
          continue;
        }
        const std::size_t k = r->reap(std::span(got).subspan(n));
        r->mutex.unlock();
        caller_ring::count(r->reaped_by_worker, k);
        n += k;
      }
    }
    settle(std::span(got.data(), n));
    if (n < got.size()) return busy;
  }
}

void uring_engine::settle(std::span<const reaped> done) noexcept {
  const running_completions completing;
  unsettled level{this, done, 0, unsettled_here};
  unsettled_here = &level;
  while (!level.rest.empty())
    (void)settle_one_left();  // from the front of this level, the innermost
  unsettled_here = level.outer;
}

bool uring_engine::settle_one_left() noexcept {
  for (unsettled* u = unsettled_here; u != nullptr; u = u->outer) {
    if (u->rest.empty()) continue;
    const auto [o, res] = u->rest.front();
    u->rest = u->rest.subspan(1);
    if (auto end = outcome_of(*o, res)) {
      u->engine->owner().finish(o, std::move(*end));
    } else {
      u->engine->owner().dispatch(o, u->next_worker);  // the rest goes in again, by a worker
    }
    return true;
  }
  return false;
}

void uring_engine::add_counts(engine_stats& s) const noexcept {
  s.buffered_writes_by_threads += written_by_threads_.sum();
  s.requests_on_caller_rings += retired_started_.load();
  s.requests_on_registered_files += retired_registered_.load();
  s.caller_requests_reaped_by_workers += retired_reaped_.load();
  if (!lists_) return;
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    ring_list& l = lists_[w];
    const base::lock_guard lock(l.mutex);
    for (const caller_ring* r : l.rings) {
      s.requests_on_caller_rings += r->started.load(std::memory_order_relaxed);
      s.requests_on_registered_files += r->on_registered_files.load(std::memory_order_relaxed);
      s.caller_requests_reaped_by_workers += r->reaped_by_worker.load(std::memory_order_relaxed);
    }
  }
}

void uring_engine::forget_in_callers(const uring_file& f) noexcept {
  if (!lists_) return;
  for (std::size_t w = 0; w < workers_.size(); ++w) {
    ring_list& l = lists_[w];
    const base::lock_guard lock(l.mutex);
    for (caller_ring* r : l.rings)
      r->forget(f.slot, f.file_id);
  }
}

}  // namespace keel::aio::detail::uring
