// The fault-injecting filesystem (fault_filesystem.hpp): each operation asks the rules
// (fault_rules.hpp) whether it fails, runs on the target, and tells the durability model
// (durability_model.hpp) what it made or made durable. This file owns only the table of maps
// (each map's path for the rules, its model id for the model).

#include "keel/io/fault_filesystem.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "base/thread_safety.hpp"
#include "io/durability_model.hpp"
#include "io/fault_rules.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::io {

struct fault_filesystem::state {
  explicit state(std::uint64_t seed) : rules(seed) {}

  fault_rules rules;
  durability_model model;

  base::mutex maps_mutex;  // maps
  struct mapping {
    std::byte* address;
    std::size_t length;
    off_t offset;
    std::uint64_t id;  // 0: not modelled
    keel::detail::shared_path path;
  };
  std::vector<mapping> maps KEEL_GUARDED_BY(maps_mutex);
};

fault_filesystem::fault_filesystem(filesystem& target, std::uint64_t seed)
    : filesystem_wrapper(target), state_(std::make_unique<state>(seed)) {}

fault_filesystem::~fault_filesystem() = default;

void fault_filesystem::inject(fault f) {
  state_->rules.add(std::move(f));
}

void fault_filesystem::clear_faults() {
  state_->rules.clear();
}

std::uint64_t fault_filesystem::count(fs_ops ops) const {
  return state_->rules.count(ops);
}

std::uint64_t fault_filesystem::injected() const {
  return state_->rules.injected();
}

result<void> fault_filesystem::track(const std::string& root, const std::string& shadow) {
  return state_->model.track(root, shadow);
}

void fault_filesystem::crash_now() noexcept {
  state_->model.mark_crashed();
  ::kill(::getpid(), SIGKILL);
  for (;;)
    ::pause();
}

result<fault_filesystem::restore_report> fault_filesystem::restore(const std::string& root,
                                                                   const std::string& shadow,
                                                                   const crash_options& options) {
  return durability_model::restore(root, shadow, options);
}

// ---- the operations ----

namespace {

// The path of `name` in `dir`, for matching rules.
std::string path_in(const file_handle* dir, const char* name) {
  if (name == nullptr) return {};
  if (dir == nullptr || dir->path().empty() || name[0] == '/') return name;
  return std::string(dir->path()) + "/" + name;
}

// The directory part of `path` ("." when it has none).
std::string parent_of(const char* path) {
  const std::string p(path);
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::size_t total_of(std::span<const iovec> buffers) noexcept {
  std::size_t n = 0;
  for (const iovec& b : buffers)
    n += b.iov_len;
  return n;
}

// The first `n` bytes of `buffers`, in `out`.
std::span<const iovec> prefix_of(std::span<const iovec> buffers, std::size_t n,
                                 std::vector<iovec>& out) {
  out.clear();
  for (const iovec& b : buffers) {
    if (n == 0) break;
    const std::size_t take = std::min(n, b.iov_len);
    out.push_back({b.iov_base, take});
    n -= take;
  }
  return out;
}

}  // namespace

// A random part of `buffers` through `transfer`, then `error` (0: the short count only).
template <class Transfer>
result<std::size_t> fault_filesystem::partially(int error, std::span<const iovec> buffers,
                                                Transfer&& transfer) noexcept {
  const std::size_t total = total_of(buffers);
  std::size_t part = state_->rules.random_below(total);
  if (error == 0 && part == 0 && total > 1) part = 1;
  if (part != 0) {
    std::vector<iovec> some;
    auto n = transfer(prefix_of(buffers, part, some));
    if (!n || error == 0) return n;
  }
  if (error != 0) return errno_error(error);
  return transfer(buffers);
}

#define KEEL_FAULT_GATE(op, path)                      \
  const auto decided = state_->rules.decide(op, path); \
  if (decided.crash) crash_now();                      \
  if (decided.any() && !decided.partial) return errno_error(decided.error)

result<file_handle> fault_filesystem::open(const file_handle* dir, const char* path,
                                           open_flags flags, mode_t mode) noexcept {
  if (path == nullptr) return errc_error(std::errc::invalid_argument);
  KEEL_FAULT_GATE(fs_op::open, path_in(dir, path));
  state& s = *state_;
  const bool temporary = has(flags, open_flags::temporary);
  const bool creating = has(flags, open_flags::create) || temporary;
  bool existed = !temporary;
  if (s.model.tracking() && creating && !temporary) {
    existed = target().stat_at(dir, path, !has(flags, open_flags::no_follow)).has_value();
  }
  auto f = filesystem_wrapper::open(dir, path, flags, mode);
  if (!f || !s.model.tracking() || !creating || existed) return f;
  // A file was made: modelled if it is in a modelled directory.
  const std::string where = temporary ? std::string(path) : parent_of(path);
  auto parent = target().stat_at(dir, where.c_str(), true);
  auto st = target().stat(*f);
  if (parent && st) s.model.created(*parent, *st);
  return f;
}

result<void> fault_filesystem::link(const file_handle& file, const file_handle* dir,
                                    const char* name) noexcept {
  KEEL_FAULT_GATE(fs_op::link, path_in(dir, name));
  return filesystem_wrapper::link(file, dir, name);
}

result<void> fault_filesystem::link_at(const file_handle* from_dir, const char* from,
                                       const file_handle* to_dir, const char* to) noexcept {
  KEEL_FAULT_GATE(fs_op::link, path_in(to_dir, to));
  return filesystem_wrapper::link_at(from_dir, from, to_dir, to);
}

result<void> fault_filesystem::rename(const file_handle* from_dir, const char* from,
                                      const file_handle* to_dir, const char* to,
                                      rename_mode mode) noexcept {
  KEEL_FAULT_GATE(fs_op::rename, path_in(to_dir, to));
  return filesystem_wrapper::rename(from_dir, from, to_dir, to, mode);
}

result<void> fault_filesystem::unlink(const file_handle* dir, const char* name,
                                      bool directory) noexcept {
  KEEL_FAULT_GATE(fs_op::unlink, path_in(dir, name));
  return filesystem_wrapper::unlink(dir, name, directory);
}

result<void> fault_filesystem::make_directory(const file_handle* dir, const char* name,
                                              mode_t mode) noexcept {
  if (name == nullptr) return errc_error(std::errc::invalid_argument);
  KEEL_FAULT_GATE(fs_op::make_directory, path_in(dir, name));
  auto r = filesystem_wrapper::make_directory(dir, name, mode);
  state& s = *state_;
  if (!r || !s.model.tracking()) return r;
  auto parent = target().stat_at(dir, parent_of(name).c_str(), true);
  auto st = target().stat_at(dir, name, false);
  if (parent && st) s.model.created(*parent, *st);
  return r;
}

result<std::vector<directory_entry>> fault_filesystem::list_directory(
    const file_handle& dir) noexcept {
  KEEL_FAULT_GATE(fs_op::list_directory, dir.path());
  return filesystem_wrapper::list_directory(dir);
}

result<file_status> fault_filesystem::stat_at(const file_handle* dir, const char* name,
                                              bool follow) noexcept {
  KEEL_FAULT_GATE(fs_op::stat, path_in(dir, name));
  return filesystem_wrapper::stat_at(dir, name, follow);
}

result<fs_info> fault_filesystem::statfs(const char* path) noexcept {
  KEEL_FAULT_GATE(fs_op::statfs, path != nullptr ? path : "");
  return filesystem_wrapper::statfs(path);
}

result<std::size_t> fault_filesystem::read(const file_handle& file, off_t offset,
                                           std::span<const iovec> buffers) noexcept {
  KEEL_FAULT_GATE(fs_op::read, file.path());
  const auto transfer = [&](std::span<const iovec> b) {
    return filesystem_wrapper::read(file, offset, b);
  };
  if (decided.partial) return partially(decided.error, buffers, transfer);
  return transfer(buffers);
}

result<std::size_t> fault_filesystem::write(const file_handle& file, off_t offset,
                                            std::span<const iovec> buffers) noexcept {
  KEEL_FAULT_GATE(fs_op::write, file.path());
  const auto transfer = [&](std::span<const iovec> b) {
    return filesystem_wrapper::write(file, offset, b);
  };
  if (decided.partial) return partially(decided.error, buffers, transfer);
  return transfer(buffers);
}

result<appended> fault_filesystem::append(const file_handle& file,
                                          std::span<const iovec> buffers) noexcept {
  KEEL_FAULT_GATE(fs_op::append, file.path());
  if (decided.partial) {
    // The kernel took part of it: a torn record at the end, reported as a short append (the
    // errno comes with the next one, as write(2) does it).
    const std::size_t total = total_of(buffers);
    const std::size_t part = std::max<std::size_t>(1, state_->rules.random_below(total));
    std::vector<iovec> some;
    if (total > 1) return filesystem_wrapper::append(file, prefix_of(buffers, part, some));
    if (decided.error != 0) return errno_error(decided.error);
  }
  return filesystem_wrapper::append(file, buffers);
}

result<void> fault_filesystem::sync(const file_handle& file, sync_kind kind) noexcept {
  state& s = *state_;
  auto st = target().stat(file);
  const bool directory = st && st->is_directory();
  const auto decided = s.rules.decide(directory ? fs_op::sync_directory : fs_op::sync, file.path());
  if (decided.crash) crash_now();
  if (decided.any()) {
    if (s.model.tracking() && st && !directory && kind != sync_kind::filesystem) {
      // As Linux: the dirty pages are dropped with the error, the next sync succeeds.
      s.model.sync_failed(file, *st);
    }
    return errno_error(decided.error != 0 ? decided.error : EIO);
  }
  auto r = filesystem_wrapper::sync(file, kind);
  // syncfs makes nothing durable in the model: keel never counts on it for that.
  if (!r || !s.model.tracking() || !st || kind == sync_kind::filesystem) return r;
  s.model.synced(file, *st);
  return r;
}

result<void> fault_filesystem::allocate(const file_handle& file, off_t offset, off_t length,
                                        bool keep_size) noexcept {
  KEEL_FAULT_GATE(fs_op::allocate, file.path());
  return filesystem_wrapper::allocate(file, offset, length, keep_size);
}

result<void> fault_filesystem::punch_hole(const file_handle& file, off_t offset,
                                          off_t length) noexcept {
  KEEL_FAULT_GATE(fs_op::punch_hole, file.path());
  return filesystem_wrapper::punch_hole(file, offset, length);
}

result<void> fault_filesystem::truncate(const file_handle& file, off_t length) noexcept {
  KEEL_FAULT_GATE(fs_op::truncate, file.path());
  return filesystem_wrapper::truncate(file, length);
}

result<file_status> fault_filesystem::stat(const file_handle& file) noexcept {
  KEEL_FAULT_GATE(fs_op::stat, file.path());
  return filesystem_wrapper::stat(file);
}

result<fs_info> fault_filesystem::statfs(const file_handle& file) noexcept {
  KEEL_FAULT_GATE(fs_op::statfs, file.path());
  return filesystem_wrapper::statfs(file);
}

result<bool> fault_filesystem::disable_copy_on_write(const file_handle& file) noexcept {
  KEEL_FAULT_GATE(fs_op::attributes, file.path());
  return filesystem_wrapper::disable_copy_on_write(file);
}

result<void> fault_filesystem::close(const file_handle& file) noexcept {
  const auto decided = state_->rules.decide(fs_op::close, file.path());
  if (decided.crash) crash_now();
  // The descriptor is released whatever close(2) says; an injected error comes after it.
  auto r = filesystem_wrapper::close(file);
  if (decided.any()) return errno_error(decided.error != 0 ? decided.error : EIO);
  return r;
}

result<void*> fault_filesystem::map(const file_handle& file, std::size_t length, off_t offset,
                                    map_access access) noexcept {
  KEEL_FAULT_GATE(fs_op::map, file.path());
  auto addr = filesystem_wrapper::map(file, length, offset, access);
  if (!addr) return addr;
  state& s = *state_;
  std::uint64_t id = 0;
  if (s.model.tracking() && access == map_access::read_write) {
    if (auto st = target().stat(file); st) id = s.model.id_of(*st);
  }
  const base::lock_guard lock(s.maps_mutex);
  s.maps.push_back({static_cast<std::byte*>(*addr), length, offset, id, file.shared_path()});
  return addr;
}

result<void*> fault_filesystem::remap(void* address, std::size_t length,
                                      std::size_t new_length) noexcept {
  state& s = *state_;
  keel::detail::shared_path path;
  {
    const base::lock_guard lock(s.maps_mutex);
    for (const auto& m : s.maps) {
      if (m.address == address) path = m.path;
    }
  }
  KEEL_FAULT_GATE(fs_op::map, path.view());
  auto addr = filesystem_wrapper::remap(address, length, new_length);
  if (!addr) return addr;
  const base::lock_guard lock(s.maps_mutex);
  for (auto& m : s.maps) {
    if (m.address == address) {
      m.address = static_cast<std::byte*>(*addr);
      m.length = new_length;
    }
  }
  return addr;
}

result<void> fault_filesystem::sync_map(void* address, std::size_t length, bool wait) noexcept {
  state& s = *state_;
  std::optional<state::mapping> hit;
  {
    const base::lock_guard lock(s.maps_mutex);
    auto* a = static_cast<std::byte*>(address);
    for (const auto& m : s.maps) {
      if (a >= m.address && a < m.address + m.length) hit = m;
    }
  }
  const auto decided = s.rules.decide(fs_op::sync_map, hit ? hit->path.view() : std::string_view());
  if (decided.crash) crash_now();
  if (decided.any()) return errno_error(decided.error != 0 ? decided.error : EIO);
  auto r = filesystem_wrapper::sync_map(address, length, wait);
  if (!r || !wait || !hit || hit->id == 0) return r;
  // What MS_SYNC wrote back is durable: lay it over the durable image.
  auto* a = static_cast<std::byte*>(address);
  const std::size_t n = std::min(length, static_cast<std::size_t>(hit->address + hit->length - a));
  const auto at =
      static_cast<std::size_t>(hit->offset) + static_cast<std::size_t>(a - hit->address);
  s.model.map_synced(hit->id, at, a, n);
  return r;
}

result<void> fault_filesystem::unmap(void* address, std::size_t length) noexcept {
  state& s = *state_;
  {
    const base::lock_guard lock(s.maps_mutex);
    std::erase_if(s.maps, [&](const state::mapping& m) { return m.address == address; });
  }
  const auto decided = s.rules.decide(fs_op::unmap, {});
  auto r = filesystem_wrapper::unmap(address, length);
  if (decided.any()) return errno_error(decided.error != 0 ? decided.error : EIO);
  return r;
}

result<void> fault_filesystem::lock(const file_handle& file, off_t offset, off_t length,
                                    lock_request request, bool wait) noexcept {
  KEEL_FAULT_GATE(fs_op::lock, file.path());
  return filesystem_wrapper::lock(file, offset, length, request, wait);
}

result<bool> fault_filesystem::lock_is_free(const file_handle& file, off_t offset, off_t length,
                                            lock_request request) noexcept {
  KEEL_FAULT_GATE(fs_op::lock, file.path());
  return filesystem_wrapper::lock_is_free(file, offset, length, request);
}

#undef KEEL_FAULT_GATE

}  // namespace keel::io
