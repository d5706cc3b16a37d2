// keel kv: the store from the shell. Binary-safe (values through stdin and stdout, keys in hex
// with --hex), with exit codes scripts can test (see kv_command.hpp).

#include "kv_command.hpp"
#include "keel/kv/batch_writer.hpp"
#include "kv_dump.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

#include "keel/kv/store.hpp"

namespace keel::tools {
namespace {

constexpr int exit_ok = 0;
constexpr int exit_not_found = 1;
constexpr int exit_usage = 2;
constexpr int exit_corrupt = 3;
constexpr int exit_conflict = 4;
constexpr int exit_error = 5;
constexpr int exit_budget = 6;

int fail(const std::string& what, const error& e) {
  fmt::print(stderr, "keel kv: {}: {}\n", what, e.message());
  if (what == "open" && e == std::errc::device_or_resource_busy) {
    fmt::print(stderr,
               "keel kv: another process has the store open: a reader that may not write the "
               "store's files builds an index of its own at open, which it can do only while "
               "no other user has the store open, and no opener builds an index beside a user "
               "of one removed from the store; try again once they have closed it\n");
  } else if (what == "open" && e == std::errc::timed_out) {
    fmt::print(stderr,
               "keel kv: another user kept the store busy past the lock timeout (while it opened "
               "the store, or built a read-only index of its own); try again\n");
  } else if (e == std::errc::timed_out) {
    fmt::print(stderr,
               "keel kv: a lock of the store stayed held past the lock timeout (30 s): another "
               "user holds it, perhaps a process stopped mid-commit (`keel kv PATH stats` lists "
               "the users); nothing of this {} was done\n",
               what);
  }
  if (e == errc::not_found) return exit_not_found;
  if (e == errc::corrupt || e == errc::not_keel_file || e == errc::unsupported_version) {
    return exit_corrupt;
  }
  if (e == errc::conflict) return exit_conflict;
  if (e == errc::budget_reached) return exit_budget;
  return exit_error;
}

bool from_hex(const std::string& in, std::string& out) {
  if (in.size() % 2 != 0) return false;
  out.clear();
  for (std::size_t i = 0; i < in.size(); i += 2) {
    unsigned v = 0;
    if (std::sscanf(in.c_str() + i, "%2x", &v) != 1 ||
        std::isxdigit(static_cast<unsigned char>(in[i])) == 0 ||
        std::isxdigit(static_cast<unsigned char>(in[i + 1])) == 0) {
      return false;
    }
    out.push_back(static_cast<char>(v));
  }
  return true;
}

std::string to_hex(std::string_view in) {
  std::string out;
  for (const char c : in)
    out += fmt::format("{:02x}", static_cast<unsigned char>(c));
  return out;
}

// A key or value for JSON: text when it is valid printable UTF-8-free ASCII, else hex.
nlohmann::json printable(std::string_view s) {
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u >= 0x7f) return {{"hex", to_hex(s)}};
  }
  return std::string(s);
}

// The value as it is, through stdio (binary-safe): a short write is an error.
bool write_all(std::string_view s) {
  return std::fwrite(s.data(), 1, s.size(), stdout) == s.size() && std::fflush(stdout) == 0;
}

// When a process started, from its start in clock ticks since boot: "YYYY-MM-DD HH:MM:SS" in
// local time, or "unknown".
std::string started_at(std::uint64_t ticks) {
  std::ifstream stat("/proc/stat");
  long long boot = 0;
  for (std::string word; stat >> word;) {
    if (word == "btime") {
      stat >> boot;
      break;
    }
  }
  const long hz = ::sysconf(_SC_CLK_TCK);
  if (ticks == 0 || boot == 0 || hz <= 0) return "unknown";
  const std::time_t at = static_cast<std::time_t>(boot + static_cast<long long>(ticks) / hz);
  std::tm local{};
  if (::localtime_r(&at, &local) == nullptr) return "unknown";
  char out[32];
  std::strftime(out, sizeof out, "%Y-%m-%d %H:%M:%S", &local);
  return out;
}

// keel kv load: all-or-nothing into a new store (store::build), in batches into one that exists.
int run_load(const std::string& path, const std::string& from, bool sync, std::uint64_t max_bytes,
             bool single_host) {
  std::FILE* in = from == "-" ? stdin : std::fopen(from.c_str(), "rb");
  if (in == stdin && ::isatty(STDIN_FILENO) == 1) {
    fmt::print(stderr, "keel kv: load: reading a dump from the terminal; end it with Ctrl-D\n");
  }
  if (in == nullptr) {
    fmt::print(stderr, "keel kv: load: {}: {}\n", from, std::strerror(errno));
    return exit_error;
  }
  std::string why;
  std::uint64_t failed_line = 0;
  std::uint64_t keys = 0;
  const auto fill = [&](kv::store& s) -> result<void> {
    kv::batch_writer batch(s);
    auto n = read_dump(
        in, [&](std::string_view k, std::string_view v) { return batch.put(k, v); }, why,
        failed_line);
    if (!n) return std::unexpected(n.error());
    keys = *n;
    return batch.finish(sync ? kv::durability::sync : kv::durability::none);
  };
  kv::options o;
  o.max_bytes = max_bytes;
  o.every_user_on_this_host = single_host;
  std::error_code ec;
  const bool fresh = !std::filesystem::exists(std::filesystem::symlink_status(path, ec));
  // (A link to an empty directory too: what the store would be made in.)
  if (!fresh && std::filesystem::is_directory(std::filesystem::status(path, ec)) &&
      std::filesystem::is_empty(path, ec) && !ec) {
    if (in != stdin) std::fclose(in);
    fmt::print(stderr,
               "keel kv: load: {} is an empty directory: a load makes a new store only where "
               "PATH does not exist (all or nothing); remove the directory, or name a path "
               "that does not exist\n",
               path);
    return exit_usage;
  }
  result<void> r;
  if (fresh) {
    r = kv::store::build(path, o, fill);
  } else {
    o.create_if_missing = false;
    auto s = kv::store::open(path, o);
    if (!s) {
      if (in != stdin) std::fclose(in);
      return fail("open", s.error());
    }
    r = fill(**s);
  }
  if (in != stdin) std::fclose(in);
  if (!r && !why.empty()) {
    fmt::print(stderr, "keel kv: load: {}: {}{}\n", from == "-" ? "stdin" : from, why,
               fresh ? " (nothing was made)"
                     : " (the batches committed before it stay in the store: load the same "
                       "dump again once it is mended)");
    return exit_usage;
  }
  if (!r) {
    if (failed_line != 0) {
      fmt::print(stderr, "keel kv: load: at the key on line {} of the dump\n", failed_line);
    }
    return fail(fresh ? "load (nothing was made)" : "load (the batches before this stay)",
                r.error());
  }
  // (Entries of the dump: a key it gives twice is one key in the store, holding the later.)
  fmt::print("loaded {} entries into {}{}\n", keys, path,
             fresh ? " (a new store, made whole)" : " (an existing store)");
  return exit_ok;
}

// The word where a subcommand should be that names none of `app`'s (empty if there is none):
// the second argument that is not an option or an option's value (the first is PATH).
std::string unknown_subcommand(const CLI::App& app, int argc, char** argv) {
  int positional = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    if (a == "--max-bytes") {
      ++i;
      continue;
    }
    if (a.starts_with("-")) continue;
    if (++positional < 2) continue;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      if (sub->get_name() == a) return {};
    }
    return std::string(a);
  }
  return {};
}

}  // namespace

int run_kv_command(int argc, char** argv) {
  CLI::App app{kv_command_summary, "keel kv"};
  app.footer(
      "Exit status: 0 ok, 1 key not found, 2 usage error, 3 corrupt or not a store, 4 conflict,\n"
      "5 any other error (the message says which), 6 the --max-bytes budget is reached (del\n"
      "and compact still work then).");
  std::string path;
  bool hex = false;
  bool sync = false;
  app.add_option("PATH", path, "The store (a directory; made by put if absent)")->required();
  app.add_flag("--hex", hex, "Keys (and, for put, the value argument) are given in hex");
  app.add_flag("--sync", sync, "put/del: return once the change is on stable storage");
  std::uint64_t max_bytes = 0;
  app.add_option("--max-bytes", max_bytes,
                 "put: fail (exit 6) rather than let the store's files grow past this many "
                 "bytes; at least three of its segments (a new store's start at 256 KiB and "
                 "grow to a 256th of this) and its index: 1626112 for a new store")
      ->check(CLI::Validator(
          [](std::string& in) -> std::string {
            // (CLI11 reads "-1" into an unsigned as its wrapped value: no budget at all.)
            // (from_chars takes digits only: no sign, no space; out of range is refused.)
            std::uint64_t v = 0;
            const auto [end, ec] = std::from_chars(in.data(), in.data() + in.size(), v);
            if (ec != std::errc{} || end != in.data() + in.size()) {
              return "a number of bytes from 0 to 18446744073709551615, not '" + in + "'";
            }
            return {};
          },
          "BYTES"));
  bool single_host = false;
  app.add_flag("--single-host", single_host,
               "Every user of the store is on this host, through this mount: open it on a "
               "network, cluster or FUSE filesystem (refused otherwise)");
  app.require_subcommand(1, 1);
  app.fallthrough();  // --hex and --sync after the subcommand too

  std::string key;
  std::string value;
  auto* put = app.add_subcommand("put", "Store VALUE (or stdin when it is - or absent) at KEY");
  put->add_option("KEY", key, "The key (1 to 1024 bytes)")->required();
  put->add_option("VALUE", value, "The value; - or absent: read it from stdin");
  auto* get = app.add_subcommand("get", "Write the value of KEY to stdout, as it is");
  get->add_option("KEY", key, "The key")->required();
  auto* del = app.add_subcommand("del", "Remove KEY (exit 1 if absent)");
  del->add_option("KEY", key, "The key")->required();
  bool keys_only = false;
  bool json = false;
  auto* scan = app.add_subcommand("scan", "List every key and value (hash order)");
  scan->add_flag("--keys-only", keys_only, "Keys only");
  scan->add_flag("--json", json, "JSON lines: {\"key\":...,\"value\":...} (hex objects for bytes)");
  bool nul = false;
  scan->add_flag("-0,--null", nul,
                 "KEY NUL VALUE NUL for each key (KEY NUL with --keys-only), bytes as they are");
  auto* stats = app.add_subcommand("stats", "Counts and sizes");
  stats->add_flag("--json", json, "As JSON");
  auto* verify = app.add_subcommand("verify", "Read every block and live value; check checksums");
  auto* compact = app.add_subcommand(
      "compact", "Move live records out of mostly dead segments and remove those files");
  compact->add_flag("--json", json, "As JSON");
  auto* checkpoint = app.add_subcommand(
      "checkpoint",
      "Write a checkpoint now: after a power loss, the next open replays only the log since");
  std::string dest;
  auto* salvage = app.add_subcommand(
      "salvage",
      "Copy the newest readable version of every key into a new store DEST, reading the "
      "segments directly (for a damaged store, also one that will not open); list what could "
      "not be read. Exit 0 when everything was read, 3 when something was not (DEST is "
      "written either way)");
  salvage->add_option("DEST", dest, "The new store (absent, or an empty directory)")->required();
  auto* backup = app.add_subcommand(
      "backup",
      "Copy the store, as it is when the backup begins, into a new store DEST while readers "
      "and writers go on: every commit acknowledged before it is in the copy, none that began "
      "after; live records only (as mdb_copy -c). DEST is made beside under a hidden name and "
      "renamed once whole and durable: it is a whole copy or absent");
  backup->add_option("DEST", dest, "The new store (must not exist)")->required();
  bool live_only = false;
  backup->add_flag("--compact", live_only,
                   "Live records only, as mdb_copy -c: what every backup writes (accepted for "
                   "those used to asking)");
  bool print_format = false;
  auto* dump = app.add_subcommand(
      "dump",
      "Write the store, one snapshot of it, to stdout as text in mdb_dump's format (which "
      "mdb_load and keel kv load read back): binary-safe, one line per key and per value");
  dump->add_flag("--print", print_format,
                 "Printable bytes as they are (mdb_dump -p); the rest as \\xx. LMDB 0.9's "
                 "mdb_dump -p and mdb_load mishandle backslashes: with them, use the default");
  std::string from = "-";
  auto* load = app.add_subcommand(
      "load",
      "Put every key of a dump (keel kv dump's or mdb_dump's) into the store. Where PATH does "
      "not exist, load is all-or-nothing: the store is made beside PATH and appears only once "
      "whole and durable. Into a store that exists, it commits in batches: an error leaves the "
      "batches before it, and loading the same dump again finishes the job. A dump keel "
      "cannot read exits 2 naming the line");
  load->add_option("FILE", from, "The dump (- or absent: stdin)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 says only "a subcommand is required" of one it does not know: name it.
    if (const std::string word = unknown_subcommand(app, argc, argv); !word.empty()) {
      fmt::print(stderr, "keel kv: no subcommand '{}' (keel kv --help lists them)\n", word);
      return exit_usage;
    }
    const int code = app.exit(e);
    return code == 0 ? exit_ok : exit_usage;
  }
  const bool from_stdin = put->parsed() && (put->count("VALUE") == 0 || value == "-");
  if (hex) {
    std::string raw;
    if ((*put || *get || *del) && !from_hex(key, raw)) {
      fmt::print(stderr, "keel kv: --hex: '{}' is not hex\n", key);
      return exit_usage;
    }
    key = raw;
    if (*put && !from_stdin) {
      if (!from_hex(value, raw)) {
        fmt::print(stderr, "keel kv: --hex: the value is not hex\n");
        return exit_usage;
      }
      value = raw;
    }
  }
  if ((*put || *get || *del) && (key.empty() || key.size() > kv::max_key_size)) {
    fmt::print(stderr, "keel kv: the key is {} bytes: keys are 1 to {} bytes\n", key.size(),
               kv::max_key_size);
    return exit_usage;
  }
  if (*put && !from_stdin && value.size() > kv::max_value_size) {
    fmt::print(stderr, "keel kv: the value is {} bytes: values are at most {} bytes (1 GiB)\n",
               value.size(), kv::max_value_size);
    return exit_usage;
  }
  if (*salvage) {
    kv::options made;
    made.durable = kv::durability::none;
    made.every_user_on_this_host = single_host;
    auto r = kv::store::salvage(path, dest, made);
    if (!r) return fail("salvage", r.error());
    for (const kv::damage& d : r->unreadable) {
      fmt::print("unreadable: {} at offset {}: {}\n", d.file, d.offset, d.what);
    }
    for (const auto& k : r->older) {
      fmt::print("older: {}: {}\n", hex ? to_hex(k.key) : k.key, k.what);
    }
    fmt::print("salvaged {} keys into {} ({} erased, {} commits read, {} torn by a power cut)\n",
               r->keys, dest, r->erased, r->commits, r->torn);
    return r->unreadable.empty() && r->older.empty() ? exit_ok : exit_corrupt;
  }
  if (*load) return run_load(path, from, sync, max_bytes, single_host);
  kv::options o;
  o.create_if_missing = put->parsed();
  o.read_only = !(put->parsed() || del->parsed() || compact->parsed() || checkpoint->parsed());
  o.durable = sync ? kv::durability::sync : kv::durability::none;
  o.max_bytes = max_bytes;
  o.every_user_on_this_host = single_host;
  auto s = kv::store::open(path, o);
  if (!s && max_bytes != 0 && s.error() == std::errc::invalid_argument) {
    fmt::print(stderr,
               "keel kv: --max-bytes {} is too small for this store: it must hold three of its "
               "segments (four where their size is fixed) and the index (a new store: at "
               "least 1626112)\n",
               max_bytes);
    return exit_usage;
  }
  if (!s) {
    const int code = fail("open", s.error());
    std::error_code ec;
    if (!o.read_only && std::filesystem::exists(path + "/keel-kv", ec) &&
        (s.error() == std::errc::read_only_file_system ||
         s.error() == std::errc::permission_denied)) {
      fmt::print(stderr,
                 "keel kv: get, scan, dump, stats, verify, backup and salvage read a store that "
                 "cannot be written here\n");
    }
    return code;
  }

  if (*put) {
    if (from_stdin) {
      // A user at a terminal who gave no value would otherwise wait on a silent prompt.
      if (::isatty(STDIN_FILENO) == 1) {
        fmt::print(stderr,
                   "keel kv: put: reading the value from the terminal; end it with Ctrl-D\n");
      }
      value.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
      if (value.size() > kv::max_value_size) {
        fmt::print(stderr, "keel kv: the value is {} bytes: values are at most {} bytes (1 GiB)\n",
                   value.size(), kv::max_value_size);
        return exit_usage;
      }
    }
    auto r = (*s)->put(key, value);
    return r ? exit_ok : fail("put", r.error());
  }
  if (*get) {
    auto v = (*s)->get(key);
    if (!v) return fail("get", v.error());
    return write_all(*v) ? exit_ok : exit_error;
  }
  if (*del) {
    auto r = (*s)->erase(key);
    return r ? exit_ok : fail("del", r.error());
  }
  if (*scan) {
    // One snapshot for every page: the listing is the store as it was at one moment.
    auto t = (*s)->begin();
    if (!t) return fail("scan", t.error());
    std::string cursor;
    std::string out;
    for (;;) {
      auto page = t->scan(cursor, 1024, keys_only);
      if (!page) return fail("scan", page.error());
      for (const auto& it : page->items) {
        out.clear();
        if (json) {
          nlohmann::json line{{"key", printable(it.key)}};
          if (!keys_only) line["value"] = printable(it.value);
          out = line.dump() + '\n';
        } else if (nul) {
          out.append(it.key).push_back('\0');
          if (!keys_only) out.append(it.value).push_back('\0');
        } else if (keys_only) {
          out = (hex ? to_hex(it.key) : it.key) + '\n';
        } else {
          // --hex: the value too, so that a line is one key and one value whatever the bytes.
          out = (hex ? to_hex(it.key) : it.key) + '\t' + (hex ? to_hex(it.value) : it.value) + '\n';
        }
        if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size()) break;
      }
      if (page->done || std::ferror(stdout)) break;
      cursor = page->cursor;
    }
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
      fmt::print(stderr, "keel kv: scan: writing the output: {}\n", std::strerror(errno));
      return exit_error;
    }
    return exit_ok;
  }
  if (*stats) {
    auto st = (*s)->stats();
    if (!st) return fail("stats", st.error());
    if (json) {
      nlohmann::json j{{"records", st->records},
                       {"live_bytes", st->live_bytes},
                       {"dead_bytes", st->dead_bytes},
                       {"segments", st->segments},
                       {"segment_bytes", st->segment_bytes},
                       {"index_bytes", st->index_bytes},
                       {"index_pages", st->index_pages},
                       {"index_free_pages", st->index_free_pages},
                       {"index_load", st->index_load},
                       {"visible_seq", st->visible_seq},
                       {"checkpoint_seq", st->checkpoint_seq},
                       {"unchecked_bytes", st->unchecked_bytes},
                       {"replayed_bytes", st->replayed_bytes},
                       {"checkpoint_errno", st->checkpoint_errno},
                       {"compactions", st->compactions},
                       {"users", nlohmann::json::array()}};
      for (const kv::store_user& u : st->users) {
        j["users"].push_back(
            {{"pid", u.pid},
             {"started", started_at(u.started)},
             {"slots", u.slots},
             {"oldest_snapshot", u.reading ? nlohmann::json(u.oldest_snapshot) : nlohmann::json()},
             {"commits_behind", u.reading ? st->visible_seq - u.oldest_snapshot : 0},
             {"dead", u.dead},
             {"self", u.self}});
      }
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print("records        {}\n", st->records);
      fmt::print("live bytes     {}\n", st->live_bytes);
      fmt::print("dead bytes     {}\n", st->dead_bytes);
      fmt::print("segments       {} ({} bytes), {} compactions since the index was built\n",
                 st->segments, st->segment_bytes, st->compactions);
      fmt::print("index          {} bytes, {} bucket pages, load {:.2f}, {} free pages\n",
                 st->index_bytes, st->index_pages, st->index_load, st->index_free_pages);
      fmt::print("visible seq    {}\n", st->visible_seq);
      fmt::print("checkpoint     at seq {}, {} bytes of log since", st->checkpoint_seq,
                 st->unchecked_bytes);
      if (st->checkpoint_errno != 0) {
        fmt::print(" (the last one failed: {})",
                   std::make_error_code(static_cast<std::errc>(st->checkpoint_errno)).message());
      }
      fmt::print("\n");
      if (st->replayed_bytes != 0) {
        fmt::print("this open      rebuilt the index, replaying {} bytes of log\n",
                   st->replayed_bytes);
      }
      for (const kv::store_user& u : st->users) {
        fmt::print("user           pid {}{}, started {}, {} slot{}", u.pid,
                   u.self ? " (this command)" : "", started_at(u.started), u.slots,
                   u.slots == 1 ? "" : "s");
        if (u.reading) {
          fmt::print(
              ", reads the snapshot at seq {} ({} commits behind: it holds their old "
              "versions)",
              u.oldest_snapshot, st->visible_seq - u.oldest_snapshot);
        }
        fmt::print("{}\n", u.dead ? ", dead (its slots go to the next user)" : "");
      }
    }
    return exit_ok;
  }
  if (*compact) {
    auto c = (*s)->compact();
    if (!c) return fail("compact", c.error());
    if (json) {
      nlohmann::json j{
          {"segments_removed", c->segments_removed}, {"records_moved", c->records_moved},
          {"bytes_moved", c->bytes_moved},           {"bytes_freed", c->bytes_freed},
          {"erasures_dropped", c->erasures_dropped}, {"records_unreadable", c->records_unreadable}};
      fmt::print("{}\n", j.dump(2));
    } else {
      fmt::print(
          "removed {} segments ({} bytes), moved {} records ({} bytes), forgot {} erased "
          "keys\n",
          c->segments_removed, c->bytes_freed, c->records_moved, c->bytes_moved,
          c->erasures_dropped);
      if (c->records_unreadable != 0) {
        fmt::print(
            "left {} records that do not check out where they are (their segments stay while "
            "they are live): run verify\n",
            c->records_unreadable);
      }
    }
    return exit_ok;
  }
  if (*checkpoint) {
    if (auto c = (*s)->checkpoint(); !c) return fail("checkpoint", c.error());
    return exit_ok;
  }
  if (*dump) {
    auto n = dump_store(**s, stdout, print_format);
    return n ? exit_ok : fail("dump", n.error());
  }
  if (*backup) {
    auto b = (*s)->backup(dest);
    if (!b) return fail("backup", b.error());
    fmt::print("copied {} keys ({} bytes of keys and values), every commit up to seq {}, into {}\n",
               b->keys, b->bytes, b->seq, dest);
    return exit_ok;
  }
  if (*verify) {
    kv::verify_report report;
    auto v = (*s)->verify(&report);
    for (const kv::damage& d : report.damaged) {
      fmt::print("damaged: {} at offset {}: {}\n", d.file, d.offset, d.what);
    }
    const std::string torn =
        report.torn == 0 ? ""
                         : fmt::format(
                               " ({} commits a power cut tore before they completed: they never "
                               "happened)",
                               report.torn);
    if (!v && report.damaged.empty()) return fail("verify", v.error());
    if (!v) {
      fmt::print(stderr,
                 "keel kv: verify: {} places damaged, {} commits whole{}; a key whose newest "
                 "version is damaged reads as corrupt until written anew or erased\n",
                 report.damaged.size(), report.commits, torn);
      return exit_corrupt;
    }
    fmt::print("ok: {} commits, every checksum matches{}\n", *v, torn);
    return exit_ok;
  }
  return exit_usage;
}

}  // namespace keel::tools
