// The io_uring engine: one ring per worker thread, created by that thread (so the ring can
// be SINGLE_ISSUER with DEFER_TASKRUN: completions are processed when the worker asks, on
// its own thread). Requests are queued into the ring as they arrive and submitted together
// with the wait for completions: one io_uring_enter per round, however many requests.
// The worker sleeps in the ring; an eventfd read kept armed in the ring wakes it for new
// requests.

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <utility>

#include "cache.hpp"
#include "detail.hpp"

namespace keel::aio::detail {
namespace {

constexpr std::uint64_t wake_tag = 0;  // user data of the eventfd read; ops are pointers
constexpr std::size_t max_chunk = std::size_t{1} << 30;  // an SQE's length is 32 bits

class uring_worker final : public worker {
 public:
  uring_worker(controller::impl& c, unsigned depth) : worker(c), depth_(depth) {}
  ~uring_worker() override {
    join();
    if (efd_ >= 0) ::close(efd_);
  }

  void wake() noexcept override {
    const std::uint64_t one = 1;
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
    std::unique_lock lock(start_mutex_);
    start_cv_.wait(lock, [&] { return started_; });
    if (start_error_) {
      lock.unlock();
      join();
      return std::unexpected(start_error_);
    }
    return {};
  }

 private:
  void report_start(std::error_code ec) {
    const std::scoped_lock lock(start_mutex_);
    start_error_ = ec;
    started_ = true;
    start_cv_.notify_all();
  }

  void run() noexcept {
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
    report_start({});
    loop();
    // Whatever is still queued was cancelled by the loop; the eventfd read dies with the ring.
    ::io_uring_queue_exit(&ring_);
  }

  void loop() noexcept {
    for (;;) {
      for (op* o = take_all(); o != nullptr;) {
        op* next = o->next;
        intake(*o);
        o = next;
      }
      queue_pending();
      if (!armed_) {
        if (io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_); sqe != nullptr) {
          ::io_uring_prep_read(sqe, efd_, &efd_value_, sizeof efd_value_, 0);
          ::io_uring_sqe_set_data64(sqe, wake_tag);
          armed_ = true;
        }
      }
      if (in_flight_ == 0 && pending_.empty() && may_exit()) return;

      if (in_flight_ == 0 && pending_.empty() && inbox_empty() && spin_for_work() &&
          !inbox_empty()) {
        continue;
      }
      sleeping_.store(true);
      const bool block = inbox_empty() && pending_.empty() && !may_exit();
      int r =
          block ? ::io_uring_submit_and_wait(&ring_, 1) : ::io_uring_submit_and_get_events(&ring_);
      sleeping_.store(false);
      if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
        // The ring itself failed: nothing queued will run. Fail what is waiting for a slot.
        while (!pending_.empty()) {
          op* o = pending_.front();
          pending_.pop_front();
          done(*o, errno_error(-r));
        }
      }
      unsigned head = 0;
      unsigned seen = 0;
      io_uring_cqe* cqe = nullptr;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        complete(*cqe);
      }
      ::io_uring_cq_advance(&ring_, seen);
    }
  }

  void intake(op& o) noexcept {
    if (ctl_.stopping.load(std::memory_order_relaxed)) {
      done(o, 0, true);
      return;
    }
    if (o.file->cache) {
      if (auto n = cache_handle(ctl_, o, true)) {
        done(o, *n);
        return;
      }
    }
    if (o.kind == op_kind::task) {
      done(o, o.task());
    } else if ((o.kind == op_kind::read || o.kind == op_kind::write) && o.length == 0) {
      done(o, 0);
    } else {
      pending_.push_back(&o);
    }
  }

  // Moves the ready requests into the ring's free entries, in order. A request of a chain
  // whose predecessor's entry was queued just before is linked to it (IOSQE_IO_LINK: the
  // kernel starts it when that one has completed in full); one whose predecessor is in the
  // kernel since an earlier round, or parked, cannot be linked any more and parks, with the
  // rest of its chain, until the predecessor ends.
  void queue_pending() noexcept {
    const op* last = nullptr;
    io_uring_sqe* last_sqe = nullptr;
    while (!pending_.empty()) {
      op& o = *pending_.front();
      const bool link = o.chain_prev != nullptr && !o.chain_prev->ended;
      if (link && o.chain_prev != last) {
        park_chain(o);
        continue;
      }
      io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      if (link) {
        last_sqe->flags |= IOSQE_IO_LINK;
        count(linked_);
      }
      prepare(sqe, o);
      pending_.pop_front();
      ++in_flight_;
      last = &o;
      last_sqe = sqe;
    }
  }

  // Takes `o` (the front of pending_) and the requests linked after it from pending_ and
  // parks them on o's predecessor.
  void park_chain(op& o) noexcept {
    pending_.pop_front();
    op* tail = &o;
    o.next = nullptr;
    while (!pending_.empty() && pending_.front()->chain_prev == tail) {
      tail->next = pending_.front();
      tail = tail->next;
      tail->next = nullptr;
      pending_.pop_front();
    }
    park(*o.chain_prev, &o);
  }

  static void park(op& on, op* chain) noexcept {
    op** end = &on.parked;
    while (*end != nullptr)
      end = &(*end)->next;
    *end = chain;
  }

  // Every end of a request on this worker: what was parked on it goes back to the front of
  // the queue, in order (the first is no longer linked: `o` has ended).
  void done(op& o, result<std::size_t> outcome, bool cancelled = false) noexcept {
    o.ended = true;
    auto at = pending_.begin();
    for (op* p = std::exchange(o.parked, nullptr); p != nullptr; p = p->next) {
      at = pending_.insert(at, p);
      ++at;
    }
    if (op* prev = std::exchange(o.chain_prev, nullptr); prev != nullptr) prev->unref();
    ctl_.finish(&o, std::move(outcome), cancelled);
  }

  static void prepare(io_uring_sqe* sqe, op& o) noexcept {
    const int fd = o.file->fd;
    const auto chunk = static_cast<unsigned>(std::min(o.length - o.done, max_chunk));
    switch (o.kind) {
      case op_kind::read:
        ::io_uring_prep_read(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done);
        break;
      case op_kind::write:
        ::io_uring_prep_write(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done);
        break;
      case op_kind::fsync:
        ::io_uring_prep_fsync(sqe, fd, 0);
        break;
      case op_kind::fdatasync:
        ::io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
        break;
      case op_kind::task:
        break;  // never queued
    }
    ::io_uring_sqe_set_data(sqe, &o);
  }

  void complete(const io_uring_cqe& cqe) noexcept {
    if (cqe.user_data == wake_tag) {
      armed_ = false;
      return;
    }
    op& o = *static_cast<op*>(::io_uring_cqe_get_data(&cqe));
    --in_flight_;
    const int res = cqe.res;
    if (res == -ECANCELED && o.chain_prev != nullptr) {
      // Its chain broke before it started: an earlier request failed or came back short.
      // It runs once its predecessor has ended, as if it had been held back.
      if (o.chain_prev->ended) {
        pending_.push_back(&o);
      } else {
        o.next = nullptr;
        park(*o.chain_prev, &o);
      }
      return;
    }
    if (o.kind == op_kind::fsync || o.kind == op_kind::fdatasync) {
      // Never retried: a failed fsync says data may be lost, a retry would hide it.
      done(o, res < 0 ? result<std::size_t>(errno_error(-res)) : result<std::size_t>(0));
      return;
    }
    if (res < 0) {
      if (res == -EINTR || res == -EAGAIN) {
        pending_.push_back(&o);
      } else {
        done(o, errno_error(-res));
      }
      return;
    }
    if (res == 0) {
      if (o.kind == op_kind::read) {
        done(o, o.done);  // end of file
      } else {
        done(o, errc_error(std::errc::io_error));  // no progress: never spin
      }
      return;
    }
    o.done += static_cast<std::size_t>(res);
    if (o.done < o.length) {
      pending_.push_back(&o);  // a short transfer: the rest goes in again
    } else {
      done(o, o.done);
    }
  }

  unsigned depth_;
  io_uring ring_{};
  int efd_ = -1;
  std::uint64_t efd_value_ = 0;
  bool armed_ = false;
  std::deque<op*> pending_;  // ready, waiting for a submission slot
  unsigned in_flight_ = 0;

  std::mutex start_mutex_;
  std::condition_variable start_cv_;
  bool started_ = false;
  std::error_code start_error_;
};

}  // namespace

std::unique_ptr<worker> make_uring_worker(controller::impl& c, unsigned queue_depth) {
  return std::make_unique<uring_worker>(c, queue_depth);
}

}  // namespace keel::aio::detail
