// keel io micro-benchmarks: each keel wrapper against the raw syscall it wraps, in one run, on
// one file, so the report can quote ratios (raw time / keel time: 1.0 means no overhead).
// Each pair runs in alternating blocks (see run_paired) and reports counters keel_ns and
// peer_ns, the median time per call of each side.
//
//   io/byte_lock         exclusive OFD lock + unlock of one byte, uncontended, vs raw fcntl
//   io/read_at_4k        4 KiB read at a random 4 KiB-aligned offset of a 64 MiB file, vs pread
//   io/write_at_4k       4 KiB write likewise, vs pwrite
//   io/timed_lock_1ms/keel   a 1 ms timed wait on a held lock: how close to 1 ms it returns
//
// Usage: keel_bench_io [Google Benchmark flags] [--dir=PATH]   (default: /dev/shm, else $TMPDIR)

#include <fcntl.h>
#include <unistd.h>

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "keel/io/byte_lock.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"

namespace {

using keel::io::file_handle;

std::string bench_dir;
constexpr std::size_t file_size = 64u << 20;
constexpr std::size_t block = 4096;

file_handle open_file(const char* name) {
  const std::string path = bench_dir + "/" + name;
  auto f = file_handle::open(path.c_str(),
                             keel::io::open_flags::read_write | keel::io::open_flags::create);
  if (!f) {
    std::fprintf(stderr, "keel_bench_io: cannot open %s: %s\n", path.c_str(),
                 f.error().message().c_str());
    std::exit(1);
  }
  return std::move(*f);
}

// One data file shared by the read and write benchmarks, filled once so reads hit real pages.
const file_handle& data_file() {
  static file_handle f = [] {
    file_handle h = open_file("io-bench.data");
    std::vector<std::byte> chunk(1 << 20, std::byte{0x5a});
    for (std::size_t at = 0; at < file_size; at += chunk.size()) {
      if (!h.write_at(static_cast<off_t>(at), chunk)) std::exit(1);
    }
    return h;
  }();
  return f;
}

// The same offsets for keel and raw: a fixed-seed sequence of aligned blocks.
std::vector<off_t> offsets() {
  std::mt19937_64 rng(42);
  std::vector<off_t> v(4096);
  for (auto& o : v)
    o = static_cast<off_t>((rng() % (file_size / block)) * block);
  return v;
}

// Times `keel_op` and `peer_op` in alternating blocks of `block_ops` calls (keel first on even
// iterations, peer first on odd ones), so both see the same machine state from one
// microsecond to the next; a burst of noise hits both sides instead of one. Reports the
// median nanoseconds per call of each side as counters keel_ns and peer_ns.
template <class KeelOp, class PeerOp>
void run_paired(benchmark::State& state, KeelOp keel_op, PeerOp peer_op) {
  constexpr int block_ops = 32;
  std::vector<double> keel_ns;
  std::vector<double> peer_ns;
  bool ok = true;
  const auto time_block = [&](auto& op, std::vector<double>& out) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < block_ops; ++i)
      ok &= op();
    const auto t1 = std::chrono::steady_clock::now();
    out.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / block_ops);
  };
  bool keel_first = true;
  for (auto _ : state) {
    if (keel_first) {
      time_block(keel_op, keel_ns);
      time_block(peer_op, peer_ns);
    } else {
      time_block(peer_op, peer_ns);
      time_block(keel_op, keel_ns);
    }
    keel_first = !keel_first;
  }
  if (!ok) {
    state.SkipWithError("an operation failed");
    return;
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  state.counters["keel_ns"] = median(keel_ns);
  state.counters["peer_ns"] = median(peer_ns);
  state.SetItemsProcessed(state.iterations() * 2 * block_ops);
}

void byte_lock_pair(benchmark::State& state) {
  file_handle f = open_file("io-bench.lock");
  const auto keel_op = [&] {
    auto g = keel::io::lock_extent(f, 0, 1, keel::io::lock_kind::exclusive);
    return g.has_value();  // the guard unlocks here
  };
  const auto peer_op = [&] {
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = 0;
    fl.l_len = 1;
    if (::fcntl(f.fd(), F_OFD_SETLKW, &fl) != 0) return false;
    fl.l_type = F_UNLCK;
    return ::fcntl(f.fd(), F_OFD_SETLK, &fl) == 0;
  };
  run_paired(state, keel_op, peer_op);
}

void read_pair(benchmark::State& state) {
  const file_handle& f = data_file();
  const auto offs = offsets();
  std::vector<std::byte> buf(block);
  std::size_t i = 0;
  std::size_t j = 0;
  const auto keel_op = [&] {
    auto n = f.read_at(offs[i++ % offs.size()], buf);
    return n && *n == block;
  };
  const auto peer_op = [&] {
    return ::pread(f.fd(), buf.data(), block, offs[j++ % offs.size()]) ==
           static_cast<ssize_t>(block);
  };
  run_paired(state, keel_op, peer_op);
}

void write_pair(benchmark::State& state) {
  const file_handle& f = data_file();
  const auto offs = offsets();
  std::vector<std::byte> buf(block, std::byte{0x33});
  std::size_t i = 0;
  std::size_t j = 0;
  const auto keel_op = [&] { return f.write_at(offs[i++ % offs.size()], buf).has_value(); };
  const auto peer_op = [&] {
    return ::pwrite(f.fd(), buf.data(), block, offs[j++ % offs.size()]) ==
           static_cast<ssize_t>(block);
  };
  run_paired(state, keel_op, peer_op);
}

void timed_lock_1ms(benchmark::State& state) {
  file_handle holder = open_file("io-bench.timed");
  file_handle waiter = open_file("io-bench.timed");
  auto held = keel::io::lock_extent(holder, 0, 1, keel::io::lock_kind::exclusive);
  if (!held) {
    state.SkipWithError("cannot take the lock to wait on");
    return;
  }
  for (auto _ : state) {
    auto r = keel::io::lock_extent(waiter, 0, 1, keel::io::lock_kind::exclusive,
                                   std::chrono::milliseconds(1));
    if (r || r.error() != std::errc::timed_out) state.SkipWithError("expected timed_out");
  }
}

}  // namespace

BENCHMARK(byte_lock_pair)->Name("io/byte_lock");
BENCHMARK(read_pair)->Name("io/read_at_4k");
BENCHMARK(write_pair)->Name("io/write_at_4k");
BENCHMARK(timed_lock_1ms)->Name("io/timed_lock_1ms/keel");

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--dir=", 6) == 0) {
      bench_dir = argv[i] + 6;
    } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::printf("usage: keel_bench_io [Google Benchmark flags] [--dir=PATH]\n");
      return 0;
    } else {
      std::fprintf(stderr, "keel_bench_io: unknown argument %s (try --help)\n", argv[i]);
      return 2;
    }
  }
  if (bench_dir.empty()) {
    auto shm = keel::io::stat_fs("/dev/shm");
    const char* tmp = std::getenv("TMPDIR");
    bench_dir = shm && shm->type == keel::io::fs_type::tmpfs ? "/dev/shm" : tmp ? tmp : "/tmp";
  }
  auto fs = keel::io::stat_fs(bench_dir.c_str());
  if (!fs) {
    std::fprintf(stderr, "keel_bench_io: %s: %s\n", bench_dir.c_str(),
                 fs.error().message().c_str());
    return 1;
  }
  benchmark::AddCustomContext("keel_dir", bench_dir);
  benchmark::AddCustomContext("keel_fs", std::string(fs->type_name()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (const char* name : {"io-bench.data", "io-bench.lock", "io-bench.timed"}) {
    (void)keel::io::unlink((bench_dir + "/" + name).c_str());
  }
  return 0;
}
