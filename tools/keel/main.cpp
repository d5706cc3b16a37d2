// keel: the command-line face of the library, what users run: lock, locks, kv, fsinfo. The
// benchmarks and the torture harness are keel-bench's, so this program links keel alone.

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <string_view>

#include "keel/io/fs_info.hpp"
#include "keel/version.hpp"
#include "kv_command.hpp"
#include "lock_command.hpp"
#include "locks_command.hpp"

namespace {

int run_fsinfo(const std::string& path) {
  auto info = keel::io::stat_fs(path.c_str());
  if (!info) {
    fmt::print(stderr, "keel fsinfo: {}: {}\n", path, info.error().message());
    return 1;
  }
  fmt::print("path       {}\n", path);
  fmt::print("type       {} (magic 0x{:x})\n", info->type_name(), info->magic);
  fmt::print("local      {}\n", info->is_local ? "yes" : "no");
  fmt::print("block size {}\n", info->block_size);
  fmt::print("total      {}\n", info->total_bytes);
  fmt::print("free       {}\n", info->free_bytes);
  fmt::print("available  {}\n", info->available_bytes);
  // Which lock and store to use here (the headers of include/keel/lock say why).
  if (info->is_local) {
    fmt::print("locks      any algorithm; memory_map is the fastest\n");
    fmt::print("store      keel kv works here\n");
  } else {
    fmt::print(
        "locks      users may be on other machines: byte_ranges (or fcntl, flock) where\n"
        "           their byte-range locks reach every client (NFSv4, GlusterFS), lock_files\n"
        "           where only link(2) is atomic; memory_map degrades to byte_ranges;\n"
        "           atomic_append and sysv refuse\n");
    fmt::print(
        "store      keel kv refuses, unless every user is on this host through this mount\n"
        "           (--single-host, options::every_user_on_this_host)\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // `keel lock` splits its own arguments at "--" (the command follows), so it parses them.
  if (argc >= 2 && std::string_view(argv[1]) == "lock") {
    return keel::tools::run_lock_command(argc - 1, argv + 1);
  }
  if (argc >= 2 && std::string_view(argv[1]) == "locks") {
    return keel::tools::run_locks_command(argc - 1, argv + 1);
  }
  if (argc >= 2 && std::string_view(argv[1]) == "kv") {
    return keel::tools::run_kv_command(argc - 1, argv + 1);
  }
  if (argc >= 2) {
    for (const std::string_view moved :
         {"lockscale", "lockmatrix", "lockcli", "aiobench", "kvbench", "spacebench", "torture"}) {
      if (std::string_view(argv[1]) != moved) continue;
      fmt::print(stderr, "keel: {0} is keel-bench's now: run `keel-bench {0}`\n", moved);
      return 2;
    }
  }
  CLI::App app{"keel: a safe, fast filesystem for coordinating processes and keeping data"};
  app.set_version_flag("--version", "keel " KEEL_VERSION_STRING);
  app.require_subcommand(0, 1);
  app.footer("keel's benchmarks and its crash and fault harness: keel-bench --help\n");

  // Listed for --help; argv is handed to run_lock_command before parsing reaches it.
  app.add_subcommand("lock", keel::tools::lock_command_summary)->allow_extras();
  app.add_subcommand("locks", keel::tools::locks_command_summary)->allow_extras();
  app.add_subcommand("kv", keel::tools::kv_command_summary)->allow_extras();

  std::string path;
  auto* fsinfo = app.add_subcommand("fsinfo", "Show what keel sees of the filesystem at a path");
  fsinfo->add_option("PATH", path, "A file or directory on the filesystem")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    // Usage errors exit 2, like the shell's built-ins; --help and --version exit 0.
    return code == 0 ? 0 : 2;
  }
  if (*fsinfo) return run_fsinfo(path);
  fmt::print("{}", app.help());
  return 0;
}
