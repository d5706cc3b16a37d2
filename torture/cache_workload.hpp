#pragma once
// The aio write-back cache workload of the harness (see cache_workload.cpp).

#include <cstdint>
#include <optional>
#include <string>

#include "keel/io/filesystem.hpp"

namespace keel::torture::detail {

//! One cycle's writer and its oracle, kept in memory shared with the processes it forks.
class cache_run {
 public:
  cache_run();
  ~cache_run();
  cache_run(const cache_run&) = delete;
  cache_run& operator=(const cache_run&) = delete;

  //! The writer (run in a child): `rounds` writes of random blocks of `path`, an fsync after
  //! one in eight, through `fs`. Records what each successful fsync covered. Returns 0.
  int write(const std::string& path, io::filesystem& fs, std::uint64_t seed, int rounds);
  //! After the writer is gone: whether `path` holds what was promised (else what is wrong).
  [[nodiscard]] std::optional<std::string> check(const std::string& path) const;

 private:
  void* oracle_;
};

}  // namespace keel::torture::detail
