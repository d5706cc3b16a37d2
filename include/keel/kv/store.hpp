#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "keel/io/deadline.hpp"
#include "keel/io/filesystem.hpp"
#include "keel/result.hpp"

//! keel::kv: an embedded transactional key-value store, shared by every thread and process
//! that opens it, with no server (formats and protocols: doc/kv-format.md).
//!
//! - **Data**: keys are 1 B to 1 KiB of any bytes, values 0 B to `max_value_size`. Keys are
//!   found through a memory-mapped hash index of their 128-bit hash; the full key is stored
//!   and compared, so a collision costs a probe, never an error.
//! - **Transactions** read a snapshot (the store as of `begin`, plus their own writes) and
//!   commit all or nothing. A commit fails with `errc::conflict` when another transaction
//!   committed a key this one read or wrote since its snapshot (serializable, optimistic):
//!   nothing of it was applied; retry it. Single-key calls are one-operation transactions.
//! - **Concurrency**: readers never wait; writers of different keys commit in parallel (they
//!   lock only the index pages of their keys), and only the final "make visible" step is
//!   taken in commit order. A process that dies at any point blocks nobody: what it held is
//!   taken over and its half-done commit is either completed or never seen.
//! - **Durability**: `durability::none` survives any process crash (the OS writes back);
//!   `durability::sync` returns once the commit is on stable storage, and concurrent sync
//!   committers of all processes share one fdatasync (group commit). A failed fdatasync is
//!   returned to every commit of its group and turns the store read-only until reopened.
//! - **Integrity**: every record and header carries an XXH3 checksum; with
//!   `verify_checksums` (the default) every read checks it, and damage is `errc::corrupt`
//!   naming the file and offset, never wrong data.
//!
//! Thread-safe: one `store` may be used by any number of threads at once. A `transaction`
//! belongs to one thread at a time. A forked child may use its parent's store (its calls fail
//! with ESTALE once the index was removed and made anew since: it opens the store again).
namespace keel::kv {

//! The largest key (bytes).
constexpr std::size_t max_key_size = 1024;
//! The largest value (bytes) this version writes.
constexpr std::uint64_t max_value_size = std::uint64_t{1} << 30;

enum class durability : std::uint8_t {
  none,  //!< survives a process crash; a power loss may lose the latest commits
  sync,  //!< on stable storage when commit returns (group commit)
};

struct options {
  bool create_if_missing = true;
  bool error_if_exists = false;
  //! Reads only: every change fails with errc::read_only. Nothing of the log (segments,
  //! manifest, checkpoint) is written, also when the store needs recovery; the index file,
  //! the shared map every user registers in (and a cache of the log), is written: its user
  //! slots, and a rebuild of it when the opener is the first since a reboot.
  //!
  //! Where the lock or index file may not be written (a read-only filesystem, files or a
  //! directory this user may only read, a volume full or at a quota that refuses their
  //! writes), the opener writes nothing at all: it builds an index
  //! of its own from the log, in memory (/dev/shm, else $TMPDIR or /tmp), and reads the
  //! store as it was when it opened (reopen to see later commits). It opens only while no
  //! other user has the store open (else device_or_resource_busy: the log must not move
  //! while it reads it); openers that would write wait while it builds, and may come once it
  //! has. stats() lists only its own users. A child it forks reopens that index through
  //! /proc/self/fd at its first call, which needs /proc and the rights the reader opened with.
  bool read_only = false;
  //! The default of every commit (a transaction may ask for another).
  durability durable = durability::none;
  //! Check the checksum of every record and value read (cheap; on by default).
  bool verify_checksums = true;
  //! For a new store: the size of its segment files (a power of two, 1 MiB to 1 GiB), or 0
  //! to let the store choose for its volume: a 1024th of the volume's size (statfs), at least
  //! 1 MiB and at most 64 MiB, which its segments grow to from 256 KiB as the log grows (a
  //! new store takes under 2 MiB; doc/kv-format.md, "Segments"). The store keeps room for
  //! compaction (a spare as large as its largest segment) and for deletes (256 KiB, or a
  //! segment when the size is given; doc/kv-format.md, "Space"): with 64 MiB segments given,
  //! a 256 MiB volume held 58 MiB of data, a 64 MiB volume none. A commit's records (values
  //! below 64 KiB, with their keys) must fit one segment, and a store holds at most 8064
  //! segments. On a full volume, a commit that only erases must fit the deletes' room (else
  //! too_large: split it).
  std::uint64_t segment_size = 0;
  //! How long a commit may wait for the locks of its keys (held by other commits) before it
  //! fails with timed_out.
  std::chrono::milliseconds lock_timeout{30'000};
  //! The most bytes the store's files may take, segments, index, checkpoint and the small
  //! files (the store file, the manifest, the lock files, the directories) as allocated (0: no cap;
  //! a checkpoint that would pass it is not written, and a put that finds the budget reached
  //! with nothing dead to compact removes the one there). A commit
  //! that would need a new segment beyond it fails with errc::budget_reached, before it is
  //! visible and leaving no trace. Puts leave a segment of it for commits that only erase,
  //! and one more (the spare) for compaction, so that deleting and compacting still work when
  //! the budget is reached: it must be at least three segments (of the size they grow to;
  //! four where `segment_size` fixes it, so that the log has one below the tail's for
  //! compaction to take), the index, the index pages a segment of 1 KiB values' keys may
  //! split into (a page for every 63 keys) and 32 KiB for the small files, or open fails
  //! with invalid_argument: 1 626 112 bytes for a new store whose segments grow (three of
  //! 256 KiB and an index of 205 pages).
  //! Each opener's own cap: give every opener of a store the same.
  std::uint64_t max_bytes = 0;
  //! A checkpoint (a copy of the index, so that a rebuild after a power loss replays only
  //! the log written since) is written once the log has grown by this many bytes since the
  //! last one, by a thread the commit that crosses the mark starts (0: the larger of 128 MiB
  //! and the index's size, which keeps the copying under one byte per byte of log).
  std::uint64_t checkpoint_bytes = 0;
  //! Compaction in the background: once this fraction of the log is dead (superseded and
  //! erased records, abandoned room) and the dead make up at least two segments, the commit
  //! that finds it so starts a thread of this process's own (the checkpoint's) that compacts
  //! as `compact` does, so that dead versions give their room back to the volume before a put
  //! finds it full. 0 turns it off (compaction then runs only when a put finds no room, or
  //! when asked); 0.5 by default: the log stays near twice what is live, unless writers
  //! outrun the one thread (no writer is slowed for it: a single process putting 2 KiB values
  //! as fast as it can over 0.7 MiB of keys was measured at 97 segments). A run that finds
  //! a transaction left open waits for it only 250 ms, then gives up until more has died.
  //! Must be from 0 to below 1, or open fails with invalid_argument. Each opener's own
  //! choice.
  double compact_dead_fraction = 0.5;
  //! Charge every commit that puts its worst-case room in the space ledger
  //! (keel/space/ledger.hpp) before anything of it is written, so that one that cannot fit
  //! fails at once with no_space (or budget_reached), its blobs unwritten and the index
  //! unsplit. Off: the same commit fails instead where it finds the room missing (still
  //! before it is visible). Each opener's own choice; off is for measuring what the ledger
  //! costs.
  bool ledger = true;
  //! The caller states that every user of the store is on this machine and reaches it
  //! through the same mount. Without it, a store on a filesystem other machines may share (a
  //! network or cluster filesystem, FUSE, or one keel does not know: io::fs_info::is_local)
  //! is refused with errc::needs_local_filesystem: its index is a shared map, which the
  //! clients of a network filesystem do not share (each would read its own stale copy: a
  //! second GlusterFS client read a value overwritten a moment before).
  bool every_user_on_this_host = false;
  //! The filesystem the store's files are reached through (null: io::os()).
  io::filesystem* fs = nullptr;
};

//! What a store holds, as of a snapshot of its counters.
//! A process using the store, as its slots in the shared index show it (as `mdb_stat -r`
//! lists LMDB's readers).
struct store_user {
  std::uint32_t pid = 0;
  //! When the process started: clock ticks since boot (/proc/PID/stat's field 22; 0: unknown).
  std::uint64_t started = 0;
  //! Slots it holds: threads in a call or a transaction, and slots it keeps for its next ones.
  std::uint32_t slots = 0;
  //! Whether it reads a snapshot now (a call or a transaction under way), and the oldest it
  //! reads: versions later commits superseded stay for it, and compaction waits for it.
  bool reading = false;
  std::uint64_t oldest_snapshot = 0;
  //! Its liveness lock is free: the process is gone, and its slots go to the next user that
  //! needs them.
  bool dead = false;
  bool self = false;  //!< the process asking
};

struct store_stats {
  //! Live keys, and the bytes of their newest records (keys, values, headers). Exact, but
  //! for a commit whose writer was killed after sealing it and before making it visible:
  //! made visible by another user, it is not counted here until the index is rebuilt
  //! (doc/kv-format.md, Committing, step 9).
  std::uint64_t records = 0;
  std::uint64_t live_bytes = 0;
  //! Bytes of superseded records and abandoned space (an estimate: space a dead writer
  //! reserved and never wrote is not counted, and a rebuild counts a segment's abandoned end
  //! again when it was switched during the checkpoint's copy).
  std::uint64_t dead_bytes = 0;
  std::uint64_t segments = 0;       //!< segment files
  std::uint64_t segment_bytes = 0;  //!< their allocated size
  std::uint64_t index_bytes = 0;    //!< the index file's size
  std::uint64_t index_pages = 0;    //!< bucket pages reachable from the directory
  //! Pages on the index's free list: retired by splits, taken by later splits once no
  //! snapshot can still be reading them.
  std::uint64_t index_free_pages = 0;
  double index_load = 0;             //!< claimed entries / entries, over those pages
  std::uint64_t visible_seq = 0;     //!< the newest commit visible
  std::uint64_t checkpoint_seq = 0;  //!< the seq the last checkpoint is a copy at (0: none yet)
  //! Log bytes since that checkpoint: what a rebuild after a power loss would replay.
  std::uint64_t unchecked_bytes = 0;
  //! Log bytes this process's open replayed to rebuild the index (0: it was used as it was).
  std::uint64_t replayed_bytes = 0;
  //! The error of the last checkpoint written after a commit, if it failed (0: none).
  int checkpoint_errno = 0;
  //! Compactions that removed segments since the index was built, by every user, asked for
  //! or in the background.
  std::uint64_t compactions = 0;
  //! The error of this process's last compaction in the background, if it failed (0: none).
  int compaction_errno = 0;
  //! The processes with slots in the store, by pid.
  std::vector<store_user> users;
};

//! What a compaction did.
struct compact_stats {
  std::uint64_t segments_removed = 0;
  std::uint64_t records_moved = 0;
  std::uint64_t bytes_moved = 0;  //!< written to the tail: moved records and blobs
  std::uint64_t bytes_freed = 0;  //!< of segment files removed
  //! Erased keys forgotten: their erase records went with their segments, and their index
  //! entries were freed for other keys (no older version of the key was left anywhere).
  std::uint64_t erasures_dropped = 0;
  //! Records in the segments it emptied that did not check out (damaged): never copied (a
  //! copy would look whole), left where they are; a segment with one an entry still names
  //! stays. `verify` names each. Written anew or erased, such a key's damaged record is dead.
  std::uint64_t records_unreadable = 0;
};

//! A place `verify` found damaged.
struct damage {
  std::string file;          //!< the store's file
  std::uint64_t offset = 0;  //!< where in it
  std::string what;          //!< what is wrong there (and the key, when it can be read)
};

//! What `verify` found.
struct verify_report {
  std::uint64_t commits = 0;  //!< complete commit blocks
  //! Commit blocks a power cut tore before they completed: commits that never happened
  //! (not damage: the store was never told they were durable).
  std::uint64_t torn = 0;
  //! Every block, record, value and index entry that does not check out, old versions
  //! included, in file order.
  std::vector<damage> damaged;
};

//! What `store::salvage` did.
struct salvage_report {
  std::uint64_t keys = 0;     //!< keys copied: the newest readable version of each
  std::uint64_t erased = 0;   //!< keys whose newest readable version is an erase (not copied)
  std::uint64_t commits = 0;  //!< commit blocks read, whole or in part
  //! Commit blocks a power cut tore before they completed: commits that never happened.
  std::uint64_t torn = 0;
  //! Every place it could not read: segment files, blocks, records, values.
  std::vector<damage> unreadable;
  //! Keys whose newest version found could not be read: what was copied is older (or the
  //! key is absent). Each key as it is, and what happened.
  struct older_key {
    std::string key;
    std::string what;
  };
  std::vector<older_key> older;
};

//! What `store::backup` copied.
struct backup_report {
  std::uint64_t keys = 0;   //!< keys in the copy
  std::uint64_t bytes = 0;  //!< their keys' and values' bytes
  std::uint64_t seq = 0;    //!< the snapshot copied: every commit up to this seq, none after
};

class store;

//! One key and its value, as a scan returns them.
struct item {
  std::string key;
  std::string value;
};

//! A page of a scan and where the next one starts.
struct scan_page {
  std::vector<item> items;
  //! Pass back to `scan` for the next page; `done` when there is none.
  std::string cursor;
  bool done = false;
};

//! A transaction: reads see the snapshot taken when it began plus its own writes; writes are
//! buffered until `commit`. Destroying it without committing aborts it. Move-only; one thread
//! at a time.
class transaction {
 public:
  transaction() noexcept;
  transaction(transaction&&) noexcept;
  transaction& operator=(transaction&&) noexcept;
  transaction(const transaction&) = delete;
  transaction& operator=(const transaction&) = delete;
  ~transaction();

  //! The value of `key` (a copy). Errors: not_found, invalid_argument (empty key), too_large
  //! (key), corrupt (file, offset), and the store's I/O errors.
  [[nodiscard]] result<std::string> get(std::string_view key) noexcept;
  //! The value of `key` without a copy: valid until this transaction ends (a value written by
  //! this transaction: until it writes the key again).
  [[nodiscard]] result<std::span<const std::byte>> get_view(std::string_view key) noexcept;
  //! Copies the value of `key` into `out` and returns its full length (only the first
  //! out.size() bytes are copied when it is longer).
  [[nodiscard]] result<std::size_t> get_into(std::string_view key,
                                             std::span<std::byte> out) noexcept;
  //! Buffers a write. Errors: invalid_argument, too_large, read_only, and misuse (a finished
  //! transaction: invalid_argument).
  [[nodiscard]] result<void> put(std::string_view key, std::string_view value) noexcept;
  [[nodiscard]] result<void> erase(std::string_view key) noexcept;
  //! Up to `limit` items of this transaction's snapshot, in hash order, from `cursor` ("" for
  //! the start): every page of one transaction reads the same snapshot, so the pages together
  //! are the store as it was when the transaction began (a consistent copy, while writers go
  //! on). For reading only: a transaction that has written may not scan, and one that has
  //! scanned may not write (invalid_argument; serializability tracks reads key by key).
  [[nodiscard]] result<scan_page> scan(std::string_view cursor, std::size_t limit,
                                       bool keys_only = false) noexcept;
  //! Applies every write at once, or none, and returns the commit's seq: its place in the
  //! store's serial order (a transaction that wrote nothing returns its snapshot, where it
  //! is serialised). Errors: conflict (retry), timed_out (the keys' locks), read_only,
  //! too_large (its records, values below the blob threshold included, take more than one
  //! segment: so on any volume, full or not), budget_reached (options::max_bytes),
  //! no_space_on_device (the volume is full: nothing of the commit is visible; puts stop with a
  //! segment's room kept for commits that only erase, which go on into it; once they have filled
  //! it too, such a commit compacts, through a spare segment kept for it alone, as store::erase
  //! does, and goes in, or, if the transaction read keys, fails with conflict to be retried: do
  //! not commit one while this thread holds another transaction, which the compaction would
  //! wait for), and I/O errors (for `sync`, a failed fdatasync: the commit is
  //! visible but not known to be durable). Ends the transaction either way.
  [[nodiscard]] result<std::uint64_t> commit() noexcept;
  [[nodiscard]] result<std::uint64_t> commit(durability d) noexcept;
  //! Ends the transaction with no trace.
  void abort() noexcept;

  //! The seq of the snapshot it reads.
  [[nodiscard]] std::uint64_t snapshot() const noexcept;
  [[nodiscard]] bool active() const noexcept { return impl_ != nullptr; }

  struct impl;

 private:
  friend class store;
  friend struct store_internals;  // (keel's own code and tests: src/kv/store_impl.hpp)
  explicit transaction(std::unique_ptr<impl> p) noexcept;
  std::unique_ptr<impl> impl_;
};

class store {
 public:
  //! Opens the store at `path` (a directory), making it if asked. Recovers by itself from
  //! any crash of its users. Errors: no_such_file_or_directory, file_exists, not_keel_file
  //! (a directory holding something else: it is left alone), unsupported_version (a store of
  //! another format), corrupt, invalid_argument (bad options), device_or_resource_busy (past
  //! lock_timeout, a process has the store open through an index removed from its path by
  //! hand: it must close the store first), ESTALE (the index was removed or replaced by hand
  //! while it opened: open again), and the errno of what failed (permission_denied,
  //! read_only_file_system, ...).
  [[nodiscard]] static result<std::unique_ptr<store>> open(const std::string& path,
                                                           const options& o) noexcept;
  [[nodiscard]] static result<std::unique_ptr<store>> open(const std::string& path) noexcept {
    return open(path, options{});
  }
  //! Copies the newest readable version of every key of the store at `from` into a new
  //! store made at `to` (absent, or an empty directory), and lists what it could not read
  //! (SQLite's .recover, tkrzw's restore): for a store that refuses to open (`corrupt`), or
  //! to move what survives of a damaged one. It reads `from`'s store file and segments
  //! directly (its index, manifest and checkpoint are not needed) and never writes there;
  //! nobody may write `from` meanwhile. A commit a power cut tore is left out (it never
  //! happened); a damaged one gives the records of it that check out. `o` is the new
  //! store's (its fs reads `from` too). Errors: not_keel_file, unsupported_version or corrupt
  //! (`from`'s store file: without it nothing can be read), file_exists (`to` holds
  //! something), and what making or writing `to` met.
  [[nodiscard]] static result<salvage_report> salvage(const std::string& from,
                                                      const std::string& to,
                                                      const options& o) noexcept;
  //! Copies this store, as it is when the call begins, into a new store made at `to` (which
  //! must not exist), while readers and writers go on: every commit acknowledged before the
  //! call is in the copy, and none that began after. Only live records are copied (as
  //! `mdb_copy -c`). The copy is made beside `to` under a hidden name of its own, made durable,
  //! and then renamed to `to`: `to` is a whole copy or absent (a backup killed half-way leaves
  //! `.NAME.keel-build-PID-RANDOM` beside it). The snapshot it reads holds back compaction until it
  //! ends. Errors: file_exists (`to` exists), invalid_argument (`to` names no entry), and what
  //! reading this store or making and writing the copy met.
  [[nodiscard]] result<backup_report> backup(const std::string& to) noexcept;
  //! Makes a new store at `to` (which must not exist) with options `o`, and lets `fill` write
  //! it; `to` appears only once `fill` has succeeded and all it wrote is durable: it is the
  //! whole store or absent (a bulk load that is all-or-nothing, whatever the size). The store
  //! is made beside `to` under a hidden name, `.NAME.keel-build-PID-RANDOM`, removed if `fill` or
  //! anything after it fails (a process killed half-way leaves it). Errors: file_exists,
  //! invalid_argument (`to` names no entry), what `fill` returned, and what making, syncing
  //! and renaming the store met.
  [[nodiscard]] static result<void> build(const std::string& to, const options& o,
                                          const std::function<result<void>(store&)>& fill) noexcept;
  ~store();
  store(const store&) = delete;
  store& operator=(const store&) = delete;

  [[nodiscard]] result<std::string> get(std::string_view key) noexcept;
  //! The value of `key`, into `value` (its memory reused: a loop of gets into one string
  //! allocates nothing once it has grown). Errors: get's, and not_enough_memory; `value` is
  //! unchanged by any error.
  [[nodiscard]] result<void> get(std::string_view key, std::string& value) noexcept;
  //! When the commit finds no room while the log holds at least a segment of dead versions,
  //! it compacts (once for every writer that found the store full at the same time) and
  //! tries again, so the store is full when its live data fills the volume (or budget), not
  //! its log. Like `compact`, that waits (up to options::lock_timeout) for the transactions
  //! open in any thread: do not call it while this thread holds one. Errors: commit's, and
  //! compact's when the compaction it ran failed.
  [[nodiscard]] result<void> put(std::string_view key, std::string_view value) noexcept;
  //! On a full store it compacts when it must (see transaction::commit), so deletes go on
  //! while compaction can free anything: like `compact`, it then waits (up to
  //! options::lock_timeout) for the transactions open in any thread, so do not call it while
  //! this thread holds one. Errors: not_found when the key is absent (nothing is written),
  //! commit's, and compact's when the compaction it ran failed.
  [[nodiscard]] result<void> erase(std::string_view key) noexcept;
  [[nodiscard]] result<transaction> begin() noexcept;

  //! Up to `limit` items of the store's newest snapshot, in hash order, from `cursor` ("" for
  //! the start). Resumable across commits and reopening: a key present throughout is
  //! returned exactly once.
  [[nodiscard]] result<scan_page> scan(std::string_view cursor, std::size_t limit,
                                       bool keys_only = false) noexcept;
  [[nodiscard]] result<store_stats> stats() noexcept;
  //! Reads every block of every segment and checks every checksum, every value a record
  //! names, and every index entry against the record it names. Returns the number of
  //! complete commit blocks; errors: corrupt (the first damage, file and offset; `report`,
  //! when given, lists every one, old versions included), timed_out, and what kept it from
  //! reading. Waits (up to options::lock_timeout) for a compaction, a checkpoint or another
  //! verify to end, and keeps them from starting until it is done (background checkpoints
  //! are written afterwards). Other processes may commit meanwhile: what they write after
  //! it began is not judged (test `KvVerify.FindsNoDamageWhileAnotherProcessCommits`).
  [[nodiscard]] result<std::uint64_t> verify(verify_report* report = nullptr) noexcept;

  //! Moves the live records out of every segment (but the one being appended to) that is at
  //! most half live (when a put would find no room: any with a sixteenth dead), and removes
  //! those files, while readers and writers go on. Moves only what fits the room left (a
  //! spare segment is kept for it): call it again while it removes segments. Waits, up to
  //! options::lock_timeout, for transactions older than its start and than its moves to end (so do
  //! not call it while this thread holds a transaction). Errors: timed_out, read_only, corrupt, and
  //! I/O errors (nothing is removed unless its records' copies are synced first).
  [[nodiscard]] result<compact_stats> compact() noexcept;
  //! Writes a checkpoint now (commits write them by themselves, see
  //! options::checkpoint_bytes): after a power loss, the next open replays only the log
  //! written since. Readers and writers go on meanwhile. Errors: read_only, timed_out,
  //! budget_reached (the copy would take the files past options::max_bytes), and I/O errors
  //! (the previous checkpoint stays).
  [[nodiscard]] result<void> checkpoint() noexcept;

  [[nodiscard]] const std::string& path() const noexcept;

  struct impl;

 private:
  friend struct store_internals;  // (keel's own code and tests: src/kv/store_impl.hpp)
  explicit store(std::unique_ptr<impl> p) noexcept;
  std::unique_ptr<impl> impl_;
};

}  // namespace keel::kv
