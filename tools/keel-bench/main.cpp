// keel-bench: keel's benchmarks and its crash and fault harness, each beside its peers. A
// program of its own (as LevelDB's db_bench is) so that `keel`, what users run, links no
// other database.

#include <fmt/format.h>

#include <CLI/CLI.hpp>

#include <array>
#include <string_view>

#include "aiobench_command.hpp"
#include "keel/version.hpp"
#include "kvbench_command.hpp"
#include "lockcli_command.hpp"
#include "lockmatrix_command.hpp"
#include "lockscale_command.hpp"
#include "spacebench_command.hpp"
#include "torture_command.hpp"

namespace {

struct command {
  std::string_view name;
  const char* summary;
  int (*run)(int argc, char** argv);
};

constexpr std::array commands{
    command{"lockscale", keel::tools::lockscale_command_summary,
            keel::tools::run_lockscale_command},
    command{"lockmatrix", keel::tools::lockmatrix_command_summary,
            keel::tools::run_lockmatrix_command},
    command{"lockcli", keel::tools::lockcli_command_summary, keel::tools::run_lockcli_command},
    command{"aiobench", keel::tools::aiobench_command_summary, keel::tools::run_aiobench_command},
    command{"kvbench", keel::tools::kvbench_command_summary, keel::tools::run_kvbench_command},
    command{"spacebench", keel::tools::spacebench_command_summary,
            keel::tools::run_spacebench_command},
    command{"torture", keel::tools::torture_command_summary, keel::tools::run_torture_command},
};

}  // namespace

int main(int argc, char** argv) {
  // Each command parses its own arguments (argv[0] is its name).
  if (argc >= 2) {
    for (const command& c : commands) {
      if (std::string_view(argv[1]) == c.name) return c.run(argc - 1, argv + 1);
    }
  }
  CLI::App app{
      "keel-bench: keel's benchmarks, each beside its peers in the same run, and its crash and "
      "fault harness"};
  app.set_version_flag("--version", "keel-bench " KEEL_VERSION_STRING);
  app.require_subcommand(0, 1);
  // Listed for --help; argv is handed to the command before parsing reaches it.
  for (const command& c : commands)
    app.add_subcommand(std::string(c.name), c.summary);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    // Usage errors exit 2, like the shell's built-ins; --help and --version exit 0.
    return code == 0 ? 0 : 2;
  }
  fmt::print("{}", app.help());
  return 0;
}
