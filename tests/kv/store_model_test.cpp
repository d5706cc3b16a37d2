// keel::kv against a model: threads and forked processes commit random multi-key
// transactions over a few shared keys; afterwards a std::map replays the successful commits
// in their serial order (the seqs commit returned) and every read any transaction made,
// committed or not, must agree with it at that transaction's snapshot, and a committed one's
// reads also just before its own seq (serializable). The final store must equal the model.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "keel/kv/store.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;

constexpr int keys = 12;
constexpr int per_worker = 300;

// One transaction as a worker saw it. A value "-" is absent (a read) or an erase (a write).
struct record {
  std::uint64_t snapshot = 0;
  std::uint64_t seq = 0;  // 0: it did not commit (a conflict), or wrote nothing
  bool conflict = false;
  std::vector<std::pair<std::string, std::string>> reads, writes;
};

std::string key_name(int k) {
  return "m" + std::to_string(k);
}

// Runs `per_worker` random transactions and writes one line per transaction to `log`:
// snapshot seq conflict nreads (key value)... nwrites (key value)...
// Returns false on an error other than conflict.
bool work(store& s, int worker, const std::string& log, std::string& why) {
  std::mt19937 rng(static_cast<unsigned>(worker) * 7919u + 1);
  std::ofstream out(log);
  for (int n = 0; n < per_worker; ++n) {
    auto t = s.begin();
    if (!t) {
      why = "begin: " + t.error().message();
      return false;
    }
    record r;
    r.snapshot = t->snapshot();
    std::map<std::string, std::string> mine;  // written here: later reads see these
    const int ops = 1 + static_cast<int>(rng() % 4);
    for (int o = 0; o < ops; ++o) {
      const std::string k = key_name(static_cast<int>(rng() % keys));
      const unsigned what = rng() % 10;
      if (what < 5) {
        auto v = t->get(k);
        if (!v && v.error() != errc::not_found) {
          why = "get: " + v.error().message();
          return false;
        }
        const std::string seen = v ? *v : "-";
        if (auto m = mine.find(k); m != mine.end()) {
          if (seen != m->second) {
            why = "read its own write of " + k + " as " + seen + ", wrote " + m->second;
            return false;
          }
        } else {
          r.reads.emplace_back(k, seen);
        }
      } else if (what < 9) {
        const std::string v =
            "w" + std::to_string(worker) + "." + std::to_string(n) + "." + std::to_string(o);
        if (!t->put(k, v)) {
          why = "put failed";
          return false;
        }
        mine[k] = v;
      } else {
        if (!t->erase(k)) {
          why = "erase failed";
          return false;
        }
        mine[k] = "-";
      }
    }
    for (const auto& [k, v] : mine)
      r.writes.emplace_back(k, v);
    auto c = t->commit();
    if (c) {
      r.seq = r.writes.empty() ? 0 : *c;
    } else if (c.error() != errc::conflict) {
      why = "commit: " + c.error().message();
      return false;
    } else {
      r.writes.clear();  // left no trace
      r.conflict = true;
    }
    out << r.snapshot << ' ' << r.seq << ' ' << r.conflict << ' ' << r.reads.size();
    for (const auto& [k, v] : r.reads)
      out << ' ' << k << ' ' << v;
    out << ' ' << r.writes.size();
    for (const auto& [k, v] : r.writes)
      out << ' ' << k << ' ' << v;
    out << '\n';
  }
  out.close();
  if (!out) {
    why = "cannot write " + log;
    return false;
  }
  return true;
}

std::vector<record> read_log(const std::string& path) {
  std::vector<record> all;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    record r;
    std::size_t n = 0;
    ls >> r.snapshot >> r.seq >> r.conflict >> n;
    r.reads.resize(n);
    for (auto& [k, v] : r.reads)
      ls >> k >> v;
    ls >> n;
    r.writes.resize(n);
    for (auto& [k, v] : r.writes)
      ls >> k >> v;
    if (!ls) ADD_FAILURE() << "bad log line in " << path << ": " << line;
    all.push_back(std::move(r));
  }
  return all;
}

std::string model_value(const std::map<std::string, std::string>& m, const std::string& k) {
  auto i = m.find(k);
  return i == m.end() ? "-" : i->second;
}

TEST(KvModel, RandomTransactionsOfThreadsAndProcessesAreSerializable) {
  temp_dir dir;
  const std::string path = dir.file("s");
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  o.create_if_missing = true;
  auto opened = store::open(path, o);
  ASSERT_TRUE(opened) << opened.error().message();
  store& s = **opened;

  constexpr int processes = 3;
  constexpr int threads = 2;
  std::vector<pid_t> children;
  test::signal_pipe ready, go;  // all start at once, so that they contend
  for (int w = 0; w < processes; ++w) {
    children.push_back(fork_child([&, w] {
      auto mine = store::open(path, o);
      ready.notify();
      if (!mine) return 2;
      if (go.wait() == 0) return 4;
      std::string why;
      if (!work(**mine, w, dir.file("log" + std::to_string(w)), why)) {
        std::fprintf(stderr, "worker %d: %s\n", w, why.c_str());
        return 3;
      }
      return 0;
    }));
  }
  for (int w = 0; w < processes; ++w)
    ASSERT_NE(ready.wait(), 0);
  for (int w = 0; w < processes; ++w)
    go.notify();
  std::vector<std::string> thread_errors(threads);
  std::vector<std::thread> ts;
  for (int w = processes; w < processes + threads; ++w) {
    ts.emplace_back([&, w] {
      std::string why;
      if (!work(s, w, dir.file("log" + std::to_string(w)), why)) {
        thread_errors[static_cast<std::size_t>(w - processes)] = why;
      }
    });
  }
  for (auto& t : ts)
    t.join();
  for (const pid_t c : children)
    EXPECT_EQ(test::wait_exit(c), 0);
  for (const auto& e : thread_errors)
    EXPECT_EQ(e, "");
  if (HasFailure()) return;

  std::vector<record> all;
  for (int w = 0; w < processes + threads; ++w) {
    auto part = read_log(dir.file("log" + std::to_string(w)));
    ASSERT_EQ(part.size(), static_cast<std::size_t>(per_worker)) << "worker " << w;
    all.insert(all.end(), part.begin(), part.end());
  }
  std::vector<const record*> commits;
  std::vector<const record*> by_snapshot;
  std::size_t conflicts = 0;
  for (const record& r : all) {
    if (r.seq != 0) commits.push_back(&r);
    conflicts += r.conflict ? 1 : 0;
    by_snapshot.push_back(&r);
  }
  std::ranges::sort(commits, {}, [](const record* r) { return r->seq; });
  std::ranges::sort(by_snapshot, {}, [](const record* r) { return r->snapshot; });
  for (std::size_t i = 1; i < commits.size(); ++i)
    ASSERT_NE(commits[i - 1]->seq, commits[i]->seq) << "two commits with one seq";
  EXPECT_GT(commits.size(), all.size() / 4) << "too few commits to say much";
  EXPECT_GT(conflicts, 0u) << "no conflicts: the keys were not contended";
  std::printf("%zu transactions: %zu commits, %zu conflicts\n", all.size(), commits.size(),
              conflicts);

  // Replay in seq order; check each read set at its snapshot and each commit's reads just
  // before it.
  std::map<std::string, std::string> model;
  std::size_t next_check = 0;
  int bad = 0;
  const auto check_snapshots_up_to = [&](std::uint64_t seq) {
    for (; next_check < by_snapshot.size() && by_snapshot[next_check]->snapshot <= seq;
         ++next_check) {
      const record& r = *by_snapshot[next_check];
      for (const auto& [k, v] : r.reads) {
        if (model_value(model, k) != v && bad++ < 10) {
          ADD_FAILURE() << "snapshot " << r.snapshot << " read " << k << " = " << v
                        << ", the serial order says " << model_value(model, k);
        }
      }
    }
  };
  for (const record* c : commits) {
    check_snapshots_up_to(c->seq - 1);
    for (const auto& [k, v] : c->reads) {
      if (model_value(model, k) != v && bad++ < 10) {
        ADD_FAILURE() << "commit " << c->seq << " read " << k << " = " << v
                      << " but just before it the value was " << model_value(model, k)
                      << ": not serializable";
      }
    }
    for (const auto& [k, v] : c->writes) {
      if (v == "-") {
        model.erase(k);
      } else {
        model[k] = v;
      }
    }
  }
  check_snapshots_up_to(UINT64_MAX);
  EXPECT_EQ(bad, 0);

  // The store now is the model.
  std::map<std::string, std::string> now;
  std::string cursor;
  for (;;) {
    auto page = s.scan(cursor, 5);
    ASSERT_TRUE(page) << page.error().message();
    for (auto& it : page->items)
      EXPECT_TRUE(now.emplace(it.key, it.value).second) << "scanned twice: " << it.key;
    if (page->done) break;
    cursor = page->cursor;
  }
  EXPECT_EQ(now, model);
  for (int k = 0; k < keys; ++k) {
    auto v = s.get(key_name(k));
    EXPECT_EQ(v ? *v : "-", model_value(model, key_name(k))) << key_name(k);
  }
}

}  // namespace
}  // namespace keel::kv
