#pragma once
// The System V semaphore set of a sysv lock: its key, from the lock file's device and inode,
// and which semaphores guard an entity. Shared by sysv.cpp and by inspect, which reads the
// set's counts to show its holders.

#include <sys/ipc.h>

#include <cstdint>

#include "detail/common.hpp"

namespace keel::lock::sysv_set {

inline key_t key_of(const detail::file_id& id) noexcept {
  // ftok keeps only 8 bits of the device and 16 of the inode; mix all of both instead.
  std::uint64_t h = id.dev * 0x9e3779b97f4a7c15ULL ^ id.ino * 0xc2b2ae3d27d4eb4fULL;
  h ^= h >> 29;
  auto key = static_cast<key_t>(h & 0x7fffffff);
  return key == IPC_PRIVATE ? key_t{1} : key;
}

//! Semaphores 2i (writer: 0 or 1) and 2i + 1 (readers: a count) guard slot i; an entity's
//! slot is its value modulo the slots (the set has twice as many semaphores).
inline std::uint64_t slot_of(std::uint64_t value, std::uint64_t slots) noexcept {
  return value % slots;
}
inline unsigned short writer_sem(std::uint64_t slot) noexcept {
  return static_cast<unsigned short>(2 * slot);
}
inline unsigned short readers_sem(std::uint64_t slot) noexcept {
  return static_cast<unsigned short>(2 * slot + 1);
}

}  // namespace keel::lock::sysv_set
