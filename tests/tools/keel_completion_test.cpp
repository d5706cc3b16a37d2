// The bash completion (doc/completion/keel.bash) offers what the programs' --help lists: it
// reads their --help when asked, and this test asks it as bash would, word by word.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

// Where bash is ("" when it is not here).
std::string bash() {
  for (const char* p : {"/bin/bash", "/usr/bin/bash", "/usr/local/bin/bash"})
    if (::access(p, X_OK) == 0) return p;
  return "";
}

// What the completion offers for the words of `line` (the last one being completed).
std::vector<std::string> offered(const std::vector<std::string>& line, const std::string& cwd) {
  const std::string bin_dir = std::filesystem::path(KEEL_BINARY).parent_path().string();
  std::string words;
  for (const std::string& w : line)
    words += " '" + w + "'";
  const std::string script = "cd '" + cwd + "' && source '" + std::string(KEEL_SOURCE_DIR) +
                             "/doc/completion/keel.bash' && PATH='" + bin_dir +
                             "':$PATH && COMP_WORDS=(" + words +
                             ") && COMP_CWORD=" + std::to_string(line.size() - 1) +
                             " && _keel && printf '%s\\n' \"${COMPREPLY[@]}\"";
  const auto r = keel::test::run_program(bash(), {"-c", script}, cwd);
  EXPECT_EQ(r.code, 0) << r.err;
  std::vector<std::string> out;
  std::istringstream in(r.out);
  for (std::string w; std::getline(in, w);)
    if (!w.empty()) out.push_back(w);
  return out;
}

bool has(const std::vector<std::string>& v, const std::string& w) {
  return std::find(v.begin(), v.end(), w) != v.end();
}

TEST(KeelCompletion, OffersSubcommandsOptionsAndPathsWhereEachGoes) {
  if (bash().empty()) GTEST_SKIP() << "no bash here";
  keel::test::temp_dir dir;
  std::filesystem::create_directory(dir.file("app.kv"));
  const std::string cwd = dir.path().string();
  const auto first = offered({"keel", ""}, cwd);
  for (const char* w : {"lock", "locks", "kv", "fsinfo", "--help", "--version"})
    EXPECT_TRUE(has(first, w)) << w;
  EXPECT_EQ(offered({"keel", "k"}, cwd), std::vector<std::string>{"kv"});
  EXPECT_EQ(offered({"keel", "kv", "ap"}, cwd), std::vector<std::string>{"app.kv"});
  const auto verbs = offered({"keel", "kv", "app.kv", ""}, cwd);
  for (const char* w : {"put", "get", "del", "scan", "stats", "verify", "compact", "checkpoint",
                        "salvage", "backup", "dump", "load"})
    EXPECT_TRUE(has(verbs, w)) << w;
  EXPECT_FALSE(has(verbs, "--hex"));
  EXPECT_TRUE(has(offered({"keel", "kv", "--"}, cwd), "--hex"));
  EXPECT_TRUE(has(offered({"keel", "kv", "--max-bytes", "9", "app.kv", "b"}, cwd), "backup"));
  EXPECT_TRUE(has(offered({"keel", "kv", "app.kv", "scan", "--"}, cwd), "--json"));
  EXPECT_TRUE(has(offered({"keel", "lock", "--"}, cwd), "--conflict-exit-code"));
  const auto bench = offered({"keel-bench", ""}, cwd);
  for (const char* w :
       {"lockscale", "lockmatrix", "lockcli", "aiobench", "kvbench", "spacebench", "torture"})
    EXPECT_TRUE(has(bench, w)) << w;
  EXPECT_TRUE(has(offered({"keel-bench", "torture", "--m"}, cwd), "--mode"));
  // Nothing of the store was touched by asking for its subcommands' options.
  EXPECT_TRUE(std::filesystem::is_empty(dir.file("app.kv")));
}

}  // namespace
