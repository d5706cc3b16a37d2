// Writes the seed inputs of each harness (fuzz/corpus/<name>/seed-*) from files the real code
// makes: a lock log with released, live and multi-record chunks, a memory_map lock file page
// (live and degraded) and its map's header; and a few scripted slot-table runs. Run it again
// when a format changes (its header no longer matches the seeds):
//   build/debug/bin/fuzz_make_seeds fuzz/corpus

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "keel/lock/atomic_append.hpp"
#include "keel/lock/memory_map.hpp"
#include "kv/format.hpp"
#include "lock/memory_map/format.hpp"

namespace {

using namespace keel;
using bytes = std::vector<std::uint8_t>;
namespace fs = std::filesystem;
using lock::entity;

bytes read_file(const std::string& path, std::size_t at_most = ~std::size_t{0}) {
  std::ifstream in(path, std::ios::binary);
  bytes b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (b.size() > at_most) b.resize(at_most);
  return b;
}

bytes cat(bytes a, const bytes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

void write_seed(const fs::path& dir, const std::string& name, const bytes& b) {
  fs::create_directories(dir);
  std::ofstream out(dir / ("seed-" + name), std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  if (!out) {
    std::fprintf(stderr, "cannot write %s\n", (dir / name).c_str());
    std::exit(1);
  }
}

[[noreturn]] void fail(const char* what, const error& e) {
  std::fprintf(stderr, "%s: %s\n", what, e.message().c_str());
  std::exit(1);
}

// A log with a released chunk, a shared and an exclusive live one (their owner, this
// process, is dead by the time the seeds are used), and a chunk of two records.
bytes make_log(const std::string& path) {
  auto m = lock::atomic_append::open(path);
  if (!m) fail("atomic_append::open", m.error());
  auto locked = [&](std::vector<entity> set) {
    auto g = (*m)->lock(set);
    if (!g) fail("atomic_append lock", g.error());
    return std::move(*g);
  };
  (void)locked({entity(0), entity(1, false), entity(2)}).unlock();
  locked({entity(3, false)}).release();
  locked({entity(4)}).release();
  std::vector<entity> many;
  for (std::uint64_t v = 5; v < 35; ++v)
    many.push_back(entity(v, v % 2 == 0));
  locked(many).release();
  return read_file(path);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR (fuzz/corpus)\n", argv[0]);
    return 2;
  }
  const fs::path out = argv[1];
  std::string tmpl = "/dev/shm/keel-seeds.XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) return 1;
  const fs::path tmp = tmpl;

  // ---- atomic_append ----
  const bytes log = make_log((tmp / "log").string());
  const bytes header_only(log.begin(), log.begin() + 4096);
  const bytes records(log.begin() + 4096, log.end());
  // aa_log: how (bit 0: wait 5 ms, bit 1: spin), entity count - 1, entities (value % 8, bit 7
  // exclusive), then the file.
  write_seed(out / "aa_log", "log-try-exclusive-3", cat({0, 0, 0x83}, log));
  write_seed(out / "aa_log", "log-wait-shared-3", cat({1, 0, 0x03}, log));
  write_seed(out / "aa_log", "log-spin-all", cat({3, 7, 0x80, 1, 0x82, 3, 0x84, 5, 0x86, 7}, log));
  write_seed(out / "aa_log", "log-released-only",
             cat({0, 1, 0x80, 0x81}, bytes(log.begin(), log.begin() + 4096 + 256)));
  write_seed(out / "aa_log", "header-only", cat({0, 0, 0x80}, header_only));
  write_seed(out / "aa_log", "empty-file", {0, 0, 0x80});
  // aa_chunk: a 4-byte bit selector, then records.
  write_seed(out / "aa_chunk", "released", cat({0, 0, 0, 0}, records));
  write_seed(out / "aa_chunk", "two-records",
             cat({0x40, 0x12, 0, 0}, bytes(records.begin() + 3 * 256, records.end())));
  write_seed(out / "aa_chunk", "live-shared",
             cat({0x41, 0x00, 0x01, 0}, bytes(records.begin() + 256, records.begin() + 512)));

  // ---- memory_map ----
  lock::memory_map::options o;
  o.map_directory = tmp.string();
  const std::string mm_path = (tmp / "mm").string();
  auto mm = lock::memory_map::open(mm_path, o);
  if (!mm) fail("memory_map::open", mm.error());
  if (auto g = (*mm)->lock({entity(1)}); !g) fail("memory_map lock", g.error());
  const bytes page = read_file(mm_path, lock::memory_map_detail::lockfile_page);
  auto state = lock::memory_map_detail::parse_lock_file(std::as_bytes(std::span(page)));
  if (!state) fail("parse_lock_file", state.error());
  const bytes map_head = read_file(state->map_path, 256);
  o.force_fallback = true;
  const std::string degraded_path = (tmp / "mm-degraded").string();
  auto degraded = lock::memory_map::open(degraded_path, o);
  if (!degraded) fail("memory_map::open (fallback)", degraded.error());
  const bytes degraded_page = read_file(degraded_path, lock::memory_map_detail::lockfile_page);

  write_seed(out / "mm_lock_file", "live", page);
  write_seed(out / "mm_lock_file", "degraded", degraded_page);
  write_seed(out / "mm_lock_file", "header-only", bytes(page.begin(), page.begin() + 256));
  write_seed(out / "mm_lock_file", "blank", bytes(4096, 0));
  write_seed(out / "mm_lock_file", "map-name",
             bytes(lock::memory_map_detail::map_name_prefix.begin(),
                   lock::memory_map_detail::map_name_prefix.end()));
  write_seed(out / "format_header", "lock-file", bytes(page.begin(), page.begin() + 32));
  write_seed(out / "format_header", "map", bytes(map_head.begin(), map_head.begin() + 32));
  write_seed(out / "format_header", "log", bytes(log.begin(), log.begin() + 32));
  write_seed(out / "format_header", "zeros", bytes(24, 0));

  // ---- the slot table (fuzz/mm_slot_table.cpp decodes these) ----
  // Ours: users 0 and 1, nothing scribbled. 0 takes slot 0 exclusively, 1 sleeps on it (long
  // since: a hand-over), 0 gives it back, 1 takes it, gives everything back.
  write_seed(out / "mm_slot_table", "hand-over",
             {1, 0, 1, 0, /**/ 0, 0x80, 0, /**/ 1, 0xc2, 0, /**/ 0, 0x81, 0, /**/ 1, 0x00, 0,
              /**/ 1, 11, 0});
  // Ours: user 1023. Scribbled: slot 4095's writer is user 1022, 1021 reads it. 1023 tries
  // shared and exclusive, sleeps, the dead writer and reader are cleared (which wakes it),
  // 1023 takes the slot and gives it back.
  write_seed(out / "mm_slot_table", "dead-holders",
             {0,      15,   2,      /**/ 2, 7,    14,     /**/ 3, 7,      13,
              /**/ 0, 0x00, 7,      /**/ 0, 0x80, 7,
              /**/ 0, 0x82, 7,      /**/ 0, 6,    7,      14,     /**/ 0, 6,
              7,      13,   /**/ 0, 0x00,   7,    /**/ 0, 11,     7});
  // Ours: users 63 and 64. Scribbled: slot 3's spin budget is an hour. 64 takes slot 3
  // exclusively, 63 spins for it with no deadline (the budget must be bounded to end it).
  write_seed(out / "mm_slot_table", "spin-budget-of-an-hour",
             {1,      5,    6,    1,      /**/ 7, 9, 3,      0, 0x00, 0xa0, 0xb8,   0x30, 0x46,
              0x03,   0x00, 0x00,
              /**/ 1, 0x80, 3,    /**/ 0, 0x89,   3, /**/ 0, 4, 3,    2,    /**/ 1, 11,   3});

  // ---- keel::kv's blocks and headers (fuzz/kv_block.cpp, fuzz/kv_headers.cpp) ----
  {
    namespace f = kv::disk;
    constexpr std::uint64_t salt = 0x0123456789abcdefULL;
    const auto salted = [&](const std::vector<std::byte>& block) {
      bytes b(8);
      std::memcpy(b.data(), &salt, 8);
      for (const std::byte x : block)
        b.push_back(static_cast<std::uint8_t>(x));
      return b;
    };
    const std::string k1 = "key", v1 = "a value of some length", k2 = "gone";
    f::record_in put;
    put.key = std::as_bytes(std::span(k1.data(), k1.size()));
    put.value = std::as_bytes(std::span(v1.data(), v1.size()));
    put.prev = f::make_location(1, 4096);
    put.prev_seq = 3;
    f::record_in erase;
    erase.key = std::as_bytes(std::span(k2.data(), k2.size()));
    erase.what = f::op::erase;
    f::record_in blob;
    blob.key = put.key;
    blob.what = f::op::put_blob;
    blob.blob = {f::make_location(2, 4096), 77};
    blob.value_length = 100000;
    const std::vector<f::record_in> three{put, erase, blob};
    std::vector<std::byte> commit(f::block_size(three));
    f::encode_block(commit, f::block_kind::commit, 4, three, salt);
    write_seed(out / "kv_block", "commit", salted(commit));
    put.seq = 2;
    std::vector<std::byte> moved(f::block_size(std::span(&put, 1)));
    f::encode_block(moved, f::block_kind::relocation, 0, std::span(&put, 1), salt);
    write_seed(out / "kv_block", "relocation", salted(moved));
    std::vector<std::byte> value(21, std::byte{0x5a});
    std::vector<std::byte> blob_block(f::blob_block_size(value.size()));
    f::encode_blob_block(blob_block, value, salt);
    write_seed(out / "kv_block", "blob", salted(blob_block));
    std::vector<std::byte> pad(96);
    f::encode_pad_block(pad, salt);
    write_seed(out / "kv_block", "pad", salted(pad));

    f::store_params p;
    p.id = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    p.salt = salt;
    const auto store_file = f::encode_store_file(p);
    write_seed(out / "kv_headers", "store-file",
               bytes(reinterpret_cast<const std::uint8_t*>(store_file.data()),
                     reinterpret_cast<const std::uint8_t*>(store_file.data()) + store_file.size()));
    const auto seg = f::encode_segment_header({p.id, 5, f::default_segment_size}, salt);
    // The header, then the salt (the harness takes it from the input's last 8 bytes).
    bytes seg_seed(reinterpret_cast<const std::uint8_t*>(seg.data()),
                   reinterpret_cast<const std::uint8_t*>(seg.data()) + seg.size());
    seg_seed.resize(seg.size() + 8);
    std::memcpy(seg_seed.data() + seg.size(), &salt, 8);
    write_seed(out / "kv_headers", "segment-header", seg_seed);
  }

  std::error_code ec;
  fs::remove_all(tmp, ec);
  std::printf("seeds written under %s\n", out.c_str());
  return 0;
}
