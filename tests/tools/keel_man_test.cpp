// The man pages (doc/man) are written once, by hand, and checked here against the programs:
// every option and subcommand a --help lists is on its page, so a new option without its
// documentation fails the suite.

#include <gtest/gtest.h>

#include <cctype>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

// The page's text with roff's escaped hyphens plain.
std::string page(const std::string& name) {
  // (Appended, not `+`: GCC 12 warns falsely of bounds on `string(literal) + literal`.)
  std::string at = KEEL_SOURCE_DIR;
  at.append("/doc/man/").append(name);
  std::string text = keel::test::slurp(at);
  std::string plain;
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == '-') continue;
    plain += text[i];
  }
  return plain;
}

// What a --help lists: its options (-x, --long) and its subcommands.
std::set<std::string> listed(const std::string& help) {
  std::set<std::string> out;
  std::istringstream in(help);
  bool subcommands = false;
  for (std::string line; std::getline(in, line);) {
    if (line.starts_with("Subcommands:")) {
      subcommands = true;
      continue;
    }
    if (line.empty() || line[0] != ' ') {
      subcommands = false;
      continue;
    }
    std::size_t first = line.find_first_not_of(' ');
    if (subcommands) {
      out.insert(line.substr(first, line.find(' ', first) - first));
    } else if (line[first] == '-') {
      // The option column only: up to the two spaces before its description.
      const std::string column = line.substr(first, line.find("  ", first) - first);
      // Each -x or --long in it: a dash at the start or after a space or comma, a letter.
      for (std::size_t i = 0; i < column.size(); ++i) {
        if (column[i] != '-' || (i > 0 && column[i - 1] != ' ' && column[i - 1] != ',')) continue;
        std::size_t end = i;
        while (end < column.size() && column[end] == '-')
          ++end;
        if (end - i > 2 || end >= column.size() ||
            std::isalpha(static_cast<unsigned char>(column[end])) == 0) {
          continue;
        }
        while (end < column.size() &&
               (std::isalnum(static_cast<unsigned char>(column[end])) != 0 || column[end] == '-'))
          ++end;
        out.insert(column.substr(i, end - i));
        i = end;
      }
    }
  }
  return out;
}

void expect_documented(const std::string& page_name, const std::string& program,
                       const std::vector<std::string>& args) {
  keel::test::temp_dir dir;
  const auto help = run_program(program, args, dir.path().string());
  ASSERT_EQ(help.code, 0) << help.err;
  const std::string text = page(page_name);
  ASSERT_FALSE(text.empty()) << page_name;
  const auto words = listed(help.out);
  EXPECT_FALSE(words.empty()) << help.out;
  for (const std::string& w : words)
    EXPECT_NE(text.find(w), std::string::npos) << page_name << " does not name " << w;
}

TEST(KeelMan, EveryOptionAndSubcommandOfKeelIsOnItsPage) {
  expect_documented("keel.1", KEEL_BINARY, {"--help"});
  expect_documented("keel-lock.1", KEEL_BINARY, {"lock", "--help"});
  expect_documented("keel-lock.1", KEEL_BINARY, {"locks", "--help"});
  expect_documented("keel-kv.1", KEEL_BINARY, {"kv", "--help"});
  for (const char* sub : {"put", "get", "del", "scan", "stats", "verify", "compact", "checkpoint",
                          "salvage", "backup", "dump", "load"}) {
    expect_documented("keel-kv.1", KEEL_BINARY, {"kv", "PATH", sub, "--help"});
  }
}

TEST(KeelMan, EveryCommandAndOptionOfKeelBenchIsOnItsPage) {
  expect_documented("keel-bench.1", KEEL_BENCH_BINARY, {"--help"});
  for (const char* command :
       {"lockscale", "lockmatrix", "lockcli", "aiobench", "kvbench", "spacebench", "torture"}) {
    expect_documented("keel-bench.1", KEEL_BENCH_BINARY, {command, "--help"});
  }
}

}  // namespace
