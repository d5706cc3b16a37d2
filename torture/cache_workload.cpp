// The aio write-back cache under the harness: a writer puts versions of 64 blocks through a
// controller with the cache on, fsyncing now and then, and records in shared memory what each
// successful fsync made durable. After a kill, a power cut or failed operations, every
// 512-byte sector of a block must hold the version its last successful fsync covered, or a
// later one: a write-out that failed is reported by the next fsync, never lost silently.

#include "cache_workload.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
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

// What the writer knows, in memory its parent can read after it died.
struct cache_oracle {
  std::atomic<std::uint32_t> durable[blocks];  // version the last good fsync covered (0: none)
  std::atomic<std::uint32_t> fsyncs_ok;
  std::atomic<std::uint32_t> fsyncs_failed;
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

int cache_run::write(const std::string& path, io::filesystem& fs, std::uint64_t seed, int rounds) {
  auto& o = *static_cast<cache_oracle*>(oracle_);
  aio::options opts;
  opts.fs = &fs;
  opts.engine = aio::engine_kind::posix;
  opts.workers = 1;
  auto c = aio::controller::start(opts);
  if (!c) return 0;  // failed on purpose: nothing promised
  aio::open_options how;
  how.write = true;
  how.create = true;
  how.cache = true;
  auto f = (*c)->open(path, how);
  if (!f) return 0;
  // A new file's name is durable once its directory is synced: until then, nothing is
  // promised (an fsync of the file does not make its name survive a power cut).
  const std::string dir = path.substr(0, path.rfind('/'));
  if (!io::sync_directory(fs, dir.c_str())) return 0;
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> written(blocks, 0);
  std::vector<std::uint32_t> since_fsync;  // blocks written since the last fsync call
  std::vector<std::byte> buf(block_size);
  std::uint32_t version = 0;
  for (int i = 0; i < rounds; ++i) {
    const auto b = static_cast<std::uint32_t>(rng() % blocks);
    fill(buf, b, ++version);
    // Each write waited for: the buffer is reused.
    if (!f->write(std::uint64_t{b} * block_size, buf).wait()) {
      continue;  // refused or failed: not promised either
    }
    written[b] = version;
    since_fsync.push_back(b);
    if (rng() % 8 == 0) {
      auto r = f->fsync().wait();
      if (r) {
        for (std::uint32_t w : since_fsync)
          o.durable[w].store(written[w]);
        o.fsyncs_ok.fetch_add(1);
      } else {
        o.fsyncs_failed.fetch_add(1);  // those writes may be gone: nothing promised
      }
      since_fsync.clear();
    }
  }
  (void)f->close();
  return 0;
}

std::optional<std::string> cache_run::check(const std::string& path) const {
  const auto& o = *static_cast<const cache_oracle*>(oracle_);
  auto f = io::file_handle::open(path.c_str(), io::open_flags::read);
  std::vector<std::byte> buf(block_size);
  for (std::uint32_t b = 0; b < blocks; ++b) {
    const std::uint32_t promised = o.durable[b].load();
    if (promised == 0) continue;
    if (!f) return "the data file is gone, though fsync succeeded: " + f.error().message();
    std::fill(buf.begin(), buf.end(), std::byte{0});
    (void)f->read_at(static_cast<off_t>(std::uint64_t{b} * block_size), buf);
    for (std::size_t s = 0; s < block_size; s += sector) {
      std::uint64_t word = 0;
      std::memcpy(&word, buf.data() + s, sizeof word);
      const auto got_block = static_cast<std::uint32_t>(word >> 32);
      const auto got_version = static_cast<std::uint32_t>(word);
      if (got_block != b || got_version < promised) {
        return "block " + std::to_string(b) + " sector " + std::to_string(s / sector) +
               ": version " + std::to_string(got_version) + " of block " +
               std::to_string(got_block) + " where a successful fsync promised version " +
               std::to_string(promised) + " or later (" + std::to_string(o.fsyncs_ok.load()) +
               " fsyncs ok, " + std::to_string(o.fsyncs_failed.load()) + " failed)";
      }
    }
  }
  return std::nullopt;
}

}  // namespace keel::torture::detail
