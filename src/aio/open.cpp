// controller::open: a file's state, set up for the engine and the write-back cache.

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <new>

#include "base/abandon.hpp"
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
  // In a forked child, the parent's: a stdio stream would flush the parent's buffer.
  if (owner && owner->inherited()) base::abandon(std::move(engine_data));
  engine_data.reset();  // before the handle closes the descriptor
}

result<detail::stream*> detail::file_state::stream_of_this_thread() noexcept {
  return streams.get<stream>([]() -> result<std::unique_ptr<stream>> {
    std::unique_ptr<stream> s(new (std::nothrow) stream);
    if (!s) return errc_error(std::errc::not_enough_memory);
    return s;
  });
}

result<file> controller::open(const std::string& path, open_options how) noexcept {
  if (impl_->inherited()) return std::unexpected(make_error_code(errc::inherited_across_fork));
  if (!how.read && !how.write) return errc_error(std::errc::invalid_argument);
  if ((how.create || how.truncate) && !how.write) return errc_error(std::errc::invalid_argument);
  if (auto ok = impl_->engine->accepts(how); !ok) return std::unexpected(ok.error());
  io::open_flags flags = io::open_flags::none;
  if (how.read) flags = flags | io::open_flags::read;
  if (how.write) flags = flags | io::open_flags::write;
  if (how.create) flags = flags | io::open_flags::create;
  if (how.truncate) flags = flags | io::open_flags::truncate;
  if (how.direct) flags = flags | io::open_flags::direct;
  auto h = io::file_handle::open(*impl_->opts.fs, path.c_str(), flags, 0644);
  if (!h) return std::unexpected(h.error());
  std::shared_ptr<detail::file_state> s;
  try {
    s = std::make_shared<detail::file_state>();
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  s->handle = std::move(*h);
  s->owner = impl_;
  s->id = next_file_id.fetch_add(1);
  s->readable = how.read;
  s->writable = how.write;
  s->direct = how.direct;
  if (how.direct) {
    // The kernel says what O_DIRECT needs (Linux 6.1+); else the logical block size is the
    // safe bet.
    const int fd = s->handle.fd();
    struct statx sx {};
    std::size_t align = 0;
#ifdef STATX_DIOALIGN
    // A question about the device, not a file operation: the seam has no statx.
    if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
        (sx.stx_mask & STATX_DIOALIGN) != 0 && sx.stx_dio_offset_align != 0) {
      align = std::max<std::size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
    }
#endif
    if (align == 0) align = 4096;
    s->align = align;
    // The cache writes out from its pages, aligned to a page: finer alignments only.
    if (how.cache && align > detail::page_size) {
      return std::unexpected(make_error_code(errc::cache_needs_buffered_io));
    }
  }
  if (auto e = impl_->engine->opened(*s, how); !e) return std::unexpected(e.error());
  if (how.cache && impl_->cache) {
    const auto size = s->handle.size();
    if (!size) return std::unexpected(size.error());
    if (auto a = impl_->cache->attach(s, static_cast<std::uint64_t>(*size)); !a) {
      return std::unexpected(a.error());
    }
  }
  return file(std::move(s));
}

}  // namespace keel::aio
