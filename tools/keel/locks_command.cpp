// keel locks: the holders and waiters of a keel lock (lslocks shows the kernel's locks only).

#include "locks_command.hpp"

#include <fmt/format.h>
#include <time.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <CLI/CLI.hpp>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "keel/lock/inspect.hpp"
#include "keel/lock/shared_fs_mutex.hpp"

namespace keel::tools {
namespace {

std::string role_name(lock::lock_holder::role r) {
  switch (r) {
    case lock::lock_holder::role::holds:
      return "holds";
    case lock::lock_holder::role::waits:
      return "waits";
    case lock::lock_holder::role::stale:
      return "stale";
  }
  return "?";
}

std::string local_time(std::uint64_t unix_s) {
  if (unix_s == 0) return "?";
  const auto t = static_cast<time_t>(unix_s);
  tm parts{};
  ::localtime_r(&t, &parts);
  char out[32];
  std::strftime(out, sizeof out, "%Y-%m-%d %H:%M:%S", &parts);
  return out;
}

// Text from files (a record's host, a path, a name) with control characters shown as '?': it
// must not move the cursor or forge a line of the table.
std::string printable(std::string s) {
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  }
  return s;
}

// 0, or 74 (EX_IOERR) when the output could not be written (a full disk, a closed pipe).
int finish_output() {
  if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0) {
    fmt::print(stderr, "keel locks: writing the output: {}\n", std::strerror(errno));
    return 74;
  }
  return 0;
}

}  // namespace

int run_locks_command(int argc, char** argv) {
  CLI::App app{
      "keel locks PATH [--json] [--name NAME...]\n"
      "The holders and waiters of the keel lock at PATH (a lock file, or a directory for\n"
      "lock_files and flock), for every algorithm: pid, host, when the process started (the\n"
      "kernel does not record when a lock was taken), the entity (its 63-bit value; --name\n"
      "shows the names you give; memory_map and sysv lock slots, which several entities\n"
      "share: the slot, and the names given that fall in it), shared or exclusive, and\n"
      "holders proven dead whose mark is still there as stale. Kernel locks are those of\n"
      "processes on this machine (as root, every user's); waiters are those asleep in the\n"
      "kernel or queued in the lock (a waiter that polls, as on a network filesystem, is\n"
      "not seen). It only reads: it takes no lock. What cannot be shown is said.",
      "keel locks"};
  std::string path;
  bool json = false;
  std::vector<std::string> names;
  app.add_option("PATH", path, "The lock file or directory")->required();
  app.add_flag("--json", json, "Print JSON instead of a table");
  app.add_option("-N,--name", names, "An entity name to show by name (repeatable)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  auto st = lock::inspect(path);
  if (!st) {
    fmt::print(stderr, "keel locks: {}\n", st.error().message());
    return 66;
  }
  // Entity values by the names given (both shared and exclusive hash alike).
  std::map<std::uint64_t, std::string> named;
  for (const auto& n : names)
    named[lock::entity::from_string(n).value] = n;
  // A slot's row (memory_map, sysv) may be any entity of the slot: the names given in it.
  const auto names_in_slot = [&](const lock::lock_holder& h) {
    std::vector<std::string> in;
    for (const auto& [value, name] : named) {
      if (h.could_be(value)) in.push_back(name);
    }
    return in;
  };
  const auto entity_text = [&](const lock::lock_holder& h) -> std::string {
    if (h.whole_file) return "(whole file)";
    if (h.slot >= 0) {
      const auto in = names_in_slot(h);
      return fmt::format("slot {}{}", h.slot,
                         in.empty() ? std::string() : fmt::format(" ({})", fmt::join(in, ", ")));
    }
    if (!h.entity_known) return "?";
    const auto it = named.find(h.entity);
    if (it != named.end()) return it->second;
    return fmt::format("{:016x}", h.entity);
  };
  if (json) {
    nlohmann::json doc;
    doc["path"] = path;
    doc["directory"] = st->directory;
    doc["open_with"] = st->open_with;
    doc["users"] = st->users;
    doc["holders"] = nlohmann::json::array();
    for (const auto& h : st->holders) {
      using json_t = nlohmann::json;
      nlohmann::json j = {{"state", role_name(h.what)},
                          {"algorithm", h.algorithm},
                          {"pid", h.pid},
                          {"host", h.host},
                          {"process_started", h.process_started},
                          {"whole_file", h.whole_file},
                          {"exclusive", h.mode_known ? json_t(h.exclusive) : json_t()}};
      if (!h.whole_file && h.entity_known) {
        j["entity"] = fmt::format("{:016x}", h.entity);
        if (named.contains(h.entity)) j["name"] = named[h.entity];
      }
      if (h.slot >= 0) {
        j["slot"] = h.slot;
        j["slots"] = h.slots;
        j["names_in_slot"] = names_in_slot(h);
      }
      if (h.count != 1) j["count"] = h.count;
      doc["holders"].push_back(std::move(j));
    }
    doc["not_shown"] = st->not_shown;
    // Paths, names and hosts are bytes: what is not UTF-8 is shown replaced, never a crash.
    fmt::print("{}\n", doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace));
    return finish_output();
  }
  fmt::print(
      "{}: {}{}\n", printable(path),
      st->open_with.empty() ? std::string("not open with a keel algorithm")
                            : "open with " + fmt::format("{}", fmt::join(st->open_with, ", ")),
      st->users.empty() ? std::string() : fmt::format(" by pid {}", fmt::join(st->users, ", ")));
  if (st->holders.empty()) {
    fmt::print("no holders and no waiters seen\n");
  } else {
    fmt::print("{:<6} {:>8} {:<16} {:<19} {:<9} {:<18} {}\n", "STATE", "PID", "HOST",
               "PROCESS STARTED", "MODE", "ENTITY", "ALGORITHM");
    for (const auto& h : st->holders) {
      fmt::print("{:<6} {:>8} {:<16} {:<19} {:<9} {:<18} {}\n", role_name(h.what),
                 h.count != 1 ? fmt::format("{}x ?", h.count)
                 : h.pid == 0 ? std::string("?")
                              : std::to_string(h.pid),
                 h.host.empty() ? "?" : printable(h.host), local_time(h.process_started),
                 !h.mode_known ? "?"
                 : h.exclusive ? "exclusive"
                               : "shared",
                 printable(entity_text(h)), printable(h.algorithm));
    }
  }
  for (const auto& n : st->not_shown)
    fmt::print("not shown: {}\n", printable(n));  // may name a path read from a file
  return finish_output();
}

}  // namespace keel::tools
