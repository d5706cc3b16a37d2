// The README's key-value store example, run as it is shown there (between the markers), and
// compared with the README's text, so the first store code a newcomer reads keeps working.

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string>

#include "keel/kv/store.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

// The text between `from` and `to` in `text`, without whitespace (clang-format may lay the
// copy here out differently).
std::string between(const std::string& text, const std::string& from, const std::string& to) {
  const auto a = text.find(from);
  if (a == std::string::npos) return "(no " + from + ")";
  const auto b = text.find(to, a + from.size());
  if (b == std::string::npos) return "(no " + to + ")";
  std::string s = text.substr(a + from.size(), b - a - from.size());
  std::erase_if(s, [](unsigned char c) { return std::isspace(c) != 0; });
  return s;
}

int run_example() {
  // --- README ---
  using namespace keel::kv;

  auto db = store::open("accounts.kv", {.durable = durability::sync}).value();  // a directory
  db->put("alice", "100").value();  // a one-operation transaction
  for (;;) {                        // move 10 from alice to bob, all or nothing
    auto tx = db->begin().value();
    auto alice = tx.get("alice").value();  // its snapshot, plus its own writes
    auto bob = tx.get("bob");              // errc::not_found: never written
    tx.put("alice", std::to_string(std::stoi(alice) - 10)).value();
    tx.put("bob", std::to_string((bob ? std::stoi(*bob) : 0) + 10)).value();
    auto done = tx.commit();  // on stable storage when it returns
    if (!done && done.error() == keel::errc::conflict) continue;  // another writer was first
    done.value();                                                 // any other error: report it
    break;
  }
  // --- end ---
  return 0;
}

TEST(ReadmeExample, TheStoreExampleMovesTheMoneyAndIsTheREADMEs) {
  keel::test::temp_dir dir;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  ASSERT_EQ(run_example(), 0);
  std::filesystem::current_path(cwd);

  auto db = keel::kv::store::open(dir.file("accounts.kv"));
  ASSERT_TRUE(db) << db.error().message();
  EXPECT_EQ((*db)->get("alice").value_or("?"), "90");
  EXPECT_EQ((*db)->get("bob").value_or("?"), "10");

  const std::string readme = keel::test::slurp(KEEL_SOURCE_DIR "/README.md");
  const std::string self = keel::test::slurp(__FILE__);
  const std::string shown = between(readme, "using namespace keel::kv;\n", "```");
  EXPECT_EQ(between(self, "using namespace keel::kv;\n", "// --- end ---"), shown)
      << "the example here and the README's have drifted apart";
  EXPECT_GT(shown.size(), 200u);
}

}  // namespace
