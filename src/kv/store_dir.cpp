// A store's directory (store_dir.hpp, doc/kv-format.md "Files"): made whole or not at all,
// opened and checked to be keel's, its store file's parameters read. Owns the store file.

#include "kv/store_dir.hpp"

#include <sys/random.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>

#include "keel/io/fs_info.hpp"
#include "kv/index_file.hpp"

namespace keel::kv {
namespace {

// What a crashed creator may leave beside nothing else: its temporary store file.
constexpr std::string_view temp_prefix = ".keel-kv.";

bool is_creators_leftover(const io::directory_entry& e) noexcept {
  return e.name.starts_with(temp_prefix);
}

result<void> fill_random(std::span<std::uint8_t> out) noexcept {
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::getrandom(out.data() + done, out.size() - done, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return last_errno_error();
    }
    done += static_cast<std::size_t>(n);
  }
  return {};
}

result<disk::store_params> read_store_file(const io::file_handle& f) noexcept {
  std::array<std::byte, disk::store_file_size> page{};
  auto n = f.read_at(0, page);
  if (!n) return std::unexpected(n.error());
  auto p = disk::parse_store_file(std::span(page).first(*n));
  if (!p) return std::unexpected(p.error().about(f.shared_path()));
  return p;
}

// Writes a new store file under a temporary name and links it into place. file_exists:
// another creator was first (its store is the one to open).
// The segment size a new store in `dir` gets when its options leave it to the store: a
// 1024th of the volume, a power of two from 1 MiB to 64 MiB. The room kept for deletes and
// compaction (two segments) is then 0.2 % of a volume of 1 GiB or more. And large enough
// that half the segment table holds the whole volume, up to 1 GiB: at 64 MiB the table's
// 8064 segments held 504 GiB, and a store on a 1 TiB volume would have failed with
// file_too_large half full.
std::uint64_t segment_size_of_volume(std::uint64_t total_bytes) noexcept {
  std::uint64_t size = disk::min_segment_size;
  while (size < disk::default_segment_size && size * 2 <= total_bytes / 1024)
    size *= 2;
  while (size < disk::max_segment_size && size * (segtab_entries / 2) < total_bytes)
    size *= 2;
  return size;
}

result<std::uint64_t> segment_size_for(io::filesystem& fs, const io::file_handle& dir) noexcept {
  auto info = fs.statfs(dir);
  if (!info) return std::unexpected(info.error());
  return segment_size_of_volume(info->total_bytes);
}

result<disk::store_params> create_store_file(io::filesystem& fs, const io::file_handle& dir,
                                             const store_dir_options& o) noexcept {
  disk::store_params p;
  p.segment_size = o.segment_size;
  if (p.segment_size == 0) {
    auto chosen = segment_size_for(fs, dir);
    if (!chosen) return std::unexpected(chosen.error());
    p.segment_size = *chosen;
    // Chosen for the volume, it is what segments grow to: a new store starts small.
    p.first_segment_size = disk::min_first_segment_size;
  }
  p.created_ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  if (auto r = fill_random(p.id); !r) return std::unexpected(r.error());
  while (p.salt == 0) {  // 0 is not a salt (the format refuses it)
    std::array<std::uint8_t, 8> salt{};
    if (auto r = fill_random(salt); !r) return std::unexpected(r.error());
    std::memcpy(&p.salt, salt.data(), salt.size());
  }
  const auto bytes = disk::encode_store_file(p);
  auto t = io::make_temp_file(dir, temp_prefix, io::open_flags::read_write, 0644);
  if (!t) return std::unexpected(t.error());
  auto written = t->file.write_at(0, bytes);
  if (written) written = t->file.sync_all();
  if (written) written = t->link_as(dir, store_file_name);
  (void)t->remove_name(dir);
  if (!written) return std::unexpected(written.error());
  if (auto s = dir.sync_all(); !s) return std::unexpected(s.error());
  return p;
}

}  // namespace

std::optional<std::uint64_t> segment_number_of(std::string_view name) noexcept {
  if (name.size() != 16) return std::nullopt;
  std::uint64_t n = 0;
  for (const char c : name) {
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (digit < 0) return std::nullopt;
    n = n << 4 | static_cast<std::uint64_t>(digit);
  }
  if (n == 0 || n > disk::max_segment_number) return std::nullopt;
  return n;
}

result<std::uint64_t> new_store_segment_size(const std::string& path,
                                             const store_dir_options& options) noexcept {
  if (options.segment_size != 0) return options.segment_size;
  io::filesystem& fs = options.fs != nullptr ? *options.fs : io::os();
  // The volume the store would be made on: the path's, or its nearest existing parent's.
  std::string at = path;
  for (;;) {
    auto info = fs.statfs(at.c_str());
    if (info) return segment_size_of_volume(info->total_bytes);
    if (info.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(info.error().about(at));
    }
    const std::size_t slash = at.find_last_of('/');
    if (slash == std::string::npos) {
      at = ".";
    } else if (slash == 0) {
      at = "/";
    } else {
      at.resize(slash);
    }
  }
}

result<store_dir> open_store_dir(const std::string& path,
                                 const store_dir_options& options) noexcept {
  io::filesystem& fs = options.fs != nullptr ? *options.fs : io::os();
  if (options.segment_size != 0 && (options.segment_size < disk::min_segment_size ||
                                    options.segment_size > disk::max_segment_size ||
                                    (options.segment_size & (options.segment_size - 1)) != 0)) {
    return errc_error(std::errc::invalid_argument);
  }
  if (options.create_if_missing) {
    if (auto m = fs.make_directory(nullptr, path.c_str(), 0755);
        !m && m.error() != std::errc::file_exists) {
      return std::unexpected(m.error().about(path));
    }
  }
  store_dir out;
  auto d = io::file_handle::open_directory(fs, path.c_str());
  if (!d) return std::unexpected(d.error().about(path));
  out.dir = std::move(*d);
  for (;;) {
    // (Never blocking: a FIFO at the name is somebody's, refused as not a store.)
    auto f = io::file_handle::open_at(
        out.dir, store_file_name,
        io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
    if (f) {
      if (options.error_if_exists) return errc_error(std::errc::file_exists);
      auto p = read_store_file(*f);
      if (!p) return std::unexpected(p.error());
      out.params = *p;
      break;
    }
    if (f.error() != std::errc::no_such_file_or_directory) {
      return std::unexpected(f.error().about(path + "/" + store_file_name));
    }
    // No store file: a store only if the directory holds nothing else (but what a crashed
    // creator of this store left: its temporary store file; the store file is linked before
    // anything else is made). Anything else is somebody's, and stays untouched, even one
    // named as a store's own (`seg`, `manifest`).
    auto entries = fs.list_directory(out.dir);
    if (!entries) return std::unexpected(entries.error());
    // A racing creator linked it since we looked (and may have made `seg` since, listed
    // before it): open that. Only then is anything else somebody's.
    if (std::ranges::any_of(*entries, [](const auto& e) { return e.name == store_file_name; })) {
      continue;
    }
    if (!std::ranges::all_of(*entries, [](const auto& e) { return is_creators_leftover(e); })) {
      return std::unexpected(error(errc::not_keel_file).about(path));
    }
    if (!options.create_if_missing) return errc_error(std::errc::no_such_file_or_directory);
    auto made = create_store_file(fs, out.dir, options);
    if (made) {
      out.params = *made;
      out.created = true;
      break;
    }
    if (made.error() != std::errc::file_exists) return std::unexpected(made.error());
    // Another creator linked its store file first: open that one.
  }
  // Made unless there (a creator killed before it made it): looked for first, so that a
  // reader that may not write the directory opens a store that has it.
  const auto open_segments = [&] {
    return io::file_handle::open_at(
        out.dir, segments_dir_name,
        io::open_flags::read | io::open_flags::directory | io::open_flags::no_follow);
  };
  auto named = io::file_handle::open_at(
      out.dir, store_file_name,
      io::open_flags::read | io::open_flags::no_follow | io::open_flags::non_blocking);
  if (!named) return std::unexpected(named.error().about(path + "/" + store_file_name));
  out.store_file = std::move(*named);
  auto seg = open_segments();
  if (!seg && seg.error() == std::errc::no_such_file_or_directory) {
    if (auto m = fs.make_directory(&out.dir, segments_dir_name, 0755);
        !m && m.error() != std::errc::file_exists) {
      return std::unexpected(m.error().about(path + "/" + segments_dir_name));
    }
    seg = open_segments();
  }
  if (!seg) return std::unexpected(seg.error().about(path + "/" + segments_dir_name));
  out.segments = std::move(*seg);
  if (out.created) {
    if (auto s = out.dir.sync_all(); !s) return std::unexpected(s.error());
    // The store's directory is an entry of its parent: durable too, or a power cut could take
    // the whole store after its first `sync` commit returned.
    std::string parent = path;
    while (parent.size() > 1 && parent.back() == '/')
      parent.pop_back();
    const std::size_t slash = parent.find_last_of('/');
    parent = slash == std::string::npos ? "." : slash == 0 ? "/" : parent.substr(0, slash);
    auto up = io::file_handle::open_directory(fs, parent.c_str());
    if (!up) return std::unexpected(up.error().about(parent));
    if (auto s = up->sync_all(); !s) return std::unexpected(s.error().about(parent));
  }
  return out;
}

}  // namespace keel::kv
