#pragma once
// What the store's tests share: small segments (so a few thousand keys fill several) and an
// open that reports its error.

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "keel/kv/store.hpp"
#include "kv/index.hpp"
#include "kv/store_dir.hpp"
#include "kv/store_impl.hpp"

namespace keel::kv {

//! A commit step's name, for test names and messages.
inline const char* name_of(commit_step at) noexcept {
  switch (at) {
    case commit_step::charging:
      return "charging";
    case commit_step::charged:
      return "charged";
    case commit_step::locked:
      return "locked";
    case commit_step::reserved:
      return "reserved";
    case commit_step::marked:
      return "marked";
    case commit_step::took_seq:
      return "took_seq";
    case commit_step::recorded:
      return "recorded";
    case commit_step::written:
      return "written";
    case commit_step::published_one:
      return "published_one";
    case commit_step::published:
      return "published";
    case commit_step::visible:
      return "visible";
    case commit_step::leaving:
      return "leaving";
    case commit_step::sync_waiting:
      return "sync_waiting";
    case commit_step::syncing:
      return "syncing";
  }
  return "?";
}
inline void PrintTo(commit_step at, std::ostream* os) {
  *os << name_of(at);
}

}  // namespace keel::kv

namespace keel::kv::test_support {

//! While it lives, a new index has one bucket page (not index::initial_depth's 64): for tests
//! that split that page on purpose.
struct one_page_index {
  unsigned was = index::initial_depth;
  one_page_index() noexcept { index::initial_depth = 0; }
  ~one_page_index() { index::initial_depth = was; }
  one_page_index(const one_page_index&) = delete;
  one_page_index& operator=(const one_page_index&) = delete;
};

//! In a writer forked to be killed: SIGKILL at step `at` of its commits.
inline void die_at(commit_step at) noexcept {
  static commit_step kill_at;
  kill_at = at;
  commit_hook = [](commit_step now) noexcept {
    if (now == kill_at) ::raise(SIGKILL);
  };
}

//! 1 MiB segments.
//! Bytes the files under `path` take on their volume (their blocks, as du counts them; `path`
//! itself left out).
inline std::uint64_t allocated_under(const std::string& path) {
  std::uint64_t total = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(path)) {
    struct stat st {};
    if (::lstat(e.path().c_str(), &st) == 0)
      total += static_cast<std::uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

inline options small() {
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  return o;
}

//! small(), with no compaction in the background (only when asked, or when a put finds no
//! room): for tests of what one compaction does, which one run meanwhile would take away.
inline options manual_compaction(options o = small()) {
  o.compact_dead_fraction = 0;
  return o;
}

//! The store at `path`, or null after a test failure naming the error.
inline std::unique_ptr<store> open_ok(const std::string& path, const options& o = small()) {
  auto s = store::open(path, o);
  if (!s) ADD_FAILURE() << s.error().message();
  return s ? std::move(*s) : nullptr;
}

//! Rewrites each slot of the manifest of the closed store at `path` that parses as
//! `rewrite(manifest, dir)` returns it (its bytes, written at the slot's start over zeros):
//! how many it rewrote, or -1 after a test failure naming the error.
template <class Rewrite>
int rewrite_manifest_slots(const std::string& path, Rewrite&& rewrite) {
  auto d = open_store_dir(path, {.create_if_missing = false});
  if (!d) {
    ADD_FAILURE() << d.error().message();
    return -1;
  }
  std::fstream f(path + "/manifest", std::ios::in | std::ios::out | std::ios::binary);
  std::vector<char> file((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const std::size_t slot = file.size() / 2;
  int rewritten = 0;
  for (std::size_t at = 0; at < file.size(); at += slot) {
    auto m = disk::parse_manifest(std::as_bytes(std::span(file).subspan(at, slot)), d->params.id,
                                  d->params.salt);
    if (!m) continue;  // blank, or a generation never written
    const std::vector<std::byte> bytes = rewrite(*m, *d);
    std::fill(file.begin() + static_cast<std::ptrdiff_t>(at),
              file.begin() + static_cast<std::ptrdiff_t>(at + slot), '\0');
    std::memcpy(file.data() + at, bytes.data(), bytes.size());
    ++rewritten;
  }
  f.seekp(0);
  f.write(file.data(), static_cast<std::streamsize>(file.size()));
  if (!f.flush()) ADD_FAILURE() << "cannot write " << path << "/manifest";
  return rewritten;
}

}  // namespace keel::kv::test_support
