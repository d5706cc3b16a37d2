#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "keel/io/filesystem.hpp"

namespace keel::io {

//! A filesystem for tests (SQLite's test VFS, RocksDB's FaultInjectionTestFS, LazyFS): it
//! fails operations on purpose, returning real errors, and models what survives a power cut.
//!
//! **Faults.** `inject` adds a rule: the N-th matching operation from then on fails with an
//! errno (EIO, ENOSPC, EDQUOT, EROFS, ...), once, from then on, or at random with a
//! probability from a seed; reads and writes can first move a random part (a short transfer,
//! then the error, as a disk that fills mid-write does); or the process can lose power there
//! (`crash`: it is killed with SIGKILL before the operation runs). A failed sync behaves as
//! Linux does: the file's unsynced writes are gone (dropped back to what was last synced)
//! and later syncs succeed.
//!
//! **Durability model.** After `track(root, shadow)`, everything below `root` counts as
//! durable as it is; from then on only what a sync makes durable is: the content of a file
//! as of its last fsync/fdatasync (or, range by range, msync), a directory's entries as of
//! its last fsync. The durable state lives in `shadow` (a directory outside `root`), so every
//! process of a test that opens a fault_filesystem on the same pair shares one model, and
//! `restore` can rebuild `root` from it once they are all gone: every name created, removed
//! or renamed since its directory's last sync reverts, every file's content reverts to its
//! durable image, and with `crash_options::torn` a random subset of the unsynced 512-byte
//! sectors (and of the unsynced size changes) survives instead, as after a real power cut.
//! Writes through maps are modelled too: what msync or fsync covered is durable, nothing
//! else. Names created outside a tracked directory, and files keel did not open through
//! this filesystem, are not modelled.
//!
//! Thread-safe. A forked child may keep using the parent's instance (it reopens what it
//! must). Meant for tests of modest size: a sync copies the file into the shadow.
class fault_filesystem final : public filesystem_wrapper {
 public:
  struct fault {
    //! The operations it counts and fails.
    fs_ops on = fs_ops::all();
    //! The first one to fail: the nth matching operation after `inject` (1-based).
    std::uint64_t nth = 1;
    enum class repeat : std::uint8_t {
      once,      //!< only the nth
      forever,   //!< the nth and every matching one after it
      randomly,  //!< from the nth on, each with `probability` (from the seed)
    };
    repeat repeat = repeat::once;
    double probability = 1.0;
    //! The errno it fails with; 0 with `partial`: a short transfer that reports no error.
    int error = EIO;
    //! read, write, append: first move a random part of what was asked (at least nothing,
    //! never all), as a disk that fills up part-way does.
    bool partial = false;
    //! Power loss instead of an error: the process is killed (SIGKILL) before the operation
    //! runs; `restore` then rebuilds what survives.
    bool crash = false;
    //! Only operations on files whose path contains this (empty: every file).
    std::string path_contains{};
  };

  //! Forwards to `target`; `seed` drives every random choice.
  explicit fault_filesystem(filesystem& target = os(), std::uint64_t seed = 1);
  ~fault_filesystem() override;

  void inject(fault f);
  //! Removes every rule (a fault that cleared).
  void clear_faults();
  //! Operations of `ops` seen so far (whether or not they failed).
  [[nodiscard]] std::uint64_t count(fs_ops ops = fs_ops::all()) const;
  //! Operations failed (or crashed on) so far.
  [[nodiscard]] std::uint64_t injected() const;

  //! Starts modelling durability below `root` (a directory), keeping the durable state in
  //! `shadow` (a directory elsewhere, created if missing). The first process to track the
  //! pair takes what is below `root` now as durable; later ones join its model.
  [[nodiscard]] result<void> track(const std::string& root, const std::string& shadow);

  struct crash_options {
    //! Keep a random subset of the unsynced 512-byte sectors and size changes (else none).
    bool torn = false;
    //! With torn: the chance that each unsynced sector survives.
    double keep_probability = 0.5;
    std::uint64_t seed = 1;
  };
  //! What `restore` did.
  struct restore_report {
    std::uint64_t files = 0;         //!< files rebuilt (names, hard links counted once)
    std::uint64_t directories = 0;   //!< directories rebuilt, root included
    std::uint64_t reverted = 0;      //!< files whose content differed from their durable image
    std::uint64_t torn_sectors = 0;  //!< unsynced sectors kept (torn)
  };
  //! Power loss, seen from after: rebuilds `root` as the model in `shadow` says it survived
  //! (see above), then starts a new model of it (everything durable again). Every process
  //! that used the pair must be gone (or quiet, for a crash in one process): handles and
  //! maps opened before point to files that no longer exist.
  [[nodiscard]] static result<restore_report> restore(const std::string& root,
                                                      const std::string& shadow,
                                                      const crash_options& options);

  //! Loses power now: marks the model crashed (no sync of any process lands after this)
  //! and kills this process with SIGKILL.
  [[noreturn]] void crash_now() noexcept;

  // The operations (see filesystem.hpp).
  [[nodiscard]] result<file_handle> open(const file_handle* dir, const char* path, open_flags flags,
                                         mode_t mode) noexcept override;
  [[nodiscard]] result<void> link(const file_handle& file, const file_handle* dir,
                                  const char* name) noexcept override;
  [[nodiscard]] result<void> link_at(const file_handle* from_dir, const char* from,
                                     const file_handle* to_dir, const char* to) noexcept override;
  [[nodiscard]] result<void> rename(const file_handle* from_dir, const char* from,
                                    const file_handle* to_dir, const char* to,
                                    rename_mode mode) noexcept override;
  [[nodiscard]] result<void> unlink(const file_handle* dir, const char* name,
                                    bool directory) noexcept override;
  [[nodiscard]] result<void> make_directory(const file_handle* dir, const char* name,
                                            mode_t mode) noexcept override;
  [[nodiscard]] result<std::vector<directory_entry>> list_directory(
      const file_handle& dir) noexcept override;
  [[nodiscard]] result<file_status> stat_at(const file_handle* dir, const char* name,
                                            bool follow) noexcept override;
  [[nodiscard]] result<fs_info> statfs(const char* path) noexcept override;
  [[nodiscard]] result<std::size_t> read(const file_handle& file, off_t offset,
                                         std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<std::size_t> write(const file_handle& file, off_t offset,
                                          std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<appended> append(const file_handle& file,
                                        std::span<const iovec> buffers) noexcept override;
  [[nodiscard]] result<void> sync(const file_handle& file, sync_kind kind) noexcept override;
  [[nodiscard]] result<void> allocate(const file_handle& file, off_t offset, off_t length,
                                      bool keep_size) noexcept override;
  [[nodiscard]] result<void> punch_hole(const file_handle& file, off_t offset,
                                        off_t length) noexcept override;
  [[nodiscard]] result<void> truncate(const file_handle& file, off_t length) noexcept override;
  [[nodiscard]] result<file_status> stat(const file_handle& file) noexcept override;
  [[nodiscard]] result<fs_info> statfs(const file_handle& file) noexcept override;
  [[nodiscard]] result<bool> disable_copy_on_write(const file_handle& file) noexcept override;
  result<void> close(const file_handle& file) noexcept override;
  [[nodiscard]] result<void*> map(const file_handle& file, std::size_t length, off_t offset,
                                  map_access access) noexcept override;
  [[nodiscard]] result<void*> remap(void* address, std::size_t length,
                                    std::size_t new_length) noexcept override;
  [[nodiscard]] result<void> sync_map(void* address, std::size_t length,
                                      bool wait) noexcept override;
  result<void> unmap(void* address, std::size_t length) noexcept override;
  [[nodiscard]] result<void> lock(const file_handle& file, off_t offset, off_t length,
                                  lock_request request, bool wait) noexcept override;
  [[nodiscard]] result<bool> lock_is_free(const file_handle& file, off_t offset, off_t length,
                                          lock_request request) noexcept override;

 private:
  struct state;
  template <class Transfer>
  result<std::size_t> partially(int error, std::span<const iovec> buffers,
                                Transfer&& transfer) noexcept;
  std::unique_ptr<state> state_;
};

}  // namespace keel::io
