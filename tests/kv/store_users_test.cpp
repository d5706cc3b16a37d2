// store::stats lists the store's users, as mdb_stat -r lists LMDB's readers: a process that
// holds an old snapshot is seen with how far behind it reads, and one that died is seen dead.

#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <string>

#include "keel/kv/store.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test::fork_child;
using test::temp_dir;
using test::wait_exit;
using test_support::open_ok;

TEST(KvUsers, StatsShowsAReaderHoldingAnOldSnapshotAndADeadOne) {
  temp_dir d;
  const std::string path = d.file("s");
  auto s = open_ok(path);
  ASSERT_TRUE(s && s->put("k", "1"));
  int ready[2];
  int go[2];
  ASSERT_EQ(::pipe(ready), 0);
  ASSERT_EQ(::pipe(go), 0);
  const pid_t reader = fork_child([&] {
    auto own = store::open(path, test_support::small());
    if (!own) return 2;
    auto t = (*own)->begin();
    if (!t || !t->get("k")) return 3;
    char c = 1;
    if (::write(ready[1], &c, 1) != 1) return 4;
    (void)::read(go[0], &c, 1);  // holds the transaction until told, or killed
    return 0;
  });
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  const std::uint64_t held = s->stats()->visible_seq;
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(s->put("k", std::to_string(i)));
  auto st = s->stats();
  ASSERT_TRUE(st);
  const auto find = [&](const store_stats& x, pid_t pid) {
    return std::ranges::find(x.users, static_cast<std::uint32_t>(pid), &store_user::pid);
  };
  auto r = find(*st, reader);
  ASSERT_NE(r, st->users.end());
  EXPECT_TRUE(r->reading);
  EXPECT_EQ(r->oldest_snapshot, held);
  EXPECT_EQ(st->visible_seq - r->oldest_snapshot, 5u);
  EXPECT_FALSE(r->dead);
  EXPECT_FALSE(r->self);
  EXPECT_NE(r->started, 0u);
  auto me = find(*st, ::getpid());
  ASSERT_NE(me, st->users.end());
  EXPECT_TRUE(me->self);
  ::kill(reader, SIGKILL);
  EXPECT_EQ(wait_exit(reader), 128 + SIGKILL);
  st = s->stats();
  ASSERT_TRUE(st);
  r = find(*st, reader);
  ASSERT_NE(r, st->users.end()) << "its slot is only reclaimed when another user needs it";
  EXPECT_TRUE(r->dead);
  ::close(ready[0]);
  ::close(ready[1]);
  ::close(go[0]);
  ::close(go[1]);
}

}  // namespace
}  // namespace keel::kv
