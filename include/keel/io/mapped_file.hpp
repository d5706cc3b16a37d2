#pragma once

#include <sys/types.h>

#include <cstddef>
#include <span>

#include "keel/io/file_handle.hpp"
#include "keel/result.hpp"

namespace keel::io {

enum class map_advice {
  normal,      //!< MADV_NORMAL
  random,      //!< MADV_RANDOM: no read-ahead
  sequential,  //!< MADV_SEQUENTIAL: aggressive read-ahead
  will_need,   //!< MADV_WILLNEED: start reading now
  dont_need,   //!< MADV_DONTNEED: drop the pages (a shared map re-reads them from the file)
  //! MADV_POPULATE_READ (Linux 5.14): fault the pages in now, without dirtying them, so
  //! that the first touch later costs no page fault. Older kernels: invalid_argument.
  populate_read,
  //! MADV_POPULATE_WRITE (Linux 5.14): fault the pages in writable now. Where the kernel
  //! would raise SIGBUS on a store (a filesystem that refuses the write fault: btrfs with no
  //! room for its reservation), this fails with bad_address instead. Older kernels:
  //! invalid_argument.
  populate_write,
};

//! A memory map of (part of) a file, made, synced and unmapped through the file's
//! filesystem (the seam). Move-only; unmaps on destruction.
//!
//! **SIGBUS**: touching a page of a map that lies past the end of the file, or writing
//! through a shared map into a hole of a file whose filesystem is full, raises SIGBUS: the
//! kernel has no way to return an error from a store instruction. Code that writes through
//! maps must therefore make sure the blocks exist first: `allocate_and_map` (what keel itself
//! uses) reserves them with fallocate before mapping, so "no space" comes back as an error
//! from that call, never as a signal later. Likewise, never map past the end of the file.
//!
//! Some filesystems refuse a write fault even on allocated blocks: btrfs reserves metadata
//! for every write fault on a shared map and raises SIGBUS when it cannot at once (seen with
//! a thousand processes writing one store on a volume a third full). So keel guards its
//! writable maps: the first one made installs a SIGBUS handler, if SIGBUS still has its
//! default action, that waits out such a refusal in a guarded map (sleeping 1 ms, doubling
//! up to 50 ms, then retrying the store) and gives up after 20 s of one fault, when the
//! default action kills the process as before. Any other SIGBUS goes to the default action
//! at once. An application that installs its own SIGBUS handler first keeps it, and the
//! guard stays out; so does a thread that blocks SIGBUS (the kernel then kills on a fault);
//! `KEEL_MAP_GUARD=0` in the environment turns the guard off. A lasting failure that raises
//! the same signal (an I/O error reading a page in, a file cut short) kills after the 20 s.
class mapped_file {
 public:
  mapped_file() noexcept = default;
  mapped_file(mapped_file&& other) noexcept;
  mapped_file& operator=(mapped_file&& other) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file();

  //! Maps `length` bytes of `file` from `offset` (a multiple of the page size); `length`
  //! 0 means up to the end of the file. Mapping an empty range succeeds with an empty map.
  //! The map stays valid after `file` is closed. Errors: invalid_argument (offset not page
  //! aligned or negative), the errno of fstat(2)/mmap(2) (access_denied for read_write on a
  //! file opened read-only, no_such_device for files that cannot be mapped).
  [[nodiscard]] static result<mapped_file> map(const file_handle& file, map_access access,
                                               std::size_t length = 0, off_t offset = 0) noexcept;

  [[nodiscard]] std::byte* data() const noexcept { return static_cast<std::byte*>(addr_); }
  [[nodiscard]] std::size_t size() const noexcept { return length_; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data(), length_}; }
  [[nodiscard]] map_access access() const noexcept { return access_; }
  [[nodiscard]] filesystem& fs() const noexcept { return fs_ != nullptr ? *fs_ : os(); }

  //! Changes the mapped length to `new_length` (the file must already be that long before
  //! the new pages are touched; see `allocate_and_map`). The map may move: pointers into it
  //! are invalid afterwards. Errors: the errno of mremap(2)/mmap(2); the old map is kept.
  [[nodiscard]] result<void> remap(std::size_t new_length) noexcept;
  //! Writes the dirty pages of [offset, offset + length) of the map back to the file
  //! (msync(2)); `length` 0 means to the end. `wait` makes it synchronous (MS_SYNC): the
  //! bytes are then durable, as after an fsync of the file.
  [[nodiscard]] result<void> sync(std::size_t offset = 0, std::size_t length = 0,
                                  bool wait = true) const noexcept;
  //! madvise(2): a hint about memory, not a file operation (it never reaches the seam).
  [[nodiscard]] result<void> advise(map_advice advice, std::size_t offset = 0,
                                    std::size_t length = 0) const noexcept;
  //! Unmaps now, returning munmap's error if any.
  result<void> unmap() noexcept;

 private:
  void* addr_ = nullptr;
  std::size_t length_ = 0;
  off_t offset_ = 0;
  map_access access_ = map_access::read_only;
  filesystem* fs_ = nullptr;  // null: os()
};

//! Grows `file` to at least `length` bytes with every block reserved (`file_handle::allocate`),
//! then maps `length` bytes of it from offset 0. With a file that was fully allocated this
//! way, writes through the map cannot raise SIGBUS for lack of space. Errors:
//! no_space_on_device (nothing is mapped, the file may have grown partly), and those of `map`.
[[nodiscard]] result<mapped_file> allocate_and_map(
    const file_handle& file, std::size_t length,
    map_access access = map_access::read_write) noexcept;

//! Grows an existing map of `file` the same way: reserve blocks first, then remap.
[[nodiscard]] result<void> allocate_and_remap(const file_handle& file, mapped_file& map,
                                              std::size_t new_length) noexcept;

//! The system's page size.
[[nodiscard]] std::size_t page_size() noexcept;

}  // namespace keel::io
