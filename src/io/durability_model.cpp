// The fault filesystem's durability model: see durability_model.hpp.

#include "io/durability_model.hpp"

#include <unistd.h>

#include <signal.h>
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <sstream>
#include <utility>

namespace keel::io {

namespace shadow_files {

result<bytes> read_whole(const file_handle& f) noexcept {
  auto size = f.size();
  if (!size) return std::unexpected(size.error());
  bytes b(static_cast<std::size_t>(*size));
  auto n = f.read_at(0, b);
  if (!n) return std::unexpected(n.error());
  b.resize(*n);
  return b;
}

result<bytes> read_path(const std::string& path) noexcept {
  auto f = file_handle::open(os(), path.c_str(), open_flags::read);
  if (!f) return std::unexpected(f.error());
  return read_whole(*f);
}

bytes read_path_or_empty(const std::string& path) noexcept {
  auto b = read_path(path);
  return b ? std::move(*b) : bytes{};
}

result<void> write_path(const std::string& path, std::span<const std::byte> content) noexcept {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    auto f = file_handle::open(os(), tmp.c_str(),
                               open_flags::write | open_flags::create | open_flags::truncate);
    if (!f) return std::unexpected(f.error());
    if (auto w = f->write_at(0, content); !w) return w;
  }
  return os().rename(nullptr, tmp.c_str(), nullptr, path.c_str(), rename_mode::replace);
}

result<void> write_text(const std::string& path, const std::string& text) noexcept {
  return write_path(path, std::as_bytes(std::span(text.data(), text.size())));
}

std::string text_of(const bytes& b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

std::string absolute(const std::string& p) {
  std::error_code ec;
  auto a = std::filesystem::weakly_canonical(std::filesystem::absolute(p, ec), ec);
  return ec ? p : a.string();
}

std::string format_entries(const std::vector<dir_entry_record>& entries) {
  std::string s;
  for (const auto& e : entries) {
    s += e.directory ? "d " : "f ";
    s += std::to_string(e.mode) + " " + std::to_string(e.id) + " " + e.name + "\n";
  }
  return s;
}

std::vector<dir_entry_record> parse_entries(const std::string& text) {
  std::vector<dir_entry_record> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    std::string type;
    dir_entry_record e;
    if (!(l >> type >> e.mode >> e.id)) continue;
    l.get();  // the space before the name
    std::getline(l, e.name);
    if (e.name.empty()) continue;
    e.directory = type == "d";
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace shadow_files

using namespace shadow_files;

namespace {

// The same file opened afresh on the real filesystem, for reading or writing whatever the
// handle was opened for: the model's own I/O must not come back through the fault
// filesystem.
file_handle plain(const file_handle& f, open_flags flags) noexcept {
  const std::string proc = "/proc/self/fd/" + std::to_string(f.fd());
  auto h = file_handle::open(os(), proc.c_str(), flags);
  return h ? std::move(*h) : file_handle();
}

}  // namespace

durability_model::model_lock::model_lock(durability_model& m) : lock_(m.mutex_) {
  if (m.lock_pid_ != ::getpid()) {
    (void)m.lock_file_.release();  // the parent's description: never close or unlock it
    auto f = file_handle::open(os(), (m.shadow_ + "/.lock").c_str(),
                               open_flags::read_write | open_flags::create);
    if (f) m.lock_file_ = std::move(*f);
    m.lock_pid_ = ::getpid();
  }
  if (m.lock_file_.is_open()) {
    auto g = lock_extent(m.lock_file_, 0, 1, lock_kind::exclusive);
    if (g) guard_ = std::move(*g);
  }
}

// ---- under model_lock ----

bool durability_model::crashed() const noexcept {
  return os().stat_at(nullptr, (shadow_ + "/crashed").c_str(), false).has_value();
}

void durability_model::load_ids() {
  auto f = file_handle::open(os(), (shadow_ + "/inodes").c_str(), open_flags::read);
  if (!f) return;
  auto size = f->size();
  if (!size || *size <= inodes_read_) return;
  bytes b(static_cast<std::size_t>(*size - inodes_read_));
  auto n = f->read_at(inodes_read_, b);
  if (!n) return;
  const std::string text = text_of(b).substr(0, *n);
  // Only whole lines: one cut short by a kill is read again (and ignored) next time.
  const std::size_t complete = text.rfind('\n');
  if (complete == std::string::npos) return;
  std::istringstream in(text.substr(0, complete + 1));
  file_key k;
  std::uint64_t id = 0;
  while (in >> k.device >> k.inode >> id)
    ids_[k] = id;
  inodes_read_ += static_cast<off_t>(complete + 1);
}

std::uint64_t durability_model::id_locked(const file_key& k) {
  load_ids();
  auto it = ids_.find(k);
  return it == ids_.end() ? 0 : it->second;
}

std::uint64_t durability_model::bind(const file_key& k) {
  load_ids();
  const std::uint64_t id = std::max<std::uint64_t>(
      1, std::strtoull(text_of(read_path_or_empty(shadow_ + "/next_id")).c_str(), nullptr, 10));
  (void)write_text(shadow_ + "/next_id", std::to_string(id + 1));
  auto f = file_handle::open(os(), (shadow_ + "/inodes").c_str(),
                             open_flags::write | open_flags::append | open_flags::create);
  if (f) {
    const std::string line =
        std::to_string(k.device) + " " + std::to_string(k.inode) + " " + std::to_string(id) + "\n";
    (void)f->append(std::as_bytes(std::span(line.data(), line.size())));
  }
  return id;
}

std::string durability_model::data_path(std::uint64_t id) const {
  return shadow_ + "/data/" + std::to_string(id);
}

std::string durability_model::dir_path(std::uint64_t id) const {
  return shadow_ + "/dirs/" + std::to_string(id);
}

// Makes the current entries of directory `dir` (model id `id`) its durable ones.
void durability_model::save_directory(const file_handle& dir, std::uint64_t id) {
  auto list = os().list_directory(dir);
  if (!list) return;
  std::vector<dir_entry_record> entries;
  for (const auto& e : *list) {
    if (e.type != entry_type::regular && e.type != entry_type::directory) continue;
    auto st = os().stat_at(&dir, e.name.c_str(), false);
    if (!st) continue;
    std::uint64_t child = id_locked(key_of(*st));
    if (child == 0) child = bind(key_of(*st));  // made behind the model's back
    entries.push_back({st->is_directory(), st->mode & 07777, child, e.name});
  }
  (void)write_text(dir_path(id), format_entries(entries));
}

// Makes the current content of `file` (model id `id`) its durable one.
void durability_model::save_content(const file_handle& file, std::uint64_t id) {
  auto b = read_whole(plain(file, open_flags::read));
  if (b) (void)write_path(data_path(id), *b);
}

// Puts the durable content of model file `id` back into `file` (a failed fsync).
void durability_model::revert_content(const file_handle& file, std::uint64_t id) {
  const bytes durable = read_path_or_empty(data_path(id));
  const file_handle f = plain(file, open_flags::write);
  (void)f.truncate(0);
  if (!durable.empty()) (void)f.write_at(0, durable);
  (void)f.truncate(static_cast<off_t>(durable.size()));
}

// Everything below `path` (model directory `id`) as durable as it is now.
void durability_model::snapshot(const std::string& path, std::uint64_t id) {
  auto dir = file_handle::open_directory(os(), path.c_str());
  if (!dir) return;
  save_directory(*dir, id);
  auto list = os().list_directory(*dir);
  if (!list) return;
  for (const auto& e : *list) {
    auto st = os().stat_at(&*dir, e.name.c_str(), false);
    if (!st) continue;
    const std::uint64_t child = id_locked(key_of(*st));
    if (st->is_directory()) {
      snapshot(path + "/" + e.name, child);
    } else if (st->is_regular()) {
      auto f = file_handle::open_at(*dir, e.name.c_str(), open_flags::read);
      if (f) save_content(*f, child);
    }
  }
}

// ---- the calls ----

result<void> durability_model::track(const std::string& root, const std::string& shadow) {
  const std::string root_path = absolute(root);
  const std::string shadow_path = absolute(shadow);
  std::error_code ec;
  std::filesystem::create_directories(shadow_path + "/data", ec);
  std::filesystem::create_directories(shadow_path + "/dirs", ec);
  if (ec) return errno_error(ec.value());
  {
    const base::lock_guard lock(mutex_);
    root_ = root_path;
    shadow_ = shadow_path;
  }
  const model_lock lock(*this);
  auto known = read_path(shadow_ + "/root");
  if (known && text_of(*known) != root_) return errc_error(std::errc::invalid_argument);
  if (!known) {
    // The first to track the pair: what is below root now is durable.
    std::vector<std::pair<std::string, file_status>> all;
    const std::function<void(const std::string&)> walk = [&](const std::string& path) {
      auto st = os().stat_at(nullptr, path.c_str(), false);
      if (!st) return;
      all.emplace_back(path, *st);
      if (!st->is_directory()) return;
      for (const auto& e : std::filesystem::directory_iterator(path, ec))
        walk(e.path().string());
    };
    walk(root_);
    if (all.empty()) return errc_error(std::errc::no_such_file_or_directory);
    for (const auto& [path, st] : all) {
      if (st.is_directory() || st.is_regular()) (void)bind(key_of(st));
    }
    const std::uint64_t root_id = id_locked(key_of(all.front().second));
    snapshot(root_, root_id);
    (void)write_text(shadow_ + "/root_id", std::to_string(root_id));
    if (auto w = write_text(shadow_ + "/root", root_); !w) return w;
  }
  load_ids();
  tracking_ = true;
  return {};
}

void durability_model::mark_crashed() noexcept {
  if (!tracking()) return;
  const model_lock lock(*this);
  (void)write_text(shadow_ + "/crashed", "power lost\n");
}

void durability_model::created(const file_status& parent, const file_status& made) {
  const model_lock lock(*this);
  if (id_locked(key_of(parent)) != 0) (void)bind(key_of(made));
}

void durability_model::sync_failed(const file_handle& file, const file_status& st) {
  const model_lock lock(*this);
  if (const std::uint64_t id = id_locked(key_of(st)); id != 0) revert_content(file, id);
}

void durability_model::synced(const file_handle& file, const file_status& st) {
  const model_lock lock(*this);
  if (crashed()) {
    // Another process lost power: so did this one, before its sync could land.
    ::kill(::getpid(), SIGKILL);
  }
  if (const std::uint64_t id = id_locked(key_of(st)); id != 0) {
    if (st.is_directory()) {
      save_directory(file, id);
    } else {
      save_content(file, id);
    }
  }
}

std::uint64_t durability_model::id_of(const file_status& st) {
  const model_lock lock(*this);
  return id_locked(key_of(st));
}

namespace {

// What writeback copies out of a shared map while its users go on storing into it, as the
// kernel's does: a byte stored meanwhile is in the copy or not (no sync promised it). Not
// instrumented by ThreadSanitizer, which would call the kernel's own behaviour a race.
__attribute__((no_sanitize("thread"))) void copy_as_writeback(std::byte* to, const std::byte* from,
                                                              std::size_t n) noexcept {
  const volatile std::byte* src = from;
  for (std::size_t i = 0; i < n; ++i)
    to[i] = src[i];
}

}  // namespace

void durability_model::map_synced(std::uint64_t id, std::size_t offset, const std::byte* from,
                                  std::size_t n) {
  const model_lock lock(*this);
  if (crashed()) ::kill(::getpid(), SIGKILL);
  bytes durable = read_path_or_empty(data_path(id));
  if (durable.size() < offset + n) durable.resize(offset + n);
  copy_as_writeback(durable.data() + offset, from, n);
  (void)write_path(data_path(id), durable);
}

}  // namespace keel::io
