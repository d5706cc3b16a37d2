// The fault-injecting filesystem (fault_filesystem.hpp): rules that fail operations, and a
// model of durability kept in a shadow directory.
//
// Shadow layout (all plain files, updated under an OFD lock on `.lock`, each file replaced
// by rename so a process killed mid-update leaves the old version):
//   root          the tracked root's absolute path
//   root_id       the model id of the root directory
//   next_id       the next model id to hand out
//   inodes        lines "device inode id": which model file an inode is now (the last line
//                 for an inode wins: inode numbers are reused after a file is removed)
//   data/ID       the durable content of model file ID (absent: empty)
//   dirs/ID       the durable entries of model directory ID: lines "f|d mode id name"
//   crashed       exists once a process lost power: no sync lands after that

#include "keel/io/fault_filesystem.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fcntl.h>
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "base/thread_safety.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::io {
namespace {

using bytes = std::vector<std::byte>;
constexpr std::size_t sector = 512;

struct file_key {
  std::uint64_t device = 0;
  std::uint64_t inode = 0;
  friend auto operator<=>(const file_key&, const file_key&) = default;
};

file_key key_of(const file_status& st) noexcept {
  return {st.device, st.inode};
}

// ---- small whole-file helpers on the real filesystem (the shadow is never faulted) ----

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

// The same file opened afresh on the real filesystem, for reading or writing whatever the
// handle was opened for: the model's own I/O must not come back through the fault
// filesystem (it holds the model's lock).
file_handle plain(const file_handle& f, open_flags flags) noexcept {
  const std::string proc = "/proc/self/fd/" + std::to_string(f.fd());
  auto h = file_handle::open(os(), proc.c_str(), flags);
  return h ? std::move(*h) : file_handle();
}

// Missing is empty.
bytes read_path_or_empty(const std::string& path) noexcept {
  auto b = read_path(path);
  return b ? std::move(*b) : bytes{};
}

// Writes `content` to `path` by a rename of a fresh file: a reader sees old or new.
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

// ---- the model's durable entries of one directory ----

struct dir_entry_record {
  bool directory = false;
  std::uint32_t mode = 0644;
  std::uint64_t id = 0;
  std::string name;
};

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

// `current` laid over `durable` as a power cut might leave it: each sector that differs
// comes from one or the other, and the size is either one's.
bytes tear(const bytes& durable, const bytes& current, double keep, std::mt19937_64& rng,
           std::uint64_t& kept) {
  std::bernoulli_distribution coin(keep);
  const std::size_t size = std::bernoulli_distribution(0.5)(rng) ? current.size() : durable.size();
  bytes out(size);
  for (std::size_t at = 0; at < size; at += sector) {
    const std::size_t end = std::min(size, at + sector);
    const auto byte_of = [](const bytes& b, std::size_t i) {
      return i < b.size() ? b[i] : std::byte{0};
    };
    bool differs = false;
    for (std::size_t i = at; i < end && !differs; ++i)
      differs = byte_of(durable, i) != byte_of(current, i);
    const bytes& from = differs && coin(rng) ? current : durable;
    if (differs && &from == &current) ++kept;
    for (std::size_t i = at; i < end; ++i)
      out[i] = byte_of(from, i);
  }
  return out;
}

}  // namespace

struct fault_filesystem::state {
  explicit state(std::uint64_t seed) : rng(seed) {}

  base::mutex mutex;  // everything below
  struct rule {
    fault f;
    std::uint64_t seen = 0;
    bool done = false;
  };
  std::vector<rule> rules KEEL_GUARDED_BY(mutex);
  std::array<std::uint64_t, fs_op_count> counts KEEL_GUARDED_BY(mutex){};
  std::uint64_t injected KEEL_GUARDED_BY(mutex) = 0;
  std::mt19937_64 rng KEEL_GUARDED_BY(mutex);

  // ---- the model ----
  // Set once track() has set up the model (root and shadow then never change): read without
  // the mutex, to skip the model when not tracking.
  std::atomic<bool> tracking{false};
  std::string root KEEL_GUARDED_BY(mutex);
  std::string shadow KEEL_GUARDED_BY(mutex);
  file_handle lock_file
      KEEL_GUARDED_BY(mutex);  // the shadow's .lock, opened by each process for itself
  pid_t lock_pid KEEL_GUARDED_BY(mutex) = 0;
  std::map<file_key, std::uint64_t> ids
      KEEL_GUARDED_BY(mutex);  // inode -> model id, as far as `inodes` was read
  off_t inodes_read KEEL_GUARDED_BY(mutex) = 0;
  struct mapping {
    std::byte* address;
    std::size_t length;
    off_t offset;
    std::uint64_t id;  // 0: not modelled
    keel::detail::shared_path path;
  };
  std::vector<mapping> maps KEEL_GUARDED_BY(mutex);

  struct decision {
    int error = 0;
    bool partial = false;
    bool crash = false;
    [[nodiscard]] bool any() const noexcept { return error != 0 || partial || crash; }
  };

  decision decide(fs_op op, std::string_view path) {
    const base::lock_guard lock(mutex);
    ++counts[static_cast<std::size_t>(op)];
    for (rule& r : rules) {
      if (r.done || !r.f.on.has(op)) continue;
      if (!r.f.path_contains.empty() && path.find(r.f.path_contains) == std::string_view::npos) {
        continue;
      }
      if (++r.seen < r.f.nth) continue;
      bool hit = true;
      switch (r.f.repeat) {
        case fault::repeat::once:
          r.done = true;
          break;
        case fault::repeat::forever:
          break;
        case fault::repeat::randomly:
          hit = std::bernoulli_distribution(r.f.probability)(rng);
          break;
      }
      if (!hit) continue;
      ++injected;
      return {r.f.error, r.f.partial, r.f.crash};
    }
    return {};
  }

  std::size_t random_below(std::size_t n) {
    const base::lock_guard lock(mutex);
    return n == 0 ? 0 : static_cast<std::size_t>(rng() % n);
  }

  // The model's lock, across processes (and, with `mutex`, threads). Each process opens the
  // lock file for itself: an inherited descriptor would share the parent's lock.
  class KEEL_SCOPED_CAPABILITY model_lock {
   public:
    explicit model_lock(state& s) KEEL_ACQUIRE(s.mutex) : s_(s), lock_(s.mutex) {
      if (s_.lock_pid != ::getpid()) {
        (void)s_.lock_file.release();  // the parent's description: never close or unlock it
        auto f = file_handle::open(os(), (s_.shadow + "/.lock").c_str(),
                                   open_flags::read_write | open_flags::create);
        if (f) s_.lock_file = std::move(*f);
        s_.lock_pid = ::getpid();
      }
      if (s_.lock_file.is_open()) {
        auto g = lock_extent(s_.lock_file, 0, 1, lock_kind::exclusive);
        if (g) {
          guard_ = std::move(*g);
        }
      }
    }
    ~model_lock() KEEL_RELEASE() = default;
    model_lock(const model_lock&) = delete;
    model_lock& operator=(const model_lock&) = delete;

   private:
    state& s_;
    base::lock_guard lock_;
    extent_guard guard_;
  };

  // ---- under model_lock ----

  [[nodiscard]] bool crashed() const noexcept KEEL_REQUIRES(mutex) {
    return os().stat_at(nullptr, (shadow + "/crashed").c_str(), false).has_value();
  }

  void load_ids() KEEL_REQUIRES(mutex) {
    auto f = file_handle::open(os(), (shadow + "/inodes").c_str(), open_flags::read);
    if (!f) return;
    auto size = f->size();
    if (!size || *size <= inodes_read) return;
    bytes b(static_cast<std::size_t>(*size - inodes_read));
    auto n = f->read_at(inodes_read, b);
    if (!n) return;
    const std::string text = text_of(b).substr(0, *n);
    // Only whole lines: one cut short by a kill is read again (and ignored) next time.
    const std::size_t complete = text.rfind('\n');
    if (complete == std::string::npos) return;
    std::istringstream in(text.substr(0, complete + 1));
    file_key k;
    std::uint64_t id = 0;
    while (in >> k.device >> k.inode >> id)
      ids[k] = id;
    inodes_read += static_cast<off_t>(complete + 1);
  }

  std::uint64_t id_of(const file_key& k) KEEL_REQUIRES(mutex) {
    load_ids();
    auto it = ids.find(k);
    return it == ids.end() ? 0 : it->second;
  }

  std::uint64_t bind(const file_key& k) KEEL_REQUIRES(mutex) {
    load_ids();
    const std::uint64_t id = std::max<std::uint64_t>(
        1, std::strtoull(text_of(read_path_or_empty(shadow + "/next_id")).c_str(), nullptr, 10));
    (void)write_text(shadow + "/next_id", std::to_string(id + 1));
    auto f = file_handle::open(os(), (shadow + "/inodes").c_str(),
                               open_flags::write | open_flags::append | open_flags::create);
    if (f) {
      const std::string line = std::to_string(k.device) + " " + std::to_string(k.inode) + " " +
                               std::to_string(id) + "\n";
      (void)f->append(std::as_bytes(std::span(line.data(), line.size())));
    }
    return id;
  }

  std::string data_path(std::uint64_t id) const KEEL_REQUIRES(mutex) {
    return shadow + "/data/" + std::to_string(id);
  }
  std::string dir_path(std::uint64_t id) const KEEL_REQUIRES(mutex) {
    return shadow + "/dirs/" + std::to_string(id);
  }

  // Makes the current entries of directory `dir` (model id `id`) its durable ones.
  void save_directory(const file_handle& dir, std::uint64_t id) KEEL_REQUIRES(mutex) {
    auto list = os().list_directory(dir);
    if (!list) return;
    std::vector<dir_entry_record> entries;
    for (const auto& e : *list) {
      if (e.type != entry_type::regular && e.type != entry_type::directory) continue;
      auto st = os().stat_at(&dir, e.name.c_str(), false);
      if (!st) continue;
      std::uint64_t child = id_of(key_of(*st));
      if (child == 0) child = bind(key_of(*st));  // made behind the model's back
      entries.push_back({st->is_directory(), st->mode & 07777, child, e.name});
    }
    const std::string text = format_entries(entries);
    (void)write_text(dir_path(id), text);
  }

  // Makes the current content of `file` (model id `id`) its durable one.
  void save_content(const file_handle& file, std::uint64_t id) KEEL_REQUIRES(mutex) {
    auto b = read_whole(plain(file, open_flags::read));
    if (b) (void)write_path(data_path(id), *b);
  }

  // Puts the durable content of model file `id` back into `file` (a failed fsync).
  void revert_content(const file_handle& file, std::uint64_t id) KEEL_REQUIRES(mutex) {
    const bytes durable = read_path_or_empty(data_path(id));
    const file_handle f = plain(file, open_flags::write);
    (void)f.truncate(0);
    if (!durable.empty()) (void)f.write_at(0, durable);
    (void)f.truncate(static_cast<off_t>(durable.size()));
  }

  // Everything below `path` (model directory `id`) as durable as it is now.
  void snapshot(const std::string& path, std::uint64_t id) KEEL_REQUIRES(mutex) {
    auto dir = file_handle::open_directory(os(), path.c_str());
    if (!dir) return;
    save_directory(*dir, id);
    auto list = os().list_directory(*dir);
    if (!list) return;
    for (const auto& e : *list) {
      auto st = os().stat_at(&*dir, e.name.c_str(), false);
      if (!st) continue;
      const std::uint64_t child = id_of(key_of(*st));
      if (st->is_directory()) {
        snapshot(path + "/" + e.name, child);
      } else if (st->is_regular()) {
        auto f = file_handle::open_at(*dir, e.name.c_str(), open_flags::read);
        if (f) save_content(*f, child);
      }
    }
  }
};

fault_filesystem::fault_filesystem(filesystem& target, std::uint64_t seed)
    : filesystem_wrapper(target), state_(std::make_unique<state>(seed)) {}

fault_filesystem::~fault_filesystem() = default;

void fault_filesystem::inject(fault f) {
  const base::lock_guard lock(state_->mutex);
  state_->rules.push_back({std::move(f)});
}

void fault_filesystem::clear_faults() {
  const base::lock_guard lock(state_->mutex);
  state_->rules.clear();
}

std::uint64_t fault_filesystem::count(fs_ops ops) const {
  const base::lock_guard lock(state_->mutex);
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < fs_op_count; ++i) {
    if (ops.has(static_cast<fs_op>(i))) n += state_->counts[i];
  }
  return n;
}

std::uint64_t fault_filesystem::injected() const {
  const base::lock_guard lock(state_->mutex);
  return state_->injected;
}

result<void> fault_filesystem::track(const std::string& root, const std::string& shadow) {
  state& s = *state_;
  const std::string root_path = absolute(root);
  const std::string shadow_path = absolute(shadow);
  std::error_code ec;
  std::filesystem::create_directories(shadow_path + "/data", ec);
  std::filesystem::create_directories(shadow_path + "/dirs", ec);
  if (ec) return errno_error(ec.value());
  {
    const base::lock_guard lock(s.mutex);
    s.root = root_path;
    s.shadow = shadow_path;
  }
  const state::model_lock lock(s);
  auto known = read_path(s.shadow + "/root");
  if (known && text_of(*known) != s.root) return errc_error(std::errc::invalid_argument);
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
    walk(s.root);
    if (all.empty()) return errc_error(std::errc::no_such_file_or_directory);
    for (const auto& [path, st] : all) {
      if (st.is_directory() || st.is_regular()) (void)s.bind(key_of(st));
    }
    const std::uint64_t root_id = s.id_of(key_of(all.front().second));
    s.snapshot(s.root, root_id);
    (void)write_text(s.shadow + "/root_id", std::to_string(root_id));
    if (auto w = write_text(s.shadow + "/root", s.root); !w) return w;
  }
  s.load_ids();
  s.tracking = true;
  return {};
}

void fault_filesystem::crash_now() noexcept {
  state& s = *state_;
  if (s.tracking) {
    const state::model_lock lock(s);
    (void)write_text(s.shadow + "/crashed", "power lost\n");
  }
  ::kill(::getpid(), SIGKILL);
  for (;;)
    ::pause();
}

result<fault_filesystem::restore_report> fault_filesystem::restore(const std::string& root_in,
                                                                   const std::string& shadow_in,
                                                                   const crash_options& options) {
  const std::string root = absolute(root_in);
  const std::string shadow = absolute(shadow_in);
  auto known = read_path(shadow + "/root");
  if (!known || text_of(*known) != root) return errc_error(std::errc::invalid_argument);
  state s(options.seed);
  {
    const base::lock_guard lock(s.mutex);
    s.root = root;
    s.shadow = shadow;
  }
  restore_report report;
  std::mt19937_64 rng(options.seed);
  {
    const state::model_lock lock(s);
    s.load_ids();
    const std::uint64_t root_id =
        std::strtoull(text_of(read_path_or_empty(shadow + "/root_id")).c_str(), nullptr, 10);

    // Where each model file is now (its current content, for torn sectors).
    std::map<std::uint64_t, std::string> current;
    std::error_code ec;
    for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
      auto st = os().stat_at(nullptr, it->path().c_str(), false);
      if (!st || !st->is_regular()) continue;
      const std::uint64_t id = s.id_of(key_of(*st));
      if (id != 0) current.emplace(id, it->path().string());
    }

    // The durable tree, content computed before anything is removed.
    struct node {
      std::string path;  // relative to root
      dir_entry_record entry;
    };
    std::vector<node> nodes;
    const std::function<void(std::uint64_t, const std::string&)> collect =
        [&](std::uint64_t dir_id, const std::string& rel) KEEL_REQUIRES(s.mutex) {
          for (auto& e : parse_entries(text_of(read_path_or_empty(s.dir_path(dir_id))))) {
            const std::string p = rel + "/" + e.name;
            nodes.push_back({p, e});
            if (e.directory) collect(e.id, p);
          }
        };
    collect(root_id, "");
    std::map<std::uint64_t, bytes> content;
    for (const node& n : nodes) {
      if (n.entry.directory || content.contains(n.entry.id)) continue;
      bytes durable = read_path_or_empty(s.data_path(n.entry.id));
      auto now = current.find(n.entry.id);
      if (now != current.end()) {
        bytes cur = read_path_or_empty(now->second);
        if (cur != durable) {
          ++report.reverted;
          if (options.torn) {
            durable = tear(durable, cur, options.keep_probability, rng, report.torn_sectors);
          }
        }
      }
      content.emplace(n.entry.id, std::move(durable));
    }

    // Out with the present, in with what survived.
    for (const auto& e : std::filesystem::directory_iterator(root, ec))
      std::filesystem::remove_all(e.path(), ec);
    if (ec) return errno_error(ec.value());
    ++report.directories;
    std::map<std::uint64_t, std::string> made;
    for (const node& n : nodes) {
      const std::string p = root + n.path;
      if (n.entry.directory) {
        if (auto m = os().make_directory(nullptr, p.c_str(), n.entry.mode); !m) {
          return std::unexpected(m.error());
        }
        ++report.directories;
        continue;
      }
      if (auto first = made.find(n.entry.id); first != made.end()) {
        if (auto l = os().link_at(nullptr, first->second.c_str(), nullptr, p.c_str()); !l) {
          return std::unexpected(l.error());
        }
        continue;
      }
      auto f =
          file_handle::open(os(), p.c_str(), open_flags::write | open_flags::create, n.entry.mode);
      if (!f) return std::unexpected(f.error());
      const bytes& b = content[n.entry.id];
      if (!b.empty()) {
        if (auto w = f->write_at(0, b); !w) return std::unexpected(w.error());
      }
      made.emplace(n.entry.id, p);
      ++report.files;
    }
  }
  // A new model of what is there now.
  std::error_code ec;
  std::filesystem::remove_all(shadow, ec);
  if (ec) return errno_error(ec.value());
  fault_filesystem fresh;
  if (auto t = fresh.track(root, shadow); !t) return std::unexpected(t.error());
  return report;
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
  std::size_t part = state_->random_below(total);
  if (error == 0 && part == 0 && total > 1) part = 1;
  if (part != 0) {
    std::vector<iovec> some;
    auto n = transfer(prefix_of(buffers, part, some));
    if (!n || error == 0) return n;
  }
  if (error != 0) return errno_error(error);
  return transfer(buffers);
}

#define KEEL_FAULT_GATE(op, path)                \
  const auto decided = state_->decide(op, path); \
  if (decided.crash) crash_now();                \
  if (decided.any() && !decided.partial) return errno_error(decided.error)

result<file_handle> fault_filesystem::open(const file_handle* dir, const char* path,
                                           open_flags flags, mode_t mode) noexcept {
  if (path == nullptr) return errc_error(std::errc::invalid_argument);
  KEEL_FAULT_GATE(fs_op::open, path_in(dir, path));
  state& s = *state_;
  const bool temporary = has(flags, open_flags::temporary);
  const bool creating = has(flags, open_flags::create) || temporary;
  bool existed = !temporary;
  if (s.tracking && creating && !temporary) {
    existed = target().stat_at(dir, path, !has(flags, open_flags::no_follow)).has_value();
  }
  auto f = filesystem_wrapper::open(dir, path, flags, mode);
  if (!f || !s.tracking || !creating || existed) return f;
  // A file was made: modelled if it is in a modelled directory.
  const std::string where = temporary ? std::string(path) : parent_of(path);
  auto parent = target().stat_at(dir, where.c_str(), true);
  auto st = target().stat(*f);
  if (parent && st) {
    const state::model_lock lock(s);
    if (s.id_of(key_of(*parent)) != 0) (void)s.bind(key_of(*st));
  }
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
  if (!r || !s.tracking) return r;
  auto parent = target().stat_at(dir, parent_of(name).c_str(), true);
  auto st = target().stat_at(dir, name, false);
  if (parent && st) {
    const state::model_lock lock(s);
    if (s.id_of(key_of(*parent)) != 0) (void)s.bind(key_of(*st));
  }
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
    const std::size_t part = std::max<std::size_t>(1, state_->random_below(total));
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
  const auto decided = s.decide(directory ? fs_op::sync_directory : fs_op::sync, file.path());
  if (decided.crash) crash_now();
  if (decided.any()) {
    if (s.tracking && st && !directory && kind != sync_kind::filesystem) {
      // As Linux: the dirty pages are dropped with the error, the next sync succeeds.
      const state::model_lock lock(s);
      if (const std::uint64_t id = s.id_of(key_of(*st)); id != 0) s.revert_content(file, id);
    }
    return errno_error(decided.error != 0 ? decided.error : EIO);
  }
  auto r = filesystem_wrapper::sync(file, kind);
  // syncfs makes nothing durable in the model: keel never counts on it for that.
  if (!r || !s.tracking || !st || kind == sync_kind::filesystem) return r;
  const state::model_lock lock(s);
  if (s.crashed()) {
    // Another process lost power: so did this one, before its sync could land.
    ::kill(::getpid(), SIGKILL);
  }
  if (const std::uint64_t id = s.id_of(key_of(*st)); id != 0) {
    if (directory) {
      s.save_directory(file, id);
    } else {
      s.save_content(file, id);
    }
  }
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
  const auto decided = state_->decide(fs_op::close, file.path());
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
  if (s.tracking && access == map_access::read_write) {
    if (auto st = target().stat(file); st) {
      const state::model_lock lock(s);
      id = s.id_of(key_of(*st));
    }
  }
  const base::lock_guard lock(s.mutex);
  s.maps.push_back({static_cast<std::byte*>(*addr), length, offset, id, file.shared_path()});
  return addr;
}

result<void*> fault_filesystem::remap(void* address, std::size_t length,
                                      std::size_t new_length) noexcept {
  state& s = *state_;
  keel::detail::shared_path path;
  {
    const base::lock_guard lock(s.mutex);
    for (const auto& m : s.maps) {
      if (m.address == address) path = m.path;
    }
  }
  KEEL_FAULT_GATE(fs_op::map, path.view());
  auto addr = filesystem_wrapper::remap(address, length, new_length);
  if (!addr) return addr;
  const base::lock_guard lock(s.mutex);
  for (auto& m : s.maps) {
    if (m.address == address) {
      m.address = static_cast<std::byte*>(*addr);
      m.length = new_length;
    }
  }
  return addr;
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

result<void> fault_filesystem::sync_map(void* address, std::size_t length, bool wait) noexcept {
  state& s = *state_;
  std::optional<state::mapping> hit;
  {
    const base::lock_guard lock(s.mutex);
    auto* a = static_cast<std::byte*>(address);
    for (const auto& m : s.maps) {
      if (a >= m.address && a < m.address + m.length) hit = m;
    }
  }
  const auto decided = s.decide(fs_op::sync_map, hit ? hit->path.view() : std::string_view());
  if (decided.crash) crash_now();
  if (decided.any()) return errno_error(decided.error != 0 ? decided.error : EIO);
  auto r = filesystem_wrapper::sync_map(address, length, wait);
  if (!r || !wait || !hit || hit->id == 0) return r;
  // What MS_SYNC wrote back is durable: lay it over the durable image.
  const state::model_lock lock(s);
  if (s.crashed()) ::kill(::getpid(), SIGKILL);
  auto* a = static_cast<std::byte*>(address);
  const std::size_t n = std::min(length, static_cast<std::size_t>(hit->address + hit->length - a));
  const auto at =
      static_cast<std::size_t>(hit->offset) + static_cast<std::size_t>(a - hit->address);
  bytes durable = read_path_or_empty(s.data_path(hit->id));
  if (durable.size() < at + n) durable.resize(at + n);
  copy_as_writeback(durable.data() + at, a, n);
  (void)write_path(s.data_path(hit->id), durable);
  return r;
}

result<void> fault_filesystem::unmap(void* address, std::size_t length) noexcept {
  state& s = *state_;
  {
    const base::lock_guard lock(s.mutex);
    std::erase_if(s.maps, [&](const state::mapping& m) { return m.address == address; });
  }
  const auto decided = s.decide(fs_op::unmap, {});
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
