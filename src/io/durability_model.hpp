#pragma once
// The fault filesystem's model of durability (fault_filesystem.hpp, "Durability model"): what
// of a tracked tree a power cut would leave, kept in a shadow directory shared by every
// process that tracks the same pair. It owns the shadow and this process's view of it (the
// root, the shadow's path, the inode-to-model-id table read so far, the shadow's lock);
// the fault rules (fault_rules.hpp) never reach it.
//
// Shadow layout (all plain files, updated under an OFD lock on `.lock`, each file replaced
// by rename so a process killed mid-update leaves the old version):
//   root          the tracked root's absolute path
//   root_id       the model id of the root directory
//   next_id       the next model id to hand out
//   inodes        lines "device inode id": which model file an inode is now (the last line
//                 for an inode wins: inode numbers are reused after a file is removed)
//   data/ID       the durable content of model file ID (absent: empty)
//   dirs/ID       the durable entries of model directory ID: lines "f|d mode id name"
//   crashed       exists once a process lost power: no sync lands after that
//
// The model's own I/O goes to the real filesystem (os()), never through the fault filesystem.

#include <sys/types.h>

#include <atomic>
#include <compare>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "base/thread_safety.hpp"
#include "keel/io/byte_lock.hpp"
#include "keel/io/fault_filesystem.hpp"
#include "keel/io/file_handle.hpp"

namespace keel::io {

class durability_model {
 public:
  //! Whether track() has set the model up (root and shadow then never change): read without
  //! the lock, to skip the model when not tracking.
  [[nodiscard]] bool tracking() const noexcept { return tracking_.load(); }

  //! See fault_filesystem::track.
  [[nodiscard]] result<void> track(const std::string& root, const std::string& shadow);
  //! Power lost here: no sync of any process lands after this (when tracking).
  void mark_crashed() noexcept;

  //! `made` was just created in directory `parent`: modelled if `parent` is.
  void created(const file_status& parent, const file_status& made);
  //! A sync of `file` failed: as Linux, its unsynced writes are gone (back to the durable
  //! image) and the next sync succeeds.
  void sync_failed(const file_handle& file, const file_status& st);
  //! A sync of `file` succeeded: a file's content, or a directory's entries, are durable now.
  //! If another process lost power meanwhile, this one did too (it is killed).
  void synced(const file_handle& file, const file_status& st);
  //! The model id of a file (0: not modelled).
  [[nodiscard]] std::uint64_t id_of(const file_status& st);
  //! What MS_SYNC wrote back of model file `id`: `n` bytes at `from`, at `offset` in the
  //! file, laid over its durable image. Killed as `synced` is.
  void map_synced(std::uint64_t id, std::size_t offset, const std::byte* from, std::size_t n);

  //! See fault_filesystem::restore (durability_restore.cpp).
  [[nodiscard]] static result<fault_filesystem::restore_report> restore(
      const std::string& root, const std::string& shadow,
      const fault_filesystem::crash_options& options);

 private:
  struct file_key {
    std::uint64_t device = 0;
    std::uint64_t inode = 0;
    friend auto operator<=>(const file_key&, const file_key&) = default;
  };
  static file_key key_of(const file_status& st) noexcept { return {st.device, st.inode}; }

  // The model's lock, across processes (and, with `mutex_`, threads). Each process opens the
  // lock file for itself: an inherited descriptor would share the parent's lock.
  class KEEL_SCOPED_CAPABILITY model_lock {
   public:
    explicit model_lock(durability_model& m) KEEL_ACQUIRE(m.mutex_);
    ~model_lock() KEEL_RELEASE() = default;
    model_lock(const model_lock&) = delete;
    model_lock& operator=(const model_lock&) = delete;

   private:
    base::lock_guard lock_;
    extent_guard guard_;
  };

  [[nodiscard]] bool crashed() const noexcept KEEL_REQUIRES(mutex_);
  void load_ids() KEEL_REQUIRES(mutex_);
  std::uint64_t id_locked(const file_key& k) KEEL_REQUIRES(mutex_);
  std::uint64_t bind(const file_key& k) KEEL_REQUIRES(mutex_);
  std::string data_path(std::uint64_t id) const KEEL_REQUIRES(mutex_);
  std::string dir_path(std::uint64_t id) const KEEL_REQUIRES(mutex_);
  void save_directory(const file_handle& dir, std::uint64_t id) KEEL_REQUIRES(mutex_);
  void save_content(const file_handle& file, std::uint64_t id) KEEL_REQUIRES(mutex_);
  void revert_content(const file_handle& file, std::uint64_t id) KEEL_REQUIRES(mutex_);
  void snapshot(const std::string& path, std::uint64_t id) KEEL_REQUIRES(mutex_);

  std::atomic<bool> tracking_{false};
  base::mutex mutex_;  // everything below, and (with `.lock`) the shadow
  std::string root_ KEEL_GUARDED_BY(mutex_);
  std::string shadow_ KEEL_GUARDED_BY(mutex_);
  //! The shadow's .lock, opened by each process for itself.
  file_handle lock_file_ KEEL_GUARDED_BY(mutex_);
  pid_t lock_pid_ KEEL_GUARDED_BY(mutex_) = 0;
  //! inode -> model id, as far as `inodes` was read.
  std::map<file_key, std::uint64_t> ids_ KEEL_GUARDED_BY(mutex_);
  off_t inodes_read_ KEEL_GUARDED_BY(mutex_) = 0;
};

//! Whole-file helpers on the real filesystem, for the model (the shadow is never faulted).
namespace shadow_files {
using bytes = std::vector<std::byte>;
[[nodiscard]] result<bytes> read_whole(const file_handle& f) noexcept;
[[nodiscard]] result<bytes> read_path(const std::string& path) noexcept;
//! Missing is empty.
[[nodiscard]] bytes read_path_or_empty(const std::string& path) noexcept;
//! Writes `content` to `path` by a rename of a fresh file: a reader sees old or new.
result<void> write_path(const std::string& path, std::span<const std::byte> content) noexcept;
result<void> write_text(const std::string& path, const std::string& text) noexcept;
[[nodiscard]] std::string text_of(const bytes& b);
[[nodiscard]] std::string absolute(const std::string& p);

//! One of a directory's durable entries.
struct dir_entry_record {
  bool directory = false;
  std::uint32_t mode = 0644;
  std::uint64_t id = 0;
  std::string name;
};
[[nodiscard]] std::string format_entries(const std::vector<dir_entry_record>& entries);
[[nodiscard]] std::vector<dir_entry_record> parse_entries(const std::string& text);
}  // namespace shadow_files

}  // namespace keel::io
