#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/aio/file.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/result.hpp"

namespace keel::aio {

//! Who starts a request (options::submit_on): a worker, or the thread that submits it.
enum class submitter : std::uint8_t {
  //! Each thread by what it does: a thread that spends most of its time in keel's calls
  //! (submitting and waiting) starts its requests itself; one that computes between them
  //! hands them to the workers, which run them meanwhile. With the one-at-a-time engines
  //! (posix, stdio, null) a thread runs a request itself only when it has no other request
  //! of the file unfinished: more would run one after another instead of in parallel.
  adaptive,
  caller,   //!< always the submitting thread (io_uring: workers finish what it leaves)
  workers,  //!< always a worker
};

//! How the controller's threads do the I/O.
enum class engine_kind : std::uint8_t {
  io_uring,  //!< a ring per thread (liburing), many requests in flight per thread
  posix,     //!< pread/pwrite/fsync on each thread, one request at a time per thread
  stdio,     //!< <cstdio> (fseeko/fread/fwrite, fflush+fsync): for comparison
  null,      //!< completes every request at once without I/O: the framework's own cost
};
[[nodiscard]] std::string_view to_string(engine_kind k) noexcept;
//! "io_uring", "posix", "stdio" or "null"; invalid_argument otherwise.
[[nodiscard]] result<engine_kind> engine_from_string(std::string_view name) noexcept;

struct options {
  //! Threads the controller owns. Requests of one submitting thread are spread over them.
  unsigned workers = 2;
  //! The engine; unset: io_uring where it works here, else posix. The environment variable
  //! KEEL_AIO_ENGINE (io_uring, posix, stdio, null) overrides both. A chosen engine that
  //! cannot start is an error; only the default falls back.
  //! io_uring is tried as it is used (a NOP submitted and reaped on every ring), so a
  //! profile that lets rings be set up but denies io_uring_enter fails at start. Should
  //! io_uring_enter be denied once running, a ring fails what it holds and the kernel did
  //! not take, and every later request that reaches that ring, with that error (what the
  //! kernel took before stays pending: it cannot be reaped without entering). Requests that
  //! do not reach it still run: a write the cache takes, or one a thread of the caller's
  //! runs itself (submitter::caller, buffered).
  std::optional<engine_kind> engine;
  //! The filesystem files are opened, read, written and synced through (the seam; null:
  //! io::os()). The write-back cache writes out through it too. Only the posix engine runs
  //! requests through it (and null, which does no I/O): with any other filesystem (a
  //! fault_filesystem, a filesystem_wrapper) the default engine is posix, and asking for
  //! io_uring or stdio is errc::not_supported_by_engine. io_uring and stdio reach the
  //! kernel directly, so that io_uring pays no virtual call per request.
  io::filesystem* fs = &io::os();
  //! Submission queue entries of each io_uring ring.
  unsigned queue_depth = 128;
  //! io_uring: register each file with the rings that run its requests (the kernel then
  //! skips looking the descriptor up, and counting a reference, per request). Up to 1024
  //! files at once (fewer under a lower RLIMIT_NOFILE); others run unregistered. Closing a
  //! registered file waits for those rings to let go of it.
  bool register_files = true;
  //! io_uring: memory to register with every ring (each region at most 1 GiB, none
  //! overlapping). A read or write whose buffer lies wholly inside one goes as
  //! READ_FIXED/WRITE_FIXED: the kernel maps the pages once, not per request (what O_DIRECT
  //! pays for). The memory must stay valid while the controller runs. It counts against
  //! RLIMIT_MEMLOCK; where the rings cannot register it, io_uring does not start (the
  //! default engine then falls back to posix and says why).
  std::vector<std::span<std::byte>> registered_buffers;
  //! Where requests start. A thread that submits and then waits pays for two hand-overs
  //! per request when a worker runs it (a wake-up, a cross-CPU completion). Started on the
  //! submitting thread, an io_uring request goes on a ring of the thread's own, which the
  //! thread submits to and reaps itself, as fio does (completions it does not come back for
  //! are reaped by a worker, which the ring's eventfd wakes); a posix, stdio or null
  //! request runs then and there, inside the call that submits it. Requests on
  //! registered_buffers, chained requests of a batch, tasks and the requests of cached files
  //! that the cache has yet to see (an fsync, whose cached bytes go out first) always go to
  //! the workers (the one-at-a-time engines also run a batch there); a cached file's write
  //! the cache stepped aside for, or read it does not hold, starts like any other file's.
  //! The environment variable KEEL_AIO_SUBMIT_ON (adaptive, caller, workers) overrides this.
  submitter submit_on = submitter::adaptive;
  //! posix engine: a thread that keeps reading a file one request at a time on its own
  //! (submit_on) gets an open file description of the file of its own after its 64th such
  //! read, reopened through /proc/self/fd. Threads that share one description contend on its
  //! reference count in every pread (about a tenth of a 4 KiB read from the page cache, on
  //! two threads); threads that each opened the file, as fio's do, do not. Only reads use
  //! it; writes and syncs keep the file's own descriptor. At most this many per controller,
  //! and no more than a thirty-second of RLIMIT_NOFILE; they close with their file. 0: none.
  //! Where one cannot be had (no /proc, EMFILE, a filesystem other than io::os()), the
  //! thread reads through the file's descriptor as before. The process sees them as any
  //! other open of the file: a write lease (F_SETLEASE) cannot be taken while they are
  //! open, inotify reports their opens, and the reopen waits for a lease to break.
  unsigned reader_descriptions = 32;

  //! The write-back cache of the files opened with open_options::cache, shared by them.
  //! Above `cache_soft_limit` bytes of cached pages a flusher thread writes out and drops
  //! the least recently written first; at `cache_hard_limit` a write that touches no cached
  //! page goes straight to the engine (one that does is still cached, so the limit can be
  //! passed by at most one request). A hard limit of 0 turns the cache off. soft <= hard.
  //! Pages a buffered file wrote out go (the kernel's page cache holds their bytes); an
  //! O_DIRECT file's stay, clean, for reads. Dropped pages are kept for the next writes, up
  //! to soft / 8 bytes (at least 64 pages) beyond these limits, until an idle round or the
  //! file's close frees them.
  std::size_t cache_soft_limit = std::size_t{32} << 20;
  std::size_t cache_hard_limit = std::size_t{128} << 20;
  //! When no write came into the cache for this long, the flusher writes out and drops the
  //! least recently written half of what is cached, and so on every such round.
  std::chrono::milliseconds cache_idle_round{100};
  //! Write-behind: once a file holds twice this many bytes of dirty pages, the flusher
  //! writes out all but the most recently dirtied this many bytes of them, so that an
  //! fsync finds little left to write, and the write-out runs beside the caller's work and
  //! the file's last fsync instead of in front of its next. An overwrite soon after its
  //! write still merges in memory. 0: dirty pages wait for an fsync, a close, the soft limit
  //! or an idle round.
  std::size_t cache_write_behind = std::size_t{256} << 10;
};

//! What the write-back cache holds and has done (controller::cache_stats).
struct cache_stats {
  std::size_t cached_bytes = 0;  //!< in pages of 4 KiB
  std::size_t dirty_bytes = 0;   //!< pages with bytes not yet written to their file
  std::uint64_t writes_cached = 0;
  std::uint64_t writes_bypassed = 0;  //!< at the hard limit
  std::uint64_t reads_served = 0;     //!< wholly from the cache
  std::uint64_t bytes_written_out = 0;
};

//! What the engine did (controller::engine_stats).
struct engine_stats {
  //! io_uring: requests of a batch that waited in their ring's worker for the earlier
  //! requests of the batch they must follow (an fsync for its writes), instead of in keel's
  //! per-thread order and a hand-over once those ended.
  std::uint64_t requests_ordered_in_ring = 0;
  //! io_uring: requests on a file registered with the ring (options::register_files).
  std::uint64_t requests_on_registered_files = 0;
  //! io_uring: reads and writes into or from registered_buffers (READ_FIXED/WRITE_FIXED).
  std::uint64_t requests_on_registered_buffers = 0;
  //! io_uring: requests started on the ring of the thread that submitted them
  //! (options::submit_on), not by a worker.
  std::uint64_t requests_on_caller_rings = 0;
  //! io_uring: of those, the ones a worker reaped because their thread was away.
  std::uint64_t caller_requests_reaped_by_workers = 0;
  //! io_uring: buffered writes a thread of keel's or the submitting thread wrote itself
  //! (pwrite), to files whose filesystem cannot take a buffered write without blocking
  //! (ext4, tmpfs; unlike xfs and btrfs): the kernel would hand each to a thread of its own.
  std::uint64_t buffered_writes_by_threads = 0;
};

//! How a file is opened.
struct open_options {
  bool read = true;
  bool write = false;
  bool create = false;    //!< O_CREAT (mode 0644), needs write
  bool truncate = false;  //!< O_TRUNC, needs write
  bool direct = false;    //!< O_DIRECT: requests must be aligned (file::alignment())
  //! Writes complete into the controller's write-back cache and go to the file later (see
  //! options::cache_soft_limit): a later read, fsync, task or close of the file sees them
  //! as if written; fsync and close write them out first and report a failed write-out.
  //! With direct too ("buffered direct I/O"): the cache holds whole aligned pages and writes
  //! them out aligned, straight from them; reads of cached bytes come from memory. A write
  //! that touches no cached page goes straight to the file where the cache has not paid
  //! lately (the file's writes do not come back to what it holds). Other processes see the
  //! bytes once written out; the file must not be written by anyone else meanwhile.
  bool cache = false;
};

//! Owns worker threads and their engines, and runs the requests of the files opened through
//! it (see file.hpp for ordering). Start one with `start`; `stop` (or the destructor) ends
//! it. Thread-safe. Files may outlive it: their requests are then cancelled.
//!
//! **fork().** A controller belongs to the process that started it. In a forked child its
//! threads do not exist, and its requests (queued, running, cached bytes not yet written
//! out) are the parent's, which finishes them: the child never runs or re-runs any of them.
//! There every call on the inherited controller, its files and its receipts of requests not
//! finished at the fork fails with errc::inherited_across_fork (receipts of finished ones
//! keep their outcome; the state() of an unfinished one stays status::pending, as it was
//! at the fork: only wait() says why); stop() does nothing; closing or destroying them
//! writes, runs and frees nothing (their memory stays until the child exits: the parent's
//! threads may have held their locks). A child may do nothing with it, and start
//! controllers of its own.
class controller {
 public:
  //! Starts the workers. Errors: invalid_argument (no workers, unknown KEEL_AIO_ENGINE or
  //! KEEL_AIO_SUBMIT_ON, a soft cache limit above the hard one),
  //! errc::not_supported_by_engine (io_uring or stdio asked for with options::fs not
  //! io::os()), and
  //! for an engine that was asked for and cannot run: the error that stopped it (ENOSYS,
  //! EPERM under seccomp or kernel.io_uring_disabled, ENOMEM for locked memory, ...).
  [[nodiscard]] static result<std::unique_ptr<controller>> start(options opts = {}) noexcept;
  controller(const controller&) = delete;
  controller& operator=(const controller&) = delete;
  //! `stop()`.
  ~controller();

  //! Ends the controller: requests not yet started finish as cancelled
  //! (errc::controller_stopped), running ones are waited for, the threads are joined. Every
  //! receipt is ready afterwards. Later requests are cancelled at once. Idempotent.
  void stop() noexcept;

  [[nodiscard]] engine_kind engine() const noexcept;
  [[nodiscard]] std::string_view engine_name() const noexcept { return to_string(engine()); }
  //! Why the default engine (io_uring) is not the one running, or empty.
  [[nodiscard]] const std::string& fallback_reason() const noexcept;
  [[nodiscard]] unsigned workers() const noexcept;
  [[nodiscard]] cache_stats cache() const noexcept;
  [[nodiscard]] engine_stats engine_counts() const noexcept;

  //! Opens `path` through options::fs. Errors: those of open(2); invalid_argument for
  //! create/truncate without write; errc::not_supported_by_engine for direct with the stdio engine;
  //! errc::cache_needs_buffered_io for cache with direct where O_DIRECT needs an alignment
  //! coarser than the cache's 4 KiB pages.
  [[nodiscard]] result<file> open(const std::string& path, open_options how) noexcept;

  struct impl;

 private:
  explicit controller(std::shared_ptr<impl> p) noexcept;
  std::shared_ptr<impl> impl_;  // shared with the files opened through it
};

}  // namespace keel::aio
