// keel::kv on a real distributed filesystem: its index is a shared map, which two clients of
// a network filesystem do not share, so a store there is refused unless its caller states
// that every user is on this host (then it works as on a local disk).

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "keel/error.hpp"
#include "keel/kv/store.hpp"
#include "netfs/glusterfs.hpp"

namespace keel::kv {
namespace {

class GlusterfsKv : public ::testing::Test {
 protected:
  void SetUp() override {
    clients_ = test::glusterfs();
    if (!clients_.why_not.empty()) GTEST_SKIP() << clients_.why_not;
  }
  test::glusterfs_clients clients_;
};

std::string get_string(store& s, const std::string& key) {
  auto v = s.get(key);
  if (!v) return "<" + v.error().message() + ">";
  return *v;
}

TEST_F(GlusterfsKv, AStoreThereIsRefusedSayingWhyAndNothingIsMade) {
  test::shared_dir dir(clients_);
  const std::string path = dir.on(0, "store");
  auto s = store::open(path, options{});
  ASSERT_FALSE(s) << "a store opened on GlusterFS without the caller saying so";
  EXPECT_EQ(s.error(), keel::errc::needs_local_filesystem) << s.error().message();
  EXPECT_NE(s.error().message().find(path), std::string::npos) << s.error().message();
  EXPECT_NE(s.error().message().find("every_user_on_this_host"), std::string::npos);
  EXPECT_FALSE(std::filesystem::exists(path));

  // One made by a caller who said so is refused to the next who does not.
  options mine;
  mine.every_user_on_this_host = true;
  {
    auto made = store::open(path, mine);
    ASSERT_TRUE(made) << made.error().message();
  }
  auto again = store::open(dir.on(1, "store"), options{});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error(), keel::errc::needs_local_filesystem);
}

TEST_F(GlusterfsKv, StatingEveryUserIsOnThisHostOpensItAndItKeepsItsWord) {
  test::shared_dir dir(clients_);
  const std::string path = dir.on(0, "store");
  options o;
  o.every_user_on_this_host = true;
  o.durable = durability::sync;
  {
    auto s = store::open(path, o);
    ASSERT_TRUE(s) << s.error().message();
    ASSERT_TRUE((*s)->put("a", "1"));
    ASSERT_TRUE((*s)->put("a", "2"));
    EXPECT_EQ(get_string(**s, "a"), "2");
  }
  auto s = store::open(path, o);
  ASSERT_TRUE(s) << s.error().message();
  EXPECT_EQ(get_string(**s, "a"), "2");
}

}  // namespace
}  // namespace keel::kv
