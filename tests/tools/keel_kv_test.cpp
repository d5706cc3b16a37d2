// keel kv, run as a user would: binary-safe values through stdin and stdout, hex keys, the
// documented exit codes, JSON, and a directory that is not a store left alone.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "keel/kv/store.hpp"
#include "support/process.hpp"
#include "support/run_program.hpp"

namespace {

using keel::test::run_program;

// A scan's lines in sorted order (two stores hash their keys apart: scans list them in the
// order of each store's hashes).
std::vector<std::string> sorted_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    lines.push_back(line);
  std::sort(lines.begin(), lines.end());
  return lines;
}

std::string to_hex_for_test(const std::string& bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (const char c : bytes) {
    out += digits[static_cast<unsigned char>(c) >> 4];
    out += digits[static_cast<unsigned char>(c) & 15];
  }
  return out;
}

keel::test::program_outcome kv(const keel::test::temp_dir& dir, std::vector<std::string> args) {
  args.insert(args.begin(), "kv");
  return run_program(KEEL_BINARY, args, dir.path().string());
}

TEST(KeelKv, MaxBytesStopsPutsWithItsOwnExitCodeAndLetsDelete) {
  keel::test::temp_dir dir;
  const std::string s = dir.file("store");
  // A store of 1 MiB segments, filled to an 8 MiB budget by the library.
  keel::kv::options o;
  o.segment_size = std::uint64_t{1} << 20;
  o.max_bytes = std::uint64_t{8} << 20;
  {
    auto st = keel::kv::store::open(s, o);
    ASSERT_TRUE(st) << st.error().message();
    for (int i = 0;; ++i) {
      auto r = (*st)->put("k" + std::to_string(i), std::string(1024, 'v'));
      if (!r) {
        ASSERT_EQ(r.error(), keel::errc::budget_reached) << r.error().message();
        break;
      }
    }
  }
  const std::string budget = std::to_string(o.max_bytes);
  auto r = kv(dir, {s, "put", "--max-bytes", budget, "one-more", std::string(4096, 'x')});
  EXPECT_EQ(r.code, 6) << r.err;
  EXPECT_NE(r.err.find("budget"), std::string::npos) << r.err;
  EXPECT_EQ(kv(dir, {s, "get", "one-more"}).code, 1);
  r = kv(dir, {s, "del", "--max-bytes", budget, "k0"});
  EXPECT_EQ(r.code, 0) << r.err;
  // Too small a budget is a usage error that says why, and changes nothing.
  r = kv(dir, {s, "put", "--max-bytes", "1000", "k1", "x"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--max-bytes"), std::string::npos) << r.err;
  EXPECT_EQ(kv(dir, {s, "get", "k1"}).out, std::string(1024, 'v'));
  // A negative budget is no budget a user meant (CLI11 read "-1" as 2^64 - 1: no cap at all).
  for (const char* bad : {"-1", "-5", "1e9", "", "18446744073709551616"}) {
    r = kv(dir, {"--max-bytes", bad, dir.file("fresh"), "put", "k", "v"});
    EXPECT_EQ(r.code, 2) << bad;
    EXPECT_NE(r.err.find("a number of bytes"), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(dir.file("fresh"))) << bad;
  }
}

TEST(KeelKv, PutGetDelScanStatsVerifyCompactWithTheirExitCodes) {
  keel::test::temp_dir dir;
  const std::string s = dir.file("store");
  auto r = kv(dir, {s, "put", "greeting", "hello"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = kv(dir, {s, "get", "greeting"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, "hello") << "the value as it is, no newline added";
  r = kv(dir, {s, "get", "absent"});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("not found"), std::string::npos);
  // Binary values through stdin and stdout; keys in hex.
  r = run_program("/bin/sh",
                  {"-c", std::string("printf 'a\\000b\\377' | ") + KEEL_BINARY + " kv " + s +
                             " --hex put 00ff"},
                  dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  r = kv(dir, {s, "--hex", "get", "00ff"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, std::string("a\0b\xff", 4));
  r = kv(dir, {s, "scan", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::istringstream lines(r.out);
  std::string line;
  int n = 0;
  bool saw_hex = false;
  while (std::getline(lines, line)) {
    const auto j = nlohmann::json::parse(line);
    saw_hex |= j["key"].is_object() && j["key"]["hex"] == "00ff" && j["value"]["hex"] == "610062ff";
    ++n;
  }
  EXPECT_EQ(n, 2);
  EXPECT_TRUE(saw_hex) << r.out;
  // Output that parses back whatever the bytes: --hex hexes values too; -0 ends each key and
  // each value with a NUL.
  r = kv(dir, {s, "--hex", "scan"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("00ff\t610062ff\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("6772656574696e67\t68656c6c6f\n"), std::string::npos) << r.out;
  r = kv(dir, {s, "scan", "-0"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find(std::string("\0\xff\0a\0b\xff\0", 8)), std::string::npos);
  EXPECT_NE(r.out.find(std::string("greeting\0hello\0", 15)), std::string::npos);
  EXPECT_EQ(r.out.size(), std::string("greeting\0hello\0", 15).size() + 8);
  r = kv(dir, {s, "del", "greeting"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = kv(dir, {s, "del", "greeting"});
  EXPECT_EQ(r.code, 1);
  r = kv(dir, {s, "stats", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["records"], 1);
  r = kv(dir, {s, "verify"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = kv(dir, {s, "compact", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(nlohmann::json::parse(r.out)["segments_removed"].is_number()) << r.out;
  EXPECT_TRUE(nlohmann::json::parse(r.out)["erasures_dropped"].is_number()) << r.out;
  r = kv(dir, {s, "--hex", "get", "00ff"});
  EXPECT_EQ(r.out, std::string("a\0b\xff", 4)) << "compact kept it";
  // A checkpoint, then a reboot (the index goes): the rebuild starts from it.
  r = kv(dir, {s, "checkpoint"});
  ASSERT_EQ(r.code, 0) << r.err;
  r = kv(dir, {s, "stats", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto st = nlohmann::json::parse(r.out);
  EXPECT_GT(st["checkpoint_seq"], 0) << r.out;
  EXPECT_EQ(st["unchecked_bytes"], 0) << r.out;
  std::filesystem::remove(s + "/index");
  r = kv(dir, {s, "stats"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("rebuilt the index, replaying"), std::string::npos) << r.out;
  r = kv(dir, {s, "--hex", "get", "00ff"});
  EXPECT_EQ(r.out, std::string("a\0b\xff", 4)) << "rebuilt from the checkpoint";
}

// backup makes a copy that reads the same and verifies, and never writes over what is there.
TEST(KeelKv, BackupCopiesTheStoreAndRefusesAnExistingDestination) {
  keel::test::temp_dir dir;
  const std::string s = dir.file("s");
  for (const char* k : {"a", "b", "c"})
    ASSERT_EQ(kv(dir, {s, "put", k, std::string("value of ") + k}).code, 0);
  auto r = kv(dir, {s, "backup", dir.file("copy")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("copied 3 keys"), std::string::npos) << r.out;
  EXPECT_EQ(kv(dir, {dir.file("copy"), "verify"}).code, 0);
  for (const char* k : {"a", "b", "c"})
    EXPECT_EQ(kv(dir, {dir.file("copy"), "get", k}).out, std::string("value of ") + k);
  // --compact, as mdb_copy -c users ask: what every backup writes.
  r = kv(dir, {s, "backup", "--compact", dir.file("compacted")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(kv(dir, {dir.file("compacted"), "get", "b"}).out, "value of b");
  std::ofstream(dir.file("mine")) << "mine";
  r = kv(dir, {s, "backup", dir.file("mine")});
  EXPECT_EQ(r.code, 5);
  EXPECT_NE(r.err.find("File exists"), std::string::npos) << r.err;
  EXPECT_EQ(keel::test::slurp(dir.file("mine")), "mine");
}

// dump | load round trip with binary keys and values, in both of mdb_dump's formats; a new
// store is made whole or not at all, and a dump keel cannot read names its line.
TEST(KeelKv, DumpAndLoadRoundTripBinaryKeysAndValues) {
  keel::test::temp_dir dir;
  const std::string s = dir.file("s");
  // A dump written by hand: keys with NUL, newline, backslash and high bytes, values of every
  // byte and empty ones.
  std::string text = "VERSION=3\nformat=bytevalue\ntype=btree\nHEADER=END\n";
  std::vector<std::pair<std::string, std::string>> pairs;
  for (int i = 0; i < 300; ++i) {
    std::string key = "k" + std::to_string(i);
    key += static_cast<char>(i % 256);
    std::string value(static_cast<std::size_t>(i % 7) * 100, static_cast<char>(255 - i % 256));
    if (i % 3 == 0) value += "\\\n";
    text += " " + to_hex_for_test(key) + "\n " + to_hex_for_test(value) + "\n";
    pairs.emplace_back(key, value);
  }
  text += "DATA=END\n";
  std::ofstream(dir.file("made"), std::ios::binary) << text;
  auto loaded = kv(dir, {s, "load", dir.file("made")});
  ASSERT_EQ(loaded.code, 0) << loaded.err;
  EXPECT_NE(loaded.out.find("loaded 300 entries"), std::string::npos) << loaded.out;
  for (std::size_t i : {0u, 10u, 255u, 299u}) {
    const auto got = kv(dir, {s, "--hex", "get", to_hex_for_test(pairs[i].first)});
    EXPECT_EQ(got.out, pairs[i].second) << i;
  }
  for (const char* format : {"bytevalue", "print"}) {
    const std::string dump = dir.file(std::string("dump.") + format);
    std::vector<std::string> args{s, "dump"};
    if (std::string(format) == "print") args.push_back("--print");
    auto r = kv(dir, args);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(r.out.starts_with("VERSION=3\nformat=" + std::string(format) + "\n")) << format;
    EXPECT_TRUE(r.out.ends_with("DATA=END\n"));
    std::ofstream(dump, std::ios::binary) << r.out;
    const std::string copy = dir.file(std::string("copy.") + format);
    r = kv(dir, {copy, "load", dump});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_NE(r.out.find("loaded 300 entries"), std::string::npos) << r.out;
    // Every key and value as it was.
    const auto a = kv(dir, {s, "scan", "--json"});
    const auto b = kv(dir, {copy, "scan", "--json"});
    ASSERT_EQ(a.code, 0);
    EXPECT_EQ(sorted_lines(a.out), sorted_lines(b.out)) << format;
    EXPECT_EQ(sorted_lines(a.out).size(), 300u);
    EXPECT_EQ(kv(dir, {copy, "verify"}).code, 0);
  }
  // A bad line: exit 2 naming it, and nothing made.
  std::ofstream(dir.file("bad")) << "VERSION=3\nformat=bytevalue\nHEADER=END\n 6b\n 7\nDATA=END\n";
  auto r = kv(dir, {dir.file("never"), "load", dir.file("bad")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("line 5"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(dir.file("never")));
  for (const auto& e : std::filesystem::directory_iterator(dir.path()))
    EXPECT_FALSE(e.path().filename().string().starts_with(".never")) << e.path();
  // An empty directory is not keel's to replace: refused, and left as it is.
  std::filesystem::create_directory(dir.file("empty"));
  r = kv(dir, {dir.file("empty"), "load", dir.file("made")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("is an empty directory"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::is_empty(dir.file("empty")));
  // So is a link to one.
  std::filesystem::create_directory_symlink(dir.file("empty"), dir.file("link"));
  r = kv(dir, {dir.file("link"), "load", dir.file("made")});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("is an empty directory"), std::string::npos) << r.err;
  EXPECT_TRUE(std::filesystem::is_empty(dir.file("empty")));
  // Into a store that exists, the same refusal says what stays.
  r = kv(dir, {s, "load", dir.file("bad")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("the batches committed before it stay in the store"), std::string::npos)
      << r.err;
  // LMDB's named or duplicate-keyed databases, and text that is no dump, are refused.
  for (const char* other :
       {"VERSION=3\nformat=bytevalue\ndatabase=users\nHEADER=END\nDATA=END\n",
        "VERSION=3\nformat=bytevalue\nduplicates=1\nHEADER=END\nDATA=END\n", "hello\n", ""}) {
    std::ofstream(dir.file("other")) << other;
    r = kv(dir, {dir.file("never"), "load", dir.file("other")});
    EXPECT_EQ(r.code, 2) << other;
  }
}

// The format is LMDB's: keel kv dump | mdb_load makes an LMDB environment, and mdb_dump of it
// | keel kv load gives back the same store.
TEST(KeelKv, DumpAndLoadSpeakMdbDumpsFormatBothWays) {
  if (::access("/usr/bin/mdb_load", X_OK) != 0 || ::access("/usr/bin/mdb_dump", X_OK) != 0) {
    GTEST_SKIP() << "no mdb_load and mdb_dump here (Debian's lmdb-utils)";
  }
  keel::test::temp_dir dir;
  const std::string s = dir.file("s");
  std::string text = "VERSION=3\nformat=bytevalue\nHEADER=END\n";
  for (int i = 0; i < 200; ++i) {
    const std::string key = std::string("key\n") + static_cast<char>(i) + std::to_string(i);
    const std::string value(static_cast<std::size_t>(i) * 10, static_cast<char>(i));
    text += " " + to_hex_for_test(key) + "\n " + to_hex_for_test(value) + "\n";
  }
  std::ofstream(dir.file("made"), std::ios::binary) << text << "DATA=END\n";
  ASSERT_EQ(kv(dir, {s, "load", dir.file("made")}).code, 0);
  const std::string k = std::string(KEEL_BINARY);
  const std::string env = dir.file("lmdb");
  std::filesystem::create_directory(env);
  const std::string script = "set -e; '" + k + "' kv '" + s + "' dump | mdb_load '" + env +
                             "'; mdb_dump '" + env + "' | '" + k + "' kv '" + dir.file("back") +
                             "' load";
  const auto r = run_program("/bin/sh", {"-c", script}, dir.path().string());
  ASSERT_EQ(r.code, 0) << r.err;
  const auto a = kv(dir, {s, "scan", "--json"});
  const auto b = kv(dir, {dir.file("back"), "scan", "--json"});
  EXPECT_EQ(sorted_lines(a.out), sorted_lines(b.out));
  EXPECT_EQ(sorted_lines(b.out).size(), 200u);
}

TEST(KeelKv, UsageErrorsExitTwoAndForeignDirectoriesThree) {
  keel::test::temp_dir dir;
  EXPECT_EQ(kv(dir, {}).code, 2);
  auto unknown = kv(dir, {dir.file("s"), "frobnicate"});
  EXPECT_EQ(unknown.code, 2);
  EXPECT_NE(unknown.err.find("no subcommand 'frobnicate'"), std::string::npos) << unknown.err;
  // A key out of bounds is a usage error that says the bounds (not "invalid argument", nor
  // "too large for the store", which reads as "full"); nothing is made for it.
  for (const std::string& key : {std::string(), std::string(1025, 'k')}) {
    for (const char* verb : {"put", "get", "del"}) {
      auto r = kv(dir, {dir.file("s"), verb, key, "v"});
      if (std::string(verb) != "put") r = kv(dir, {dir.file("s"), verb, key});
      EXPECT_EQ(r.code, 2) << verb << " " << key.size();
      EXPECT_NE(r.err.find("keys are 1 to 1024 bytes"), std::string::npos) << r.err;
    }
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("s")));
  EXPECT_EQ(kv(dir, {dir.file("s"), "--hex", "get", "zz"}).code, 2);
  auto help = kv(dir, {"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("Exit status"), std::string::npos);
  const std::string foreign = dir.file("foreign");
  std::filesystem::create_directory(foreign);
  std::ofstream(foreign + "/notes") << "mine";
  auto r = kv(dir, {foreign, "put", "k", "v"});
  EXPECT_EQ(r.code, 3) << r.err;
  EXPECT_EQ(std::filesystem::directory_iterator(foreign)->path().filename(), "notes");
  EXPECT_EQ(kv(dir, {dir.file("absent"), "get", "k"}).code, 5) << "no store is made by get";
  EXPECT_FALSE(std::filesystem::exists(dir.file("absent")));
}

}  // namespace

namespace {

TEST(KeelKv, VerifyNamesEveryDamagedPlaceAndExitsThree) {
  keel::test::temp_dir dir;
  const std::string s = dir.file("store");
  {
    auto st = keel::kv::store::open(s);
    ASSERT_TRUE(st) << st.error().message();
    ASSERT_TRUE((*st)->put("a", "old <old-marker> value"));
    ASSERT_TRUE((*st)->put("a", "new value"));
  }
  auto r = kv(dir, {s, "verify"});
  EXPECT_EQ(r.code, 0) << r.err;
  // One flipped bit in the old version's value.
  for (const auto& e : std::filesystem::directory_iterator(s + "/seg")) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    std::stringstream all;
    all << f.rdbuf();
    const std::size_t at = all.str().find("<old-marker>");
    if (at == std::string::npos) continue;
    f.seekp(static_cast<std::streamoff>(at + 2));
    f.put(static_cast<char>(all.str()[at + 2] ^ 0x04));
  }
  r = kv(dir, {s, "verify"});
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.out.find("damaged: " + s + "/seg/0000000000000001 at offset "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\"a\""), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("1 places damaged"), std::string::npos) << r.err;
  r = kv(dir, {s, "get", "a"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "new value");
  // salvage copies what it can read into a new store, lists the rest, and exits 3.
  const std::string d = dir.file("salvaged");
  r = kv(dir, {s, "salvage", d});
  EXPECT_EQ(r.code, 3) << r.out << r.err;
  EXPECT_NE(r.out.find("unreadable: " + s + "/seg/0000000000000001 at offset "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("salvaged 1 keys into " + d), std::string::npos) << r.out;
  r = kv(dir, {d, "get", "a"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "new value");
  r = kv(dir, {s, "salvage", d});
  EXPECT_EQ(r.code, 5) << "a store is there now: " << r.err;
}

}  // namespace
