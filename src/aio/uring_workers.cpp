// The io_uring engine: one ring per worker thread, created by that thread (so the ring can
// be SINGLE_ISSUER with DEFER_TASKRUN: completions are processed when the worker asks, on
// its own thread). Requests are queued into the ring as they arrive and submitted together
// with the wait for completions: one io_uring_enter per round, however many requests.
// The worker sleeps in the ring; an eventfd read kept armed in the ring wakes it for new
// requests. Files are registered in the ring's table as they come (close asks the ring to
// let go: forget), options::registered_buffers at start; the requests of a batch that must
// follow earlier ones of it wait here in their chain (queue_pending, done).

#include "uring.hpp"

#include <new>

namespace keel::aio::detail::uring {

class uring_worker final : public worker {
 public:
  uring_worker(engine_context& c, uring_engine& e, unsigned index)
      : worker(c), engine_(e), depth_(c.opts().queue_depth), index_(index) {}
  ~uring_worker() override {
    join();
    if (efd_ >= 0) ::close(efd_);  // the wake-up eventfd: not a file, not the seam's
  }

  [[nodiscard]] int wake_fd() const noexcept { return efd_; }

  void wake() noexcept override {
    const std::uint64_t one = 1;
    // The wake-up eventfd: not a file, not the seam's.
    (void)!::write(efd_, &one, sizeof one);
  }

  result<void> start() noexcept override {
    efd_ = ::eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) return last_errno_error();
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      return std::unexpected(e.code());
    }
    started_.wait(false);  // start_error_ is written before started_ is set
    if (start_error_) {
      join();
      return std::unexpected(start_error_);
    }
    return {};
  }

 private:
  void report_start(std::error_code ec) noexcept {
    start_error_ = ec;
    started_.store(true);
    started_.notify_all();
  }

  void run() noexcept {
    running_here = this;
    this_thread_is_mine();
    io_uring_params p{};
    p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int r = ::io_uring_queue_init_params(depth_, &ring_, &p);
    if (r == -EINVAL) {  // a kernel older than 6.1: without the flags
      p = io_uring_params{};
      r = ::io_uring_queue_init_params(depth_, &ring_, &p);
    }
    if (r < 0) {
      report_start(std::error_code(-r, std::system_category()));
      return;
    }
    ring_made();
    if (r = probe(ring_); r < 0) {
      exit_ring(ring_);
      report_start(std::error_code(-r, std::system_category()));
      return;
    }
    if (!engine_.buffers().empty()) {
      std::vector<iovec> iov;
      try {
        iov.reserve(engine_.buffers().size());
      } catch (const std::bad_alloc&) {
        exit_ring(ring_);
        report_start(std::make_error_code(std::errc::not_enough_memory));
        return;
      }
      for (const auto& b : engine_.buffers())
        iov.push_back({b.data(), b.size()});
      r = ::io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
      if (r < 0) {
        exit_ring(ring_);
        report_start(std::error_code(-r, std::system_category()));
        return;
      }
    }
    // A sparse table (Linux 5.19+) the files are put into as they come; without it, files
    // go by descriptor.
    const unsigned slots = engine_.file_slots();
    if (files_.start(ring_, slots)) {
      try {
        const base::lock_guard lock(forget_mutex_);
        forget_.reserve(slots);  // one file per index at most waits to be let go
      } catch (const std::bad_alloc&) {
        files_.drop(ring_);
      }
    }
    report_start({});
    loop();
    // Whatever is still queued was cancelled by the loop; the eventfd read dies with the ring.
    // The files go first, at once (the ring itself is torn down later, in the background).
    files_.drop(ring_);
    exit_ring(ring_);
    const base::lock_guard lock(forget_mutex_);
    exited_ = true;
    forget_done_.store(forget_asked_.load());
    forget_done_.notify_all();
  }

 public:
  void add_counts(engine_stats& s) const noexcept override {
    s.requests_ordered_in_ring += ordered_.load(std::memory_order_relaxed);
    s.requests_on_registered_files += registered_.load(std::memory_order_relaxed);
    s.requests_on_registered_buffers += fixed_buffers_.load(std::memory_order_relaxed);
  }

  //! Makes the ring let go of file `id` at table index `slot` if it registered it, and
  //! returns when it has (at once when the thread ended).
  void forget(int slot, std::uint64_t id) noexcept KEEL_EXCLUDES(forget_mutex_) {
    if (files_.empty()) return;  // set before start() returned, never changed after
    base::unique_lock lock(forget_mutex_);
    if (exited_) return;
    try {
      forget_.push_back({slot, id});  // reserved for one file per index
    } catch (const std::bad_alloc&) {
      return;  // the ring keeps the file until its index is reused
    }
    const std::uint64_t ticket = forget_asked_.load() + 1;
    forget_asked_.store(ticket);
    if (running_here == this) {  // a task or completion on this worker closed the file
      lock.unlock();
      forget_files();
      return;
    }
    lock.unlock();
    wake();
    // A worker does not wait for another (two could wait for each other): the file is
    // then let go of a moment after close(2).
    if (running_here != nullptr) return;
    for (std::uint64_t d = forget_done_.load(); d < ticket; d = forget_done_.load())
      forget_done_.wait(d);
  }

 private:
  // Lets go of the files close() asked about (worker thread).
  void forget_files() noexcept KEEL_EXCLUDES(forget_mutex_) {
    const base::lock_guard lock(forget_mutex_);
    for (const auto& [slot, id] : forget_)
      files_.forget(ring_, slot, id);
    forget_.clear();
    forget_done_.store(forget_asked_.load());
    forget_done_.notify_all();
  }

  // The descriptor a request names in its SQE: the file's table index once this ring has
  // registered it (registering it now if need be), else its descriptor.
  bool use_registered(file_state& f) noexcept {
    bool fresh = false;
    if (files_.use(ring_, f, fresh) < 0) return false;
    if (fresh) of(f).registered_in.fetch_or(std::uint64_t{1} << (index_ % 64));
    return true;
  }

  void loop() noexcept {
    for (;;) {
      if (dead_ != 0) {
        without_the_ring();
        return;
      }
      start_turn();
      if (in_flight_ == 0 && pending_.empty() && may_exit()) return;

      if (in_flight_ == 0 && pending_.empty() && inbox_empty() && spin_for_work() &&
          !inbox_empty()) {
        continue;
      }
      sleeping_.store(true);
      const bool block = inbox_empty() && pending_.empty() && !look_again_ && !may_exit();
      int r = 0;
      if (!block) {
        r = ::io_uring_submit_and_get_events(&ring_);
      } else if (engine_.rings_away(index_)) {
        // Requests left on a caller ring: look in again within 10 ms even without a
        // wake-up (ETIME then).
        __kernel_timespec ts{0, 10'000'000};
        io_uring_cqe* first = nullptr;
        r = ::io_uring_submit_and_wait_timeout(&ring_, &first, 1, &ts, nullptr);
      } else {
        r = ::io_uring_submit_and_wait(&ring_, 1);
      }
      sleeping_.store(false);
      after_submit(r);
    }
  }

 public:
  //! A completion or task running on this worker waits for a request (receipt.hpp allows
  //! it): nobody else takes this worker's inbox or reaps its ring, so the wait does. First
  //! what this thread took and has yet to settle, then one turn of the loop, waiting up to
  //! a millisecond for the ring (woken by a push). Whether it may have helped.
  bool help() noexcept override {
    if (uring_engine::settle_one_left()) return true;
    if (running_here != this) return false;
    if (dead_ != 0) return fail_inbox();
    start_turn();
    __kernel_timespec ts{0, 1'000'000};
    io_uring_cqe* first = nullptr;
    sleeping_.store(true);  // a push wakes the wait (the eventfd's read ends it)
    const bool wait = inbox_empty() && pending_.empty();
    const int r = wait ? ::io_uring_submit_and_wait_timeout(&ring_, &first, 1, &ts, nullptr)
                       : ::io_uring_submit_and_get_events(&ring_);
    sleeping_.store(false);
    after_submit(r);
    return true;
  }

 private:
  // A turn of the loop up to its submission: files close() asked about, the inbox, the
  // ready requests into the ring, the eventfd's read.
  void start_turn() noexcept {
    if (forget_done_.load(std::memory_order_relaxed) != forget_asked_.load()) forget_files();
    intake_all();
    queue_pending();
    arm();
  }

  // Looks at what the inbox holds: what an earlier look took and has not looked at yet
  // first (a completion run meanwhile may have waited, and looked itself: help).
  void intake_all() noexcept {
    if (taken_ == nullptr) taken_ = take_all();
    while (taken_ != nullptr) {
      op& o = *taken_;
      taken_ = o.next;
      intake(o);
    }
  }

  // The eventfd's read, which a push completes: a wait on the ring then ends.
  void arm() noexcept {
    if (armed_) return;
    if (io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_); sqe != nullptr) {
      ::io_uring_prep_read(sqe, efd_, &efd_value_, sizeof efd_value_, 0);
      ::io_uring_sqe_set_data64(sqe, wake_tag);
      armed_ = true;
    }
  }

  // After submitting (with what it returned, `r`): the completions, one at a time, each
  // taken off the ring before its request ends (a completion that waits may reap the ring
  // itself: help), then what the submitting threads left on their own rings.
  void after_submit(int r) noexcept {
    if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
      // The ring itself failed: nothing queued will run. Fail what is waiting for a slot.
      while (!pending_.empty()) {
        op* o = pending_.front();
        pending_.pop_front();
        done(*o, errno_error(-r));
      }
      if (ring_is_dead(r) && dead_ == 0) {
        // For good (io_uring_enter denied once running): what the kernel never took fails
        // with the error, as does every request that comes from now on; the loop sleeps on
        // the eventfd instead of the ring (without_the_ring). Requests the kernel took
        // before cannot be reaped without entering: they stay pending.
        dead_ = -r;
        take_back_unsubmitted(ring_, [&](op& o) {
          --in_flight_;
          done(o, errno_error(dead_));
        });
      }
    }
    for (;;) {
      unsigned head = 0;
      io_uring_cqe* cqe = nullptr;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        break;
      }
      if (cqe == nullptr) break;
      const io_uring_cqe got = *cqe;
      ::io_uring_cq_advance(&ring_, 1);
      complete(got);
    }
    look_again_ = engine_.reap_left(index_);
  }

  // The loop of a worker whose ring died: every request that comes fails with the ring's
  // error (tasks still run), and the thread sleeps on its eventfd.
  void without_the_ring() noexcept {
    for (;;) {
      // close() still asks this worker to let go of its files (it waits for that).
      if (forget_done_.load(std::memory_order_relaxed) != forget_asked_.load()) forget_files();
      if (fail_inbox()) continue;
      if (may_exit()) return;
      sleeping_.store(true);
      if (inbox_empty() && !may_exit() && forget_done_.load() == forget_asked_.load()) {
        std::uint64_t v = 0;
        (void)!::read(efd_, &v, sizeof v);  // the wake-up eventfd: not a file, not the seam's
      }
      sleeping_.store(false);
    }
  }

  // Ends what the inbox holds, the ring dead: whether there was anything.
  bool fail_inbox() noexcept {
    if (taken_ == nullptr) taken_ = take_all();
    if (taken_ == nullptr) return false;
    while (taken_ != nullptr) {
      op& o = *taken_;
      taken_ = o.next;
      if (auto early = ctx_.before_engine(o)) {
        done(o, std::move(early->outcome), early->cancelled);
      } else if (o.kind == op_kind::task) {
        done(o, o.task());
      } else {
        done(o, errno_error(dead_));
      }
    }
    return true;
  }

  void intake(op& o) noexcept {
    if (auto early = ctx_.before_engine(o)) {
      done(o, std::move(early->outcome), early->cancelled);
      return;
    }
    if (o.kind == op_kind::task) {
      done(o, o.task());
    } else if ((o.kind == op_kind::read || o.kind == op_kind::write) && o.length == 0) {
      done(o, 0);
    } else {
      pending_.push_back(&o);
    }
  }

  // Moves the ready requests into the ring's free entries, in order. A barrier of a chain
  // (a request that must follow earlier ones of its batch) starts only once the chain's
  // requests before it have ended; until then it waits in its chain, with the chain's
  // requests after it.
  void queue_pending() noexcept {
    while (!pending_.empty()) {
      op& o = *pending_.front();
      chain* ch = o.in_chain;
      if (ch != nullptr && o.barrier && !o.counted && ch->running != 0) {
        do {
          op* w = pending_.front();
          pending_.pop_front();
          w->next = nullptr;
          (ch->waiting_tail != nullptr ? ch->waiting_tail->next : ch->waiting) = w;
          ch->waiting_tail = w;
          // Not one that started already (a short transfer's rest): it ends on its own.
        } while (!pending_.empty() && pending_.front()->in_chain == ch &&
                 !pending_.front()->counted);
        continue;
      }
      if (engine_.buffer_of(o) < 0) o.done += learn_buffered_writes(o);
      if (written_by_a_thread(o) && engine_.buffer_of(o) < 0) {
        pending_.pop_front();
        engine_.wrote_one();
        done(o, write_here(o));
        continue;
      }
      if (o.kind == op_kind::write && o.done == o.length) {  // written whole as it learnt
        pending_.pop_front();
        done(o, o.length);
        continue;
      }
      io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      if (ch != nullptr && !o.counted) {
        o.counted = true;
        ++ch->running;
        if (o.barrier) count(ordered_);
      }
      prepare(sqe, o);
      pending_.pop_front();
      ++in_flight_;
    }
  }

  // Every end of a request on this worker. The last running request of a chain lets what
  // waits in it go back to the front of the queue, in order.
  void done(op& o, result<std::size_t> outcome, bool cancelled = false) noexcept {
    if (chain* ch = std::exchange(o.in_chain, nullptr); ch != nullptr) {
      if (o.counted && --ch->running == 0 && ch->waiting != nullptr) {
        auto at = pending_.begin();
        for (op* w = std::exchange(ch->waiting, nullptr); w != nullptr; w = w->next) {
          at = pending_.insert(at, w);
          ++at;
        }
        ch->waiting_tail = nullptr;
      }
      if (--ch->refs == 0) delete ch;
    }
    ctx_.finish(&o, std::move(outcome), cancelled);
  }

  void prepare(io_uring_sqe* sqe, op& o) noexcept {
    const bool registered = use_registered(*o.file);
    const int fd = registered ? of(*o.file).slot : o.file->handle.fd();
    int buffer = -1;
    if (o.kind == op_kind::read || o.kind == op_kind::write) {
      buffer = engine_.buffer_of(o);
      if (buffer >= 0) count(fixed_buffers_);
    }
    prepare_sqe(sqe, o, fd, registered, buffer);
    if (registered) count(registered_);
  }

  void complete(const io_uring_cqe& cqe) noexcept {
    if (cqe.user_data == wake_tag) {
      armed_ = false;
      return;
    }
    // The timeout liburing queues itself for a wait with a timeout on kernels before 5.11,
    // and the NOPs of the probe and of requests taken back.
    if (cqe.user_data == LIBURING_UDATA_TIMEOUT || cqe.user_data == discarded_tag) return;
    op& o = *static_cast<op*>(::io_uring_cqe_get_data(&cqe));
    --in_flight_;
    if (auto end = outcome_of(o, cqe.res)) {
      done(o, std::move(*end));
    } else {
      pending_.push_back(&o);  // the rest goes in again
    }
  }

  uring_engine& engine_;
  unsigned depth_;
  unsigned index_;
  // Counts for engine_stats, written by the worker thread only.
  std::atomic<std::uint64_t> ordered_{0};
  std::atomic<std::uint64_t> registered_{0};
  std::atomic<std::uint64_t> fixed_buffers_{0};
  static void count(std::atomic<std::uint64_t>& n) noexcept {
    n.store(n.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  io_uring ring_{};
  ring_files files_;  // the worker thread's
  // close()'s requests to let go of a file: (index, file id), counted in and out.
  base::mutex forget_mutex_;
  std::vector<std::pair<int, std::uint64_t>> forget_ KEEL_GUARDED_BY(forget_mutex_);
  std::atomic<std::uint64_t> forget_asked_{0};  // changed under forget_mutex_
  std::atomic<std::uint64_t> forget_done_{0};
  bool exited_ KEEL_GUARDED_BY(forget_mutex_) = false;
  int efd_ = -1;
  std::uint64_t efd_value_ = 0;
  bool armed_ = false;
  std::deque<op*> pending_;  // ready, waiting for a submission slot
  op* taken_ = nullptr;      // taken from the inbox, not looked at yet (intake_all)
  unsigned in_flight_ = 0;
  bool look_again_ = false;  // a caller ring with completions was busy (reap_left)
  int dead_ = 0;             // the errno that killed the ring (after_submit), 0 while it lives

  // start() waits for the worker thread to set up its ring: the outcome, then the flag.
  std::atomic<bool> started_{false};
  std::error_code start_error_;
};

std::unique_ptr<worker> uring_engine::make_worker(unsigned index) noexcept {
  try {
    workers_.reserve(workers_.size() + 1);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  auto w = std::unique_ptr<uring_worker>(new (std::nothrow) uring_worker(context(), *this, index));
  if (w) workers_.push_back(w.get());
  return w;
}

void uring_engine::kick(unsigned w) noexcept {
  workers_[w]->wake();
}

int uring_engine::worker_wake_fd(unsigned w) const noexcept {
  return workers_[w]->wake_fd();
}

void uring_engine::forget_in_workers(const uring_file& f) noexcept {
  const std::uint64_t rings = f.registered_in.load();
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    if ((rings & (std::uint64_t{1} << (i % 64))) != 0) workers_[i]->forget(f.slot, f.file_id);
  }
}

}  // namespace keel::aio::detail::uring
