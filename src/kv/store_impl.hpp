#pragma once
// The store's insides, shared by its parts, each a file that says at its top what it owns:
// open.cpp (opening, the index checked or recovered), users.cpp (liveness and slots),
// pages.cpp (the index's pages), segments.cpp, rooms.cpp (the spare and the deletes' room),
// reserve.cpp (where blocks go), budget.cpp (what may still be taken), transaction.cpp and
// commit_run.hpp (a transaction's calls, the commit protocol's steps), compaction.hpp (a
// compaction's steps), visible.cpp (commits made visible in order, dead writers' settled),
// group_sync.cpp (durable commits), read.cpp (lookups, scans, stats), maintenance.cpp (the
// background thread and the maintenance byte), store.cpp (the store's own calls), and the
// others named by section below.
// index_file.hpp is the index file's fixed part: its header's words, and which file writes
// each. The state a part owns per process is a type of its own, in its header: users.hpp,
// maintenance.hpp, segment_map.hpp, segment_sum_memo.hpp, and process_compaction below.
// (Over 500 lines: the declarations of the one object whose calls the parts' files define,
// each with its contract. The walks and views that need no store are elsewhere:
// block_walk.hpp, index.hpp, test_hooks.hpp.)
// Layouts and protocols are doc/kv-format.md's; the names here follow it.

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "base/format_header.hpp"
#include "base/thread_safety.hpp"
#include "io/map_guard.hpp"
#include "keel/io/file_handle.hpp"
#include "keel/io/fs_info.hpp"
#include "keel/io/mapped_file.hpp"
#include "keel/kv/store.hpp"
#include "keel/lock/memory_map.hpp"
#include "keel/space/ledger.hpp"
#include "kv/block_walk.hpp"
#include "kv/format.hpp"
#include "kv/index.hpp"
#include "kv/index_file.hpp"
#include "kv/maintenance.hpp"
#include "kv/segment_map.hpp"
#include "kv/segment_sum_memo.hpp"
#include "kv/store_dir.hpp"
#include "kv/supplier.hpp"
#include "kv/test_hooks.hpp"
#include "kv/users.hpp"

namespace keel::kv {

//! Who asks for room, from the most bound to the least (doc/kv-format.md, Space). A commit
//! that puts leaves the spare and the deletes' room; one that only erases leaves the spare,
//! and may take the deletes' room; compaction may take the spare. So deletes work on a
//! volume puts, or another program, have filled, and compaction always has a segment's room
//! to move a victim into.
enum class room_for : std::uint8_t { put, erase, compaction };

//! What the spare must be for a writer: as large as the largest log segment (a put, and
//! whatever its copies go to: compaction copies any one into it), or only there (a commit
//! that only erases: a spare smaller than that, kept by a compaction whose victims were all
//! smaller, still holds the copies of a victim that fits it, and grows again when the volume
//! has the room).
enum class room_need : std::uint8_t { every_segment, there };

//! A segment's room allocated ahead as a file of seg/, for one kind of writer only, with the
//! header word that holds its size while it is there and whole (a hint: the file decides).
struct room_file {
  const char* name;
  std::size_t word;
};
//! What compaction moves a victim into when no segment can be made.
inline constexpr room_file spare_room{"spare", header::spare};
//! What a commit that only erases writes into when no segment can be made: the room puts
//! leave for deletes, held as a file so that another program on the volume cannot take it.
inline constexpr room_file deletes_room{"deletes", header::deletes_room};

//! A record found by a lookup, with its location.
struct found_record {
  std::uint64_t location = 0;
  disk::record_view rec;
  segment* seg = nullptr;
};

struct store::impl final : index::page_source {
  impl() = default;
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  ~impl();

  // ---- set once by open ----
  std::string path;
  options opts;
  io::filesystem* fs = nullptr;
  store_dir dir;
  io::file_handle index_file;
  io::mapped_file index_map;
  //! The store's locks; null for a reader with an index of its own (it changes nothing).
  std::unique_ptr<lock::memory_map> locks;
  //! A read-only opener that may not write the store's files (a read-only filesystem, a
  //! directory or files it may only read): its index is its own, built from the log at open
  //! in an unnamed file (open_private_index), and shows the store as it was then.
  bool private_index = false;
  //! That reader holds private_reading_byte on dir.store_file while it lives.
  std::optional<index::table> table;
  std::uint64_t salt = 0;
  //! The hash of a key in this store (seeded with its salt: disk::hash_key).
  [[nodiscard]] disk::key_hash hash_of(std::span<const std::byte> key) const noexcept {
    return disk::hash_key(key, salt);
  }
  //! The space ledger in the index header, its pins in the user slots (every user has the
  //! view; only writers with options::ledger on charge it).
  std::optional<space::ledger> ledger;
  //! Set once open is done: from then on index growth leaves the room kept for deletes
  //! (pages.cpp).
  bool serving = false;

  // ---- per process (reopened after fork) ----
  //! This process's liveness descriptor and user slots (users.hpp owns them).
  process_users users;
  //! A sync failed: read-only until reopened (set by group_sync.cpp and manifest.cpp, where
  //! a sync fails; every writer reads it).
  std::atomic<bool> failed{false};
  //! The last reuse_horizon this process saw (it only grows: a cache, not a promise), and
  //! *visible* when it last looked (pages.cpp's).
  std::atomic<std::uint64_t> horizon_seen{0};
  std::atomic<std::uint64_t> horizon_looked_at{0};

  //! index_pages_for's last figure for each segment size (by its power of two): a walk of
  //! every bucket page, taken for `slack` more keys than asked and kept until that many more
  //! records are live or the directory changes (budget.cpp's). After the users' part: 2.5 KiB read
  //! only when a segment is made, kept off the pages every call touches (the idle-slot cells).
  struct split_estimate {
    std::uint64_t size = 0, records = 0, directory = 0, slack = 0, pages = 0;
  };
  mutable base::mutex split_estimates_mutex;
  mutable std::array<split_estimate, 64> split_estimates KEEL_GUARDED_BY(split_estimates_mutex){};

  // ---- segments mapped in this process (segment_map.hpp owns them) ----
  segment_map mapped;

  // ---- the index ----
  [[nodiscard]] std::byte* base() const noexcept { return index_map.data(); }
  [[nodiscard]] std::atomic_ref<std::uint64_t> h64(std::size_t at) const noexcept {
    return std::atomic_ref(*reinterpret_cast<std::uint64_t*>(base() + at));
  }
  //! The low 32 bits of the header word at `at`, for a futex: they change whenever a counter
  //! that only grows moves.
  [[nodiscard]] std::uint32_t* futex_word(std::size_t at) const noexcept {
    static_assert(std::endian::native == std::endian::little);
    return reinterpret_cast<std::uint32_t*>(base() + at);
  }
  [[nodiscard]] slot_ref slot(std::size_t u) const noexcept {
    return {base() + slot_first_page * disk::page_size + u * slot_size};
  }
  //! The segment table entry of segment `n`: number, size, dead bytes, reserved (its dirty
  //! bit is in the header: dirty_word).
  [[nodiscard]] std::atomic_ref<std::uint64_t> segtab(std::uint64_t n,
                                                      std::size_t field) const noexcept {
    return std::atomic_ref(
        *reinterpret_cast<std::uint64_t*>(base() + segtab_first_page * disk::page_size +
                                          (n % segtab_entries) * segtab_entry_size + field * 8));
  }

  // page_source
  result<std::uint64_t> allocate(std::size_t count) noexcept override;
  void retire(std::uint64_t first, std::size_t count) noexcept override;
  void release(std::uint64_t first, std::size_t count) noexcept override;
  //! The oldest snapshot any user holds or can still take: a page retired at or below it is
  //! out of every reader's reach.
  [[nodiscard]] std::uint64_t reuse_horizon() noexcept;
  //! Forgets what this process saw of the horizon (horizon_seen): for a forked child, which
  //! may have missed a rebuild of the index meanwhile.
  void forget_horizon() noexcept;
  //! A free page no snapshot can be reading, off the free list (0: none). Directory lock.
  [[nodiscard]] std::uint64_t reuse_free_page() noexcept;
  //! Appends page `p` (a bucket page, retired at `at`) to the free list, or puts it first
  //! (`front`: one nobody ever read). Directory lock, or alone.
  void add_free_page(std::uint64_t p, std::uint64_t at, bool front) noexcept;
  //! Marks the free list as being changed; a list found marked already (its changer died
  //! in the middle) is first rebuilt from what its head reaches (a page is never handed out
  //! twice; one being taken when its taker died is left unused).
  void begin_free_list_change() noexcept;
  //! Whether page `p`, named by the free list, can be a free page at all.
  [[nodiscard]] bool may_be_free(std::uint64_t p) const noexcept;
  //! After a checkpoint is loaded, alone: every zeroed page below pages_used outside the
  //! directory onto the free list.
  void collect_free_pages() noexcept;

  // ---- opening (open.cpp, private_index.cpp) ----
  [[nodiscard]] result<void> open_index() noexcept;
  //! Maps `index_file` and sets up the views of it (table, ledger).
  [[nodiscard]] result<void> map_index() noexcept;
  //! For a read-only opener that may not write the store's files: builds an index of its
  //! own from the log (private_index). Errors: device_or_resource_busy (another user has the
  //! store open: the log could move under the build), and rebuild's.
  [[nodiscard]] result<void> open_private_index() noexcept;
  //! open_private_index's build, its index in an unnamed file in directory `where`;
  //! `place_failed` says the failure was the place's (no room there, no such directory...).
  [[nodiscard]] result<void> build_private_index(const char* where, bool& place_failed) noexcept;
  //! Whether a reader with an index of its own may be mapping the segments (compaction then
  //! only unlinks what it gives back).
  [[nodiscard]] bool private_readers_present() const noexcept;
  //! Called by an opener holding the open byte through `f`: whether a reader with an index of
  //! its own is building it. If so, the open byte is let go again and this opener says it
  //! waits (opener_waiting_byte); it tries again after a moment.
  [[nodiscard]] bool waits_for_private_build(const io::file_handle& f) noexcept;
  //! The store file opened anew (ESTALE: not the file opened first, one replaced by hand):
  //! what this process holds presence_byte through.
  [[nodiscard]] result<io::file_handle> open_store_hold() noexcept;
  //! Takes presence_byte shared through `held` (no process takes it exclusively).
  [[nodiscard]] result<void> take_presence_byte(const io::file_handle& held) noexcept;
  //! For an opener alone on the index at the path: takes presence_byte through `held`, and
  //! whether no other process holds it (false: let go again; a user goes on through an index
  //! removed or replaced since, or another opener is alone on another index file).
  [[nodiscard]] result<bool> alone_in_store(const io::file_handle& held) noexcept;
  //! ESTALE unless the index at the path is `f`'s file (asked once presence_byte is held: an
  //! opener alone that replaces it later finds the byte held).
  [[nodiscard]] result<void> index_at_path_is(const io::file_handle& f) const noexcept;
  //! Whether any process holds presence_byte (a reader about to build its own index asks:
  //! a user may go on through an index removed from the path). (An error asking: held.)
  [[nodiscard]] bool user_of_another_index() const noexcept;
  //! The numbers of the segments this user's index has in its table, ascending.
  [[nodiscard]] std::vector<std::uint64_t> table_segment_numbers() const;
  [[nodiscard]] result<void> recover_alone() noexcept;
  //! Whether an index found valid on disk looks like what its users left (alone, before it
  //! is used): its pages add up (index::table::pages_sound) and its tail lies past the log's
  //! last block. False: it is rebuilt.
  [[nodiscard]] bool index_sound() noexcept;
  //! Whether the tail's segment ends at the index's tail (index_sound).
  [[nodiscard]] bool tail_segment_ends_at_tail(std::uint64_t tail) noexcept;
  //! Whether nothing is written in any listed log segment numbered past the tail's
  //! (index_sound).
  [[nodiscard]] bool nothing_past_tail_segment(std::uint64_t tail) noexcept;
  //! Whether every block from the lowest commit in flight up to the tail's segment carries
  //! a seq below *next seq* (index_sound).
  [[nodiscard]] bool nothing_in_flight_past_next_seq(std::uint64_t tail) noexcept;
  //! Whether the manifest lists every segment the segment table names (index_sound).
  [[nodiscard]] bool every_table_segment_listed() noexcept;
  //! Whether the index's header is whole and this boot's, its pages all in the file (read
  //! with the open byte held, never past the file's end). False with `why` empty: not valid,
  //! to rebuild or wait for; with `why`: damaged.
  [[nodiscard]] result<bool> index_header_valid(error& why) const noexcept;
  //! For a user holding the open byte shared through `f`: whether the index's header is
  //! valid (index_header_valid). Not valid, but not damaged either (its rebuilder died
  //! part-way): false, and the byte let go, for an opener alone to rebuild it. Damaged:
  //! corrupt, naming the index.
  [[nodiscard]] result<bool> index_valid_or_let_go(const io::file_handle& f) noexcept;

  // ---- recovery.cpp: rebuilding the index from the log ----
  //! Rebuilds the index from the checkpoint and the log (alone), by the recovery rules
  //! (doc/kv-format.md, "Recovery"). Errors: what it could not read (then nothing of the log
  //! was changed), corrupt (file, offset: damage that may hide a key's newest version),
  //! read_only (a read-only opener that found a commit it must void).
  [[nodiscard]] result<void> rebuild() noexcept;
  //! The segments the manifest lists, each checked to be there (corrupt, naming one that is
  //! not), and those named in seg/ that it does not list (leftovers, never replayed).
  struct segment_census {
    std::vector<std::uint64_t> listed;    //!< the manifest's, all there
    std::vector<std::uint64_t> unlisted;  //!< named in seg/, not listed: leftovers
    //! The manifest's (at least the highest listed plus one): no new segment is numbered lower.
    std::uint64_t numbered_below = 1;
  };
  [[nodiscard]] result<segment_census> check_segments() noexcept;
  //! Puts the rebuilt `tail` (in a segment of `tail_size` bytes) past any bytes written after
  //! the last block there, spanned as a block keel left on purpose (recovery.cpp).
  [[nodiscard]] result<void> span_past_tail(std::uint64_t& tail, std::uint64_t tail_size,
                                            bool writable) noexcept;
  //! Proves each leftover holds nothing live (alone, the index built), and with `remove`
  //! (writable) removes it; else corrupt, naming the manifest (it lost a segment that matters,
  //! or was damaged: a read-only opener never serves the store without it either).
  [[nodiscard]] result<void> remove_leftovers(const std::vector<std::uint64_t>& unlisted,
                                              bool remove) noexcept;
  //! Locations from `from` up to `to`.
  struct location_range {
    std::uint64_t from;
    std::uint64_t to;
  };
  //! Whether an index entry names a location in one of `ranges`: its record, its record's
  //! blob, or (with `pending`) its pending block (alone: no snapshot is taken).
  [[nodiscard]] result<bool> index_names(std::span<const location_range> ranges,
                                         bool pending) noexcept;
  //! Applies a replayed record at `location` of commit `seq` to the index (alone).
  [[nodiscard]] result<void> apply_record(std::uint64_t location, const disk::record_view& r,
                                          std::uint64_t seq) noexcept;
  struct replay_state;
  //! Replays the blocks of `s` from offset `end` on; `end` ends after its last block whose
  //! header checks out (complete or not: its writer reserved all of it).
  [[nodiscard]] result<void> replay_segment(segment& s, replay_state& st,
                                            std::uint64_t& end) noexcept;
  //! What a commit block whose header checks out is: complete (every record and every blob
  //! there; a blob damaged since is that key's `corrupt`, the commit stands), torn (a sector
  //! of it, or of a blob it names, never written: a power cut took the commit) or damaged
  //! (written whole, and changed since). Errors: what kept it from being read.
  struct commit_judgement {
    enum class kind : std::uint8_t { complete, torn, damaged } what = kind::complete;
    //! torn: the block itself is whole, a blob it names is not (a later replay would take
    //! the commit for whole once that blob's segment is compacted away: it must be voided).
    bool blob_torn = false;
  };
  [[nodiscard]] result<commit_judgement> judge_commit(std::uint64_t location,
                                                      const disk::block_header& head) noexcept;
  //! Makes the index empty (a directory of depth 0 and its page), state `building`.
  [[nodiscard]] result<void> reset_index() noexcept;
  //! Removes what checkpointers killed part-way left (alone).
  void remove_checkpoint_leftovers() noexcept;
  //! Removes the temporary copies checkpointers killed part-way left (holding the
  //! checkpoint byte: no checkpointer is writing one).
  void remove_checkpoint_temps() noexcept;
  //! Bytes of log this process's open replayed (0: the index was used as it was).
  std::uint64_t replayed_bytes = 0;

  // ---- background maintenance (maintenance.cpp) ----
  //! Takes the checkpoint byte of the index file (OFD, for other processes) and this
  //! process's claim on it (for its other threads), waiting until `cd` expires if `wait`.
  //! Not a keel::lock entity: one that shares a lock slot with bucket pages would stall
  //! their writers for as long as a checkpoint or a compaction runs. Errors: timed_out (or
  //! resource_unavailable_try_again when not waiting), the lock's.
  [[nodiscard]] result<void> take_checkpoint_byte(const io::countdown& cd, byte_claim how) noexcept;
  //! How long background work leaves the byte to a caller that waited for it.
  static constexpr std::uint64_t maintenance_yield_ns = 50'000'000;
  void release_checkpoint_byte() noexcept;
  //! After a commit: by a thread of this process's own (none when one is running here, or
  //! another user holds the maintenance byte), a compaction if one is due
  //! (compaction_due), then a checkpoint if the log has grown by the interval since the last
  //! one. A failure is kept for stats.
  void maybe_maintain() noexcept;
  //! Waits for this process's maintenance thread, if any (a forked child forgets its
  //! parent's).
  void join_maintenance() noexcept;
  //! This process's maintenance thread and its claim on the byte (maintenance.hpp owns them).
  process_maintenance maintenance;

  // ---- fresh log pages (supplier.cpp) ----
  //! Has the chunk of the log at `location` faulted in by the supplier's thread (started
  //! here if this process has none), or, with no thread to be had, now.
  void supply_ahead(std::uint64_t location) noexcept;
  //! Whether a supplier thread of this process serves requests now (false: none could start,
  //! the store is closing, or another holds the supplier's mutex: never waited for).
  [[nodiscard]] bool start_supplier() noexcept;
  //! The supplier's thread: serves requests until the store closes.
  void serve_supply() noexcept;
  //! Ends this process's supplier thread, if any (a forked child forgets its parent's).
  void join_supplier() noexcept;
  //! This process's supplier of fresh log pages (supplier.hpp owns it).
  log_supplier supplier;

  // ---- checkpoints (checkpoint.cpp) ----
  //! Loads `checkpoint` into the reset index, alone: where the replay starts and the seq it
  //! is a copy at. nullopt: none, or one that does not check out (replay everything).
  [[nodiscard]] result<std::optional<std::pair<std::uint64_t, std::uint64_t>>>
  load_checkpoint() noexcept;
  //! Whether a checkpoint the store writes by itself (in the background, after a compaction)
  //! may: not while the volume's free space is below the index's pages and two segments,
  //! which writers and the spare need more than a shorter replay; nor, as one `asked` for
  //! with store::checkpoint too, where its copy would take the files past options::max_bytes.
  //! Errors: no_space, budget_reached. (One asked for is written while the volume has room.)
  [[nodiscard]] result<void> room_for_checkpoint(bool asked = false) const noexcept;
  //! Writes a checkpoint, holding the checkpoint byte (take_checkpoint_byte).
  [[nodiscard]] result<void> checkpoint_locked(const io::countdown& cd) noexcept;
  //! Log bytes between two locations (whole segments counted at the segment size).
  [[nodiscard]] std::uint64_t log_distance(std::uint64_t from, std::uint64_t to) const noexcept;
  //! log_distance's sums of whole segments (segment_sum_memo.hpp).
  mutable segment_sum_memo segment_sums;
  //! The segments in `seg/`, by number (removing makers' leftovers, when alone).
  [[nodiscard]] result<std::vector<std::uint64_t>> segment_numbers(bool remove_leftovers) noexcept;

  //! Removes the checkpoint (a copy of the index kept only so that an open after a crash of
  //! every user need not replay the log) for a put the volume has no room for. Whether a
  //! retry may find room: this call, or another user since `seen_seq` was read from
  //! header::checkpoint_seq, removed one. Errors: taking the maintenance byte, the unlink, the
  //! directory's sync.
  [[nodiscard]] result<bool> drop_checkpoint_for_room(std::uint64_t seen_seq) noexcept;
  //! Removes the checkpoint file, syncs the directory and forgets the checkpoint in the
  //! header (holding the maintenance byte).
  [[nodiscard]] result<void> remove_checkpoint() noexcept;
  //! Sets header::checkpoint_bytes from `checkpoint` as it is (alone).
  void reconcile_checkpoint_bytes() noexcept;
  //! The size of `checkpoint` (0: none, or it cannot be told).
  [[nodiscard]] std::uint64_t checkpoint_file_bytes() const noexcept;
  //! Writes a checkpoint of the entries as they are after a compaction (which holds the
  //! maintenance byte), naming the copies. Its failure (no_space on a nearly full volume,
  //! where the copy would take the room just freed) leaves a longer replay after a power loss,
  //! nothing wrong: noted in header::checkpoint_error, for stats.
  void checkpoint_after_compaction(const io::countdown& cd) noexcept;

  // ---- the manifest (manifest.cpp): which segments the store has ----
  //! The segments the manifest lists, ascending. A store with no manifest and no segment
  //! file has none (one just made); one with segment files and no manifest is corrupt.
  [[nodiscard]] result<disk::manifest> read_manifest() noexcept;
  [[nodiscard]] result<std::vector<disk::manifest_entry>> listed_segments() noexcept;
  //! Adds (or updates) segment `number` of `size` bytes: before anything is written into it
  //! (under the `segment` lock, or alone). The file is durable when this returns.
  [[nodiscard]] result<void> list_segment(std::uint64_t number, std::uint64_t size) noexcept;
  //! Takes `numbers` off the manifest: before their files are removed (under the `segment`
  //! lock, or alone).
  [[nodiscard]] result<void> unlist_segments(const std::set<std::uint64_t>& numbers) noexcept;
  //! Makes the manifest file if there is none (under the `segment` lock, or alone): before
  //! the first segment is named.
  [[nodiscard]] result<void> ensure_manifest() noexcept;
  //! The last user closing (alone, writable): syncs every segment, then records in the
  //! manifest that every block below the tail is durable (disk::manifest::durable_below), so
  //! that a later rebuild takes a block there that does not check out for damage, never for
  //! one a power cut tore. Errors: the syncs', the manifest's (nothing is claimed then).
  [[nodiscard]] result<void> seal_durable() noexcept;
  //! seal_durable, alone: buries as one block keel left on purpose the space from `at` (the
  //! end of the last block a walk explained) to the next block, when a header was never
  //! written at `at` (48 zero bytes before `odd`, the first byte the walk could not explain):
  //! what a writer that died left of a blob or a commit block. Whether it did.
  [[nodiscard]] bool bury_headerless(segment& s, std::uint64_t at, std::uint64_t odd,
                                     std::uint64_t tail) noexcept;
  //! The blocks of a segment below a manifest's durable_below, as a walk finds them.
  struct sealed_census {
    std::uint64_t blocks = 0;  //!< headers that check out
    //! Where the first space between blocks (or after the last) begins: where a block that
    //! was counted and is not found any more lay.
    std::uint64_t gap = 0;
  };
  [[nodiscard]] sealed_census count_sealed(const segment& s, std::uint64_t below) const noexcept;
  //! Whether `s` still has every block `m` counted in it (disk::manifest_entry::sealed_blocks).
  //! Errors: corrupt, naming the segment and count_sealed's gap.
  [[nodiscard]] result<void> check_sealed(const segment& s, const disk::manifest& m) const noexcept;
  //! Alone and writable: a version 2 manifest slot left beside a current version 3 one is
  //! written over (manifest.cpp).
  [[nodiscard]] result<void> finish_manifest_upgrade() noexcept;
  //! Replaces the manifest with `m`, its generation one more.
  [[nodiscard]] result<void> write_manifest(const disk::manifest& m) noexcept;

  // ---- the log's blocks, walked (block_walk.hpp) ----
  //! Calls `f(offset, header)` (returning result<void>) for every block of `s` whose header
  //! checks out, complete or not, in order; space between them is stepped over 8 bytes at a
  //! time, and a block by its length (its writer reserved all of it).
  template <class F>
  [[nodiscard]] result<void> for_each_block(const segment& s, F&& f) const noexcept {
    return for_each_block(s, disk::segment_header_size, std::forward<F>(f));
  }
  //! The same from offset `from` (a block's, or space to step over) on.
  template <class F>
  [[nodiscard]] result<void> for_each_block(const segment& s, std::uint64_t from,
                                            F&& f) const noexcept {
    const auto nothing = [](std::uint64_t, std::uint64_t) noexcept { return result<void>{}; };
    return for_each_block(s, from, std::forward<F>(f), 0, nothing, nothing);
  }
  //! The same over the blocks that begin below offset `end` only: where writers may be
  //! writing past it, nothing there is read.
  template <class F>
  [[nodiscard]] result<void> for_each_block_below(const segment& s, std::uint64_t end,
                                                  F&& f) const noexcept {
    const auto nothing = [](std::uint64_t, std::uint64_t) noexcept { return result<void>{}; };
    return for_each_block(s, disk::segment_header_size, std::forward<F>(f), 0, nothing, nothing,
                          end);
  }
  //! The same, telling what lies between blocks (walk_blocks, block_walk.hpp).
  template <class F, class Unexplained, class Spanned>
  [[nodiscard]] result<void> for_each_block(const segment& s, std::uint64_t from, F&& f,
                                            std::uint64_t known_below, Unexplained&& unexplained,
                                            Spanned&& spanned,
                                            std::uint64_t end = UINT64_MAX) const noexcept {
    return walk_blocks(s, salt, from, std::forward<F>(f), known_below,
                       std::forward<Unexplained>(unexplained), std::forward<Spanned>(spanned), end);
  }

  // ---- the dirty bitmap: segments written since the last group sync ----
  //! The word of the dirty bitmap that holds segment table entry `entry`'s bit.
  [[nodiscard]] std::atomic_ref<std::uint64_t> dirty_word(std::uint64_t entry) const noexcept {
    return h64(header::dirty_segments + (entry / 64) * 8);
  }
  //! Sets the dirty bit of the segment holding `location`. Before a write, a load first (the
  //! word is shared by 64 segments and every commit of the active one sets it); after one,
  //! always a fetch_or: a leader's exchange then either reads it (and so sees the write) or
  //! came before it (and leaves the bit for the next leader).
  void mark_dirty(std::uint64_t location, bool written) const noexcept {
    const std::uint64_t entry = disk::segment_of(location) % segtab_entries;
    const std::uint64_t bit = std::uint64_t{1} << (entry % 64);
    const auto word = dirty_word(entry);
    if (written || (word.load(std::memory_order_seq_cst) & bit) == 0)
      word.fetch_or(bit, std::memory_order_seq_cst);
  }
  //! Runs `fill` (which writes a block at `location` through the map) between two settings of
  //! the segment's dirty bit (doc/kv-format.md, "Committing", step 7): before, so a block
  //! that completes is synced by the next group sync even if its writer dies at once; after,
  //! so a sync leader that cleared the bit while the block landed leaves it to the next one.
  //! Returns what `fill` returns.
  template <class Fill>
  auto write_dirty(std::uint64_t location, Fill&& fill) noexcept {
    mark_dirty(location, false);
    if constexpr (std::is_void_v<decltype(fill())>) {
      fill();
      mark_dirty(location, true);
    } else {
      auto r = fill();
      mark_dirty(location, true);
      return r;
    }
  }
  //! At close (~impl): what the last user out leaves (seal_durable), this process's slots
  //! given back, and its bytes let go.
  void close_users() noexcept;

  // ---- users (users.cpp): slots taken, given back, and a dead user's settled ----
  //! The liveness descriptor of this process (opened again in a forked child, whose first
  //! call finds the index as a lone opener may have left it: rebuilt, or cut short by a
  //! rebuilder that died, which it waits out as an opener does, until `until` (now_ms; 0:
  //! lock_timeout from now); or removed and made anew, another index: ESTALE).
  [[nodiscard]] result<void> ensure_live(std::uint64_t until = 0) noexcept
      KEEL_REQUIRES(users.mutex);
  //! What every public call does before it reads the index: ensure_live, unless this process
  //! holds the open byte already (a load). A forked child holds none until then, and a lone
  //! opener may meanwhile cut the index short (a rebuild): a read of it would fault.
  [[nodiscard]] result<void> hold_open_byte() noexcept;
  //! A slot, its pages made writable (write_ready). For `reading`, where the volume refused
  //! that (no_space, EDQUOT), a slotless lease instead: a reader never needs to write.
  [[nodiscard]] result<slot_lease> acquire_slot(slot_use use = slot_use::writing) noexcept;
  //! acquire_slot's search, without making the slot's pages writable.
  [[nodiscard]] result<slot_lease> take_slot(bool patient = true) noexcept;
  //! A slotless lease (slotless_byte held shared while this process has any).
  [[nodiscard]] result<slot_lease> take_slotless() noexcept;
  void release_slot(slot_lease s) noexcept;
  //! Whether no process reads without a slot now (slotless_byte free). Errors count as held.
  [[nodiscard]] bool no_slotless_readers() noexcept;
  //! Slot `u`'s snapshot back to none (its holder's); false when the volume refuses its page
  //! (the snapshot stays: the holder then gives the slot up).
  [[nodiscard]] bool clear_snapshot(std::uint32_t u) noexcept;
  //! Takes a snapshot (the visible seq) for the slot, published in it first (a slotless
  //! lease: the visible seq, its byte already held). Where the volume refuses the slot's page
  //! past the call's deadline, the slot is given up: a call that reads goes on without one
  //! (`lease` becomes slotless), one that writes fails. Errors: index_write_refusal, and
  //! take_slotless's.
  [[nodiscard]] result<std::uint64_t> take_snapshot(slot_lease& lease, slot_use use) noexcept;
  //! Whether a slot whose user is gone may be taken by another: idle, or a dead writer's
  //! that no settling will need any more (doc/kv-format.md, "Dead users").
  [[nodiscard]] bool slot_reclaimable(const slot_ref& s) noexcept;
  //! Frees slot `u` of a dead user if it is reclaimable, holding its byte meanwhile.
  void free_dead_slot(std::uint32_t u) noexcept;
  //! Before a dead user's slot is cleared (its byte held, or alone): the commit block it was
  //! writing, if it never sealed it, is buried (disk::bury_block), so that no later walk takes
  //! what it left for damage once a close records the space as durable. A read-only user
  //! writes no segment: the first such block is noted as unvoided torn instead (no close
  //! records it as durable).
  void bury_unsealed(const slot_ref& s) noexcept;
  //! Runs `f()` holding slot `u`'s byte, if no user of this process has the slot and its
  //! byte is free (its user is gone): nobody else can be using the slot meanwhile, not its
  //! dead user nor a new one (who would hold the byte).
  template <class F>
  void as_dead_users_byte(std::uint32_t u, F&& f) noexcept {
    const io::map_guard::no_escape held_back;  // no commit's escape leaves these held
    base::lock_guard g(users.mutex);
    if (!ensure_live() || users.ours[u]) return;
    if (!fs->lock(users.live, user_byte + u, 1, io::lock_request::exclusive, false)) return;
    f();
    (void)fs->lock(users.live, user_byte + u, 1, io::lock_request::unlock, false);
  }
  //! Gives slot `s` up while this process lives on: its byte let go and no longer one of ours,
  //! so every user (this process too) settles what it holds as a dead writer's. `s` then
  //! holds nothing.
  void forsake_slot(slot_lease& s) noexcept;
  //! Whether the user of slot `u` is gone (its byte is free and it is not one of ours).
  [[nodiscard]] bool slot_owner_dead(std::uint32_t u) noexcept;

  // ---- segments (segments.cpp), the rooms (rooms.cpp), where blocks go (reserve.cpp), the
  // budget and the volume's room (budget.cpp) ----
  [[nodiscard]] result<segment*> segment_at(std::uint64_t number) noexcept;
  [[nodiscard]] result<std::uint64_t> make_segment(std::uint64_t size) noexcept;
  //! Whether `size` is a log segment's (or a room's) in this store: the segment size, or in a
  //! store whose segments grow, a power of two from its first segment size up to that. A
  //! blob's segment of its own is larger than the segment size (doc/kv-format.md).
  [[nodiscard]] bool log_segment_size(std::uint64_t size) const noexcept;
  //! How long a log segment (or a room) made now is: the segment size, or in a store whose
  //! segments grow, the largest power of two from its first segment size up to the segment
  //! size that is at most a sixteenth of what the log holds (live and dead bytes) and, past
  //! the first segment size, at most a 256th of room_scale; and at least `at_least`, rounded
  //! up to a power of two (at most the segment size).
  [[nodiscard]] std::uint64_t next_segment_size(std::uint64_t at_least = 0) const noexcept;
  //! The size of the log segment `location` is in, by the segment table (the least a log
  //! segment may be when the table does not hold it).
  [[nodiscard]] std::uint64_t log_segment_size_at(std::uint64_t location) const noexcept;
  //! The least log segment size that holds `bytes` (a power of two from the first segment
  //! size; the segment size in a store whose segments do not grow).
  [[nodiscard]] std::uint64_t least_segment_size(std::uint64_t bytes) const noexcept;
  //! The largest log segment in the segment table, leaving out `except` (0: none). The spare
  //! is never smaller while it is there: compaction must be able to copy any one segment's
  //! live records into it (doc/kv-format.md, "Space").
  [[nodiscard]] std::uint64_t largest_log_segment(
      std::span<const std::uint64_t> except = {}) const noexcept;
  //! Makes `name` in seg/: an unnamed file allocated to `size`, `head` written at 0, synced,
  //! then linked (file_exists if the name is taken), so that a named file is always whole.
  //! No directory sync.
  [[nodiscard]] result<void> make_whole_file(const char* name, std::uint64_t size,
                                             std::span<const std::byte> head) noexcept;
  //! `file.allocate(offset, length)`, and once more after a sync of the filesystem when it
  //! said no_space while statfs says the volume has the room (doc/kv-format.md, "Space").
  [[nodiscard]] result<void> allocate_in(const io::file_handle& file, off_t offset,
                                         off_t length) const noexcept;
  //! Enters segment `number` of `size` bytes in the segment table (under the `segment` lock,
  //! or alone). Errors: index_write_refusal (store_or_refuse: left as a maker killed there
  //! leaves it, a segment listed and not entered).
  [[nodiscard]] result<void> enter_segment(std::uint64_t number, std::uint64_t size) noexcept;
  //! The number a new segment takes (under the `segment` lock, or alone).
  [[nodiscard]] result<std::uint64_t> new_segment_number() noexcept;
  //! Makes `f` (seg/spare, seg/deletes), a whole segment's room allocated ahead that only its
  //! taker may take, when no new segment can be made (the volume full, or the budget reached).
  //! A commit that needs a new segment makes the spare first, and a put the deletes' room too
  //! (so a full volume stops commits while the rooms are still there). Under the `segment`
  //! lock, or alone. In a store whose segments grow, the spare is at least `at_least` and every
  //! log segment in the table, and grows (like the deletes' room, never past the spare) to
  //! the size segments are made at now while the volume has the room. Errors: the
  //! allocation's (no_space), also when the spare cannot grow to what it must be (unless
  //! `need` is room_need::there).
  [[nodiscard]] result<void> ensure_room(const room_file& f, std::uint64_t at_least = 0,
                                         room_need need = room_need::every_segment) noexcept;
  //! Grows room `f` in place to `size` bytes, allocated whole (under the `segment` lock).
  //! Returns false, leaving the room as it was, when the volume has no room for it.
  [[nodiscard]] result<bool> grow_room(const room_file& f, std::uint64_t size) noexcept;
  //! Makes `f` the next segment (under the `segment` lock). Errors: no_space when there is
  //! none.
  [[nodiscard]] result<std::uint64_t> adopt_room(const room_file& f) noexcept;
  //! Sets the rooms' words from the files as they are (a maker or taker killed between a file
  //! and its word left them apart). Alone, or with the `segment` lock, which every change of
  //! a room holds. Errors: index_write_refusal (store_or_refuse).
  [[nodiscard]] result<void> reconcile_rooms() noexcept;
  //! Whether `f` is there (by its word).
  [[nodiscard]] bool has_room(const room_file& f) const noexcept {
    return h64(f.word).load(std::memory_order_acquire) != 0;
  }
  //! The last segment made, when the tail never moved into it (its maker, or the taker of the
  //! spare, killed or failed in between): nothing was written there (0: none).
  [[nodiscard]] std::uint64_t abandoned_segment() const noexcept;
  //! Lists and enters the last segment made when its maker died between naming it and
  //! listing it (under the `segment` lock): abandoned_segment then hands it out.
  [[nodiscard]] result<void> adopt_named_leftover() noexcept;
  //! The next active segment (under the `segment` lock): a new one, or when none can be made,
  //! for a commit that only erases the deletes' room, for compaction the spare.
  //! A new one is made at least `at_least` long (next_segment_size).
  [[nodiscard]] result<std::uint64_t> next_active_segment(room_for who,
                                                          std::uint64_t at_least = 0) noexcept;
  //! What a put needs before it makes `more` bytes of new segment (under the `segment` lock):
  //! room in the budget, the spare and the deletes' room made, and `more` on the volume.
  //! Errors: budget_reached, no_space.
  //! `blob`: the segment is a blob's own, which holds one key.
  [[nodiscard]] result<void> ready_for_put(std::uint64_t more, bool blob = false) noexcept;
  //! Whether a put could make `more` bytes of new segment now (budget and volume room).
  [[nodiscard]] bool could_put(std::uint64_t more) const noexcept;
  //! Whether puts keep off the segment of `location`: the deletes' segment (made of the room
  //! kept for deletes, or taken for it), while the deletes' room is not there again. Once it
  //! is, that segment is a log segment like any (reserve.cpp; the ledger's room, space.cpp).
  [[nodiscard]] bool puts_keep_off(std::uint64_t location) const noexcept {
    return location != 0 &&
           disk::segment_of(location) ==
               h64(header::deletes_segment).load(std::memory_order_acquire) &&
           h64(header::deletes_room).load(std::memory_order_acquire) == 0;
  }
  //! What a put that makes `more` bytes of new segment needs of the budget and the volume:
  //! `more`, and (when `more` is not 0) the index's pages that puts filling it may split into
  //! (index_pages_for; a blob's own segment, one) and index_headroom. Their pages come from
  //! the volume, never from the tail's segment: a put that made the last segment with the
  //! volume's last room left none for them, and the first key whose page was full failed
  //! while the next went in.
  [[nodiscard]] std::uint64_t put_needs(std::uint64_t more, bool blob = false) const noexcept;
  //! Index pages puts filling a new log segment of `size` may split into (index::table::
  //! pages_for_keys, from the pages as they are now), for the keys it holds as single puts of
  //! the live records' mean size (keys_in_segment; a log record at most, blobs' bytes aside;
  //! 1 KiB with none yet). An estimate, not a bound: records smaller than the mean, several
  //! in one block, or keys whose hashes crowd one page split more, and the put that then finds
  //! no page fails (no_space) with nothing of it visible.
  [[nodiscard]] std::uint64_t index_pages_for(std::uint64_t size) const noexcept;
  //! Bytes the index needs once beside index_pages_for: its directory doubled, less the pages
  //! it has allocated ahead of use.
  [[nodiscard]] std::uint64_t index_headroom() const noexcept;
  //! Records `made` (a segment made or taken, under the `segment` lock) as the deletes'
  //! segment when `for_deletes` (a put could not have made it), else clears the word.
  //! Returns `made`.
  [[nodiscard]] result<std::uint64_t> mark_for_deletes(result<std::uint64_t> made,
                                                       bool for_deletes) noexcept;
  //! Reserves `length` bytes in the active segment (a new one when it is full).
  [[nodiscard]] result<std::uint64_t> reserve(std::uint64_t length,
                                              room_for who = room_for::put) noexcept;
  //! Where reserve_fitting reserved, and how many of its lengths fit there.
  struct reserved {
    std::uint64_t at = 0;
    std::size_t count = 0;  // lengths[count - 1] bytes were reserved
  };
  //! Reserves the longest of `lengths` (ascending; the first at most a segment's room) that
  //! fits the rest of the active segment, in a new one when not even the first does (made for
  //! the first): compaction's copies fill a segment to its end with the records that fit.
  [[nodiscard]] result<reserved> reserve_fitting(std::span<const std::uint64_t> lengths,
                                                 room_for who) noexcept;
  //! Whether `more` bytes of new segment fit in options::max_bytes (see reserve).
  [[nodiscard]] result<void> check_budget(std::uint64_t more, room_for who) const noexcept;
  //! Whether the volume has `more` bytes for a put's segments (or index pages), and
  //! kept_free more. Errors: no_space.
  [[nodiscard]] result<void> check_headroom(std::uint64_t more) const noexcept;
  //! What puts leave free on a volume of `free` beside what they make (see check_headroom).
  [[nodiscard]] std::uint64_t kept_free(const io::fs_info& free) const noexcept;
  //! Bytes counted against options::max_bytes for `who`: the files, the spare (made or
  //! still to make), and the deletes' room (made, or for a put still to make).
  [[nodiscard]] std::uint64_t budget_used(room_for who) const noexcept;
  //! The segments in the table: how many, and their sizes added up.
  struct table_segments {
    std::uint64_t count = 0;
    std::uint64_t bytes = 0;      // as the table has them
    std::uint64_t allocated = 0;  // each rounded up to whole pages, as the volume holds them
  };
  [[nodiscard]] table_segments segments_in_table() const noexcept;
  //! Bytes options::max_bytes leaves `who` for new files (all of them: UINT64_MAX when none).
  [[nodiscard]] std::uint64_t budget_left(room_for who) const noexcept;
  //! Bytes commits can still write under options::max_bytes: the rest of the tail's segment
  //! and the whole segments the budget still allows.
  [[nodiscard]] std::uint64_t room_left(room_for who) const noexcept;
  //! Bytes compaction can copy into: the rest of the tail's segment, the spare, and the whole
  //! segments both the budget and the volume's free space still allow.
  [[nodiscard]] std::uint64_t compaction_room() const noexcept;
  //! Whether a put that needs a new segment would fail for room now (budget or volume): then
  //! compaction takes any victim with some dead room that fits, not only those half dead.
  [[nodiscard]] bool short_of_room() const noexcept;
  // ---- compaction (compaction.hpp runs it; compaction_schedule.cpp, relocate.cpp) ----
  //! Whether the background compaction's policy (options::compact_dead_fraction) asks for
  //! one now: the dead are that fraction of the log and at least two segments, or a segment
  //! and the store is short of room (checked at most every room_check_ms). Not again before
  //! the dead have grown by a segment since the last one here.
  [[nodiscard]] bool compaction_due() noexcept;
  //! Runs one compaction for the background thread, and keeps what it found.
  void compact_in_background() noexcept;
  //! This process's compaction as its writers and its background thread see it: while it
  //! runs (holding the maintenance byte), what it tells the writers (compaction.cpp and
  //! compaction_victims.cpp set it, reserve.cpp and budget.cpp read it); when the background
  //! compaction next looks, and what it last found (compaction_schedule.cpp).
  struct process_compaction {
    //! The size of the segments its copies go to, as compaction_room counted them (0: not
    //! compacting).
    std::atomic<std::uint64_t> segment_size{0};
    //! Whether its copies must keep off the spare (the pass frees less than the spare's size,
    //! so the spare could not be made again of its room).
    std::atomic<bool> keeps_off_spare{false};
    //! When this process may next ask whether the store is short of room (steady clock, ms).
    std::atomic<std::uint64_t> next_room_check{0};
    static constexpr std::uint64_t room_check_ms = 100;
    //! How long a background compaction waits for the transactions open when it looks.
    static constexpr std::chrono::milliseconds background_patience{250};
    //! The error of this process's last background compaction (0: none, or it succeeded).
    std::atomic<int> background_errno{0};
  };
  process_compaction compacting;
  //! Waits until every transaction open now (of a live user) has ended. Errors: timed_out.
  [[nodiscard]] result<void> wait_for_transactions(const io::countdown& cd) noexcept;
  //! Whether an entry names the record at `at` (of `key`), looked up with no lock: a record
  //! none names is dead for good (a location superseded is never named again). A look that
  //! meets a split may miss one that is named: compaction then keeps its segment (step 5b).
  [[nodiscard]] bool named_now(std::uint64_t at, std::span<const std::byte> key) const noexcept;
  //! Points the entry that names the record of `key` at `at` to `to` (0: empties it, an
  //! erase record forgotten), if an entry still names it: whether one did.
  [[nodiscard]] result<bool> repoint(std::uint64_t at, std::span<const std::byte> key,
                                     std::uint64_t to, const io::countdown& cd) noexcept;
  //! A live record compaction moves: where it is, and what it holds.
  struct move {
    std::uint64_t at = 0;
    disk::record_view rec;
  };
  //! Copies `moves` to the tail, many to a relocation block (and each one's blob, if that
  //! lies in a victim), then points each one's entry at its copy if the entry still names
  //! the record (a copy none names is dead). Adds the bytes of the records moved to `moved`.
  [[nodiscard]] result<void> relocate(std::span<const move> moves,
                                      const std::set<std::uint64_t>& victims,
                                      const io::countdown& cd, compact_stats& st,
                                      std::uint64_t& moved) noexcept;
  //! Where a removed segment's room went: back to the volume, or kept as seg/spare or
  //! seg/deletes, or as the next segment (`number`, named and synced, still to list and
  //! enter).
  struct room_kept {
    enum : std::uint8_t { volume, spare, deletes, next } as = volume;
    std::uint64_t number = 0;
  };
  //! Removes segment `number` (off the manifest and the table already, nobody reading it):
  //! kept as `may_keep` asks, zeroed, when it can be; else unlinked and emptied, so that no
  //! other process's map of it holds its blocks. Under the `segment` lock.
  [[nodiscard]] result<room_kept> give_back_segment(std::uint64_t number, std::uint64_t size,
                                                    room_kept may_keep) noexcept;
  //! Unmaps segments a compaction removed (once per compaction, cheap to call often). With
  //! `always`, whether or not one ended since the last look: for holders of the maintenance
  //! byte, which no compaction holds meanwhile, and which may meet segments a compactor
  //! killed part-way through step 7 removed (before it counted its run: header::compactions).
  void unmap_removed_segments(bool always = false) noexcept;
  // ---- the space ledger (space.cpp) ----
  //! The room puts may still take: the rest of the tail's segment (unless it is the
  //! deletes'), and the whole segments less their headers that the budget and the volume
  //! still let a put make (see room_for), each an ideal fit. `why`: what bounds it, budget or
  //! volume.
  struct put_room {
    std::uint64_t bytes = 0;
    error why;
  };
  [[nodiscard]] put_room room_for_puts() const noexcept;
  //! Charges `cost` to the ledger for the commit in slot `lease` (see charge_cost), closing
  //! deltas as the back end (closing_delta) until it fits. Errors: no_space_on_device or
  //! budget_reached when even an empty delta's budget is below `cost`, timed_out (`cd`), and
  //! what the volume says when it refuses the ledger's pages past `cd` (index_write_refusal):
  //! the slot is then forsaken, its pin and charge left as a dead writer's.
  [[nodiscard]] result<space::charge> charge(slot_lease& lease, std::int64_t cost,
                                             const io::countdown& cd) noexcept;
  //! After a charge of `cost` to delta `seen` failed (by the user in slot `lease`): becomes
  //! the closer (header::ledger_closer) and closes it with close_delta, or waits while another
  //! closes it (taking over from a dead one). Returns once the front has moved on. A closer
  //! that cannot clear its mark (the volume refuses the page) forsakes its slot: to the
  //! others, a dead closer.
  [[nodiscard]] result<void> after_failed_charge(slot_lease& lease, std::uint64_t seen,
                                                 std::int64_t cost,
                                                 const io::countdown& cd) noexcept;
  //! The back end (the closer only): closes `seen`, giving the next delta its share of the
  //! room for puts less the closed delta's whole budget; when that is below `cost`, waits
  //! until the closed delta is quiet and raises the budget to the share of the room measured
  //! then (Tux3's correction), failing when even the whole room is below `cost`.
  [[nodiscard]] result<void> close_delta(std::uint64_t seen, std::int64_t cost,
                                         const io::countdown& cd) noexcept;
  //! What one delta may be given of `room`: a quarter, so that the next opens with room of
  //! its own; the whole room near full (four segments or less) or when a sixteenth of it is
  //! below `cost`.
  [[nodiscard]] std::int64_t share(std::uint64_t room, std::int64_t cost) const noexcept;
  //! Waits until no writer is inside delta `d`, clearing the pins of dead users, and past
  //! `cd` evicting live ones (space::ledger::evict). Errors: timed_out (a pin that could be
  //! neither cleared nor evicted).
  [[nodiscard]] result<void> wait_quiet(std::uint64_t d, const io::countdown& cd) noexcept;
  //! Evicts every live user whose pin names delta `d` (space::ledger::evict): by the closer
  //! past its deadline, and by a writer waiting for a close past its own.
  void evict_live_pins(std::uint64_t d, const io::countdown& cd) noexcept;
  //! Leaves for every dead user (holding its byte) whose pin names delta `d` (0: none) or
  //! is evicted.
  void free_dead_pins(std::uint64_t d, const io::countdown& cd) noexcept;
  //! Zeroes the ledger and every pin: alone, before anyone charges.
  void reset_ledger() noexcept;

  //! store::compact; with `unless_since` (header::compaction_runs as the caller last saw it),
  //! none when another compaction has begun since, which `others_ran` then says.
  //! Unless `how` waits, a maintenance byte held by another fails at once with
  //! resource_unavailable_try_again.
  [[nodiscard]] result<compact_stats> compact(std::optional<std::uint64_t> unless_since,
                                              bool* others_ran, byte_claim how) noexcept;
  //! What compaction had done when a commit began: runs begun, and runs that removed
  //! segments (header::compactions).
  //! Compaction runs begun so far (header::compaction_runs).
  [[nodiscard]] std::uint64_t compaction_runs_now() const noexcept {
    return h64(header::compaction_runs).load(std::memory_order_seq_cst);
  }
  //! After a commit that began when `seen_runs` compactions had begun failed for room: a
  //! compaction, unless one began since. Whether a retry may find room: another began since,
  //! ours removed segments, or a put could make a segment now. Errors: the compaction's.
  [[nodiscard]] result<bool> make_room(std::uint64_t seen_runs) noexcept;
  //! After `freed` bytes were unlinked, with `before` what statfs said first: syncs the
  //! filesystem when statfs does not show at least half of them free (btrfs frees them when
  //! its transaction commits). Errors: the sync's.
  [[nodiscard]] result<void> show_freed_room(const result<io::fs_info>& before,
                                             std::uint64_t freed) noexcept;
  //! Bytes of the log's segments that hold no live record (dead versions, erase records,
  //! abandoned ends), at least: from the segment table and the live counters, which stay
  //! exact where the dead counter drifts low (a compaction subtracts its estimate of what it
  //! freed).
  [[nodiscard]] std::uint64_t log_not_live() const noexcept;
  //! Whether the last compaction short of room found nothing it could take, and no byte has
  //! died since that could change it (the hint the header's *fruitless* words keep).
  [[nodiscard]] bool compaction_would_take_nothing() const noexcept;

  //! Faults in (without dirtying) `prefault_chunk` bytes of a segment from `offset`, or
  //! `length` bytes when given.
  void prefault(std::uint64_t segment, std::uint64_t offset,
                std::uint64_t length = prefault_chunk) noexcept;
  static constexpr std::uint64_t prefault_chunk = std::uint64_t{1} << 20;
  //! A location's bytes from there to the end of its segment.
  [[nodiscard]] result<std::span<std::byte>> bytes_at(std::uint64_t location) noexcept;

  // ---- Writes through the maps where the filesystem may refuse them (write_ready.cpp) ----
  //! btrfs reserves room for every write fault on a shared map, also of a page allocated and
  //! written before, and raises SIGBUS when it cannot: on a full volume, and always while a
  //! qgroup is at its limit (statfs cannot see one; no write of any kind goes through then).
  //! There the pages a call will write are faulted in writable first (MADV_POPULATE_WRITE),
  //! where a refusal is an error the call returns before it changed anything, and the stores
  //! escape a refusal that outlasts their deadline (stored_escapably: a page the kernel wrote
  //! back in between faults again). Set by open (a btrfs volume); never on elsewhere.
  std::atomic<bool> writes_refusable{false};
  //! The most the store could ever take, as open found it: the volume's size, or the budget
  //! (options::max_bytes) if smaller; UINT64_MAX when statfs could not tell. Set by open,
  //! read only after. A log segment grows past the first segment size to at most a 256th of
  //! it (next_segment_size): the spare, as large as the largest segment, then holds back at
  //! most that much of a full volume (on a 64 MiB tmpfs it was 1 MiB, a sixty-fourth, with
  //! segments of a sixteenth of the log).
  std::uint64_t room_scale = UINT64_MAX;
  //! The kernel has no MADV_POPULATE_WRITE (before 5.14): write_ready touches the pages
  //! itself (touch_writable).
  std::atomic<bool> no_populate_write{false};
  //! [p, p + n) of `map` (of `file`) writable now, where writes_refusable. Errors: what the
  //! filesystem refused a write for (no_space, EDQUOT: found by writing a page of a file
  //! made for the purpose), else, after retrying until the call's deadline (call_expiry),
  //! bad_address (the fault was refused, a write was not), invalid_argument (a map not
  //! opened for writing, or a range outside it: a caller's mistake), and madvise's other
  //! errors.
  [[nodiscard]] result<void> write_ready(const io::mapped_file& map, const void* p, std::size_t n,
                                         std::string_view file, bool patient = true) noexcept;
  //! write_ready where the kernel has no MADV_POPULATE_WRITE: [offset, offset + n) of `map`
  //! faulted in writable by storing to each page, a refused store escaping (patient: at the
  //! call's deadline). Errors: as write_ready's.
  [[nodiscard]] result<void> touch_writable(const io::mapped_file& map, std::size_t offset,
                                            std::size_t n, std::string_view file,
                                            bool patient) noexcept;
  //! write_ready for the index's header page and slot `u`'s page: what every call writes.
  //! Not `patient`: a fault refused while a page write goes through is bad_address at once
  //! (a reader then reads without a slot rather than wait).
  [[nodiscard]] result<void> slot_write_ready(std::uint32_t u, bool patient = true) noexcept;
  //! write_ready for index page `p`.
  [[nodiscard]] result<void> index_write_ready(std::uint64_t p) noexcept;
  //! For an opener alone, where writes_refusable: write_ready for the index's fixed pages
  //! (the header, the slots, the segment table), which its recovery writes. Refused, a
  //! read-only opener reads through an index of its own (store::open: a reader never needs
  //! to write), and a writable one fails with the volume's error. Called with the index
  //! mapped and its header valid.
  [[nodiscard]] result<void> alone_write_ready() noexcept;
  //! write_ready for the segment bytes at `location`, `n` of them.
  [[nodiscard]] result<void> segment_write_ready(std::uint64_t location, std::size_t n,
                                                 bool patient = true) noexcept;
  //! Why the volume refuses a write now (write_ready): the error of a page written to a file
  //! of our own, made for it and gone at once; bad_address about `file` when it was written.
  [[nodiscard]] error why_writes_refused(std::string_view file) noexcept;
  //! What a refused write to the index comes to: why_writes_refused, or timed_out where a
  //! page written now goes through (the refusal outlasted the call's deadline all the same).
  [[nodiscard]] error index_write_refusal() noexcept;
  //! When what this thread's call waits for a volume that refuses its writes must end: its
  //! call_scope's deadline (below), else lock_timeout from now.
  [[nodiscard]] io::countdown::clock::time_point call_expiry() const noexcept;
  //! stored_escapably by the call's deadline (call_expiry), for the words of the index a call
  //! changes under the `segment` lock and its like (the tail, the rooms, the segment table): {}
  //! once stored, else index_write_refusal.
  template <class F>
  [[nodiscard]] result<void> store_or_refuse(F&& stores) noexcept {
    if (!writes_refusable.load(std::memory_order_relaxed)) {
      stores();
      return {};
    }
    if (io::map_guard::run_escapable(call_expiry(), stores)) return {};
    return std::unexpected(index_write_refusal());
  }
  //! index::change_entry of `e`, its page asked for first and the change stored with
  //! store_or_refuse, where the volume may refuse it: for a change outside a commit's escape
  //! (settling a dead writer's entry). Errors: the page's refusal, index_write_refusal.
  template <class Change>
  [[nodiscard]] result<void> change_entry_escapably(const index::entry_ref& e,
                                                    Change&& change) noexcept {
    const index::bucket_ref b = table->page_holding(e);
    if (writes_refusable.load(std::memory_order_relaxed)) {
      const auto page = static_cast<std::uint64_t>(b.base - base()) / disk::page_size;
      if (auto w = index_write_ready(page); !w) return w;
    }
    return store_or_refuse([&] { index::change_entry(b, e, change); });
  }
  //! Runs `stores` so that a write fault the volume still refuses at `cd`'s deadline (or the
  //! call's, call_scope, if sooner) ends them rather than the process
  //! (io::map_guard::run_escapable, where writes_refusable; else they just run). False when they
  //! were ended so, some of them perhaps landed: the caller goes on as the dead writer those stores
  //! must already survive. `stores` may only store to the maps and compute: nothing in it owns
  //! memory or holds a lock. Its own escape: it may run inside another, or inside a no_escape
  //! (io::map_guard::run_escapable).
  template <class F>
  [[nodiscard]] bool stored_escapably(const io::countdown& cd, F&& stores) noexcept {
    if (!writes_refusable.load(std::memory_order_relaxed)) {
      stores();
      return true;
    }
    return io::map_guard::run_escapable(std::min(cd.expiry(), call_expiry()), stores);
  }
  //! stored_escapably by the call's deadline (call_expiry), read only where writes are
  //! refusable: the path every read takes twice (its slot's snapshot taken and put back)
  //! reads no clock.
  template <class F>
  [[nodiscard]] bool stored_escapably_by_call(F&& stores) noexcept {
    if (!writes_refusable.load(std::memory_order_relaxed)) {
      stores();
      return true;
    }
    return io::map_guard::run_escapable(call_expiry(), stores);
  }

  // ---- reading (read.cpp) ----
  //! The record at `location`, checked as the options say. Errors: corrupt (file, offset).
  [[nodiscard]] result<found_record> record_at(std::uint64_t location, bool verify) noexcept;
  //! The record at `location`, its header checked alone (disk::parse_record_head: its padding
  //! and checksum unread). Errors: corrupt (file, offset).
  [[nodiscard]] result<found_record> record_head_at(std::uint64_t location) noexcept;
  //! A value's bytes (inline, or its blob's, checked as the options say).
  [[nodiscard]] result<std::span<const std::byte>> value_of(const found_record& r,
                                                            bool verify) noexcept;
  //! Back from `rec` through its previous versions to the newest one `snapshot` sees
  //! (nullopt: none, the key did not exist then). An erase record is returned as it is.
  [[nodiscard]] result<std::optional<found_record>> back_to(found_record rec,
                                                            std::uint64_t snapshot,
                                                            bool verify) noexcept;
  //! The version of `key` a snapshot sees: its record, or nullopt (absent or erased).
  //! Up to `limit` items of `snapshot` from `cursor` (store::scan's contract), for a caller
  //! that holds a slot whose snapshot is at most `snapshot`.
  [[nodiscard]] result<scan_page> scan_at(std::string_view cursor, std::size_t limit,
                                          bool keys_only, std::uint64_t snapshot) noexcept;
  [[nodiscard]] result<std::optional<found_record>> read_at_snapshot(std::span<const std::byte> key,
                                                                     const disk::key_hash& h,
                                                                     std::uint64_t snapshot,
                                                                     bool verify) noexcept;
  //! The complete commit block at `location`, if it is one (with every blob it names): its
  //! header; nullopt when it is not complete. Errors: what kept it from being read (a
  //! segment that cannot be opened or mapped, EMFILE, ENOMEM...): never taken for "not
  //! complete", which would roll a commit back.
  [[nodiscard]] result<std::optional<disk::block_header>> complete_block(
      std::uint64_t location) noexcept;
  //! The complete commit block at `location` if its seq is at most `snapshot`: how a reader
  //! looks at the block of an entry still marked pending. Its writer may be writing it right
  //! now; then its seq word is 0 or above any snapshot (a live writer clears the mark before
  //! its seq is visible), and nothing past that word is read. Errors: complete_block's.
  [[nodiscard]] result<std::optional<disk::block_header>> settled_block(
      std::uint64_t location, std::uint64_t snapshot) noexcept;

  // ---- probing (probe.cpp): which entry of a probe chain is which key's ----
  // Two keys may share a 128-bit hash, so an entry is a key's only when the record it names
  // holds the key's bytes; a pending entry (a writer's mark: pending | its block) names, once
  // its block counts, its own key's record there. Every lookup, settling, scan, checkpoint
  // copy and move of an entry goes through these (doc/kv-format.md, "Reading at a
  // snapshot", "Dead users").
  //! For a reader at `snapshot`: the newest record of `key` its entry names (checked as
  //! `verify` says; back_to then finds the version the snapshot sees), or nullopt (no entry,
  //! or a dead writer's insert not settled at the snapshot). Errors: a record or block that
  //! cannot be read (a damaged record of another key of the hash is passed over).
  [[nodiscard]] result<std::optional<found_record>> locate(std::uint64_t page,
                                                           const disk::key_hash& h,
                                                           std::span<const std::byte> key,
                                                           std::uint64_t snapshot,
                                                           bool verify) noexcept;
  //! For the holder of `page` (exclusively): the entry of `key`, if it has one, once every
  //! pending entry of hash `h` a dead writer left before it in the chain (all of them, when
  //! the key has none) is settled (settle_chain). Errors: as settle_chain's.
  [[nodiscard]] result<std::optional<index::entry_ref>> find_locked(
      std::uint64_t page, const disk::key_hash& h, std::span<const std::byte> key) noexcept;
  //! For the holder of `page` (exclusively): every entry of hash `h` a dead writer left
  //! pending is settled: its block complete, it names its own key's record there and the
  //! block's seq; else it goes back to the version its location names (new keys' entries to
  //! holding nothing). Errors: a block or record that cannot be read: those entries stay
  //! pending, nothing is guessed.
  [[nodiscard]] result<void> settle_chain(std::uint64_t page, const disk::key_hash& h) noexcept;
  //! What entry `e` (of hash `h` in `page`, its seq and location as read) names for a reader
  //! at `snapshot`: its location, or for a pending entry whose block is settled at or below
  //! the snapshot, its own key's record there (0: none). For walks that meet entries, not
  //! keys: checkpoints and scans.
  [[nodiscard]] result<std::uint64_t> named_by(std::uint64_t page, const disk::key_hash& h,
                                               index::entry_ref e, std::uint64_t seq,
                                               std::uint64_t at, std::uint64_t snapshot) noexcept;

  // ---- writing (commit_run.hpp), made visible (visible.cpp), made durable (group_sync.cpp) ----
  //! What a wait for *visible* does once its deadline has passed.
  enum class past_deadline : bool {
    settle,   // settles the writer in front, alive or not: the wait never fails (commits')
    give_up,  // returns false (compaction's, which then fails with timed_out)
  };
  //! Waits until every commit up to `seq` is visible, settling dead writers' commits: whether
  //! they are. Once `cd` has expired, a writer in front that is alive but has not made its
  //! commit visible is not waited for either: settled (settle_commit abandons or makes its
  //! commit), or the wait gives up, as `then` says. The one wait for *visible* (visible.cpp).
  bool wait_visible(std::uint64_t seq, const io::countdown& cd,
                    past_deadline then = past_deadline::settle) noexcept;
  //! Settles commit `v` (= visible + 1) if its writer is dead, or, with `abandon_live`, alive
  //! but too slow to wait for: a block not sealed yet is abandoned (disk::void_block: v is a
  //! hole, and its writer's seal fails), a sealed one is made visible. Returns whether it did.
  bool settle_commit(std::uint64_t v, bool abandon_live) noexcept;
  //! The end of a commit through `lease` whose write fault the volume refused past its
  //! deadline (transaction::impl::commit, io/map_guard.hpp): the slot is forsaken, the
  //! ledger's hold on it dropped (`ledger_hold` null: the charge stays, as a dead user's).
  //! Its block at `block` (0: none reserved) sealed with seq `seq` (0: none taken): the commit is
  //! made, its seq returned once visible (waiting no refused fault out past `cd`, the commit's
  //! deadline) and synced for `d`; not visible by then, it is seen once the next commit settles
  //! it, and the call fails. Else what the volume says (EDQUOT, ENOSPC; timed_out when a page
  //! written now goes through).
  result<std::uint64_t> escaped_commit(slot_lease& lease, impl*& ledger_hold, std::uint64_t seq,
                                       std::uint64_t block, durability d,
                                       const io::countdown& cd) noexcept;
  //! Whether another waiter on *visible* looked for a dead writer within the last 2 ms, or
  //! is looking now: else the caller's turn (it says so in the header).
  bool dead_check_is_taken() noexcept;
  //! What a commit changes in the header's counters.
  struct counter_delta {
    std::int64_t records = 0;
    std::int64_t live = 0;
    std::uint64_t dead = 0;
  };
  //! Makes commit `seq` visible once every commit before it is, adding its counter changes
  //! in the same ordered step (so the counters are exact as of *visible*: see checkpoints).
  void publish_visible(std::uint64_t seq, counter_delta d, const io::countdown& cd) noexcept;
  //! Wakes every thread sleeping on *visible* (all processes).
  //! *visible* has become `seq`: wakes its waiters.
  void wake_visible(std::uint64_t seq) noexcept;
  //! The futex word of seq's gate (see header::visible_gates).
  [[nodiscard]] std::uint32_t* visible_gate(std::uint64_t seq) const noexcept {
    return reinterpret_cast<std::uint32_t*>(base() + header::visible_gates +
                                            4 * (seq % header::visible_gate_count));
  }
  //! `every_segment`: syncs every segment, dirty or not (a checkpoint: a dead writer's
  //! block may have landed after a leader took its dirty bit, and nobody set it again).
  [[nodiscard]] result<void> group_sync(bool every_segment = false) noexcept;
  //! The same within `cd` (its header stores escape a refusal past it; a waiter whose leader
  //! is still at it then syncs for itself).
  [[nodiscard]] result<void> group_sync(bool every_segment, const io::countdown& cd) noexcept;
  //! Whether this store takes changes: read_only (opened so), sync_failed (an fdatasync of
  //! the segment it names failed: until reopened alone), else nothing.
  [[nodiscard]] result<void> writable() noexcept;
  //! A sync waiter's own sync once its deadline passed with the leader still at it (stopped,
  //! or starved): every segment in use, without the sync lock. Errors: as a leader's.
  [[nodiscard]] result<void> sync_without_leader() noexcept;
  //! A sync leader's wait for the commits the last sync woke (doc/kv-format.md, step 11).
  void gather_sync_batch() noexcept;
  //! Makes room for `wanted` new keys in page `page`'s chain (`coming`: their hashes; `h`
  //! one of them): splits it when a split separates its keys, else gives its chain a page
  //! more (keys of one hash: no directory doubling for nothing). Takes the page's and the
  //! directory's locks.
  [[nodiscard]] result<void> grow_page(std::uint64_t page, const disk::key_hash& h,
                                       std::span<const disk::key_hash> coming, std::size_t wanted,
                                       const io::countdown& cd) noexcept;
  //! Finishes the split a dead splitter left half done, if any, taking the locks it needs
  //! (a live splitter's is waited for).
  [[nodiscard]] result<void> settle_split(const io::countdown& cd) noexcept;
};

//! The store call this thread is in, set at the top of the calls a user makes one after
//! another (open, close, begin, get, put, erase, scan, stats, commit; not compact, backup,
//! verify or checkpoint, which run long and whose stores keep a lock_timeout each): its
//! deadline for what a volume that refuses its writes (writes_refusable) makes it wait,
//! lock_timeout from the call's start. write_ready's patience and every escape
//! (stored_escapably, a commit's) end by then, so the call ends near lock_timeout however many
//! of its stores are refused. (Before, each waited lock_timeout of its own: a blob put, or a
//! put that dropped the checkpoint and retried, took several.) A call on the same store inside
//! it (put's commit) keeps the outer deadline; one on another store has its own for as long as
//! it runs. Set only where writes_refusable (elsewhere nothing reads it: no clock is read on
//! the calls' fast path). Owned by the thread; lock waits keep their own deadlines.
class call_scope {
 public:
  explicit call_scope(const store::impl& s) noexcept;
  ~call_scope();
  call_scope(const call_scope&) = delete;
  call_scope& operator=(const call_scope&) = delete;

 private:
  const store::impl* outer_store_;
  io::countdown::clock::time_point outer_expiry_;
};

[[nodiscard]] inline std::span<const std::byte> as_bytes(std::string_view s) noexcept {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

//! A segment's file name in `seg/` (16 hex digits).
[[nodiscard]] std::string segment_name(std::uint64_t number);
//! The prefix of a segment's name while it is made (a leftover the next lone opener removes).
inline constexpr std::string_view segment_temp_prefix = ".seg.";

//! Enters an open store in this process's registry, which a forked child goes through to let
//! go of the parent's liveness (users.cpp); its impl leaves it when it goes.
void register_store(store::impl* s) noexcept;

//! Lets the waiting byte go (waits_for_private_build) when an opener's wait ends, in or not:
//! held on, by a forked child's inherited descriptor too, it would keep private readers out.
struct done_waiting_for_builds {
  store::impl& s;
  ~done_waiting_for_builds() {
    (void)s.fs->lock(s.dir.store_file, opener_waiting_byte, 1, io::lock_request::unlock, false);
  }
};

//! Checks a key's size: invalid_argument (empty), too_large.
[[nodiscard]] result<void> check_key(std::string_view key) noexcept;

//! The steady clock (the machine's: comparable between processes), in nanoseconds.
[[nodiscard]] inline std::uint64_t now_ns() noexcept {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}
//! The same, in milliseconds.
[[nodiscard]] inline std::uint64_t now_ms() noexcept {
  return now_ns() / 1'000'000;
}

//! Whether a try at a lock (the maintenance byte, a compaction that did not wait for it)
//! failed only because another holds it.
[[nodiscard]] inline bool held_elsewhere(const error& e) noexcept {
  return e == std::errc::operation_would_block || e == std::errc::resource_unavailable_try_again;
}

//! The maintenance byte held by a compaction or a verify (taken with take_checkpoint_byte).
//! Letting it go looks for a checkpoint it kept waiting: the background thread that found
//! the byte taken does not come back by itself.
struct maintenance_hold {
  store::impl* s;
  explicit maintenance_hold(store::impl* held) noexcept : s(held) {}
  maintenance_hold(const maintenance_hold&) = delete;
  maintenance_hold& operator=(const maintenance_hold&) = delete;
  ~maintenance_hold() {
    s->release_checkpoint_byte();
    s->maybe_maintain();
  }
};

//! The volume (no_space, EDQUOT) or the budget has no room for what was asked.
[[nodiscard]] inline bool out_of_room(const error& e) noexcept {
  return e == std::errc::no_space_on_device || e == errc::budget_reached ||
         e == std::error_code(EDQUOT, std::system_category());
}

//! What keeps the pages a walk of the index reaches from reuse, outside a transaction: a
//! user slot holding a snapshot (reuse_horizon); where the volume refused the slot's write,
//! the slotless byte; or, with every slot taken, the `directory` lock, which every split (and
//! so every retire and reuse) needs. Let go when it goes.
class snapshot_hold {
 public:
  [[nodiscard]] static result<snapshot_hold> take(store::impl& s,
                                                  slot_use use = slot_use::reading) noexcept {
    auto lease = s.acquire_slot(use);
    if (!lease) {
      if (lease.error() != errc::too_many_users || !s.locks) {
        return std::unexpected(lease.error());
      }
      auto g = s.locks->lock({lock::entity(entity_directory)}, s.opts.lock_timeout);
      if (!g) return std::unexpected(g.error());
      snapshot_hold h(s, slot_lease{});
      h.directory_ = std::move(*g);
      return h;
    }
    snapshot_hold h(s, *lease);
    // Published in the slot: what counts, not its value.
    if (auto snap = s.take_snapshot(h.l_, use); !snap) return std::unexpected(snap.error());
    return h;
  }
  snapshot_hold(snapshot_hold&& o) noexcept
      : s_(std::exchange(o.s_, nullptr)), l_(o.l_), directory_(std::move(o.directory_)) {}
  snapshot_hold(const snapshot_hold&) = delete;
  snapshot_hold& operator=(const snapshot_hold&) = delete;
  snapshot_hold& operator=(snapshot_hold&&) = delete;
  ~snapshot_hold() {
    if (s_ != nullptr && (l_.held() || l_.slotless)) s_->release_slot(l_);
  }

 private:
  snapshot_hold(store::impl& s, slot_lease l) noexcept : s_(&s), l_(l) {}
  store::impl* s_;
  slot_lease l_;
  lock::entities_guard directory_;  // only when no slot was free
};

//! The insides of a store or a transaction handed out (for keel's own code that holds the
//! public object, and for the tests of the parts).
struct store_internals {
  [[nodiscard]] static store::impl& of(store& s) noexcept { return *s.impl_; }
  [[nodiscard]] static transaction::impl& of(transaction& t) noexcept { return *t.impl_; }
};

}  // namespace keel::kv
