#pragma once
// lock_files' owner record and the names in its directory (doc/lock-formats.md): what
// lock_files writes and `inspect` reads.

#include <cstdint>

namespace keel::lock::lf {

// The owner record every lock file holds.
struct owner_record {
  char magic[8];  // "KEELLF02"
  std::uint32_t pid;
  std::uint32_t pid_ns;
  std::uint64_t start_time;
  std::uint8_t boot_id[16];
  std::uint8_t machine_id[16];
  char host[48];  // for people reading the file: never used to judge
};
static_assert(sizeof(owner_record) == 104);
constexpr char record_magic[8] = {'K', 'E', 'E', 'L', 'L', 'F', '0', '2'};
constexpr const char* breaker_name = ".keel-break";

}  // namespace keel::lock::lf
