// The keel::kv workload: a writer commits random transactions of one to three keys (puts of
// values from a few bytes to a blob, erases; `sync` one time in four), compacts and
// checkpoints now and then, and notes in memory shared with the harness what each commit
// wrote, before it commits, and whether it was acknowledged. Then the cycle's event, and a
// checker reads every key:
//
// - kill: the writer is killed at a random moment. Every acknowledged commit is there.
// - powerloss: the power goes at a random operation of the writer (torn writes in half the
//   cycles), then a reboot. Every commit up to the last acknowledged `sync` one is there.
// - io-errors: the writer's N-th operation fails (EIO, ENOSPC, EDQUOT, EMFILE, ENOMEM, and
//   EAGAIN from mmap; once or from then on; reads and writes part-way first at times). It never
//   crashes or hangs, and once the fault is gone every acknowledged commit is there.
// - corrupt: the writer closes the store; then a file of it is damaged (bits flipped, a range
//   zeroed, cut short, removed). Each read is the newest value or an error: never an older
//   value, another key's, a crash or a hang.
//
// Every value read must be one a commit of that key wrote, whole, and at least as new as
// the floor above; a commit seen must be seen whole (every key it wrote shows it or newer).
// Half the cycles reboot (the index, a cache, goes) before the check.

#include "kv_workload.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "keel/io/fault_filesystem.hpp"
#include "keel/kv/store.hpp"
#include "process.hpp"

namespace keel::torture::detail {
namespace {

using namespace std::chrono_literals;

constexpr int key_count = 24;
constexpr std::uint32_t max_commits = 2000;

std::string key_name(int k) {
  return "key-" + std::to_string(k);
}

// What commit `c` writes for key `k`: its identity first, then filler, in sizes from a few
// bytes to a blob (values of 64 KiB and more are stored apart from their commit).
std::string value_for(std::uint32_t c, int k) {
  std::string v = "c=" + std::to_string(c) + " k=" + std::to_string(k) + " ";
  const std::size_t size = c % 29 == 0  ? 70'000
                           : c % 5 == 0 ? 3000
                                        : 40 + (c * 13 + static_cast<std::uint32_t>(k)) % 200;
  v.resize(std::max(size, v.size()),
           static_cast<char>('a' + (c * 7 + static_cast<unsigned>(k)) % 26));
  return v;
}

// The commit a value says it is from (0: not a value of this workload).
std::uint32_t commit_of(const std::string& v, int k) {
  unsigned c = 0;
  int key = -1;
  if (std::sscanf(v.c_str(), "c=%u k=%d ", &c, &key) != 2 || key != k) return 0;
  return c;
}

// What the harness knows of one commit, noted by the writer before it commits.
struct commit_note {
  std::atomic<std::uint32_t> puts{0};    // bit k: it put key k
  std::atomic<std::uint32_t> erases{0};  // bit k: it erased key k
  std::atomic<std::uint32_t> acked{0};   // its commit returned success
};

struct kv_oracle {
  std::atomic<std::uint32_t> attempted{0};  // commits 1 .. attempted were tried
  std::atomic<std::uint32_t> durable{0};    // the newest commit a `sync` commit acknowledged
  std::array<commit_note, max_commits + 1> commits;
  std::atomic<std::uint32_t> message_taken{0};
  char message[512]{};

  void report(const char* format, ...) __attribute__((format(printf, 2, 3))) {
    if (message_taken.exchange(1) != 0) return;
    va_list ap;
    va_start(ap, format);
    std::vsnprintf(message, sizeof message, format, ap);
    va_end(ap);
  }
};

class shared_oracle {
 public:
  shared_oracle() {
    void* p = ::mmap(nullptr, sizeof(kv_oracle), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                     -1, 0);
    if (p == MAP_FAILED) std::abort();
    o_ = new (p) kv_oracle{};
  }
  ~shared_oracle() { ::munmap(o_, sizeof(kv_oracle)); }
  shared_oracle(const shared_oracle&) = delete;
  shared_oracle& operator=(const shared_oracle&) = delete;
  kv_oracle* operator->() const noexcept { return o_; }
  kv_oracle& operator*() const noexcept { return *o_; }

 private:
  kv_oracle* o_;
};

kv::options store_options(io::filesystem& fs) {
  kv::options o;
  o.segment_size = std::uint64_t{1} << 20;
  o.checkpoint_bytes = std::uint64_t{256} << 10;
  o.lock_timeout = 10s;
  o.fs = &fs;
  return o;
}

// The writer (in a child): `rounds` commits (or until killed). With `errors_expected`, a
// failed call is noted and skipped; else it is the writer's failure (exit code 3-6).
int write(kv_oracle& o, const std::string& path, io::filesystem& fs, std::uint64_t seed, int rounds,
          bool errors_expected) {
  auto s = kv::store::open(path, store_options(fs));
  if (!s) {
    if (errors_expected) return 0;
    o.report("the writer could not open the store: %s", s.error().message().c_str());
    return 2;
  }
  std::mt19937_64 rng(seed);
  for (int i = 0; i < rounds; ++i) {
    const std::uint32_t c = o.attempted.load() + 1;
    if (c > max_commits) break;
    commit_note& note = o.commits[c];
    std::uint32_t puts = 0;
    std::uint32_t erases = 0;
    const int n = 1 + static_cast<int>(rng() % 3);
    for (int j = 0; j < n; ++j) {
      const std::uint32_t bit = std::uint32_t{1} << (rng() % key_count);
      if (((puts | erases) & bit) != 0) continue;
      (rng() % 6 == 0 ? erases : puts) |= bit;
    }
    const bool sync = rng() % 4 == 0;
    // Noted before the commit: a commit the checker sees was always noted.
    note.puts.store(puts);
    note.erases.store(erases);
    o.attempted.store(c);
    auto t = (*s)->begin();
    bool staged = static_cast<bool>(t);
    for (int k = 0; staged && k < key_count; ++k) {
      if ((puts >> k & 1) != 0) staged = static_cast<bool>(t->put(key_name(k), value_for(c, k)));
      if ((erases >> k & 1) != 0) staged = static_cast<bool>(t->erase(key_name(k)));
    }
    if (!staged) {
      if (errors_expected) continue;
      o.report("commit %u: begin or a write failed", c);
      return 3;
    }
    auto r = t->commit(sync ? kv::durability::sync : kv::durability::none);
    if (r) {
      note.acked.store(1);
      if (sync) o.durable.store(c);
    } else if (!errors_expected) {
      o.report("commit %u failed: %s", c, r.error().message().c_str());
      return 4;
    }
    if (rng() % 40 == 0) {
      auto cs = (*s)->compact();
      if (!cs && !errors_expected) {
        o.report("compact failed: %s", cs.error().message().c_str());
        return 5;
      }
    }
    if (rng() % 60 == 0) {
      auto cp = (*s)->checkpoint();
      if (!cp && !errors_expected) {
        o.report("checkpoint failed: %s", cp.error().message().c_str());
        return 6;
      }
    }
  }
  return 0;
}

// A reboot empties /dev/shm, where the lock file's shared map lives
// (doc/lock-formats.md, memory_map): it goes with the index.
void reboot(const std::string& path) {
  std::ifstream f(path + "/lock", std::ios::binary);
  std::array<char, 256> header{};
  if (f.read(header.data(), header.size())) {
    const std::string map(header.data() + 48, ::strnlen(header.data() + 48, 208));
    if (map.starts_with("/dev/shm/keel-mm-")) std::filesystem::remove(map);
  }
  std::error_code ignored;
  std::filesystem::remove(path + "/index", ignored);
}

struct key_state {
  bool read = false;       // the read answered (a value, or not found)
  std::uint32_t seen = 0;  // the commit whose value it read (0: not found)
};

// What the checker finds wrong (in a child: the store may crash it).
class checker {
 public:
  checker(const kv_oracle& o, mode how) : o_(o), how_(how) {}

  int run(const std::string& path) {
    kv::options opts = store_options(io::os());
    opts.create_if_missing = false;
    auto s = kv::store::open(path, opts);
    if (!s) {
      if (how_ == mode::corrupt && clear(s.error())) return 0;
      // Never made (its writer's first operations failed or lost power): nothing was promised.
      if (s.error() == std::errc::no_such_file_or_directory && nothing_promised()) return 0;
      report("the store did not open: %s", s.error().message().c_str());
      return 7;
    }
    std::array<key_state, key_count> state{};
    for (int k = 0; k < key_count; ++k) {
      auto v = (*s)->get(key_name(k));
      if (v) {
        const std::uint32_t c = commit_of(*v, k);
        if (c == 0 || c > o_.attempted.load() || (o_.commits[c].puts.load() >> k & 1) == 0 ||
            *v != value_for(c, k)) {
          report("%s: a value no commit of it wrote: %.40s", key_name(k).c_str(), v->c_str());
          return 8;
        }
        state[static_cast<std::size_t>(k)] = {true, c};
      } else if (v.error() == errc::not_found) {
        state[static_cast<std::size_t>(k)] = {true, 0};
      } else if (how_ != mode::corrupt || !clear(v.error())) {
        report("%s: %s", key_name(k).c_str(), v.error().message().c_str());
        return 9;
      }
    }
    for (int k = 0; k < key_count; ++k) {
      if (!state[static_cast<std::size_t>(k)].read) continue;
      if (auto why = older_than_promised(k, state[static_cast<std::size_t>(k)].seen)) {
        report("%s", why->c_str());
        return 10;
      }
      if (how_ == mode::corrupt) continue;
      if (auto why = half_seen(k, state)) {
        report("%s", why->c_str());
        return 11;
      }
    }
    if (how_ == mode::corrupt) {
      (void)(*s)->verify();  // must neither crash nor hang; damage is its to report
      return 0;
    }
    auto v = (*s)->verify();
    if (!v) {
      report("verify after %s: %s", std::string(to_string(how_)).c_str(),
             v.error().message().c_str());
      return 12;
    }
    return 0;
  }

  [[nodiscard]] const char* message() const noexcept { return message_.c_str(); }

 private:
  // An error that names what is wrong (damage, a missing file), not a crash in disguise.
  static bool clear(const error& e) noexcept {
    return e == errc::corrupt || e == errc::not_keel_file || e == errc::unsupported_version ||
           e == std::errc::no_such_file_or_directory || e == std::errc::invalid_argument ||
           e == std::errc::io_error || e == errc::read_only || e == errc::sync_failed ||
           e.category() == std::system_category();
  }

  [[nodiscard]] bool nothing_promised() const noexcept {
    for (int k = 0; k < key_count; ++k) {
      if (floor_of(k) != 0) return false;
    }
    return true;
  }

  [[nodiscard]] bool touches(std::uint32_t c, int k) const noexcept {
    return ((o_.commits[c].puts.load() | o_.commits[c].erases.load()) >> k & 1) != 0;
  }
  [[nodiscard]] bool erased_by(std::uint32_t c, int k) const noexcept {
    return (o_.commits[c].erases.load() >> k & 1) != 0;
  }

  // The newest commit of key k the store promised to keep (0: none).
  [[nodiscard]] std::uint32_t floor_of(int k) const noexcept {
    const std::uint32_t last = how_ == mode::powerloss ? o_.durable.load() : o_.attempted.load();
    for (std::uint32_t c = last; c > 0; --c) {
      if (touches(c, k) && o_.commits[c].acked.load() != 0) return c;
    }
    return 0;
  }

  // Whether key k showing commit `seen` (0: not found) is at least what was promised.
  [[nodiscard]] std::optional<std::string> older_than_promised(int k, std::uint32_t seen) const {
    const std::uint32_t floor = floor_of(k);
    const std::string name = key_name(k);
    if (seen != 0) {
      if (seen < floor) {
        return name + ": commit " + std::to_string(seen) + " read, " + std::to_string(floor) +
               " was promised";
      }
      if (how_ == mode::corrupt && seen != floor) {
        return name + ": commit " + std::to_string(seen) + " read, the newest is " +
               std::to_string(floor);
      }
      return std::nullopt;
    }
    // Not found: the newest promised is an erase (or nothing), or a later erase was tried.
    if (floor == 0 || erased_by(floor, k)) return std::nullopt;
    if (how_ != mode::corrupt) {
      for (std::uint32_t c = floor + 1; c <= o_.attempted.load(); ++c) {
        if (erased_by(c, k)) return std::nullopt;
      }
    }
    return name + ": not found, commit " + std::to_string(floor) + " (a put) was promised";
  }

  // Whether the commit key k shows is seen whole: every key it wrote shows it or newer.
  [[nodiscard]] std::optional<std::string> half_seen(
      int k, const std::array<key_state, key_count>& state) const {
    const std::uint32_t c = state[static_cast<std::size_t>(k)].seen;
    if (c == 0) return std::nullopt;
    for (int j = 0; j < key_count; ++j) {
      if (j == k || !touches(c, j) || !state[static_cast<std::size_t>(j)].read) continue;
      const std::uint32_t other = state[static_cast<std::size_t>(j)].seen;
      if (other >= c) continue;
      if (other == 0) {
        // Not found: c erased it, or a later commit did.
        if (erased_by(c, j)) continue;
        bool later = false;
        for (std::uint32_t d = c + 1; d <= o_.attempted.load(); ++d)
          later |= erased_by(d, j);
        if (later) continue;
      }
      return "commit " + std::to_string(c) + " seen half: " + key_name(k) + " shows it, " +
             key_name(j) + " shows " + std::to_string(other);
    }
    return std::nullopt;
  }

  void report(const char* format, ...) __attribute__((format(printf, 2, 3))) {
    char buf[512];
    va_list ap;
    va_start(ap, format);
    std::vsnprintf(buf, sizeof buf, format, ap);
    va_end(ap);
    message_ = buf;
  }

  const kv_oracle& o_;
  mode how_;
  std::string message_;
};

// Runs the checker in a child (the store may crash it): nothing, or what it found.
std::optional<std::string> check(const kv_oracle& o, mode how, const std::string& path) {
  shared_oracle verdict;
  const pid_t pid = spawn([&] {
    checker c(o, how);
    const int code = c.run(path);
    if (code != 0) verdict->report("%s", c.message());
    return code;
  });
  const exit_status s = wait_for(pid, 60s);
  if (verdict->message_taken.load() != 0) return std::string(verdict->message);
  if (!s.clean()) return "the checker " + s.describe();
  return std::nullopt;
}

// The newest commit of key k that was acknowledged (0: none), and whether it put it.
std::uint32_t newest_acked(const kv_oracle& o, int k) {
  for (std::uint32_t c = o.attempted.load(); c > 0; --c) {
    const std::uint32_t touched = o.commits[c].puts.load() | o.commits[c].erases.load();
    if ((touched >> k & 1) != 0 && o.commits[c].acked.load() != 0) return c;
  }
  return 0;
}

// Every byte of a file open in `f`, which is left at its start.
std::string contents_of(std::istream& f) {
  f.seekg(0, std::ios::end);
  const std::streamoff size = f.tellg();
  std::string out(size > 0 ? static_cast<std::size_t>(size) : 0, '\0');
  f.seekg(0);
  f.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<std::size_t>(std::max<std::streamsize>(f.gcount(), 0)));
  f.clear();
  f.seekg(0);
  return out;
}

// Flips a bit in (or just before: its record's header) the newest value of a random key,
// where damage matters most: what it did, or "" when no such value was found.
std::string damage_a_live_value(const kv_oracle& o, const std::string& path, std::mt19937_64& rng) {
  const int k = static_cast<int>(rng() % key_count);
  const std::uint32_t c = newest_acked(o, k);
  if (c == 0 || (o.commits[c].puts.load() >> k & 1) == 0) return "";
  const std::string value = value_for(c, k);
  for (const auto& e : std::filesystem::directory_iterator(path + "/seg")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    const std::string bytes = contents_of(f);
    const std::size_t at = bytes.rfind(value.substr(0, std::min<std::size_t>(value.size(), 64)));
    if (at == std::string::npos) continue;
    const std::size_t from = at >= 64 ? at - 64 : 0;
    const std::size_t where = from + rng() % (at - from + value.size());
    f.seekp(static_cast<std::streamoff>(where));
    f.put(static_cast<char>(bytes[where] ^ (1 << (rng() % 8))));
    return "seg/" + e.path().filename().string() + ": bit flipped at " + std::to_string(where) +
           " in or before the newest value of " + key_name(k);
  }
  return "";
}

// Damages one file of the closed store at `path`: what it did.
std::string damage(const kv_oracle& o, const std::string& path, std::mt19937_64& rng) {
  if (rng() % 2 == 0) {
    if (std::string what = damage_a_live_value(o, path, rng); !what.empty()) return what;
  }
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    if (!e.is_regular_file()) continue;
    // Segments, where the data is, most of the time.
    const bool segment = e.path().parent_path().filename() == "seg";
    for (int w = 0; w < (segment ? 4 : 1); ++w)
      files.push_back(e.path().string());
  }
  if (files.empty()) return "nothing to damage";
  std::sort(files.begin(), files.end());
  const std::string victim = files[rng() % files.size()];
  const std::string name = std::filesystem::relative(victim, path).string();
  std::string bytes;
  {
    std::ifstream in(victim, std::ios::binary);
    bytes = contents_of(in);
  }
  // Where something was written: damage there matters.
  std::size_t used = bytes.size();
  while (used > 0 && bytes[used - 1] == '\0')
    --used;
  const std::uint64_t kind = rng() % 8;
  std::string what;
  if (kind == 7 || bytes.empty()) {
    std::filesystem::remove(victim);
    return name + ": removed";
  }
  if (kind == 6) {
    const std::size_t to = rng() % bytes.size();
    std::filesystem::resize_file(victim, to);
    return name + ": cut to " + std::to_string(to) + " bytes";
  }
  if (kind >= 3) {
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < flips; ++i) {
      const std::size_t at = rng() % std::max<std::size_t>(used, 1);
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
      what += "bit flipped at " + std::to_string(at) + "; ";
    }
  } else {
    const std::size_t from = rng() % std::max<std::size_t>(used, 1);
    const std::size_t len = 1 + rng() % std::min<std::size_t>(bytes.size() - from, 600);
    std::memset(bytes.data() + from, 0, len);
    what = "zeroed [" + std::to_string(from) + ", " + std::to_string(from + len) + ")";
  }
  std::ofstream out(victim, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return name + ": " + what;
}

}  // namespace

std::optional<std::string> kv_cycle(mode how, const std::string& dir, const std::string& map_dir,
                                    std::uint64_t seed) {
  (void)map_dir;  // the store's lock maps go where memory_map puts them (/dev/shm)
  std::mt19937_64 rng(seed);
  const std::string root = dir + "/root";
  const std::string shadow = dir + "/shadow";
  std::filesystem::create_directories(root);
  const std::string path = root + "/store";
  shared_oracle o;
  const std::uint64_t writer_seed = rng();
  std::string how_text;
  if (how == mode::kill || how == mode::corrupt) {
    const int rounds = how == mode::kill ? static_cast<int>(max_commits) : 150;
    const pid_t pid = spawn([&] { return write(*o, path, io::os(), writer_seed, rounds, false); });
    if (how == mode::kill) {
      // At a random moment once it is at work: a start slowed by a sanitizer or a busy
      // machine must not turn the cycles into kills before the first commit.
      const std::uint32_t after = 1 + static_cast<std::uint32_t>(rng() % 100);
      (void)wait_until(
          pid, [&] { return o->attempted.load() >= after; }, 60s);
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 3000));
      ::kill(pid, SIGKILL);
    }
    const exit_status s = wait_for(pid, 60s);
    if (o->message_taken.load() != 0) return std::string(o->message);
    if (how == mode::kill && s.signal != SIGKILL && !s.clean()) {
      return "the writer " + s.describe();
    }
    if (how == mode::corrupt && !s.clean()) return "the writer " + s.describe();
    how_text = how == mode::kill
                   ? "killed after " + std::to_string(o->attempted.load()) + " commits tried"
                   : damage(*o, path, rng);
  } else {
    io::fault_filesystem::fault bad;
    bad.nth = 1 + rng() % 600;
    if (how == mode::powerloss) {
      bad.crash = true;
      how_text = "power cut at operation " + std::to_string(bad.nth);
    } else {
      static constexpr std::array<int, 6> errors{EIO, ENOSPC, EDQUOT, EMFILE, ENOMEM, EAGAIN};
      bad.error = errors[rng() % errors.size()];
      // EAGAIN: what mmap says when it cannot lock or find the memory; elsewhere it means
      // "busy", a different story.
      if (bad.error == EAGAIN) bad.on = io::fs_op::map;
      bad.repeat = rng() % 2 == 0 ? io::fault_filesystem::fault::repeat::once
                                  : io::fault_filesystem::fault::repeat::forever;
      bad.partial = rng() % 4 == 0;
      // One cycle in four aims at one of the store's files that few operations touch (the
      // manifest changes once per segment made, the store file never after it is made):
      // counted over every file, a fault almost never lands there (a bug in the manifest's
      // writing took a thousand cycles and more to show).
      static constexpr std::array<const char*, 4> rare{"/manifest", "/checkpoint", "/seg/",
                                                       "/index"};
      if (rng() % 4 == 0) {
        bad.path_contains = rare[rng() % rare.size()];
        bad.nth = 1 + rng() % 30;
      }
      how_text = (bad.path_contains.empty() ? "" : "on " + bad.path_contains + ", ") +
                 "operation " + std::to_string(bad.nth) + " failing " +
                 (bad.repeat == io::fault_filesystem::fault::repeat::once ? "once" : "forever") +
                 " with " + std::strerror(bad.error) + (bad.partial ? " after a part" : "");
    }
    const pid_t pid = spawn([&] {
      io::fault_filesystem fs(io::os(), writer_seed);
      if (!fs.track(root, shadow)) return 20;
      fs.inject(bad);
      const int code = write(*o, path, fs, writer_seed, 200, how == mode::io_errors);
      if (how == mode::powerloss) fs.crash_now();
      return code;
    });
    const exit_status s = wait_for(pid, 90s);
    if (o->message_taken.load() != 0) return std::string(o->message) + " (" + how_text + ")";
    if (how == mode::powerloss) {
      if (s.signal != SIGKILL) return "the writer that lost power " + s.describe();
      io::fault_filesystem::crash_options cut;
      cut.torn = rng() % 2 == 0;
      cut.seed = rng();
      auto r = io::fault_filesystem::restore(root, shadow, cut);
      if (!r) return "restore failed: " + r.error().message();
      how_text += cut.torn ? ", torn writes kept" : ", unsynced writes lost";
    } else if (!s.clean()) {
      return "the writer whose I/O failed " + s.describe() + " (" + how_text + ")";
    }
  }
  const bool rebooted = how == mode::powerloss || rng() % 2 == 0;
  if (rebooted) {
    reboot(path);
    how_text += ", rebooted";
  }
  auto f = check(*o, how, path);
  if (f) *f += " (" + how_text + ")";
  // The store's lock map, whatever the cycle left (the checker's process is gone).
  reboot(path);
  return f;
}

}  // namespace keel::torture::detail
