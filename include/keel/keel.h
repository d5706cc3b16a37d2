/* SPDX-License-Identifier: Apache-2.0 */
#ifndef KEEL_KEEL_H
#define KEEL_KEEL_H

/*
 * keel's C API: the store (keel::kv) and the filesystem mutexes (keel::lock) for C and any
 * language's FFI. Plain C11, a stable ABI: opaque handles, no C++ types, structs that are
 * only ever appended to (each carries its size or version).
 *
 * Errors. Every call that can fail returns an int: 0 on success, else
 *   - a positive errno value (ENOENT, EACCES, ENOSPC, ETIMEDOUT, ENOMEM, EINVAL, ...): what
 *     the kernel said, never turned into another condition;
 *   - or a negative KEEL_* code below (keel's own conditions).
 * keel_strerror(code) names either. When a call fails, the file the error is about and the
 * offset in it (a damaged record, say) are kept for the calling thread until its next
 * failing call: keel_last_error_path(), keel_last_error_offset(), keel_last_error_message().
 * Handles are never NULL on success and untouched on failure.
 *
 * Threads and processes. A keel_store may be used by any number of threads at once, and by
 * a child the process forks. A keel_txn, a keel_cursor and a keel_guard belong to one thread
 * at a time; a guard is unlocked on the thread that locked it. Semantics are those of the
 * C++ API: include/keel/kv/store.hpp and include/keel/lock/shared_fs_mutex.hpp say more.
 */

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KEEL_API __attribute__((visibility("default")))
#else
#define KEEL_API
#endif

/* ---- version ---- */

/* The version of the API this header declares. */
#define KEEL_C_API_VERSION 1

/* The library's version, "MAJOR.MINOR.PATCH"; each part through its pointer when not NULL. */
KEEL_API const char* keel_version(int* major, int* minor, int* patch);

/* ---- errors ---- */

/* keel's own conditions: -30900 less keel::errc's value. */
#define KEEL_CORRUPT (-30901)                /* a checksum or structural check failed */
#define KEEL_NOT_KEEL_FILE (-30902)          /* the path holds something keel did not write */
#define KEEL_UNSUPPORTED_VERSION (-30903)    /* written by an incompatible version */
#define KEEL_TOO_MANY_USERS (-30904)         /* a lock's shared table is full */
#define KEEL_NOT_FOUND (-30912)              /* the key is not there (also: a cursor's end) */
#define KEEL_CONFLICT (-30913)               /* another commit came first: nothing applied; retry */
#define KEEL_TOO_LARGE (-30914)              /* a key or value (or a commit) larger than allowed */
#define KEEL_READ_ONLY (-30915)              /* the store or transaction is read-only */
#define KEEL_BUDGET_REACHED (-30916)         /* the store's max_bytes is reached */
#define KEEL_SYNC_FAILED (-30917)            /* an fdatasync failed: the store takes no change */
#define KEEL_NEEDS_LOCAL_FILESYSTEM (-30919) /* the path is on a filesystem others may share */
#define KEEL_USED_BY_ANOTHER_ALGORITHM (-30920) /* the lock path is open with another algorithm */
#define KEEL_UNKNOWN_ERROR (-30999)             /* an error of no category this API knows */

/* What `code` means (never NULL; static storage). */
KEEL_API const char* keel_strerror(int code);
/* The file the calling thread's last failed call was about ("" when none). Valid until the
 * thread's next failing call. */
KEEL_API const char* keel_last_error_path(void);
/* The offset in that file, or UINT64_MAX when none. */
KEEL_API uint64_t keel_last_error_offset(void);
/* The whole message of that error, with its file and offset ("" when none). */
KEEL_API const char* keel_last_error_message(void);

/* ---- the store ---- */

typedef struct keel_store keel_store;
typedef struct keel_txn keel_txn;
typedef struct keel_cursor keel_cursor;

/* The largest key (bytes); a key is 1 to this many bytes of anything. */
#define KEEL_MAX_KEY_SIZE 1024
/* The largest value (bytes). */
#define KEEL_MAX_VALUE_SIZE (UINT64_C(1) << 30)

/* A commit's durability: the store's default, survives a process crash, or on stable
 * storage when the commit returns (group commit). */
#define KEEL_DURABLE_DEFAULT 0
#define KEEL_DURABLE_NONE 1
#define KEEL_DURABLE_SYNC 2

#define KEEL_STORE_OPTIONS_VERSION 1

/* Options of keel_store_open. Fill it with keel_store_options_init, then change fields. */
typedef struct keel_store_options {
  uint32_t version;            /* KEEL_STORE_OPTIONS_VERSION (set by init) */
  int create_if_missing;       /* 1 */
  int error_if_exists;         /* 0 */
  int read_only;               /* 0 */
  int durable;                 /* KEEL_DURABLE_NONE or KEEL_DURABLE_SYNC */
  int verify_checksums;        /* 1 */
  int every_user_on_this_host; /* 0: a store on a network filesystem is refused */
  uint64_t segment_size;       /* 0: chosen by the store */
  uint64_t max_bytes;          /* 0: no budget */
  uint64_t checkpoint_bytes;   /* 0: the store's default */
  uint32_t
      lock_timeout_ms; /* 30000; how long a call (an open too) waits for other users: ETIMEDOUT */
  double compact_dead_fraction; /* 0.5; 0 turns background compaction off */
} keel_store_options;

/* The defaults (those of keel::kv::options). */
KEEL_API void keel_store_options_init(keel_store_options* options);

/* Opens (or makes) the store at directory `path`; `options` NULL for the defaults.
 * Errors: ENOENT, EEXIST, KEEL_NOT_KEEL_FILE, KEEL_UNSUPPORTED_VERSION, KEEL_CORRUPT,
 * KEEL_NEEDS_LOCAL_FILESYSTEM, EINVAL (bad options), EACCES, EROFS, ... */
KEEL_API int keel_store_open(const char* path, const keel_store_options* options,
                             keel_store** store);
/* Closes the store (NULL: nothing). Its transactions and cursors must have ended. */
KEEL_API void keel_store_close(keel_store* store);

/* The value of `key`: copies up to `capacity` bytes into `buffer` (NULL when 0) and sets
 * `*length` to the value's whole length (call again with a larger buffer when it is more).
 * Errors: KEEL_NOT_FOUND, EINVAL (an empty key), KEEL_TOO_LARGE (the key), KEEL_CORRUPT. */
KEEL_API int keel_get(keel_store* store, const void* key, size_t key_length, void* buffer,
                      size_t capacity, size_t* length);
/* Puts `key` = `value`, committed with the store's durability. On a full store it compacts
 * when it must, and that waits (up to lock_timeout_ms) for the transactions open in any
 * thread: do not call it while this thread holds one (it would wait for itself). Errors: EINVAL,
 * KEEL_TOO_LARGE, KEEL_READ_ONLY, ENOSPC, KEEL_BUDGET_REACHED, ETIMEDOUT, KEEL_SYNC_FAILED, and I/O
 * errors. */
KEEL_API int keel_put(keel_store* store, const void* key, size_t key_length, const void* value,
                      size_t value_length);
/* Erases `key` (compacting on a full store, as keel_put). Errors: KEEL_NOT_FOUND (nothing
 * written), and keel_put's. */
KEEL_API int keel_erase(keel_store* store, const void* key, size_t key_length);

/* Begins a transaction: it reads the store as of now, plus its own writes. */
KEEL_API int keel_txn_begin(keel_store* store, keel_txn** txn);
/* As keel_get, in the transaction. */
KEEL_API int keel_txn_get(keel_txn* txn, const void* key, size_t key_length, void* buffer,
                          size_t capacity, size_t* length);
/* The value without a copy: `*value` stays valid until the transaction ends (or, for a value
 * it wrote itself, until it writes the key again). */
KEEL_API int keel_txn_get_view(keel_txn* txn, const void* key, size_t key_length,
                               const void** value, size_t* length);
/* Buffers a write until commit. Errors: EINVAL, KEEL_TOO_LARGE, KEEL_READ_ONLY. */
KEEL_API int keel_txn_put(keel_txn* txn, const void* key, size_t key_length, const void* value,
                          size_t value_length);
KEEL_API int keel_txn_erase(keel_txn* txn, const void* key, size_t key_length);
/* Applies every write or none, and ends (frees) the transaction either way. `*seq` (when
 * not NULL) is the commit's place in the store's order. Errors: KEEL_CONFLICT (retry),
 * ETIMEDOUT, KEEL_READ_ONLY, KEEL_TOO_LARGE, ENOSPC, KEEL_BUDGET_REACHED, KEEL_SYNC_FAILED,
 * I/O errors. */
KEEL_API int keel_txn_commit(keel_txn* txn, int durability, uint64_t* seq);
/* Ends (frees) the transaction with no trace (NULL: nothing). */
KEEL_API void keel_txn_abort(keel_txn* txn);

/* A cursor over every key of the store (keel_cursor_open: resumable across commits, a key
 * there throughout comes once) or of a transaction's snapshot (keel_cursor_open_txn: the
 * store as it was; the transaction may then not write; once it ends, the cursor's every
 * keel_cursor_next fails with EINVAL, and it must still be closed), in hash order. With
 * `keys_only`, values come back empty. */
KEEL_API int keel_cursor_open(keel_store* store, int keys_only, keel_cursor** cursor);
KEEL_API int keel_cursor_open_txn(keel_txn* txn, int keys_only, keel_cursor** cursor);
/* The next item: its key and value stay valid until the next call on the cursor or its close.
 * KEEL_NOT_FOUND at the end. */
KEEL_API int keel_cursor_next(keel_cursor* cursor, const void** key, size_t* key_length,
                              const void** value, size_t* value_length);
KEEL_API void keel_cursor_close(keel_cursor* cursor);

/* What a store holds (fields are only ever appended: pass sizeof; bytes past the fields this
 * library knows are zeroed). */
typedef struct keel_store_stat {
  uint64_t records;       /* live keys */
  uint64_t live_bytes;    /* their newest records' bytes */
  uint64_t dead_bytes;    /* superseded and abandoned bytes (an estimate) */
  uint64_t segments;      /* segment files */
  uint64_t segment_bytes; /* their allocated size */
  uint64_t index_bytes;   /* the index file's size */
  uint64_t visible_seq;   /* the newest commit visible */
  uint64_t compactions;   /* compactions that removed segments */
  uint64_t users;         /* processes with slots in the store */
} keel_store_stat;
KEEL_API int keel_store_stats(keel_store* store, keel_store_stat* stat, size_t stat_size);
/* Checks every checksum and index entry: `*commits` complete commit blocks, `*damaged` places
 * that do not check out (either pointer may be NULL). Errors: KEEL_CORRUPT (the first damage:
 * see keel_last_error_path), ETIMEDOUT, I/O errors. */
KEEL_API int keel_store_verify(keel_store* store, uint64_t* commits, uint64_t* damaged);
/* Compacts: `*segments_removed` (may be NULL). It waits (up to lock_timeout_ms) for the
 * transactions open in any thread: called while this thread holds one, it fails with ETIMEDOUT
 * once that time has passed. Errors: ETIMEDOUT, KEEL_READ_ONLY, KEEL_CORRUPT, I/O errors. */
KEEL_API int keel_store_compact(keel_store* store, uint64_t* segments_removed);
/* Writes a checkpoint now. */
KEEL_API int keel_store_checkpoint(keel_store* store);
/* A consistent copy into a new store at `to` while writers go on: `*keys` copied (may be
 * NULL). Errors: EEXIST, EINVAL, I/O errors. */
KEEL_API int keel_store_backup(keel_store* store, const char* to, uint64_t* keys);

/* ---- filesystem mutexes ---- */

typedef struct keel_mutex keel_mutex;
typedef struct keel_guard keel_guard;

/* An entity to lock: a 63-bit value (at most KEEL_ENTITY_MAX), exclusive or shared. */
typedef struct keel_entity {
  uint64_t value;
  int exclusive;
} keel_entity;
#define KEEL_ENTITY_MAX ((UINT64_C(1) << 63) - 18)

/* The entity value of a name (its XXH3 hash folded into [0, KEEL_ENTITY_MAX]). */
KEEL_API uint64_t keel_entity_of(const void* name, size_t length);
/* The algorithms' names by index from 0 (lock_files, byte_ranges, atomic_append, memory_map,
 * then the kernel baselines flock, fcntl, sysv), NULL past the last. */
KEEL_API const char* keel_mutex_algorithm(size_t index);
/* Opens mutex `algorithm` on `path` (a lock file; a directory for lock_files and flock).
 * Errors: EINVAL (unknown algorithm), KEEL_USED_BY_ANOTHER_ALGORITHM,
 * KEEL_NEEDS_LOCAL_FILESYSTEM, and the algorithm's own. */
KEEL_API int keel_mutex_open(const char* algorithm, const char* path, keel_mutex** mutex);
/* Closes the mutex (NULL: nothing); its guards must have been unlocked. */
KEEL_API void keel_mutex_close(keel_mutex* mutex);
/* Removes what mutex `algorithm` leaves outside `path` once nobody uses it (sysv's semaphore
 * set, the shared memory of killed memory_map users; nothing for the others). */
KEEL_API int keel_mutex_remove_resources(const char* algorithm, const char* path);
/* Locks every entity of `set` (all or none, any order, no deadlock between callers) within
 * `timeout_ms` milliseconds (negative: as long as it takes; 0: try once). Errors: ETIMEDOUT,
 * EWOULDBLOCK (timeout 0 and something held), EINVAL (a value above KEEL_ENTITY_MAX),
 * EDEADLK (this thread holds one of them already), ESTALE (the lock path was replaced), and
 * the I/O error that stopped it. */
KEEL_API int keel_mutex_lock(keel_mutex* mutex, const keel_entity* set, size_t count,
                             int64_t timeout_ms, keel_guard** guard);
/* Unlocks and frees the guard (NULL: nothing). An error is the algorithm's I/O error: the
 * entities may then stay locked until the process exits; the guard is freed either way. */
KEEL_API int keel_guard_unlock(keel_guard* guard);

#ifdef __cplusplus
}
#endif

#endif /* KEEL_KEEL_H */
