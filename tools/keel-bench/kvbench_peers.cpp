#include "kvbench_peers.hpp"

#include <fmt/format.h>
#include <leveldb/db.h>
#include <leveldb/write_batch.h>
#include <lmdb.h>
#include <rocksdb/db.h>
#include <rocksdb/write_batch.h>
#include <sqlite3.h>
#include <tdb.h>
#include <tkrzw_dbm_hash.h>

#include <fcntl.h>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <mutex>

#include "keel/kv/store.hpp"

namespace keel::tools::kvbench {
namespace {

bool make_dir(const std::string& dir, std::string& why) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) why = fmt::format("cannot make {}: {}", dir, ec.message());
  return !ec;
}

// Makes a Handle and starts it on `r`: each peer's open.
template <class Handle>
std::unique_ptr<kv_handle> open_with_start(const open_request& r, std::string& why) {
  auto h = std::make_unique<Handle>();
  if (!h->start(r, why)) return nullptr;
  return h;
}

// keel::kv: every put a transaction; `durable` makes them durability::sync (group commit).
class keel_handle final : public kv_handle {
 public:
  explicit keel_handle(std::unique_ptr<kv::store> s) : store_(std::move(s)) {}
  bool put(std::string_view key, std::string_view value) override {
    auto r = store_->put(key, value);
    return r ? true : fail(r.error().message());
  }
  bool get(std::string_view key, std::string& out) override {
    auto v = store_->get(key, out);
    return v ? true : fail(v.error().message());
  }
  bool put_all(std::span<const std::string> keys, std::string_view value) override {
    auto t = store_->begin();
    if (!t) return fail(t.error().message());
    for (const std::string& k : keys) {
      if (auto r = t->put(k, value); !r) return fail(r.error().message());
    }
    auto c = t->commit();
    return c ? true : fail(c.error().message());
  }

 private:
  std::unique_ptr<kv::store> store_;
};

std::unique_ptr<kv_handle> open_keel(const open_request& r, std::string& why) {
  kv::options o;
  o.durable = r.durable ? kv::durability::sync : kv::durability::none;
  o.verify_checksums = r.verify;
  auto s = kv::store::open(r.dir, o);
  if (!s) {
    why = s.error().message();
    return nullptr;
  }
  return std::make_unique<keel_handle>(std::move(*s));
}

// LMDB: one environment per process (LMDB forbids opening one twice in a process), shared by
// its threads; writers take turns, as LMDB has one writer at a time. Without `durable`,
// MDB_NOSYNC | MDB_NOMETASYNC: a process crash loses nothing, the OS writes back. Fetches use
// one read transaction per thread, reset and renewed around each get (LMDB's cheapest way to
// take a fresh snapshot per call, as keel's get does).
class lmdb_handle final : public kv_handle {
 public:
  ~lmdb_handle() override {
    for (MDB_txn* t : readers_)
      mdb_txn_abort(t);
    if (env_ != nullptr) mdb_env_close(env_);
  }
  bool start(const open_request& r, std::string& why) {
    if (!make_dir(r.dir, why)) return false;
    // Room for every record three times over (the B+tree's pages, copy-on-write and free
    // pages), as LMDB makes its users guess.
    const std::size_t map = (r.keys * (r.value_size + 128)) * 3 + (std::size_t{64} << 20);
    int rc = mdb_env_create(&env_);
    if (rc == 0) rc = mdb_env_set_mapsize(env_, map);
    if (rc == 0) rc = mdb_env_set_maxreaders(env_, 512);
    const unsigned flags = MDB_NOTLS | (r.durable ? 0u : MDB_NOSYNC | MDB_NOMETASYNC);
    if (rc == 0) rc = mdb_env_open(env_, r.dir.c_str(), flags, 0644);
    MDB_txn* txn = nullptr;
    if (rc == 0) rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc == 0) rc = mdb_dbi_open(txn, nullptr, 0, &dbi_);
    if (rc == 0) rc = mdb_txn_commit(txn);
    if (rc != 0) why = mdb_strerror(rc);
    return rc == 0;
  }
  bool put(std::string_view key, std::string_view value) override {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc != 0) return fail(mdb_strerror(rc));
    MDB_val k{key.size(), const_cast<char*>(key.data())};
    MDB_val v{value.size(), const_cast<char*>(value.data())};
    rc = mdb_put(txn, dbi_, &k, &v, 0);
    if (rc != 0) {
      mdb_txn_abort(txn);
      return fail(mdb_strerror(rc));
    }
    rc = mdb_txn_commit(txn);
    return rc == 0 ? true : fail(mdb_strerror(rc));
  }
  bool put_all(std::span<const std::string> keys, std::string_view value) override {
    MDB_txn* txn = nullptr;
    int rc = mdb_txn_begin(env_, nullptr, 0, &txn);
    if (rc != 0) return fail(mdb_strerror(rc));
    for (const std::string& key : keys) {
      MDB_val k{key.size(), const_cast<char*>(key.data())};
      MDB_val v{value.size(), const_cast<char*>(value.data())};
      if (rc = mdb_put(txn, dbi_, &k, &v, 0); rc != 0) {
        mdb_txn_abort(txn);
        return fail(mdb_strerror(rc));
      }
    }
    rc = mdb_txn_commit(txn);
    return rc == 0 ? true : fail(mdb_strerror(rc));
  }
  bool get(std::string_view key, std::string& out) override {
    MDB_txn* txn = reader();
    if (txn == nullptr) return false;
    if (int rc = mdb_txn_renew(txn); rc != 0) return fail(mdb_strerror(rc));
    MDB_val k{key.size(), const_cast<char*>(key.data())};
    MDB_val v{};
    const int rc = mdb_get(txn, dbi_, &k, &v);
    if (rc == 0) out.assign(static_cast<const char*>(v.mv_data), v.mv_size);
    mdb_txn_reset(txn);
    return rc == 0 ? true : fail(mdb_strerror(rc));
  }

 private:
  // This thread's read transaction (reset), made on its first fetch.
  MDB_txn* reader() {
    struct slot {
      const lmdb_handle* owner = nullptr;
      std::uint64_t generation = 0;
      MDB_txn* txn = nullptr;
    };
    thread_local slot mine;
    if (mine.owner == this && mine.generation == generation_) return mine.txn;
    MDB_txn* txn = nullptr;
    if (int rc = mdb_txn_begin(env_, nullptr, MDB_RDONLY, &txn); rc != 0) {
      fail(mdb_strerror(rc));
      return nullptr;
    }
    mdb_txn_reset(txn);
    {
      std::lock_guard lock(mutex_);
      readers_.push_back(txn);
    }
    mine = {this, generation_, txn};
    return txn;
  }
  static std::uint64_t next_generation() {
    static std::atomic<std::uint64_t> g{0};
    return ++g;
  }
  MDB_env* env_ = nullptr;
  MDB_dbi dbi_ = 0;
  std::mutex mutex_;
  std::vector<MDB_txn*> readers_;
  // Tells this handle from an earlier one that lived at the same address.
  const std::uint64_t generation_ = next_generation();
};

// tkrzw's HashDBM: a file hash table with its own locks, shared by threads; one process at a
// time. Buckets sized for the keys up front (its users' tuning). With `durable`, each put is
// followed by Synchronize(hard): HashDBM has no per-commit sync of its own.
class tkrzw_handle final : public kv_handle {
 public:
  ~tkrzw_handle() override {
    if (db_.IsOpen()) db_.Close();
  }
  bool start(const open_request& r, std::string& why) {
    if (!make_dir(r.dir, why)) return false;
    tkrzw::HashDBM::TuningParameters tp;
    tp.num_buckets = static_cast<std::int64_t>(r.keys) * 2 + 1024;
    durable_ = r.durable;
    const auto s = db_.OpenAdvanced(r.dir + "/casket.tkh", true, tkrzw::File::OPEN_DEFAULT, tp);
    if (!s.IsOK()) why = tkrzw::ToString(s);
    return s.IsOK();
  }
  bool put(std::string_view key, std::string_view value) override {
    auto s = db_.Set(key, value);
    if (s.IsOK() && durable_) s = db_.Synchronize(true);
    return s.IsOK() ? true : fail(tkrzw::ToString(s));
  }
  bool get(std::string_view key, std::string& out) override {
    const auto s = db_.Get(key, &out);
    return s.IsOK() ? true : fail(tkrzw::ToString(s));
  }

 private:
  tkrzw::HashDBM db_;
  bool durable_ = false;
};

// RocksDB and LevelDB: LSM trees, one process at a time, shared by threads (their writers
// queue and share one log write: group commit). Defaults, as most users run them; `durable`
// is WriteOptions::sync.
// `Api` names the library's types: RocksDB's and LevelDB's interfaces are the same.
template <class Api>
class lsm_handle final : public kv_handle {
 public:
  bool start(const open_request& r, std::string& why) {
    if (!make_dir(r.dir, why)) return false;
    typename Api::options o;
    o.create_if_missing = true;
    typename Api::db* db = nullptr;
    const auto s = Api::db::Open(o, r.dir, &db);
    if (!s.ok()) {
      why = s.ToString();
      return false;
    }
    db_.reset(db);
    write_.sync = r.durable;
    return true;
  }
  bool put(std::string_view key, std::string_view value) override {
    const auto s = db_->Put(write_, slice(key), slice(value));
    return s.ok() ? true : fail(s.ToString());
  }
  bool put_all(std::span<const std::string> keys, std::string_view value) override {
    typename Api::write_batch batch;
    for (const std::string& k : keys)
      batch.Put(slice(k), slice(value));
    const auto s = db_->Write(write_, &batch);
    return s.ok() ? true : fail(s.ToString());
  }
  bool get(std::string_view key, std::string& out) override {
    const auto s = db_->Get(typename Api::read_options(), slice(key), &out);
    return s.ok() ? true : fail(s.ToString());
  }

 private:
  static typename Api::slice slice(std::string_view s) { return {s.data(), s.size()}; }
  std::unique_ptr<typename Api::db> db_;
  typename Api::write_options write_;
};

struct rocksdb_api {
  using db = rocksdb::DB;
  using options = rocksdb::Options;
  using read_options = rocksdb::ReadOptions;
  using write_options = rocksdb::WriteOptions;
  using slice = rocksdb::Slice;
  using write_batch = rocksdb::WriteBatch;
};
struct leveldb_api {
  using db = leveldb::DB;
  using options = leveldb::Options;
  using read_options = leveldb::ReadOptions;
  using write_options = leveldb::WriteOptions;
  using slice = leveldb::Slice;
  using write_batch = leveldb::WriteBatch;
};

// SQLite: a WITHOUT ROWID table keyed by the key, in WAL mode, a connection per thread and
// per process (busy_timeout lets writers of several processes take turns). Without
// `durable`, synchronous=OFF (a process crash loses nothing, the OS writes back); with it,
// synchronous=FULL (the WAL synced at every commit).
class sqlite_handle final : public kv_handle {
 public:
  ~sqlite_handle() override {
    sqlite3_finalize(put_);
    sqlite3_finalize(get_);
    sqlite3_close(db_);
  }
  bool start(const open_request& r, std::string& why) {
    if (!make_dir(r.dir, why)) return false;
    const std::string path = r.dir + "/kv.sqlite";
    int rc =
        sqlite3_open_v2(path.c_str(), &db_,
                        SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
    if (rc == SQLITE_OK) rc = sqlite3_busy_timeout(db_, 60'000);
    const std::string setup = fmt::format(
        "PRAGMA journal_mode=WAL; PRAGMA synchronous={};"
        "CREATE TABLE IF NOT EXISTS kv (k BLOB PRIMARY KEY, v BLOB) WITHOUT ROWID;",
        r.durable ? "FULL" : "OFF");
    if (rc == SQLITE_OK) rc = sqlite3_exec(db_, setup.c_str(), nullptr, nullptr, nullptr);
    if (rc == SQLITE_OK)
      rc = sqlite3_prepare_v2(db_, "INSERT OR REPLACE INTO kv VALUES (?, ?)", -1, &put_, nullptr);
    if (rc == SQLITE_OK)
      rc = sqlite3_prepare_v2(db_, "SELECT v FROM kv WHERE k = ?", -1, &get_, nullptr);
    if (rc != SQLITE_OK) why = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(rc);
    return rc == SQLITE_OK;
  }
  bool put(std::string_view key, std::string_view value) override {
    sqlite3_bind_blob(put_, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    sqlite3_bind_blob(put_, 2, value.data(), static_cast<int>(value.size()), SQLITE_STATIC);
    const int rc = sqlite3_step(put_);
    sqlite3_reset(put_);
    return rc == SQLITE_DONE ? true : fail(sqlite3_errmsg(db_));
  }
  bool put_all(std::span<const std::string> keys, std::string_view value) override {
    if (sqlite3_exec(db_, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr) != SQLITE_OK) {
      return fail(sqlite3_errmsg(db_));
    }
    for (const std::string& k : keys) {
      if (!put(k, value)) {
        (void)sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
        return false;
      }
    }
    return sqlite3_exec(db_, "COMMIT", nullptr, nullptr, nullptr) == SQLITE_OK
               ? true
               : fail(sqlite3_errmsg(db_));
  }
  bool get(std::string_view key, std::string& out) override {
    sqlite3_bind_blob(get_, 1, key.data(), static_cast<int>(key.size()), SQLITE_STATIC);
    const int rc = sqlite3_step(get_);
    if (rc == SQLITE_ROW) {
      out.assign(static_cast<const char*>(sqlite3_column_blob(get_, 0)),
                 static_cast<std::size_t>(sqlite3_column_bytes(get_, 0)));
    }
    const std::string why = rc == SQLITE_ROW    ? ""
                            : rc == SQLITE_DONE ? "not found"
                                                : sqlite3_errmsg(db_);
    sqlite3_reset(get_);
    return rc == SQLITE_ROW ? true : fail(why);
  }

 private:
  sqlite3* db_ = nullptr;
  sqlite3_stmt* put_ = nullptr;
  sqlite3_stmt* get_ = nullptr;
};

// Samba's TDB: a shared-memory hash table over a file, for many processes (not threads: a
// process may open a file once). Every put is a TDB transaction (all-or-nothing, as keel's
// commits; TDB_NOSYNC unless `durable`), and TDB's transactions are serialised store-wide.
// The hash table is sized for the keys up front, with TDB's better hash.
class tdb_handle final : public kv_handle {
 public:
  ~tdb_handle() override {
    if (db_ != nullptr) tdb_close(db_);
  }
  bool start(const open_request& r, std::string& why) {
    if (!make_dir(r.dir, why)) return false;
    const std::string path = r.dir + "/kv.tdb";
    const int flags = TDB_INCOMPATIBLE_HASH | (r.durable ? 0 : TDB_NOSYNC);
    db_ = tdb_open(path.c_str(), static_cast<int>(r.keys | 1), flags, O_RDWR | O_CREAT, 0644);
    if (db_ == nullptr) why = fmt::format("tdb_open: {}", std::strerror(errno));
    return db_ != nullptr;
  }
  bool put(std::string_view key, std::string_view value) override {
    if (tdb_transaction_start(db_) != 0) return fail(tdb_errorstr(db_));
    if (tdb_store(db_, data(key), data(value), TDB_REPLACE) != 0) {
      std::string why = tdb_errorstr(db_);
      tdb_transaction_cancel(db_);
      return fail(std::move(why));
    }
    return tdb_transaction_commit(db_) == 0 ? true : fail(tdb_errorstr(db_));
  }
  bool put_all(std::span<const std::string> keys, std::string_view value) override {
    if (tdb_transaction_start(db_) != 0) return fail(tdb_errorstr(db_));
    for (const std::string& k : keys) {
      if (tdb_store(db_, data(k), data(value), TDB_REPLACE) != 0) {
        std::string why = tdb_errorstr(db_);
        tdb_transaction_cancel(db_);
        return fail(std::move(why));
      }
    }
    return tdb_transaction_commit(db_) == 0 ? true : fail(tdb_errorstr(db_));
  }
  bool get(std::string_view key, std::string& out) override {
    const auto copy = [](TDB_DATA k, TDB_DATA v, void* into) -> int {
      (void)k;
      static_cast<std::string*>(into)->assign(reinterpret_cast<const char*>(v.dptr), v.dsize);
      return 0;
    };
    return tdb_parse_record(db_, data(key), copy, &out) == 0 ? true : fail(tdb_errorstr(db_));
  }

 private:
  static TDB_DATA data(std::string_view s) {
    return TDB_DATA{reinterpret_cast<unsigned char*>(const_cast<char*>(s.data())), s.size()};
  }
  tdb_context* db_ = nullptr;
};

}  // namespace

const std::vector<engine>& engines() {
  using t = engine::threads;
  static const std::vector<engine> all{
      {"keel", "keel", t::shared, true, true, "defaults; sync: durability::sync (group commit)",
       open_keel},
      {"lmdb", "LMDB", t::shared, true, true,
       "map sized 3x the data; none: MDB_NOSYNC|MDB_NOMETASYNC; a renewed read txn per get",
       open_with_start<lmdb_handle>},
      {"tkrzw", "tkrzw HashDBM", t::shared, false, false,
       "2 buckets per key; sync: Synchronize(hard) after each put", open_with_start<tkrzw_handle>},
      {"rocksdb", "RocksDB", t::shared, false, true, "defaults; sync: WriteOptions::sync",
       open_with_start<lsm_handle<rocksdb_api>>},
      {"leveldb", "LevelDB", t::shared, false, true, "defaults; sync: WriteOptions::sync",
       open_with_start<lsm_handle<leveldb_api>>},
      {"sqlite", "SQLite", t::own_handle, true, true,
       "WAL, WITHOUT ROWID, a connection per thread; none: synchronous=OFF, sync: FULL",
       open_with_start<sqlite_handle>},
      {"tdb", "TDB", t::none, true, true,
       "a transaction per put, hash sized to the keys; none: TDB_NOSYNC",
       open_with_start<tdb_handle>},
  };
  return all;
}

}  // namespace keel::tools::kvbench
