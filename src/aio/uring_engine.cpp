// The io_uring engine: one ring per worker thread, created by that thread (so the ring can
// be SINGLE_ISSUER with DEFER_TASKRUN: completions are processed when the worker asks, on
// its own thread). Requests are queued into the ring as they arrive and submitted together
// with the wait for completions: one io_uring_enter per round, however many requests.
// The worker sleeps in the ring; an eventfd read kept armed in the ring wakes it for new
// requests. Files are registered in the ring's table as they come (close asks the ring to
// let go: forget), options::registered_buffers at start; the requests of a batch that must
// follow earlier ones of it wait here in their chain (queue_pending, done).
//
// A thread that submits and then waits may start its requests on a ring of its own instead
// (caller_ring, options::submit_on): it submits them itself, at once, and reaps its ring
// when it waits. A page-cache read then completes inside the submission, with no hand-over
// to a worker and back. The ring is not SINGLE_ISSUER: when the thread is away (computing,
// or waiting on something else) and a completion lands on its ring, the ring's eventfd (a
// worker's wake-up eventfd) wakes that worker, which reaps it under the ring's mutex. The
// thread turns the eventfd off while it is in the ring itself.
//
// A buffered write to a file whose filesystem cannot take one without blocking (ext4 and
// tmpfs cannot; xfs and btrfs can: FOP_BUFFER_WASYNC) would only be handed by the kernel to
// an io-wq thread of its own, and its end back: two more hand-overs for a copy into the page
// cache. The worker writes those itself (a pwrite, through the seam). The first buffered write of a
// file finds out which kind it is, as pwritev2 with RWF_NOWAIT, which such a filesystem refuses
// with EOPNOTSUPP before it writes anything (learn_buffered_writes). A thread that submits and then
// waits writes them itself, in the submission, as it would start them on its own ring
// (caller_ring).

#include <liburing.h>
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <new>
#include <optional>
#include <utility>

#include "base/per_thread.hpp"
#include "base/thread_safety.hpp"
#include "caller_clock.hpp"
#include "file_state.hpp"
#include "worker.hpp"

namespace keel::aio::detail {
namespace {

constexpr std::uint64_t wake_tag = 0;  // user data of the eventfd read; ops are pointers
constexpr std::size_t max_chunk = std::size_t{1} << 30;  // an SQE's length is 32 bits

// Rings' lifetimes as ThreadSanitizer sees them: liburing unmaps a ring with a raw syscall
// (Debian's build is nolibc) the sanitizer never sees, so a ring mapped later at the same
// address looked like a race with the last one's writes (a flake of
// AioCallerRings.ThreadsComeAndGoEachSeesItsOwnWrites). The kernel orders an unmap before a
// map of the same address; these tell the sanitizer so, and are nothing without it.
#if defined(__SANITIZE_THREAD__)
char ring_lifetimes;
void ring_made() noexcept {
  __tsan_acquire(&ring_lifetimes);
}
void exit_ring(io_uring& r) noexcept {
  __tsan_release(&ring_lifetimes);
  ::io_uring_queue_exit(&r);
}
#else
void ring_made() noexcept {}
void exit_ring(io_uring& r) noexcept {
  ::io_uring_queue_exit(&r);
}
#endif

class uring_engine;
class uring_worker;
class caller_ring;
thread_local const uring_worker* running_here = nullptr;  // the worker this thread runs

//! What a request's completion `res` means: its end, or nothing when the rest of it must go
//! in again (a short transfer, EINTR, EAGAIN). Counts what it transferred into o.done.
std::optional<result<std::size_t>> outcome_of(op& o, int res) noexcept {
  if (o.kind == op_kind::fsync || o.kind == op_kind::fdatasync) {
    // Never retried: a failed fsync says data may be lost, a retry would hide it.
    return res < 0 ? result<std::size_t>(errno_error(-res)) : result<std::size_t>(0);
  }
  if (res < 0) {
    if (res == -EINTR || res == -EAGAIN) return std::nullopt;
    return result<std::size_t>(errno_error(-res));
  }
  if (res == 0) {
    if (o.kind == op_kind::read) return result<std::size_t>(o.done);  // end of file
    return result<std::size_t>(errc_error(std::errc::io_error));      // no progress: never spin
  }
  o.done += static_cast<std::size_t>(res);
  if (o.done < o.length) return std::nullopt;
  return result<std::size_t>(o.done);
}

//! Fills `sqe` with the next part of `o` on descriptor (or table index) `fd`, from or into
//! registered buffer `buffer` (-1: none).
void prepare_sqe(io_uring_sqe* sqe, op& o, int fd, bool registered, int buffer) noexcept {
  const auto chunk = static_cast<unsigned>(std::min(o.length - o.done, max_chunk));
  switch (o.kind) {
    case op_kind::read:
      if (buffer >= 0) {
        ::io_uring_prep_read_fixed(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done, buffer);
      } else {
        ::io_uring_prep_read(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done);
      }
      break;
    case op_kind::write:
      if (buffer >= 0) {
        ::io_uring_prep_write_fixed(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done, buffer);
      } else {
        ::io_uring_prep_write(sqe, fd, o.buffer + o.done, chunk, o.offset + o.done);
      }
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
  if (registered) sqe->flags |= IOSQE_FIXED_FILE;
  ::io_uring_sqe_set_data(sqe, &o);
}

//! Whether `ring`'s completion queue holds anything, read by a thread that does not hold the
//! ring (the head is its reaper's, written with release: both loads atomic).
bool completions_waiting(const io_uring& ring) noexcept {
  return __atomic_load_n(ring.cq.ktail, __ATOMIC_ACQUIRE) !=
         __atomic_load_n(ring.cq.khead, __ATOMIC_RELAXED);
}

//! Whether io_uring_enter's error `r` (negative) means the ring cannot be entered again: a
//! seccomp profile that denies the call once the ring is set up, a ring torn down. Others
//! (EINTR, EAGAIN, EBUSY, ETIME, ENOMEM) pass.
bool ring_is_dead(int r) noexcept {
  switch (-r) {
    case EPERM:
    case EACCES:
    case ENOSYS:
    case EOPNOTSUPP:
    case EBADF:
    case EFAULT:
    case EINVAL:
    case ENXIO:
      return true;
    default:
      return false;
  }
}

constexpr std::uint64_t discarded_tag = 1;  // a request taken back out of a dead ring

//! The requests `ring` holds that the kernel has not taken (its enter failed): calls
//! `back(op&)` for each and turns its entry into a NOP of no request, so that nothing runs
//! them should the ring ever be entered again. Entries of no request are skipped.
template <class F>
void take_back_unsubmitted(io_uring& ring, F&& back) noexcept {
  const unsigned head = __atomic_load_n(ring.sq.khead, __ATOMIC_ACQUIRE);
  const unsigned tail = *ring.sq.ktail;
  for (unsigned i = head; i != tail; ++i) {
    io_uring_sqe* sqe = &ring.sq.sqes[i & ring.sq.ring_mask];
    const std::uint64_t tag = sqe->user_data;
    ::io_uring_prep_nop(sqe);
    ::io_uring_sqe_set_data64(sqe, discarded_tag);
    if (tag != wake_tag && tag != discarded_tag && tag != LIBURING_UDATA_TIMEOUT) {
      back(*reinterpret_cast<op*>(static_cast<std::uintptr_t>(tag)));
    }
  }
}

//! Submits a NOP to a ring just set up and reaps it: what the engine does with a ring, so
//! that a ring that can be set up but not entered (seccomp denying io_uring_enter alone)
//! fails at start, where the default engine falls back to posix. 0 or -errno.
int probe(io_uring& ring) noexcept {
  io_uring_sqe* sqe = ::io_uring_get_sqe(&ring);
  if (sqe == nullptr) return -EBUSY;
  ::io_uring_prep_nop(sqe);
  ::io_uring_sqe_set_data64(sqe, discarded_tag);
  const int r = ::io_uring_submit_and_wait(&ring, 1);
  if (r < 0) return r;
  io_uring_cqe* cqe = nullptr;
  if (::io_uring_peek_cqe(&ring, &cqe) == 0 && cqe != nullptr) ::io_uring_cqe_seen(&ring, cqe);
  return 0;
}

//! A completion taken from a caller ring, to be settled outside the ring's lock.
struct reaped {
  op* o;
  int res;
};
constexpr std::size_t reap_batch = 64;

class uring_engine;

//! Completions a thread took from a ring and has yet to settle, innermost first. One settled
//! among them may wait for another of them (completions may wait, receipt.hpp), which no
//! other thread would settle: the wait settles it (uring_worker::help).
struct unsettled {
  uring_engine* engine;
  std::span<const reaped> rest;
  unsigned next_worker;  // where what goes in again goes
  unsettled* outer;
};
thread_local unsettled* unsettled_here = nullptr;

//! What the engine keeps of a file: its index in every ring's table of registered files, or
//! -1; the workers whose ring registered it (bit i % 64 for worker i), which must let go of
//! it before it closes.
struct uring_file final : engine_file {
  uring_file(uring_engine& e, std::uint64_t id, int index) noexcept
      : owner(e), file_id(id), slot(index) {}
  ~uring_file() override;  // lets go of the index if closing did not (a failed open)
  uring_engine& owner;
  std::uint64_t file_id;
  int slot;
  std::atomic<std::uint64_t> registered_in{0};
  // Whether its buffered writes go to the ring or are written by the worker
  // (learn_buffered_writes).
  enum class writes : std::uint8_t { unknown, to_the_ring, by_the_worker };
  std::atomic<writes> buffered_writes{writes::unknown};
};

uring_file& of(file_state& f) noexcept {
  return static_cast<uring_file&>(*f.engine_data);
}

//! Whether `o` is a buffered write whose file's kind decides where it goes (see the top of
//! the file): not of a chain, whose requests count in it as they start on the ring.
bool buffered_write(const op& o) noexcept {
  return o.kind == op_kind::write && o.length != 0 && !o.file->direct && o.in_chain == nullptr;
}

//! Whether `o` is a buffered write to a file that refuses a write that must not block: one
//! the kernel would hand to a thread of its own, so one a thread of keel's writes itself.
bool written_by_a_thread(const op& o) noexcept {
  return buffered_write(o) && of(*o.file).buffered_writes.load(std::memory_order_relaxed) ==
                                  uring_file::writes::by_the_worker;
}

//! Finds out, with `o`, the first buffered write of its file, which kind of file it is: as
//! a write that must not block (io::filesystem::write_nowait), which writes nothing where the
//! file refuses it and may write some or all of `o` elsewhere. The bytes it wrote (0 where
//! the file refuses, and for any write but a file's first); the caller counts them in o.done.
std::size_t learn_buffered_writes(op& o) noexcept {
  auto& mode = of(*o.file).buffered_writes;
  if (!buffered_write(o) || mode.load(std::memory_order_relaxed) != uring_file::writes::unknown) {
    return 0;
  }
  const io::file_handle& h = o.file->handle;
  const iovec v{o.buffer + o.done, o.length - o.done};
  const auto n = h.fs().write_nowait(h, static_cast<off_t>(o.offset + o.done), std::span(&v, 1));
  if (!n && n.error() == std::errc::operation_not_supported) {
    mode.store(uring_file::writes::by_the_worker, std::memory_order_relaxed);
    return 0;
  }
  // Written, or it would have blocked, or failed: the ring takes the rest (all of it again
  // after a failure, which it reports itself).
  mode.store(uring_file::writes::to_the_ring, std::memory_order_relaxed);
  return n ? *n : 0;
}

//! Whether `o` may go to a ring other than a worker's: not a write a thread writes itself,
//! nor a buffered write to a file not known yet (learn_buffered_writes).
bool rings_may_take(const op& o) noexcept {
  return !buffered_write(o) || of(*o.file).buffered_writes.load(std::memory_order_relaxed) ==
                                   uring_file::writes::to_the_ring;
}

//! The rest of the write `o`, on the calling thread (written_by_a_thread).
result<std::size_t> write_here(op& o) noexcept {
  if (auto w =
          o.file->handle.write_at(static_cast<off_t>(o.offset + o.done),
                                  std::span<const std::byte>(o.buffer + o.done, o.length - o.done));
      !w) {
    return std::unexpected(w.error());
  }
  return o.length;  // finish() counts it in o.done
}

//! A ring's table of registered files (a sparse table, Linux 5.19+): the file id at each
//! index (0: none). Used by one thread at a time.
class ring_files {
 public:
  //! Sets the ring's table up with `slots` indexes: whether it has one (else files go by
  //! descriptor).
  bool start(io_uring& ring, unsigned slots) noexcept {
    if (slots == 0 || ::io_uring_register_files_sparse(&ring, slots) != 0) return false;
    try {
      ids_.assign(slots, 0);
    } catch (const std::bad_alloc&) {
      (void)::io_uring_unregister_files(&ring);
      return false;
    }
    return true;
  }
  [[nodiscard]] bool empty() const noexcept { return ids_.empty(); }

  //! `f`'s index in the table, registering it there now if need be (then `fresh`); -1: go
  //! by descriptor.
  int use(io_uring& ring, file_state& f, bool& fresh) noexcept {
    fresh = false;
    const int slot = of(f).slot;
    if (slot < 0 || static_cast<std::size_t>(slot) >= ids_.size()) return -1;
    auto& id = ids_[static_cast<std::size_t>(slot)];
    if (id != f.id) {
      int fd = f.handle.fd();
      if (::io_uring_register_files_update(&ring, static_cast<unsigned>(slot), &fd, 1) != 1) {
        return -1;
      }
      id = f.id;
      fresh = true;
    }
    return slot;
  }

  //! Lets go of file `id` at index `slot` if the table holds it.
  void forget(io_uring& ring, int slot, std::uint64_t id) noexcept {
    const auto i = static_cast<std::size_t>(slot);
    if (i >= ids_.size() || ids_[i] != id) return;
    int none = -1;
    (void)::io_uring_register_files_update(&ring, static_cast<unsigned>(slot), &none, 1);
    ids_[i] = 0;
  }

  //! Lets go of every file at once (the ring itself is torn down later, in the background:
  //! a file it held would stay open, a flock on it held, meanwhile).
  void drop(io_uring& ring) noexcept {
    if (!ids_.empty()) (void)::io_uring_unregister_files(&ring);
    ids_.clear();
  }

 private:
  std::vector<std::uint64_t> ids_;
};

//! The engine's own state, shared by its workers: the registered buffers and the indexes of
//! the rings' tables of files.
class uring_engine final : public engine {
 public:
  uring_engine(engine_context& c, std::vector<std::span<std::byte>> buffers) noexcept
      : engine(engine_kind::io_uring, c), buffers_(std::move(buffers)) {
    if (c.opts().register_files) {
      // The kernel refuses a table larger than RLIMIT_NOFILE.
      rlimit nofile{};
      file_slots_ = 1024;
      if (::getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < file_slots_) {
        file_slots_ = static_cast<unsigned>(nofile.rlim_cur);
      }
      try {
        free_slots_.reserve(file_slots_);
      } catch (const std::bad_alloc&) {
        file_slots_ = 0;  // files go by descriptor
      }
    }
    if (c.opts().submit_on != submitter::workers) {
      lists_.reset(new (std::nothrow) ring_list[c.opts().workers]);  // none: only workers
    }
  }

  [[nodiscard]] bool chains_batches() const noexcept override { return true; }
  std::unique_ptr<worker> make_worker(unsigned index) noexcept override;

  result<void> opened(file_state& f, const open_options& how) noexcept override {
    (void)how;
    f.engine_data.reset(new (std::nothrow) uring_file(*this, f.id, take_slot()));
    if (!f.engine_data) return errc_error(std::errc::not_enough_memory);
    return {};
  }

  result<void> closing(file_state& f) noexcept override {
    uring_file& uf = of(f);
    if (uf.slot >= 0) release_slot(uf);
    return {};
  }

  [[nodiscard]] unsigned file_slots() const noexcept { return file_slots_; }
  [[nodiscard]] const std::vector<std::span<std::byte>>& buffers() const noexcept {
    return buffers_;
  }

  //! The table index of the registered buffer holding [p, p + n) wholly, or -1.
  [[nodiscard]] int buffer_index(const std::byte* p, std::size_t n) const noexcept {
    // The last region starting at or before p.
    auto it = std::upper_bound(buffers_.begin(), buffers_.end(), p,
                               [](const std::byte* q, const auto& b) { return q < b.data(); });
    if (it == buffers_.begin()) return -1;
    --it;
    const auto offset = static_cast<std::size_t>(p - it->data());
    if (offset > it->size() || n > it->size() - offset) return -1;
    return static_cast<int>(it - buffers_.begin());
  }

  //! Makes every ring let go of `f` and frees its index (close, after the last request).
  void release_slot(uring_file& f) noexcept;

  std::size_t submit_here(std::span<op* const> ops) noexcept override;
  void settle_here() noexcept override;
  bool wait_here(op& o) noexcept override;
  void add_counts(engine_stats& s) const noexcept override;
  //! Counts a buffered write a thread of keel's wrote itself (written_by_a_thread).
  void wrote_one() noexcept {
    written_by_threads_.add(base::sharded_count::shard_of_this_thread(), 1);
  }

  //! Worker `w`'s share of the caller rings: takes the completions their threads left
  //! there (a worker's thread) and settles them. Whether a ring with completions was busy
  //! (its thread in it, about to leave): the worker must look again soon.
  bool reap_left(unsigned w) noexcept;
  //! Settles completions taken from a caller ring: ends their requests, or hands what must
  //! go in again to a worker.
  void settle(std::span<const reaped> done) noexcept;
  //! Settles one of the completions this thread took and has yet to settle (a completion
  //! among them waits): whether there was one.
  static bool settle_one_left() noexcept;
  //! Wakes worker `w` (a caller ring's completion may have gone unnoticed).
  void kick(unsigned w) noexcept;
  //! Whether a caller ring of worker `w`'s has requests its thread left running.
  bool rings_away(unsigned w) noexcept;
  void uncount_ring() noexcept;
  //! A caller ring is made (listed with its worker) or ends (unlisted).
  bool list(caller_ring& r) noexcept;
  void unlist(caller_ring& r) noexcept;
  [[nodiscard]] int buffer_of(const op& o) const noexcept {
    return buffers_.empty() ? -1 : buffer_index(o.buffer + o.done, o.length - o.done);
  }
  [[nodiscard]] engine_context& owner() const noexcept { return context(); }

 private:
  //! The calling thread's caller ring, made if `make` and there is none; null when there is
  //! none, or it could not start (then the thread uses the workers).
  caller_ring* ring_of_this_thread(bool make) noexcept;

  //! A free table index for a new file, or -1 (none left, or not registering).
  int take_slot() noexcept KEEL_EXCLUDES(slots_mutex_) {
    const base::lock_guard lock(slots_mutex_);
    if (!free_slots_.empty()) {
      const int slot = free_slots_.back();
      free_slots_.pop_back();
      return slot;
    }
    return next_slot_ < static_cast<int>(file_slots_) ? next_slot_++ : -1;
  }

  std::vector<std::span<std::byte>> buffers_;  // in address order: their index in the tables
  unsigned file_slots_ = 0;                    // the size of every ring's table of files
  base::mutex slots_mutex_;
  std::vector<int> free_slots_ KEEL_GUARDED_BY(slots_mutex_);  // reserved for every index at start
  int next_slot_ KEEL_GUARDED_BY(slots_mutex_) = 0;
  std::vector<uring_worker*> workers_;  // owned by the controller, which outlives the files

  // The caller rings, each listed with the worker that reaps what its thread leaves.
  struct ring_list {
    base::mutex mutex;
    std::vector<caller_ring*> rings KEEL_GUARDED_BY(mutex);
    std::atomic<unsigned> count{0};
  };
  static constexpr unsigned max_caller_rings = 256;  // further threads use the workers
  std::unique_ptr<ring_list[]> lists_;               // one per worker
  std::atomic<unsigned> caller_rings_{0};
  std::atomic<unsigned> next_list_{0};
  // What rings that ended did (engine_stats).
  std::atomic<std::uint64_t> retired_started_{0};
  std::atomic<std::uint64_t> retired_registered_{0};
  std::atomic<std::uint64_t> retired_reaped_{0};
  base::sharded_count written_by_threads_;  // by workers, waiters and submitters alike
  // Last: its rings end (and drain) while the rest of the engine is still there.
  base::per_thread_states rings_of_threads_;
};

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

// ---- the submitting threads' own rings ----

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
  if (!r.notify(w, workers_[w]->wake_fd())) return false;
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

void uring_engine::kick(unsigned w) noexcept {
  workers_[w]->wake();
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

uring_file::~uring_file() {
  if (slot >= 0) owner.release_slot(*this);
}

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

void uring_engine::release_slot(uring_file& f) noexcept {
  const std::uint64_t rings = f.registered_in.load();
  for (std::size_t i = 0; i < workers_.size(); ++i) {
    if ((rings & (std::uint64_t{1} << (i % 64))) != 0) workers_[i]->forget(f.slot, f.file_id);
  }
  if (lists_) {
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      ring_list& l = lists_[w];
      const base::lock_guard lock(l.mutex);
      for (caller_ring* r : l.rings)
        r->forget(f.slot, f.file_id);
    }
  }
  const base::lock_guard lock(slots_mutex_);
  free_slots_.push_back(f.slot);  // reserved for every slot at start
  f.slot = -1;
}

}  // namespace

std::unique_ptr<engine> make_uring_engine(engine_context& c,
                                          std::vector<std::span<std::byte>> buffers) noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) uring_engine(c, std::move(buffers)));
}

}  // namespace keel::aio::detail
