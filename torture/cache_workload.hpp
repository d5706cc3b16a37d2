#pragma once
// The aio workload of the harness (see cache_workload.cpp).

#include <cstdint>
#include <optional>
#include <string>

#include "keel/aio/controller.hpp"
#include "keel/io/filesystem.hpp"

namespace keel::torture::detail {

//! How one writer of the workload uses keel::aio.
struct aio_writer {
  aio::engine_kind engine = aio::engine_kind::posix;  //!< posix: through the filesystem given
  bool cache = true;
  aio::submitter submit_on = aio::submitter::adaptive;
  //! Writes in flight at once (each waited for before its buffer is reused; all of them
  //! before an fsync, which then covers what succeeded).
  unsigned window = 1;
  //! Every this many writes (0: never), with writes in flight, fork a child that checks the
  //! inherited controller refuses it and runs a controller of its own (fork mode).
  int fork_every = 0;
  std::uint32_t first_block = 0;  //!< the blocks it writes: [first_block, first_block + count)
  std::uint32_t block_count = 64;
};

//! A random writer for `seed`: any engine that starts here, cache or not, any submitter.
[[nodiscard]] aio_writer random_writer(std::uint64_t seed);

//! One cycle's writers and their oracle, kept in memory shared with the processes it forks.
class cache_run {
 public:
  cache_run();
  ~cache_run();
  cache_run(const cache_run&) = delete;
  cache_run& operator=(const cache_run&) = delete;

  //! A writer (run in a child): `rounds` writes of random blocks of `path`, an fsync after
  //! one in eight, through `fs`. Records what each successful fsync covered, and whether the
  //! file closed with every write acknowledged. Returns 0.
  int write(const std::string& path, io::filesystem& fs, std::uint64_t seed, int rounds,
            const aio_writer& how = {});
  //! After the writers are gone: whether `path` holds what was promised (else what is
  //! wrong). With `closed_exactly`, a writer whose file closed cleanly promised every block's
  //! last acknowledged version exactly, not merely the last fsynced one or a later one.
  [[nodiscard]] std::optional<std::string> check(const std::string& path,
                                                 bool closed_exactly = false) const;

 private:
  void* oracle_;
};

}  // namespace keel::torture::detail
