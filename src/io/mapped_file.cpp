#include "keel/io/mapped_file.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <limits>

#include "io/map_guard.hpp"

namespace keel::io {
namespace {

int to_madvise(map_advice a) noexcept {
  switch (a) {
    case map_advice::normal:
      return MADV_NORMAL;
    case map_advice::random:
      return MADV_RANDOM;
    case map_advice::sequential:
      return MADV_SEQUENTIAL;
    case map_advice::will_need:
      return MADV_WILLNEED;
    case map_advice::dont_need:
      return MADV_DONTNEED;
    case map_advice::populate_read:
#ifdef MADV_POPULATE_READ
      return MADV_POPULATE_READ;
#else
      return 22;  // the kernel's value, for older headers
#endif
    case map_advice::populate_write:
#ifdef MADV_POPULATE_WRITE
      return MADV_POPULATE_WRITE;
#else
      return 23;  // the kernel's value, for older headers
#endif
  }
  return MADV_NORMAL;
}

// [offset, offset + length) of a map of `size` bytes; length 0 means to the end.
bool sub_range(std::size_t size, std::size_t offset, std::size_t& length) noexcept {
  if (offset > size) return false;
  if (length == 0) length = size - offset;
  return length <= size - offset;
}

}  // namespace

std::size_t page_size() noexcept {
  static const auto size = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return size;
}

mapped_file::mapped_file(mapped_file&& other) noexcept
    : addr_(other.addr_),
      length_(other.length_),
      offset_(other.offset_),
      access_(other.access_),
      fs_(other.fs_) {
  other.addr_ = nullptr;
  other.length_ = 0;
}

mapped_file& mapped_file::operator=(mapped_file&& other) noexcept {
  if (this != &other) {
    (void)unmap();
    addr_ = other.addr_;
    length_ = other.length_;
    offset_ = other.offset_;
    access_ = other.access_;
    fs_ = other.fs_;
    other.addr_ = nullptr;
    other.length_ = 0;
  }
  return *this;
}

mapped_file::~mapped_file() {
  (void)unmap();
}

result<mapped_file> mapped_file::map(const file_handle& file, map_access access, std::size_t length,
                                     off_t offset) noexcept {
  if (offset < 0 || static_cast<std::size_t>(offset) % page_size() != 0) {
    return errc_error(std::errc::invalid_argument);
  }
  if (length == 0) {
    auto size = file.size();
    if (!size) return std::unexpected(size.error());
    if (*size > offset) length = static_cast<std::size_t>(*size - offset);
  }
  mapped_file m;
  m.access_ = access;
  m.offset_ = offset;
  m.fs_ = &file.fs();
  if (length == 0) return m;  // mmap(2) refuses empty maps; an empty span is the honest answer
  auto addr = m.fs_->map(file, length, offset, access);
  if (!addr) return std::unexpected(addr.error().about(file.shared_path()));
  m.addr_ = *addr;
  m.length_ = length;
  if (access == map_access::read_write) map_guard::add(m.addr_, m.length_);
  return m;
}

result<void> mapped_file::remap(std::size_t new_length) noexcept {
  if (new_length == length_) return {};
  if (new_length == 0) return unmap();
  if (addr_ == nullptr) return errc_error(std::errc::invalid_argument);  // nothing to grow from
  const bool guard = access_ == map_access::read_write;
  if (guard) map_guard::remove(addr_);
  auto addr = fs().remap(addr_, length_, new_length);
  if (!addr) {
    if (guard) map_guard::add(addr_, length_);
    return std::unexpected(addr.error());
  }
  addr_ = *addr;
  length_ = new_length;
  if (guard) map_guard::add(addr_, length_);
  return {};
}

result<void> mapped_file::sync(std::size_t offset, std::size_t length, bool wait) const noexcept {
  if (!sub_range(length_, offset, length)) return errc_error(std::errc::invalid_argument);
  if (length == 0) return {};
  // msync wants a page-aligned start: round down, and cover the bytes that moves in.
  const std::size_t aligned = offset - offset % page_size();
  return fs().sync_map(data() + aligned, length + (offset - aligned), wait);
}

result<void> mapped_file::advise(map_advice advice, std::size_t offset,
                                 std::size_t length) const noexcept {
  if (!sub_range(length_, offset, length)) return errc_error(std::errc::invalid_argument);
  if (length == 0) return {};
  const std::size_t aligned = offset - offset % page_size();
  if (::madvise(data() + aligned, length + (offset - aligned), to_madvise(advice)) != 0) {
    return last_errno_error();
  }
  return {};
}

result<void> mapped_file::unmap() noexcept {
  if (addr_ == nullptr) return {};
  void* addr = addr_;
  const std::size_t length = length_;
  addr_ = nullptr;
  length_ = 0;
  if (access_ == map_access::read_write) map_guard::remove(addr);
  return fs().unmap(addr, length);
}

result<mapped_file> allocate_and_map(const file_handle& file, std::size_t length,
                                     map_access access) noexcept {
  if (length == 0 || length > static_cast<std::size_t>(std::numeric_limits<off_t>::max())) {
    return errc_error(std::errc::invalid_argument);
  }
  if (auto r = file.allocate(0, static_cast<off_t>(length)); !r) return std::unexpected(r.error());
  return mapped_file::map(file, access, length, 0);
}

result<void> allocate_and_remap(const file_handle& file, mapped_file& map,
                                std::size_t new_length) noexcept {
  if (new_length == 0 || new_length > static_cast<std::size_t>(std::numeric_limits<off_t>::max())) {
    return errc_error(std::errc::invalid_argument);
  }
  if (auto r = file.allocate(0, static_cast<off_t>(new_length)); !r) {
    return std::unexpected(r.error());
  }
  if (map.size() == 0) {
    auto m = mapped_file::map(file, map.access(), new_length, 0);
    if (!m) return std::unexpected(m.error());
    map = std::move(*m);
    return {};
  }
  return map.remap(new_length);
}

}  // namespace keel::io
