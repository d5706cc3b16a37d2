#pragma once
// lock_files' owner record and the names in its directory (doc/lock-formats.md): what
// lock_files writes and `inspect` reads.

#include <cstdint>
#include <cstring>

#include "io/process.hpp"

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

//! The owner a record names, as io::check judges it.
inline io::process_identity owner_of(const owner_record& rec) noexcept {
  io::process_identity who;
  who.pid = rec.pid;
  who.pid_ns = rec.pid_ns;
  who.start_time = rec.start_time;
  std::memcpy(who.boot_id.data(), rec.boot_id, sizeof rec.boot_id);
  std::memcpy(who.machine_id.data(), rec.machine_id, sizeof rec.machine_id);
  return who;
}

}  // namespace keel::lock::lf
