// The commit protocol's steps one by one (commit_run.hpp, doc/kv-format.md "Committing"):
// each step driven by hand on a real store, and what it leaves checked before the next
// runs: the keys planned, the block sized, the pages locked and a conflict found, the slot
// reserved, the entries marked pending, the seq taken, the block sealed, the entries
// published, the commit visible, and the two ways a commit ends early. (ready_index_pages
// does nothing where the volume never refuses a write through the maps, as here: the btrfs
// qgroup tests of store_shared_volume_test.cpp run it.)

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "kv/commit_run.hpp"
#include "kv/kv_support.hpp"
#include "support/process.hpp"

namespace keel::kv {
namespace {

using test_support::open_ok;

constexpr auto u64 = [](auto v) { return static_cast<std::uint64_t>(v); };

class KvCommitSteps : public ::testing::Test {
 protected:
  void SetUp() override {
    db = open_ok(dir.file("db"));
    ASSERT_NE(db, nullptr);
    s = &store_internals::of(*db);
  }
  //! A transaction, begun now.
  transaction begin() {
    auto t = db->begin();
    EXPECT_TRUE(t) << t.error().message();
    return std::move(*t);
  }
  //! `key`'s entry in the index as it is now (its page looked up unlocked: nothing else
  //! writes here meanwhile).
  std::optional<index::entry_ref> entry_of(std::string_view key) {
    const disk::key_hash h = s->hash_of(as_bytes(key));
    auto e = s->find_locked(s->table->page_of(h), h, as_bytes(key));
    EXPECT_TRUE(e);
    return e ? *e : std::nullopt;
  }
  //! The run's steps of its preparation, before any lock.
  static void prepare_unlocked(commit_run& run) {
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    ASSERT_TRUE(run.charge());
    ASSERT_TRUE(run.write_blobs());
  }
  //! The run's steps up to and with build_records: what comes before the block's room.
  static void prepare(commit_run& run) {
    ASSERT_NO_FATAL_FAILURE(prepare_unlocked(run));
    ASSERT_TRUE(run.lock_and_validate());
    ASSERT_TRUE(run.ready_index_pages());
    ASSERT_TRUE(run.build_records());
  }
  std::uint64_t word(std::size_t at) const { return s->h64(at).load(); }

  test::temp_dir dir;
  std::unique_ptr<store> db;
  store::impl* s = nullptr;
  const io::countdown cd = io::deadline(std::chrono::seconds(30)).start();
};

TEST_F(KvCommitSteps, PlanKeysTakesEachKeyOnceWrittenOrOnlyRead) {
  transaction t = begin();
  ASSERT_TRUE(t.put("a", "1"));
  ASSERT_TRUE(t.put("b", "2"));
  ASSERT_FALSE(t.get("c"));  // read, not there
  ASSERT_TRUE(t.get("a"));   // read of a written key: planned once, as written
  commit_run run(store_internals::of(t), durability::none, cd);
  ASSERT_TRUE(run.plan_keys());
  ASSERT_EQ(run.keys.size(), 3U);
  int written = 0, read = 0;
  for (const key_plan& k : run.keys) {
    EXPECT_TRUE(k.h == s->hash_of(as_bytes(k.key))) << k.key;
    if (k.w != nullptr) {
      ++written;
      EXPECT_TRUE(k.key == "a" || k.key == "b") << k.key;
    } else {
      ++read;
      EXPECT_EQ(k.key, "c");
    }
  }
  EXPECT_EQ(written, 2);
  EXPECT_EQ(read, 1);
}

TEST_F(KvCommitSteps, SizeUpCountsTheBlockAndTellsErasesAndBlobsApart) {
  {
    transaction t = begin();
    ASSERT_TRUE(t.erase("gone"));
    commit_run run(store_internals::of(t), durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    EXPECT_TRUE(run.only_erases);
    EXPECT_FALSE(run.has_blobs);
    EXPECT_EQ(run.puts, 0U);
  }
  {
    transaction t = begin();
    ASSERT_TRUE(t.put("small", "value"));
    commit_run run(store_internals::of(t), durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    disk::record_in r;
    r.what = disk::op::put;
    r.key = as_bytes(std::string_view("small"));
    r.value = as_bytes(std::string_view("value"));
    EXPECT_FALSE(run.only_erases);
    EXPECT_FALSE(run.has_blobs);
    EXPECT_EQ(run.puts, 1U);
    EXPECT_EQ(run.block, sizeof(disk::block_header) + disk::record_size(r));
    EXPECT_EQ(run.need, run.block);
  }
  {
    const std::string big(s->dir.params.blob_threshold, 'x');
    transaction t = begin();
    ASSERT_TRUE(t.put("big", big));
    commit_run run(store_internals::of(t), durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    EXPECT_TRUE(run.has_blobs);
    // The blob's block beside the commit's, which holds only a reference to it.
    EXPECT_EQ(run.need, run.block + disk::blob_block_size(big.size()));
  }
  {
    // A block no segment can hold is too large, however much room there is.
    const std::string value(s->dir.params.blob_threshold - 1, 'v');
    transaction t = begin();
    const std::uint64_t enough = s->dir.params.segment_size / value.size() + 1;
    for (std::uint64_t k = 0; k < enough; ++k)
      ASSERT_TRUE(t.put("k" + std::to_string(k), value));
    commit_run run(store_internals::of(t), durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    auto r = run.size_up();
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error(), errc::too_large);
  }
}

TEST_F(KvCommitSteps, ChargeHoldsAPutsWorstCaseInTheLedgerAndAnEraseNothing) {
  ASSERT_TRUE(s->opts.ledger) << "the ledger is on by default";
  {
    transaction t = begin();
    ASSERT_TRUE(t.put("k", std::string(3000, 'v')));
    auto& ti = store_internals::of(t);
    commit_run run(ti, durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    ASSERT_TRUE(run.charge());
    // Charged: the run holds it, and the slot names the delta it is charged in.
    EXPECT_EQ(run.charged.s, s);
    EXPECT_EQ(run.charged.who, ti.lease.index);
    EXPECT_NE(run.charged.c.delta, 0U);
    // At least twice the block and one page per new key (commit_prepare.cpp, charge).
    EXPECT_GE(run.charged.c.cost, static_cast<std::int64_t>(2 * run.need + disk::page_size));
    EXPECT_NE(s->slot(ti.lease.index).ledger_pin().load(), 0U);
    run.charged.done();  // refunded: nothing was taken
    EXPECT_EQ(run.charged.s, nullptr);
  }
  {
    transaction t = begin();
    ASSERT_TRUE(t.erase("k"));
    commit_run run(store_internals::of(t), durability::none, cd);
    ASSERT_TRUE(run.plan_keys());
    ASSERT_TRUE(run.size_up());
    ASSERT_TRUE(run.charge());
    EXPECT_EQ(run.charged.s, nullptr) << "an erase-only commit takes no ledger charge";
  }
}

TEST_F(KvCommitSteps, WriteBlobsPutsEachLargeValueInABlockOfItsOwnBeforeAnyLock) {
  const std::string big(s->dir.params.blob_threshold + 100, 'b');
  transaction t = begin();
  ASSERT_TRUE(t.put("big", big));
  ASSERT_TRUE(t.put("small", "s"));
  commit_run run(store_internals::of(t), durability::none, cd);
  ASSERT_NO_FATAL_FAILURE(prepare_unlocked(run));
  EXPECT_FALSE(run.held.owns_lock()) << "blobs are written before any lock";
  for (const key_plan& k : run.keys) {
    if (k.key == "small") {
      EXPECT_EQ(k.blob.location, 0U);
      continue;
    }
    ASSERT_NE(k.blob.location, 0U);
    auto bytes = s->bytes_at(k.blob.location);
    ASSERT_TRUE(bytes);
    auto head = disk::parse_block_header(*bytes, s->salt);
    ASSERT_TRUE(head);
    EXPECT_EQ(head->kind, static_cast<std::uint16_t>(disk::block_kind::blob));
    const std::span<const std::byte> value = disk::blob_value(*bytes, *head);
    ASSERT_EQ(value.size(), big.size());
    EXPECT_EQ(std::memcmp(value.data(), big.data(), big.size()), 0);
    EXPECT_EQ(k.blob.checksum, head->payload_checksum) << "the reference names the block's sum";
  }
  // The rest of the commit names it: the value reads back whole.
  ASSERT_TRUE(run.lock_and_validate());
  ASSERT_TRUE(run.ready_index_pages());
  ASSERT_TRUE(run.build_records());
  ASSERT_TRUE(run.reserve_block());
  run.mark();
  run.take_seq();
  ASSERT_TRUE(run.write_block());
  run.make_visible(run.publish());
  auto got = db->get("big");
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, big);
}

TEST_F(KvCommitSteps, LockAndValidateFindsAKeyCommittedPastTheSnapshot) {
  ASSERT_TRUE(db->put("k", "first"));
  transaction late = begin();
  ASSERT_TRUE(late.put("k", "late"));
  ASSERT_TRUE(db->put("k", "second"));  // after late's snapshot
  commit_run run(store_internals::of(late), durability::none, cd);
  ASSERT_NO_FATAL_FAILURE(prepare_unlocked(run));
  auto r = run.lock_and_validate();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), errc::conflict);
}

TEST_F(KvCommitSteps, LockAndValidateHoldsThePagesAndKnowsThePreviousVersion) {
  ASSERT_TRUE(db->put("k", "first"));
  const std::optional<index::entry_ref> before = entry_of("k");
  ASSERT_TRUE(before);
  transaction t = begin();
  ASSERT_TRUE(t.put("k", "again"));
  ASSERT_TRUE(t.put("new", "one"));
  commit_run run(store_internals::of(t), durability::none, cd);
  ASSERT_NO_FATAL_FAILURE(prepare_unlocked(run));
  ASSERT_TRUE(run.lock_and_validate());
  EXPECT_TRUE(run.held.owns_lock());
  for (const key_plan& k : run.keys) {
    EXPECT_EQ(k.page, s->table->page_of(k.h)) << k.key;
    if (k.key == "k") {
      ASSERT_TRUE(k.entry);
      EXPECT_EQ(k.prev, before->location().load());
      EXPECT_EQ(k.prev_seq, before->seq().load());
      EXPECT_GT(k.prev_size, 0U);
    } else {
      EXPECT_FALSE(k.entry) << "a new key has no entry before its mark";
      EXPECT_EQ(k.prev, 0U);
    }
  }
  // Its pages are held: another writer of the key cannot take them now.
  auto other = s->locks->try_lock({lock::entity(run.keys[0].page)});
  EXPECT_FALSE(other);
  ASSERT_TRUE(run.build_records());
  EXPECT_EQ(run.records.size(), 2U);
  EXPECT_EQ(run.length, disk::block_size(run.records));
}

TEST_F(KvCommitSteps, EachWritingStepLeavesWhatTheProtocolSays) {
  ASSERT_TRUE(db->put("old", "v1"));
  transaction t = begin();
  ASSERT_TRUE(t.put("old", "v2"));
  ASSERT_TRUE(t.put("fresh", "v"));
  auto& ti = store_internals::of(t);
  commit_run run(ti, durability::sync, cd);
  ASSERT_NO_FATAL_FAILURE(prepare(run));
  const slot_ref slot = s->slot(ti.lease.index);

  // reserve_block: the slot says reserved, at the block it got; the tail is past it.
  ASSERT_TRUE(run.reserve_block());
  EXPECT_EQ(slot.state().load(), u64(commit_state::reserved));
  EXPECT_EQ(slot.block().load(), run.location);
  EXPECT_EQ(slot.block_length().load(), run.length);
  EXPECT_GE(word(header::tail), run.location + run.length);

  // mark: every written key's entry pending on the block; nothing published yet.
  run.mark();
  for (const key_plan& k : run.keys) {
    ASSERT_TRUE(k.entry) << k.key;
    EXPECT_EQ(k.entry->seq().load(), index::pending | run.location) << k.key;
    EXPECT_GT(k.record_at, run.location) << k.key;
  }

  // take_seq: the next seq, recorded in the slot, which says writing.
  const std::uint64_t next = word(header::next_seq);
  run.take_seq();
  EXPECT_EQ(run.seq, next);
  EXPECT_EQ(word(header::next_seq), next + 1);
  EXPECT_EQ(slot.seq().load(), run.seq);
  EXPECT_EQ(slot.state().load(), u64(commit_state::writing));

  // write_block: sealed with the seq.
  ASSERT_TRUE(run.write_block());
  EXPECT_EQ(disk::block_seq(run.bytes.first(run.length)), run.seq);

  // publish: each entry names its new record and the seq; not visible yet.
  const store::impl::counter_delta delta = run.publish();
  for (const key_plan& k : run.keys) {
    EXPECT_EQ(k.entry->location().load(), k.record_at) << k.key;
    EXPECT_EQ(k.entry->seq().load(), run.seq) << k.key;
  }
  EXPECT_EQ(delta.records, 1);  // one new key; the other replaced
  EXPECT_LT(word(header::visible), run.seq);

  // make_visible: visible, the slot idle, the pages let go.
  run.make_visible(delta);
  EXPECT_GE(word(header::visible), run.seq);
  EXPECT_EQ(slot.state().load(), u64(commit_state::idle));
  EXPECT_FALSE(run.held.owns_lock());
  auto got = db->get("old");
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, "v2");
  got = db->get("fresh");
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, "v");

  // make_durable: a group sync that started after it was visible has finished (the words
  // count syncs, not seqs).
  const std::uint64_t started = word(header::sync_started);
  auto durable = run.make_durable();
  ASSERT_TRUE(durable);
  EXPECT_EQ(*durable, run.seq);
  EXPECT_GT(word(header::sync_done), started);
}

TEST_F(KvCommitSteps, GivingUpTheMarksPutsEachEntryBackAndLeavesAHole) {
  ASSERT_TRUE(db->put("old", "v1"));
  const std::optional<index::entry_ref> before = entry_of("old");
  ASSERT_TRUE(before);
  const std::uint64_t old_seq = before->seq().load();
  transaction t = begin();
  ASSERT_TRUE(t.put("old", "v2"));
  ASSERT_TRUE(t.put("fresh", "v"));
  commit_run run(store_internals::of(t), durability::none, cd);
  ASSERT_NO_FATAL_FAILURE(prepare(run));
  ASSERT_TRUE(run.reserve_block());
  run.mark();
  run.take_seq();
  auto r = run.give_up_marks();
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error(), std::errc::timed_out);
  for (const key_plan& k : run.keys) {
    EXPECT_EQ(k.entry->seq().load(), k.key == "old" ? old_seq : 0U) << k.key;
  }
  // The seq is a hole, visible: later commits are not held behind it.
  EXPECT_GE(word(header::visible), run.seq);
  (void)run.held.unlock();
  auto got = db->get("old");
  ASSERT_TRUE(got);
  EXPECT_EQ(*got, "v1");
  EXPECT_EQ(db->get("fresh").error(), errc::not_found);
  ASSERT_TRUE(db->put("after", "x"));
  EXPECT_EQ(*db->get("after"), "x");
}

TEST_F(KvCommitSteps, AFailureBeforeTheMarksLeavesTheSlotIdleAndNothingSeen) {
  transaction t = begin();
  ASSERT_TRUE(t.put("never", "seen"));
  auto& ti = store_internals::of(t);
  commit_run run(ti, durability::none, cd);
  ASSERT_NO_FATAL_FAILURE(prepare(run));
  ASSERT_TRUE(run.reserve_block());
  const std::uint64_t next = word(header::next_seq);
  auto r = run.fail_unmarked(error(std::make_error_code(std::errc::io_error)));
  EXPECT_EQ(r.error(), std::errc::io_error);
  EXPECT_EQ(s->slot(ti.lease.index).state().load(), u64(commit_state::idle));
  EXPECT_EQ(word(header::next_seq), next) << "no seq was taken";
  (void)run.held.unlock();
  EXPECT_EQ(db->get("never").error(), errc::not_found);
  ASSERT_TRUE(db->put("after", "x"));
  EXPECT_EQ(*db->get("after"), "x");
}

}  // namespace
}  // namespace keel::kv
