#pragma once
// The io_uring engine's parts, shared by its three files: uring_engine.cpp (the engine and
// its files' table indexes), uring_workers.cpp (a ring per worker thread) and
// uring_callers.cpp (the submitting threads' own rings). What each owns is said where it is
// declared.
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

namespace keel::aio::detail::uring {

constexpr std::uint64_t wake_tag = 0;  // user data of the eventfd read; ops are pointers
constexpr std::size_t max_chunk = std::size_t{1} << 30;  // an SQE's length is 32 bits

// Rings' lifetimes as ThreadSanitizer sees them: liburing unmaps a ring with a raw syscall
// (Debian's build is nolibc) the sanitizer never sees, so a ring mapped later at the same
// address looked like a race with the last one's writes (a flake of
// AioCallerRings.ThreadsComeAndGoEachSeesItsOwnWrites). The kernel orders an unmap before a
// map of the same address; these tell the sanitizer so, and are nothing without it.
#if defined(__SANITIZE_THREAD__)
inline char ring_lifetimes;
inline void ring_made() noexcept {
  __tsan_acquire(&ring_lifetimes);
}
inline void exit_ring(io_uring& r) noexcept {
  __tsan_release(&ring_lifetimes);
  ::io_uring_queue_exit(&r);
}
#else
inline void ring_made() noexcept {}
inline void exit_ring(io_uring& r) noexcept {
  ::io_uring_queue_exit(&r);
}
#endif

class uring_engine;
class uring_worker;
class caller_ring;
inline thread_local const uring_worker* running_here = nullptr;  // the worker this thread runs

//! What a request's completion `res` means: its end, or nothing when the rest of it must go
//! in again (a short transfer, EINTR, EAGAIN). Counts what it transferred into o.done.
inline std::optional<result<std::size_t>> outcome_of(op& o, int res) noexcept {
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
inline void prepare_sqe(io_uring_sqe* sqe, op& o, int fd, bool registered, int buffer) noexcept {
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
inline bool completions_waiting(const io_uring& ring) noexcept {
  return __atomic_load_n(ring.cq.ktail, __ATOMIC_ACQUIRE) !=
         __atomic_load_n(ring.cq.khead, __ATOMIC_RELAXED);
}

//! Whether io_uring_enter's error `r` (negative) means the ring cannot be entered again: a
//! seccomp profile that denies the call once the ring is set up, a ring torn down. Others
//! (EINTR, EAGAIN, EBUSY, ETIME, ENOMEM) pass.
inline bool ring_is_dead(int r) noexcept {
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
inline void take_back_unsubmitted(io_uring& ring, F&& back) noexcept {
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
inline int probe(io_uring& ring) noexcept {
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
inline thread_local unsettled* unsettled_here = nullptr;

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

inline uring_file& of(file_state& f) noexcept {
  return static_cast<uring_file&>(*f.engine_data);
}

//! Whether `o` is a buffered write whose file's kind decides where it goes (see the top of
//! the file): not of a chain, whose requests count in it as they start on the ring.
inline bool buffered_write(const op& o) noexcept {
  return o.kind == op_kind::write && o.length != 0 && !o.file->direct && o.in_chain == nullptr;
}

//! Whether `o` is a buffered write to a file that refuses a write that must not block: one
//! the kernel would hand to a thread of its own, so one a thread of keel's writes itself.
inline bool written_by_a_thread(const op& o) noexcept {
  return buffered_write(o) && of(*o.file).buffered_writes.load(std::memory_order_relaxed) ==
                                  uring_file::writes::by_the_worker;
}

//! Finds out, with `o`, the first buffered write of its file, which kind of file it is: as
//! a write that must not block (io::filesystem::write_nowait), which writes nothing where the
//! file refuses it and may write some or all of `o` elsewhere. The bytes it wrote (0 where
//! the file refuses, and for any write but a file's first); the caller counts them in o.done.
inline std::size_t learn_buffered_writes(op& o) noexcept {
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
inline bool rings_may_take(const op& o) noexcept {
  return !buffered_write(o) || of(*o.file).buffered_writes.load(std::memory_order_relaxed) ==
                                   uring_file::writes::to_the_ring;
}

//! The rest of the write `o`, on the calling thread (written_by_a_thread).
inline result<std::size_t> write_here(op& o) noexcept {
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
  //! Worker `w`'s wake-up eventfd (uring_workers.cpp).
  [[nodiscard]] int worker_wake_fd(unsigned w) const noexcept;

 private:
  //! Makes the workers' rings (uring_workers.cpp), then the caller rings (uring_callers.cpp),
  //! let go of `f` (release_slot).
  void forget_in_workers(const uring_file& f) noexcept;
  void forget_in_callers(const uring_file& f) noexcept;
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

}  // namespace keel::aio::detail::uring
