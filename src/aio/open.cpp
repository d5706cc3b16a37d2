// controller::open: a file's state, set up for the engine and the write-back cache.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <new>

#include "cache.hpp"
#include "detail.hpp"
#include "keel/aio/errors.hpp"

namespace keel::aio {
namespace {

// Process-wide: an id never names two files, of any controller (io_uring's table of files
// compares ids).
std::atomic<std::uint64_t> next_file_id{1};

}  // namespace

detail::file_state::~file_state() {
  engine_data.reset();  // before the descriptor closes
  if (fd >= 0) ::close(fd);
}

result<detail::stream*> detail::file_state::stream_of_this_thread() noexcept {
  return streams.get<stream>([]() -> result<std::unique_ptr<stream>> {
    std::unique_ptr<stream> s(new (std::nothrow) stream);
    if (!s) return errc_error(std::errc::not_enough_memory);
    return s;
  });
}

result<file> controller::open(const std::string& path, open_options how) noexcept {
  if (!how.read && !how.write) return errc_error(std::errc::invalid_argument);
  if ((how.create || how.truncate) && !how.write) return errc_error(std::errc::invalid_argument);
  if (auto ok = impl_->engine->accepts(how); !ok) return std::unexpected(ok.error());
  if (how.direct && how.cache)
    return std::unexpected(make_error_code(errc::cache_needs_buffered_io));
  int flags = O_CLOEXEC | (how.read && how.write ? O_RDWR : how.write ? O_WRONLY : O_RDONLY);
  if (how.create) flags |= O_CREAT;
  if (how.truncate) flags |= O_TRUNC;
  if (how.direct) flags |= O_DIRECT;
  const int fd = ::open(path.c_str(), flags, 0644);
  if (fd < 0) return last_errno_error();
  std::shared_ptr<detail::file_state> s;
  try {
    s = std::make_shared<detail::file_state>();
  } catch (const std::bad_alloc&) {
    ::close(fd);
    return errc_error(std::errc::not_enough_memory);
  }
  s->fd = fd;
  s->owner = impl_;
  s->id = next_file_id.fetch_add(1);
  s->readable = how.read;
  s->writable = how.write;
  s->direct = how.direct;
  if (how.direct) {
    // The kernel says what O_DIRECT needs (Linux 6.1+); else the logical block size is the
    // safe bet.
    struct statx sx {};
    std::size_t align = 0;
#ifdef STATX_DIOALIGN
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) != 0 && sx.stx_dio_offset_align != 0) {
      align = std::max<std::size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
    }
#endif
    if (align == 0) align = 4096;
    s->align = align;
  }
  if (auto e = impl_->engine->opened(*s, how); !e) return std::unexpected(e.error());
  if (how.cache && impl_->cache) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return last_errno_error();
    if (auto a = impl_->cache->attach(s, static_cast<std::uint64_t>(st.st_size)); !a) {
      return std::unexpected(a.error());
    }
  }
  return file(std::move(s));
}

}  // namespace keel::aio
