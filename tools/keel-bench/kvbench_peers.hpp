#pragma once
// The stores keel-bench kvbench measures, behind one small interface: keel::kv and its peers (LMDB,
// tkrzw HashDBM, RocksDB, LevelDB, SQLite and Samba TDB), each set up the way its own users
// would for the seed's workload, with the same promise as keel's: every put is a transaction
// of its own that a process crash cannot tear, and with `durable` one that is on stable
// storage when put returns. The peers are benchmark-only dependencies, never the library's.

#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace keel::tools::kvbench {

//! One opened store of one engine.
class kv_handle {
 public:
  kv_handle() = default;
  kv_handle(const kv_handle&) = delete;
  kv_handle& operator=(const kv_handle&) = delete;
  virtual ~kv_handle() = default;
  //! Puts `value` at `key`, one transaction; false on failure (error() says why).
  [[nodiscard]] virtual bool put(std::string_view key, std::string_view value) = 0;
  //! Copies the value at `key` into `out`; false on failure, a missing key included.
  [[nodiscard]] virtual bool get(std::string_view key, std::string& out) = 0;
  //! Puts `value` at every one of `keys` in one transaction (all or none, as each put is);
  //! false on failure. Only for engines with `transactions`.
  [[nodiscard]] virtual bool put_all(std::span<const std::string> keys, std::string_view value) {
    (void)keys;
    (void)value;
    return fail("no transactions of several keys");
  }
  //! Why the last call that failed did (not thread-safe: for the message after a failure).
  [[nodiscard]] const std::string& error() const { return error_; }

 protected:
  bool fail(std::string why) {
    error_ = std::move(why);
    return false;
  }

 private:
  std::string error_;
};

struct open_request {
  std::string dir;       //!< the store's own directory (made if missing)
  bool durable = false;  //!< every put on stable storage when it returns
  std::size_t keys = 0;  //!< how many keys it will hold (for stores sized up front)
  std::size_t value_size = 0;
  //! Reads check what they read (keel's checksums; the peers check nothing on read anyway).
  bool verify = true;
};

struct engine {
  std::string id;    //!< the name in JSON and in --peers: "keel", "lmdb", ...
  std::string name;  //!< for tables: "keel", "LMDB", ...
  //! How threads use it: one handle shared by all, a handle each, or not at all.
  enum class threads { shared, own_handle, none } threading = threads::shared;
  //! Whether several processes may open one store and write to it at once.
  bool multi_process = false;
  //! Whether it commits puts of several keys as one transaction (kv_handle::put_all).
  bool transactions = true;
  //! How it is set up, in words, for the report.
  std::string setup;
  //! Opens the store in `r.dir` (creating it); null and `why` when it cannot.
  std::function<std::unique_ptr<kv_handle>(const open_request& r, std::string& why)> open;
};

//! All the engines, keel first.
[[nodiscard]] const std::vector<engine>& engines();

}  // namespace keel::tools::kvbench
