// keel-bench aiobench: keel::aio measured against its peers in the same run, on the same files.
//
//   randread  4 KiB random reads at queue depth 32 of one file: keel's io_uring engine
//             against fio's io_uring engine, with O_DIRECT and buffered (file in the page
//             cache); keel's posix engine against fio's psync with as many threads.
//   workload  the TAI thesis's workload: per item a compute step on a 64 KiB buffer
//             (calibrated to cost about one buffered 64 KiB write), then a write of it, an
//             fsync every N items; for plain POSIX calls, cstdio, glibc POSIX AIO and keel
//             (each engine, with and without the write-back cache); 1 and 2 threads, each
//             on its own file.
//   overwrite the workload with every write overwritten at once (TAI section 3.4: where a
//             write-back cache can merge); fsync every 30 and 300 items.
//   overwrite_direct  the same with O_DIRECT (section 3.5: the cache in front of O_DIRECT).
//   small     4 KiB writes at random offsets from 2 threads, 64 in flight each, fsync every
//             30: glibc's POSIX AIO against keel where its global lock shows (section 2.3).
//   null      the null engine: nanoseconds per request of the framework alone, one request
//             at a time (submit, wait) and in batches of 64.

#include "aiobench_command.hpp"

#include <aio.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "aiobench.hpp"
#include "cli_util.hpp"
#include "keel/aio/controller.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/io/fs_info.hpp"

namespace keel::tools {

using namespace aiobench;

int run_aiobench_command(int argc, char** argv) {
  CLI::App app{
      "Measure keel::aio in the same run as its peers: fio (randread), plain POSIX calls, cstdio "
      "and glibc POSIX AIO (the TAI thesis workload), and the null engine's own cost",
      "keel-bench aiobench"};
  std::string dir = "build/aiobench";
  std::uint64_t size_mib = 1024;
  double seconds = 3;
  unsigned threads = 2;
  std::uint64_t items = 600;
  std::string parts = "randread,workload,overwrite,overwrite_direct,small,null";
  std::string methods_list;
  std::string json_path;
  app.add_option("--dir", dir,
                 "Directory for the files (a real device for O_DIRECT; the read file is kept "
                 "there for the next run)")
      ->capture_default_str();
  app.add_option("--size", size_mib, "MiB of the randread file")
      ->check(CLI::Range(std::uint64_t{16}, std::uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--seconds", seconds, "Seconds per randread and null measurement")
      ->check(CLI::Range(0.1, 3600.0))
      ->capture_default_str();
  app.add_option("--threads", threads, "Threads of fio psync and of keel's posix engine")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--items", items, "Items per thread in the workload")
      ->check(CLI::Range(std::uint64_t{10}, std::uint64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--parts", parts,
                 "Comma-separated: randread, workload, overwrite, overwrite_direct, small, null")
      ->capture_default_str();
  app.add_option("--methods", methods_list,
                 "Comma-separated workload methods to run (default: all): posix, cstdio, "
                 "posix_aio, keel_io_uring, keel_posix, keel_stdio, and each keel one with "
                 "_cache");
  app.add_option("--json", json_path, "Also write the results as JSON to this file ('-': stdout)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  std::vector<std::string> wanted;
  for (std::size_t at = 0; at <= parts.size();) {
    const auto comma = std::min(parts.find(',', at), parts.size());
    const std::string p = parts.substr(at, comma - at);
    if (p != "randread" && p != "workload" && p != "overwrite" && p != "overwrite_direct" &&
        p != "small" && p != "null") {
      fmt::print(stderr, "keel-bench aiobench: --parts: unknown part '{}'\n", p);
      return 2;
    }
    wanted.push_back(p);
    at = comma + 1;
  }
  const auto wants = [&](const char* part) {
    return std::find(wanted.begin(), wanted.end(), part) != wanted.end();
  };
  std::vector<std::string> methods = workload_methods();
  if (!methods_list.empty()) {
    std::vector<std::string> chosen;
    for (std::size_t at = 0; at <= methods_list.size();) {
      const auto comma = std::min(methods_list.find(',', at), methods_list.size());
      const std::string m = methods_list.substr(at, comma - at);
      if (std::find(methods.begin(), methods.end(), m) == methods.end()) {
        fmt::print(stderr, "keel-bench aiobench: --methods: unknown method '{}'\n", m);
        return 2;
      }
      chosen.push_back(m);
      at = comma + 1;
    }
    methods = chosen;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    fmt::print(stderr, "keel-bench aiobench: {}: {}\n", dir, ec.message());
    return 1;
  }
  json doc;
  auto fs = io::stat_fs(dir.c_str());
  doc["filesystem"] = fs ? std::string(fs->type_name()) : "unknown";
  doc["dir"] = dir;
  {
    auto probe = aio::controller::start();
    doc["default_engine"] = probe ? std::string((*probe)->engine_name()) : "none";
    doc["fallback_reason"] = probe ? (*probe)->fallback_reason() : probe.error().message();
  }
  try {
    if (wants("randread")) {
      doc["randread"] = measure_randread(dir, size_mib << 20, threads, seconds);
    }
    for (const auto* v : {&plain_workload, &overwrite_workload, &direct_overwrite_workload}) {
      if (wants(v->part)) doc[v->part] = measure_workload(dir, items, methods, *v);
    }
    if (wants("small")) {
      doc["small"] = measure_small(dir, "on " + dir, items);
      // On the disk an fsync's wait sets the pace; in memory (tmpfs), what the libraries
      // themselves cost per request does, glibc's global lock among it (TAI 2.3).
      if (auto mem = memory_dir(); !mem.empty()) {
        doc["small_memory"] = measure_small(mem, "in memory (tmpfs)", items);
        std::filesystem::remove_all(mem, ec);
      } else {
        progress("small in memory skipped: /dev/shm is not a tmpfs here");
      }
    }
    if (wants("null")) doc["null"] = measure_null(dir, seconds);
  } catch (const std::exception& e) {
    fmt::print(stderr, "keel-bench aiobench: {}\n", e.what());
    return 1;
  }
  if (!json_path.empty() && !write_json("aiobench", json_path, doc)) return 1;
  return 0;
}

}  // namespace keel::tools
