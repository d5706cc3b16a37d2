// keel::aio under the harness: a writer puts versions of 64 blocks through a controller (the
// write-back cache on, by default), fsyncing now and then, and records in shared memory what
// each successful fsync made durable. After a kill, a power cut or failed operations, every
// 512-byte sector of a block must hold the version its last successful fsync covered, or a
// later one: a write-out that failed is reported by the next fsync, never lost silently.
// Writers may also use any engine with writes in flight (mixed), and fork children while
// they do (fork): a child must be refused the inherited controller and must never run the
// parent's requests, so a writer that closed cleanly left every block exactly at its last
// acknowledged version.

#include "cache_workload.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <sys/wait.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

#include "keel/aio/controller.hpp"
#include "keel/aio/file.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::torture::detail {

namespace {

constexpr std::size_t blocks = 64;
constexpr std::size_t block_size = 4096;
constexpr std::size_t sector = 512;

// What the writers know, in memory their parent can read after they died.
struct cache_oracle {
  std::atomic<std::uint32_t> durable[blocks];  // version the last good fsync covered (0: none)
  std::atomic<std::uint32_t> last[blocks];     // the last acknowledged version (0: none)
  std::atomic<std::uint32_t> fsyncs_ok;
  std::atomic<std::uint32_t> fsyncs_failed;
  std::atomic<std::uint32_t> writers_closed;     // writers whose every request succeeded
  std::atomic<std::uint32_t> writers_unclean;    // writers with a request failed
  std::atomic<std::uint32_t> children_wrong;     // forked children that saw a broken promise
  std::atomic<std::uint32_t> child_first_wrong;  // the first one's exit code
};

// Block `b` at version `v`: every 8-byte word says (b, v), so any sector read back names the
// write it came from.
void fill(std::vector<std::byte>& buf, std::uint32_t b, std::uint32_t v) {
  const std::uint64_t word = (std::uint64_t{b} << 32) | v;
  for (std::size_t k = 0; k < buf.size(); k += sizeof word)
    std::memcpy(buf.data() + k, &word, sizeof word);
}

}  // namespace

cache_run::cache_run() {
  void* p = ::mmap(nullptr, sizeof(cache_oracle), PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::abort();
  oracle_ = new (p) cache_oracle{};
}

cache_run::~cache_run() {
  ::munmap(oracle_, sizeof(cache_oracle));
}

namespace {

// A forked child of a writer with requests in flight on `f` (of `c`): the inherited
// controller must refuse it, a receipt of the parent's must not be run here, and a
// controller of its own must work. Its exit code: 0, or what went wrong.
int forked_child(aio::controller& c, aio::file& f, const std::deque<aio::receipt>& in_flight,
                 const std::string& path, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> buf(block_size);
  fill(buf, 0, 0);
  const auto refused = [](const auto& r) {
    return !r && r.error() == keel::errc::inherited_across_fork;
  };
  if (!refused(f.write(0, buf).wait())) return 10;
  if (!refused(f.fsync().wait())) return 11;
  if (!in_flight.empty()) {
    const auto r = in_flight.back().wait();
    if (!r && !refused(r)) return 12;  // done before the fork (its outcome), else refused
  }
  if (rng() % 2 == 0) {
    if (f.close()) return 13;
  }
  if (rng() % 2 == 0) c.stop();
#if defined(__SANITIZE_THREAD__)
  // ThreadSanitizer cannot run threads started after a fork of a process with threads.
  return 0;
#endif
  aio::options o;
  o.engine = random_writer(rng()).engine;
  auto mine = aio::controller::start(o);
  if (!mine) return 14;
  aio::open_options how;
  how.write = true;
  how.create = true;
  how.cache = rng() % 2 == 0;
  auto g = (*mine)->open(path + ".child", how);
  if (!g) return 15;
  fill(buf, 1, 1);
  std::vector<std::byte> back(block_size);
  if (!g->write(0, buf).wait() || !g->fsync().wait()) return 16;
  if (g->read(0, back).wait().value_or(0) != block_size || back != buf) return 17;
  return 0;
}

}  // namespace

aio_writer random_writer(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  aio_writer w;
  const aio::engine_kind kinds[] = {aio::engine_kind::io_uring, aio::engine_kind::posix,
                                    aio::engine_kind::stdio};
  w.engine = kinds[rng() % 3];
  if (w.engine == aio::engine_kind::io_uring) {
    aio::options o;
    o.engine = w.engine;
    o.workers = 1;
    if (!aio::controller::start(o)) w.engine = aio::engine_kind::posix;  // not here
  }
  w.cache = rng() % 2 == 0;
  const aio::submitter subs[] = {aio::submitter::adaptive, aio::submitter::caller,
                                 aio::submitter::workers};
  w.submit_on = subs[rng() % 3];
  w.window = 1 + static_cast<unsigned>(rng() % 8);
  return w;
}

int cache_run::write(const std::string& path, io::filesystem& fs, std::uint64_t seed, int rounds,
                     const aio_writer& how) {
  auto& o = *static_cast<cache_oracle*>(oracle_);
  aio::options opts;
  opts.fs = &fs;
  opts.engine = how.engine;
  opts.workers = 1;
  opts.submit_on = how.submit_on;
  auto c = aio::controller::start(opts);
  if (!c) return 0;  // failed on purpose: nothing promised
  aio::open_options open_how;
  open_how.write = true;
  open_how.create = true;
  open_how.cache = how.cache;
  auto f = (*c)->open(path, open_how);
  if (!f) return 0;
  // A new file's name is durable once its directory is synced: until then, nothing is
  // promised (an fsync of the file does not make its name survive a power cut).
  const std::string dir = path.substr(0, path.rfind('/'));
  if (!io::sync_directory(fs, dir.c_str())) return 0;
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> written(blocks, 0);
  std::vector<std::uint32_t> since_fsync;  // blocks written since the last fsync call
  // The writes in flight, oldest first, each with its buffer, block and version.
  struct in_flight {
    aio::receipt r;
    std::vector<std::byte> buf;
    std::uint32_t block;
    std::uint32_t version;
  };
  std::deque<in_flight> window;
  std::vector<pid_t> children;
  bool clean = true;
  // The oldest write's end: acknowledged (recorded), or failed (nothing promised).
  const auto retire = [&] {
    in_flight& w = window.front();
    if (w.r.wait()) {
      written[w.block] = w.version;
      o.last[w.block].store(w.version);
      since_fsync.push_back(w.block);
    } else {
      clean = false;
    }
    window.pop_front();
  };
  std::uint32_t version = 0;
  for (int i = 0; i < rounds; ++i) {
    const auto b = how.first_block + static_cast<std::uint32_t>(rng() % how.block_count);
    if (window.size() >= how.window) retire();
    in_flight w{{}, std::vector<std::byte>(block_size), b, ++version};
    fill(w.buf, b, w.version);
    w.r = f->write(std::uint64_t{b} * block_size, w.buf);
    window.push_back(std::move(w));
    if (how.fork_every != 0 && i % how.fork_every == how.fork_every - 1) {
      std::deque<aio::receipt> receipts;
      for (const auto& x : window)
        receipts.push_back(x.r);
      const std::uint64_t child_seed = rng();
      // exit(): destructors and atexit run (not under AddressSanitizer, whose leak check at
      // exit reports the parent's memory and can hang stopping threads that are not there).
      bool plain_exit = rng() % 3 == 0;
#if defined(__SANITIZE_ADDRESS__)
      plain_exit = false;
#endif
      std::fflush(nullptr);
      const pid_t pid = ::fork();
      if (pid == 0) {
        const int code = forked_child(**c, *f, receipts, path, child_seed);
        if (code != 0 && o.children_wrong.fetch_add(1) == 0) o.child_first_wrong.store(code);
        if (plain_exit) std::exit(code);
        ::_exit(code);
      }
      if (pid > 0) children.push_back(pid);
    }
    if (rng() % 8 == 0) {
      while (!window.empty())
        retire();
      auto r = f->fsync().wait();
      if (r) {
        for (std::uint32_t x : since_fsync)
          o.durable[x].store(written[x]);
        o.fsyncs_ok.fetch_add(1);
      } else {
        o.fsyncs_failed.fetch_add(1);  // those writes may be gone: nothing promised
        clean = false;
      }
      since_fsync.clear();
    }
  }
  while (!window.empty())
    retire();
  for (const pid_t pid : children) {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      if (o.children_wrong.fetch_add(1) == 0) {
        o.child_first_wrong.store(WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
      }
    }
  }
  const bool closed = static_cast<bool>(f->close());
  (clean && closed ? o.writers_closed : o.writers_unclean).fetch_add(1);
  return 0;
}

std::optional<std::string> cache_run::check(const std::string& path, bool closed_exactly) const {
  const auto& o = *static_cast<const cache_oracle*>(oracle_);
  if (o.children_wrong.load() != 0) {
    return std::to_string(o.children_wrong.load()) +
           " forked children saw a broken promise (the first exited " +
           std::to_string(o.child_first_wrong.load()) + ")";
  }
  // Every writer closed cleanly: each block holds exactly its last acknowledged version.
  const bool exact =
      closed_exactly && o.writers_unclean.load() == 0 && o.writers_closed.load() != 0;
  auto f = io::file_handle::open(path.c_str(), io::open_flags::read);
  std::vector<std::byte> buf(block_size);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::uint32_t promised = exact ? o.last[b].load() : o.durable[b].load();
    if (promised == 0) continue;
    if (!f) return "the data file is gone, though fsync succeeded: " + f.error().message();
    std::fill(buf.begin(), buf.end(), std::byte{0});
    (void)f->read_at(static_cast<off_t>(std::uint64_t{b} * block_size), buf);
    for (std::size_t s = 0; s < block_size; s += sector) {
      std::uint64_t word = 0;
      std::memcpy(&word, buf.data() + s, sizeof word);
      const auto got_block = static_cast<std::uint32_t>(word >> 32);
      const auto got_version = static_cast<std::uint32_t>(word);
      if (got_block != b || got_version < promised || (exact && got_version != promised)) {
        return "block " + std::to_string(b) + " sector " + std::to_string(s / sector) +
               ": version " + std::to_string(got_version) + " of block " +
               std::to_string(got_block) + " where a successful fsync promised version " +
               std::to_string(promised) + (exact ? " exactly (" : " or later (") +
               std::to_string(o.fsyncs_ok.load()) + " fsyncs ok, " +
               std::to_string(o.fsyncs_failed.load()) + " failed)";
      }
    }
  }
  return std::nullopt;
}

}  // namespace keel::torture::detail
