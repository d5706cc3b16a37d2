#pragma once
// An engine: how the controller's workers do I/O, and the state that is its own (io_uring's
// rings, registered files and buffers; stdio's streams). One per controller, made when it
// starts; it makes the workers, and the controller tells it when a file opens and closes.

#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine_context.hpp"
#include "keel/aio/controller.hpp"
#include "keel/result.hpp"

namespace keel::aio::detail {

struct file_state;
struct op;
class worker;

//! What an engine keeps of one open file (file_state::engine_data).
struct engine_file {
  engine_file() = default;
  engine_file(const engine_file&) = delete;
  engine_file& operator=(const engine_file&) = delete;
  virtual ~engine_file() = default;
};

class engine {
 public:
  engine(engine_kind k, engine_context& c) noexcept : kind_(k), context_(c) {}
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  virtual ~engine() = default;

  [[nodiscard]] engine_kind kind() const noexcept { return kind_; }
  //! Whether a batch's request that must follow earlier ones of it may be handed over with
  //! them, to wait in their worker (file::submit), rather than wait in its stream.
  [[nodiscard]] virtual bool chains_batches() const noexcept { return false; }
  //! Makes worker `index` of the controller (not started yet); null when out of memory.
  [[nodiscard]] virtual std::unique_ptr<worker> make_worker(unsigned index) noexcept = 0;
  //! Whether files opened as `how` can run here: not_supported_by_engine otherwise.
  [[nodiscard]] virtual result<void> accepts(const open_options& how) const noexcept {
    (void)how;
    return {};
  }
  //! A file was opened: sets up what the engine keeps of it (f.engine_data).
  [[nodiscard]] virtual result<void> opened(file_state& f, const open_options& how) noexcept {
    (void)f;
    (void)how;
    return {};
  }
  //! The file closes, its last request ended: the engine lets go of it (its descriptor is
  //! closed next). The error of what the engine closed.
  [[nodiscard]] virtual result<void> closing(file_state& f) noexcept {
    (void)f;
    return {};
  }
  //! Writes all of `data` at `offset` of `f` the way this engine writes, on the calling
  //! thread (the write-back cache's write-outs), or returns the error.
  [[nodiscard]] virtual result<void> write_out(file_state& f, std::uint64_t offset,
                                               std::span<const iovec> data) noexcept;
  //! Starts ready requests on the calling thread instead of handing them to a worker, where
  //! this engine does that (io_uring: options::submit_on); how many of `ops`, from the
  //! front, it took. The others go to the workers.
  [[nodiscard]] virtual std::size_t submit_here(std::span<op* const> ops) noexcept {
    (void)ops;
    return 0;
  }
  //! Ends what submit_here found ended (their completions run here, after the requests it
  //! did not take were handed to the workers: a completion may wait for those).
  virtual void settle_here() noexcept {}
  //! Waits on the calling thread for `o` if it started here (submit_here), reaping its
  //! completion, and others', itself: whether it did (`o` may still be pending: look
  //! again). False: wait for it as for any request.
  [[nodiscard]] virtual bool wait_here(op& o) noexcept {
    (void)o;
    return false;
  }
  //! Adds what the engine did outside its workers to `s`.
  virtual void add_counts(engine_stats& s) const noexcept { (void)s; }

 protected:
  //! The controller this engine serves, as engines see it.
  [[nodiscard]] engine_context& context() const noexcept { return context_; }

 private:
  engine_kind kind_;
  engine_context& context_;
};

//! Chooses the engine (options::engine, KEEL_AIO_ENGINE, else io_uring with posix as the
//! fallback) and starts `c.opts.workers` workers of it into `c`. `buffers`: the registered
//! buffers, checked and in address order, for io_uring.
[[nodiscard]] result<void> start_engine(controller::impl& c,
                                        std::vector<std::span<std::byte>> buffers) noexcept;

std::unique_ptr<engine> make_uring_engine(engine_context& c,
                                          std::vector<std::span<std::byte>> buffers) noexcept;
std::unique_ptr<engine> make_posix_engine(engine_context& c) noexcept;
//! The open file descriptions of threads' own the process can spare a controller
//! (options::reader_descriptions): a thirty-second of RLIMIT_NOFILE's soft limit.
[[nodiscard]] unsigned descriptor_share() noexcept;
std::unique_ptr<engine> make_stdio_engine(engine_context& c) noexcept;
std::unique_ptr<engine> make_null_engine(engine_context& c) noexcept;

}  // namespace keel::aio::detail
