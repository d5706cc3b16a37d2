// A transaction's write set: each key's last write found by its key (keys that share a hash
// kept apart), values written over in place or anew, erases counted, and the order of first
// writes kept, through the table's growth.

#include "kv/write_set.hpp"

#include <gtest/gtest.h>

#include <map>
#include <random>
#include <string>

namespace keel::kv {
namespace {

disk::key_hash hash_of(const std::string& key) {
  return disk::hash_key(std::as_bytes(std::span(key.data(), key.size())), 1);
}

TEST(KvWriteSet, EachKeysLastWriteIsFoundInTheOrderOfFirstWrites) {
  for (const int n : {1, 8, 9, 100, 70'000}) {
    SCOPED_TRACE(n);
    write_set set;
    std::map<std::string, std::string> model;  // (empty: erased)
    std::vector<std::string> order;
    std::mt19937 random(static_cast<unsigned>(n));
    for (int i = 0; i < 3 * n; ++i) {
      const std::string key = "k" + std::to_string(random() % static_cast<unsigned>(n));
      if (!model.contains(key)) order.push_back(key);
      if (random() % 4 == 0) {
        set.erase(key, hash_of(key));
        model[key] = "";
      } else {
        const std::string value(random() % 300, static_cast<char>('a' + i % 26));
        set.put(key, hash_of(key), value);
        model[key] = "=" + value;
      }
    }
    ASSERT_EQ(set.size(), model.size());
    std::size_t erases = 0;
    std::size_t i = 0;
    for (const write_set::write& w : set) {
      ASSERT_EQ(w.key, order[i++]);
      EXPECT_EQ(w.h, hash_of(order[i - 1]));
      const std::string& want = model[std::string(w.key)];
      EXPECT_EQ(w.erase, want.empty());
      if (!w.erase) {
        EXPECT_EQ(w.value, want.substr(1));
      }
      erases += w.erase ? 1 : 0;
    }
    EXPECT_EQ(set.only_erases(), erases == set.size());
    for (const auto& [key, want] : model) {
      const write_set::write* w = set.find(key, hash_of(key));
      ASSERT_NE(w, nullptr) << key;
      EXPECT_EQ(w->key, key);
    }
    EXPECT_EQ(set.find("absent", hash_of("absent")), nullptr);
  }
}

// Keys of one hash (the store's seed makes them hard to make, not impossible) are two writes.
TEST(KvWriteSet, KeysThatShareAHashAreKeptApart) {
  for (const int n : {3, 50}) {
    write_set set;
    const disk::key_hash one{7, 7};
    for (int i = 0; i < n; ++i)
      set.put("key" + std::to_string(i), one, "v" + std::to_string(i));
    set.erase("key1", one);
    ASSERT_EQ(set.size(), static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      const write_set::write* w = set.find("key" + std::to_string(i), one);
      ASSERT_NE(w, nullptr);
      EXPECT_EQ(w->erase, i == 1);
      if (i != 1) {
        EXPECT_EQ(w->value, "v" + std::to_string(i));
      }
    }
    EXPECT_EQ(set.find("key", one), nullptr);
    EXPECT_EQ(set.find("key0", disk::key_hash{7, 8}), nullptr);
  }
}

// A value written again fits where the last was, or goes anew (a small value's old bytes
// stay where they were until the set ends), and no key's value runs into another's.
TEST(KvWriteSet, ValuesWrittenAgainInPlaceOrAnew) {
  write_set set;
  const disk::key_hash h = hash_of("a");
  set.put("a", h, "0123456789");
  set.put("b", hash_of("b"), "bbbb");
  const char* first = set.find("a", h)->value.data();
  set.put("a", h, "short");  // fits: in place
  EXPECT_EQ(set.find("a", h)->value, "short");
  EXPECT_EQ(set.find("a", h)->value.data(), first);
  set.put("a", h, std::string(5000, 'x'));  // anew: the earlier bytes are still there
  EXPECT_EQ(set.find("a", h)->value, std::string(5000, 'x'));
  EXPECT_EQ(std::string_view(first, 5), "short");
  EXPECT_EQ(set.find("b", hash_of("b"))->value, "bbbb");
  set.erase("a", h);
  EXPECT_TRUE(set.find("a", h)->erase);
  EXPECT_FALSE(set.only_erases());
  set.put("a", h, "");
  EXPECT_FALSE(set.find("a", h)->erase);
  EXPECT_EQ(set.find("a", h)->value, "");
  set.erase("a", h);
  set.erase("b", hash_of("b"));
  EXPECT_TRUE(set.only_erases());
  // A value that is a view of the set's own bytes, written over itself.
  set.put("c", hash_of("c"), "abcdef");
  const std::string_view own = set.find("c", hash_of("c"))->value;
  set.put("c", hash_of("c"), own.substr(2));
  EXPECT_EQ(set.find("c", hash_of("c"))->value, "cdef");
}

// A value that grows a little at each write (a log appended to in a transaction) is copied
// anew a logarithmic number of times: each copy was kept to the end, and 2 000 writes of a
// value growing by 1 000 bytes took 1.9 GB for a value of 2 MB.
TEST(KvWriteSet, AValueThatGrowsIsCopiedALogarithmicNumberOfTimes) {
  write_set set;
  const disk::key_hash h = hash_of("log");
  set.put("other", hash_of("other"), "o");
  std::string value;
  int copies = 0;
  const char* at = nullptr;
  for (int i = 0; i < 2'000; ++i) {
    value.append(1'000, static_cast<char>('a' + i % 26));
    set.put("log", h, value);
    const write_set::write* w = set.find("log", h);
    ASSERT_EQ(w->value, value);
    ASSERT_GE(w->room, value.size());
    ASSERT_LE(w->room, 2 * value.size() + 1'000);
    copies += w->value.data() != at ? 1 : 0;
    at = w->value.data();
  }
  EXPECT_LE(copies, 40);
  EXPECT_EQ(set.find("other", hash_of("other"))->value, "o");
}

}  // namespace
}  // namespace keel::kv
