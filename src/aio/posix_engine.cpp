// The posix engine: pread/pwrite/fsync on the worker's thread, one request at a time, through
// the seam (io::filesystem): the one engine a fault-injecting filesystem can fail.

#include <sys/resource.h>
#include <sys/types.h>

#include <cstdio>
#include <limits>
#include <new>

#include "file_state.hpp"
#include "sync_engine.hpp"

namespace keel::aio::detail {
namespace {

// A thread's own open file description of a file comes with its read of that file run on
// it past this many (options::reader_descriptions): a thread that reads now and then keeps
// sharing the file's.
constexpr unsigned reads_before_a_reader = 64;

result<std::size_t> read_through(const io::file_handle& h, op& o) noexcept {
  auto n = h.read_at(static_cast<off_t>(o.offset), std::span(o.buffer, o.length));
  if (!n) return std::unexpected(n.error());
  o.done = *n;  // fewer only at end of file
  return *n;
}

// A new open file description of `f`'s file for reads, kept in `f` until it closes (`kept`),
// or null where none can be had: through /proc/self/fd, which reopens the file open here
// whatever its name now says.
const io::file_handle* reopen_for_reads(file_state& f, bool& kept) noexcept {
  char path[48];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", f.handle.fd());
  io::open_flags flags = io::open_flags::read;
  if (f.direct) flags = flags | io::open_flags::direct;
  auto h = io::file_handle::open(io::os(), path, flags, 0);
  if (!h) return nullptr;
  // /proc may be anything (a container's own): reads must come from this very file.
  auto mine = f.handle.status();
  auto reopened = h->status();
  const bool same = mine && reopened && mine->same_file(*reopened);
  // Kept until the file closes even when not used: closing a descriptor of a file lets go
  // of every POSIX record lock the process holds on it, which the file's own close does
  // anyway, but nothing before it may.
  std::unique_ptr<io::file_handle> own(new (std::nothrow) io::file_handle(std::move(*h)));
  if (!own) return nullptr;
  const io::file_handle* raw = own.get();
  const base::lock_guard lock(f.readers_mutex);
  try {
    f.readers.push_back(std::move(own));
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  kept = true;  // one of the controller's readers_left, given back when the file closes
  return same ? raw : nullptr;
}

// The description the submitting thread of `o` reads through: its own once it has one (made
// here, one of the controller's readers_left), else null (the file's).
const io::file_handle* reader_of(engine_context& c, op& o) noexcept {
  if (o.owner == nullptr) return nullptr;
  stream& s = *o.owner;
  if (s.reader != nullptr || s.reader_tried) return s.reader;
  if (++s.reads_here < reads_before_a_reader) return nullptr;
  s.reader_tried = true;
  file_state& f = *o.file;
  // Only the OS's descriptors can be reopened: another filesystem's are its own business.
  if (&f.handle.fs() != &io::os()) return nullptr;
  if (!c.take_reader_description()) return nullptr;
  bool kept = false;
  s.reader = reopen_for_reads(f, kept);
  if (!kept) c.give_back_reader_description();
  return s.reader;
}

class posix_engine final : public sync_engine {
 public:
  explicit posix_engine(engine_context& c) noexcept : sync_engine(engine_kind::posix, c) {}

  // Through the file's handle, so through the controller's filesystem (options::fs): the
  // handle continues short transfers and retries EINTR; its errors name the file.
  result<std::size_t> run(op& o) noexcept override {
    const io::file_handle& h = o.file->handle;
    const auto at = static_cast<off_t>(o.offset);
    switch (o.kind) {
      case op_kind::read:
        return read_through(h, o);
      case op_kind::write:
        if (auto w = h.write_at(at, std::span<const std::byte>(o.buffer, o.length)); !w) {
          return std::unexpected(w.error());
        }
        o.done = o.length;
        return o.length;
      case op_kind::fsync:
        if (auto s = h.sync_all(); !s) return std::unexpected(s.error());  // never retried
        return 0;
      case op_kind::fdatasync:
        if (auto s = h.sync_data(); !s) return std::unexpected(s.error());
        return 0;
      case op_kind::task:
        return o.task();
    }
    return errc_error(std::errc::invalid_argument);
  }

  // A read on its submitting thread goes through the thread's own description of the file
  // once it has one (options::reader_descriptions): no reference count shared with the
  // other threads' preads. Writes and syncs keep the file's descriptor, whose errors the
  // kernel reports to it.
  result<std::size_t> run_here(op& o) noexcept override {
    if (o.kind == op_kind::read) {
      if (const io::file_handle* own = reader_of(context(), o)) return read_through(*own, o);
    }
    return run(o);
  }
};

}  // namespace

unsigned descriptor_share() noexcept {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur == RLIM_INFINITY) return std::numeric_limits<unsigned>::max();
  return static_cast<unsigned>(std::min<rlim_t>(r.rlim_cur / 32, UINT32_MAX));
}

std::unique_ptr<engine> make_posix_engine(engine_context& c) noexcept {
  return std::unique_ptr<engine>(new (std::nothrow) posix_engine(c));
}

}  // namespace keel::aio::detail
