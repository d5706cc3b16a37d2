// keel._keel's store: keel.Store (a mapping of bytes to bytes over keel::kv::store, shared by
// threads and processes) and its transactions. Every call that may wait or touch the disk
// runs without the GIL.
//
// Ownership: a call holds the kv::store it uses (a shared_ptr taken with the GIL), so close()
// from another thread never frees it under the call; the store goes with the last holder
// (Store, transactions, iterators). A transaction's state (`txn_state`) is owned by its
// Transaction and by the views of its values, and guarded by its mutex: each call on it,
// from any thread, holds that mutex without the GIL.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "errors.hpp"
#include "fork.hpp"
#include "gil.hpp"
#include "keel/kv/store.hpp"

namespace py = pybind11;

namespace keel::python {
namespace {

// The bytes of a key or value argument: bytes, bytearray, memoryview or any contiguous
// buffer, held (so nothing can resize it) while the GIL is released. A str is refused: the
// store maps bytes to bytes, and which encoding is the caller's to say.
class bytes_arg {
 public:
  explicit bytes_arg(const py::handle& h) {
    if (PyBytes_Check(h.ptr())) {
      view_ = {PyBytes_AS_STRING(h.ptr()), static_cast<std::size_t>(PyBytes_GET_SIZE(h.ptr()))};
      return;
    }
    if (PyUnicode_Check(h.ptr())) {
      throw py::type_error("keys and values are bytes: encode a str first (s.encode())");
    }
    if (PyObject_GetBuffer(h.ptr(), &buffer_, PyBUF_SIMPLE) != 0) throw py::error_already_set();
    held_ = true;
    view_ = {static_cast<const char*>(buffer_.buf), static_cast<std::size_t>(buffer_.len)};
  }
  bytes_arg(const bytes_arg&) = delete;
  bytes_arg& operator=(const bytes_arg&) = delete;
  ~bytes_arg() {
    if (held_) PyBuffer_Release(&buffer_);
  }
  [[nodiscard]] std::string_view view() const { return view_; }
  //! Whether it can be a key at all (1 B to kv::max_key_size): one that cannot is absent.
  [[nodiscard]] bool can_be_key() const {
    return !view_.empty() && view_.size() <= kv::max_key_size;
  }
  //! Refuses a key that cannot be stored, saying the limit.
  const bytes_arg& writable_key() const {
    if (!can_be_key()) {
      throw py::value_error("a key is 1 to " + std::to_string(kv::max_key_size) + " bytes, not " +
                            std::to_string(view_.size()));
    }
    return *this;
  }

 private:
  Py_buffer buffer_{};
  bool held_ = false;
  std::string_view view_;
};

py::bytes to_bytes(std::string_view s) {
  return {s.data(), s.size()};
}

// A store, or none once closed.
struct py_store {
  std::shared_ptr<kv::store> s;
  std::string path;  // absolute, as opened: a process started by spawn reopens it
  py::dict options;  // as given, for pickling

  //! The store, for one call (GIL held): close() meanwhile leaves it to the call.
  [[nodiscard]] std::shared_ptr<kv::store> live() const {
    if (!s) throw py::value_error("the store is closed");
    return s;
  }
  void close() {
    auto last = std::move(s);
    without_gil([&] { last.reset(); });  // (waits for its background threads)
  }
};

template <class T>
T option_as(const py::handle& v, const std::string& name, const char* what) {
  try {
    return v.cast<T>();
  } catch (const py::cast_error&) {
    throw py::type_error("keel.Store() option " + name + ": " + what);
  }
}

kv::options options_of(const py::dict& kw) {
  kv::options o;
  for (const auto& [k, v] : kw) {
    const auto name = k.cast<std::string>();
    const auto flag = [&] {
      if (!py::isinstance<py::bool_>(v)) {
        throw py::type_error("keel.Store() option " + name + ": True or False");
      }
      return v.cast<bool>();
    };
    const auto size = [&] { return option_as<std::uint64_t>(v, name, "a number of bytes, >= 0"); };
    if (name == "create_if_missing") {
      o.create_if_missing = flag();
    } else if (name == "error_if_exists") {
      o.error_if_exists = flag();
    } else if (name == "read_only") {
      o.read_only = flag();
    } else if (name == "durable") {
      o.durable = flag() ? kv::durability::sync : kv::durability::none;
    } else if (name == "verify_checksums") {
      o.verify_checksums = flag();
    } else if (name == "segment_size") {
      o.segment_size = size();
    } else if (name == "lock_timeout") {
      const auto seconds = option_as<double>(v, name, "seconds");
      if (!(seconds >= 0 && seconds < 1e9)) throw py::value_error("lock_timeout: 0 to 1e9 s");
      o.lock_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
    } else if (name == "max_bytes") {
      o.max_bytes = size();
    } else if (name == "checkpoint_bytes") {
      o.checkpoint_bytes = size();
    } else if (name == "compact_dead_fraction") {
      o.compact_dead_fraction = option_as<double>(v, name, "a fraction from 0 to below 1");
    } else if (name == "ledger") {
      o.ledger = flag();
    } else if (name == "every_user_on_this_host") {
      o.every_user_on_this_host = flag();
    } else {
      throw py::type_error("keel.Store() got an unexpected keyword argument '" + name + "'");
    }
  }
  return o;
}

std::shared_ptr<py_store> open_store(const std::string& given, const py::kwargs& kw) {
  const kv::options o = options_of(kw);
  auto p = std::make_shared<py_store>();
  std::error_code ec;
  const auto absolute = std::filesystem::absolute(checked_path(given), ec);
  p->path = ec ? given : absolute.string();
  p->options = py::dict(kw);
  auto r = without_gil([&] { return kv::store::open(p->path, o); });
  if (!r) throw raise(r.error().about(p->path));
  p->s = std::shared_ptr<kv::store>(std::move(*r));
  return p;
}

py::object store_get(const py_store& self, const py::handle& key, const py::object& fallback,
                     bool missing_is_error) {
  bytes_arg k(key);
  auto s = self.live();
  if (!k.can_be_key()) {
    if (missing_is_error) throw key_error(k.view());
    return fallback;
  }
  auto r = without_gil([&] { return s->get(k.view()); });
  if (r) return to_bytes(*r);
  if (r.error() != keel::errc::not_found) throw raise(r.error());
  if (missing_is_error) throw key_error(k.view());
  return fallback;
}

// ---- transactions ----

struct txn_state {
  std::shared_ptr<kv::store> store;  // first: it outlives the transaction below
  kv::transaction t;
  std::mutex m;  // guards all below, and `t` (one thread at a time)
  kv::durability durable{};
  std::atomic<bool> ended{false};  // committed or aborted, as Python sees it
  bool wrote = false;
  bool scanned = false;
  int views = 0;                            // views of its snapshot alive
  std::unordered_set<std::string> written;  // keys it wrote: their views are copies
  // The fork generation it began in: a forked child's copy is its parent's (and the mutex may
  // have been held by a parent's thread that is not in the child).
  std::uint64_t generation = fork_generation();
};

// Why a transaction refused a call (no error of the store's).
struct refusal {
  const char* why = nullptr;
  bool buffer = false;  // a BufferError, else a ValueError
};

// Runs `op(state, refusal&)` without the GIL, holding the transaction's mutex, unless it has
// ended; raises what it refused.
template <class F>
auto in_txn(const std::shared_ptr<txn_state>& st, F&& op) {
  if (st->generation != fork_generation()) {
    throw py::value_error(
        "a transaction is used only in the process that began it: begin one in the child");
  }
  refusal no;
  using R = decltype(op(*st, no));
  R r = without_gil([&]() -> R {
    std::lock_guard g(st->m);
    if (st->ended.load()) {
      no.why = "the transaction has ended";
      return R{};
    }
    return op(*st, no);
  });
  if (no.why != nullptr) {
    if (no.buffer) throw py::buffer_error(no.why);
    throw py::value_error(no.why);
  }
  return r;
}

// A value of a transaction's snapshot, exported without a copy (the buffer behind a
// memoryview); keeps the snapshot while it lives.
struct value_view {
  std::shared_ptr<txn_state> st;
  std::span<const std::byte> bytes;
  value_view(std::shared_ptr<txn_state> s, std::span<const std::byte> b)
      : st(std::move(s)), bytes(b) {}  // (views counted by txn_view, under the mutex)
  value_view(const value_view&) = delete;
  value_view& operator=(const value_view&) = delete;
  ~value_view() {
    // With the GIL (a deallocation): the mutex's holders never wait for the GIL, only for the
    // store (a commit waiting for its keys' locks may make this wait as long).
    if (st->generation != fork_generation()) return;  // a forked child's: its parent's snapshot
    std::lock_guard g(st->m);
    // The last view of a transaction Python ended lets its snapshot go.
    if (--st->views == 0 && st->ended.load()) st->t.abort();
  }
};

struct py_txn {
  std::shared_ptr<txn_state> st;
};

py::object txn_get(const py_txn& self, const py::handle& key, const py::object& fallback,
                   bool missing_is_error) {
  bytes_arg k(key);
  if (!k.can_be_key()) {
    (void)in_txn(self.st, [](txn_state&, refusal&) { return 0; });  // (ended: ValueError)
    if (missing_is_error) throw key_error(k.view());
    return fallback;
  }
  auto r = in_txn(self.st, [&](txn_state& s, refusal&) { return s.t.get(k.view()); });
  if (r) return to_bytes(*r);
  if (r.error() != keel::errc::not_found) throw raise(r.error());
  if (missing_is_error) throw key_error(k.view());
  return fallback;
}

py::object txn_view(const py_txn& self, const py::handle& key) {
  bytes_arg k(key);
  struct got {
    result<std::span<const std::byte>> view;
    std::optional<result<std::string>> copy;
  };
  got g = in_txn(self.st, [&](txn_state& s, refusal&) {
    if (!k.can_be_key()) return got{keel_error(keel::errc::not_found), {}};
    // Its own write lives only until the key is written again: a copy is what stays valid.
    if (s.written.contains(std::string(k.view()))) {
      return got{std::span<const std::byte>{}, s.t.get(k.view())};
    }
    got out{s.t.get_view(k.view()), {}};
    if (out.view) ++s.views;  // counted before anyone can end the transaction
    return out;
  });
  const auto fail = [&](const keel::error& e) {
    return e == keel::errc::not_found ? key_error(k.view()) : raise(e);
  };
  if (g.copy) {
    if (!*g.copy) throw fail(g.copy->error());
    return py::memoryview(py::bytes(**g.copy));
  }
  if (!g.view) throw fail(g.view.error());
  auto holder = py::cast(std::make_unique<value_view>(self.st, *g.view));
  return py::reinterpret_steal<py::object>(PyMemoryView_FromObject(holder.ptr()));
}

void txn_write(const py_txn& self, const py::handle& key, const py::handle* value) {
  bytes_arg k(key);
  k.writable_key();
  std::optional<bytes_arg> v;
  if (value != nullptr) v.emplace(*value);
  auto r = in_txn(self.st, [&](txn_state& s, refusal& no) -> result<void> {
    if (s.scanned) {
      no.why =
          "a transaction that has scanned may not write (keel's serializability tracks "
          "reads key by key): write in another";
      return {};
    }
    auto done = v ? s.t.put(k.view(), v->view()) : s.t.erase(k.view());
    if (done) {
      s.wrote = true;
      s.written.emplace(k.view());
    }
    return done;
  });
  if (!r) throw raise(r.error());
}

// Ends the transaction: commits (or aborts) it, unless views of its snapshot are alive, when a
// read-only one keeps its snapshot until they go (nothing to commit) and one that wrote is
// refused (its commit would end the snapshot they point into).
py::object txn_end(const py_txn& self, bool commit, const py::object& durable) {
  std::optional<kv::durability> asked;
  if (!durable.is_none()) {
    asked = durable.cast<bool>() ? kv::durability::sync : kv::durability::none;
  }
  auto r = in_txn(self.st, [&](txn_state& s, refusal& no) -> result<std::uint64_t> {
    if (s.views > 0 && s.wrote && commit) {
      no.why =
          "views of this transaction's values are alive: release them (del, or "
          "memoryview.release()) or copy them (bytes(view)) before it commits";
      no.buffer = true;
      return 0;
    }
    if (s.views > 0) {
      s.ended = true;  // the snapshot goes with the last view
      return s.t.snapshot();
    }
    s.ended = true;
    if (!commit) {
      s.t.abort();
      return 0;
    }
    return s.t.commit(asked.value_or(s.durable));  // ends the transaction either way
  });
  if (!r) throw raise(r.error());
  return commit ? py::object(py::int_(*r)) : py::object(py::none());
}

// ---- iteration: pages of a scan ----

enum class yield_kind { keys, values, items };

struct scan_iter {
  scan_iter(std::shared_ptr<py_store> s, std::shared_ptr<txn_state> t, yield_kind k)
      : store(std::move(s)), txn(std::move(t)), kind(k) {}
  std::shared_ptr<py_store> store;  // a store's newest state, page by page ...
  std::shared_ptr<txn_state> txn;   // ... or a transaction's snapshot
  yield_kind kind;
  std::string cursor = {};
  std::vector<kv::item> page = {};
  std::size_t at = 0;
  bool done = false;

  py::object next() {
    if (store) (void)store->live();  // closed: a ValueError, as a closed file's iterator
    while (at == page.size()) {
      if (done) throw py::stop_iteration();
      const bool keys_only = kind == yield_kind::keys;
      result<kv::scan_page> r;
      if (txn) {
        r = in_txn(txn, [&](txn_state& s, refusal& no) -> result<kv::scan_page> {
          if (s.wrote) {
            no.why =
                "a transaction that has written may not scan (keel's serializability "
                "tracks reads key by key): scan in another";
            return kv::scan_page{};
          }
          s.scanned = true;
          return s.t.scan(cursor, 256, keys_only);
        });
      } else {
        auto s = store->live();
        r = without_gil([&] { return s->scan(cursor, 256, keys_only); });
      }
      if (!r) throw raise(r.error());
      page = std::move(r->items);
      at = 0;
      cursor = std::move(r->cursor);
      done = r->done;
    }
    const kv::item& it = page[at++];
    switch (kind) {
      case yield_kind::keys:
        return to_bytes(it.key);
      case yield_kind::values:
        return to_bytes(it.value);
      case yield_kind::items:
        break;
    }
    return py::make_tuple(to_bytes(it.key), to_bytes(it.value));
  }
};

scan_iter txn_iter(const py_txn& t, yield_kind k) {
  if (t.st->ended.load()) throw py::value_error("the transaction has ended");
  return {nullptr, t.st, k};
}

scan_iter store_iter(const std::shared_ptr<py_store>& s, yield_kind k) {
  (void)s->live();
  return {s, nullptr, k};
}

py::dict stats_dict(const kv::store_stats& st) {
  py::dict d;
  d["records"] = st.records;
  d["live_bytes"] = st.live_bytes;
  d["dead_bytes"] = st.dead_bytes;
  d["segments"] = st.segments;
  d["segment_bytes"] = st.segment_bytes;
  d["index_bytes"] = st.index_bytes;
  d["index_pages"] = st.index_pages;
  d["index_load"] = st.index_load;
  d["visible_seq"] = st.visible_seq;
  d["checkpoint_seq"] = st.checkpoint_seq;
  d["compactions"] = st.compactions;
  py::list users;
  for (const auto& u : st.users) {
    py::dict ud;
    ud["pid"] = u.pid;
    ud["reading"] = u.reading;
    ud["oldest_snapshot"] = u.oldest_snapshot;
    ud["dead"] = u.dead;
    ud["self"] = u.self;
    users.append(ud);
  }
  d["users"] = users;
  return d;
}

// Runs `op(store)` on self's store without the GIL; raises its error.
template <class F>
auto on_store(const py_store& self, F&& op) {
  auto s = self.live();
  auto r = without_gil([&] { return op(*s); });
  if (!r) throw raise(r.error());
  return r;
}

py_txn begin(const py_store& self, const py::object& durable) {
  auto st = std::make_shared<txn_state>();
  st->store = self.live();
  st->durable = self.options.contains("durable") && self.options["durable"].cast<bool>()
                    ? kv::durability::sync
                    : kv::durability::none;
  if (!durable.is_none()) {
    st->durable = durable.cast<bool>() ? kv::durability::sync : kv::durability::none;
  }
  auto r = without_gil([&] { return st->store->begin(); });
  if (!r) throw raise(r.error());
  st->t = std::move(*r);
  return py_txn{std::move(st)};
}

void register_transaction(py::module_& m) {
  py::class_<value_view>(m, "_Value", py::buffer_protocol()).def_buffer([](value_view& v) {
    return py::buffer_info(const_cast<std::byte*>(v.bytes.data()), 1,
                           py::format_descriptor<std::uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(v.bytes.size())}, {1}, true);
  });

  py::class_<scan_iter>(m, "_ScanIterator")
      .def("__iter__", [](py::object self) { return self; })
      .def("__next__", &scan_iter::next);

  py::class_<py_txn>(m, "Transaction",
                     "A transaction: reads see the store as it was when it began plus its own "
                     "writes; writes apply all at once at commit, or not at all.")
      .def("__getitem__",
           [](const py_txn& t, const py::handle& k) { return txn_get(t, k, py::none(), true); })
      .def(
          "get",
          [](const py_txn& t, const py::handle& k, const py::object& d) {
            return txn_get(t, k, d, false);
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("__contains__",
           [](const py_txn& t, const py::handle& k) {
             return !txn_get(t, k, py::none(), false).is_none();
           })
      .def("view", &txn_view, py::arg("key"),
           "The value of `key` as a read-only memoryview, without a copy. It stays valid "
           "while it lives (a transaction that only read keeps its snapshot for it).")
      .def("__setitem__",
           [](const py_txn& t, const py::handle& k, const py::handle& v) { txn_write(t, k, &v); })
      .def("__delitem__",
           [](const py_txn& t, const py::handle& k) {
             if (txn_get(t, k, py::none(), false).is_none()) {
               throw key_error(bytes_arg(k).view());
             }
             txn_write(t, k, nullptr);
           })
      .def("keys", [](const py_txn& t) { return txn_iter(t, yield_kind::keys); })
      .def("values", [](const py_txn& t) { return txn_iter(t, yield_kind::values); })
      .def("items", [](const py_txn& t) { return txn_iter(t, yield_kind::items); })
      .def("__iter__", [](const py_txn& t) { return txn_iter(t, yield_kind::keys); })
      .def(
          "commit", [](const py_txn& t, const py::object& d) { return txn_end(t, true, d); },
          py::arg("durable") = py::none(),
          "Applies every write at once and returns the commit's seq. Raises keel.Conflict "
          "when another commit got in the way (nothing was applied: retry).")
      .def("abort", [](const py_txn& t) { txn_end(t, false, py::none()); })
      .def_property_readonly("active", [](const py_txn& t) { return !t.st->ended.load(); })
      .def_property_readonly("snapshot",
                             [](const py_txn& t) {
                               return in_txn(t.st,
                                             [](txn_state& s, refusal&) { return s.t.snapshot(); });
                             })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](const py_txn& t, const py::object& type, const py::args&) {
        if (t.st->ended.load()) return false;
        txn_end(t, type.is_none(), py::none());
        return false;
      });
}

}  // namespace

void register_store(py::module_& m) {
  register_transaction(m);
  py::class_<py_store, std::shared_ptr<py_store>>(
      m, "Store",
      "keel's embedded transactional store, as a mutable mapping of bytes to bytes, shared by "
      "every thread and process that opens it.")
      .def(py::init(&open_store), py::arg("path"))
      .def_property_readonly("path", [](const py_store& s) { return s.path; })
      .def_property_readonly("options", [](const py_store& s) { return py::dict(s.options); })
      .def_property_readonly("closed", [](const py_store& s) { return !s.s; })
      .def("__getitem__",
           [](const py_store& s, const py::handle& k) { return store_get(s, k, py::none(), true); })
      .def(
          "get",
          [](const py_store& s, const py::handle& k, const py::object& d) {
            return store_get(s, k, d, false);
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("__contains__",
           [](const py_store& s, const py::handle& k) {
             return !store_get(s, k, py::none(), false).is_none();
           })
      .def("__setitem__",
           [](const py_store& s, const py::handle& k, const py::handle& v) {
             bytes_arg key(k);
             key.writable_key();
             bytes_arg value(v);
             (void)on_store(s, [&](kv::store& st) { return st.put(key.view(), value.view()); });
           })
      .def("__delitem__",
           [](const py_store& s, const py::handle& k) {
             bytes_arg key(k);
             auto st = s.live();
             if (!key.can_be_key()) throw key_error(key.view());
             auto r = without_gil([&] { return st->erase(key.view()); });
             if (r) return;
             if (r.error() == keel::errc::not_found) throw key_error(key.view());
             throw raise(r.error());
           })
      .def("__len__",
           [](const py_store& s) {
             return on_store(s, [](kv::store& st) { return st.stats(); })->records;
           })
      .def("__iter__",
           [](const std::shared_ptr<py_store>& s) { return store_iter(s, yield_kind::keys); })
      .def("keys",
           [](const std::shared_ptr<py_store>& s) { return store_iter(s, yield_kind::keys); })
      .def("values",
           [](const std::shared_ptr<py_store>& s) { return store_iter(s, yield_kind::values); })
      .def("items",
           [](const std::shared_ptr<py_store>& s) { return store_iter(s, yield_kind::items); })
      .def("transaction", &begin, py::arg("durable") = py::none(),
           "Begins a transaction; use it with `with`: it commits when the block ends, or aborts "
           "when it raises.")
      .def("stats",
           [](const py_store& s) {
             return stats_dict(*on_store(s, [](kv::store& st) { return st.stats(); }));
           })
      .def(
          "verify",
          [](const py_store& s) {
            kv::verify_report rep;
            auto st = s.live();
            auto r = without_gil([&] { return st->verify(&rep); });
            if (!r && r.error() != keel::errc::corrupt) throw raise(r.error());
            py::list damaged;
            for (const auto& d : rep.damaged)
              damaged.append(py::make_tuple(d.file, d.offset, d.what));
            py::dict out;
            out["commits"] = rep.commits;
            out["torn"] = rep.torn;
            out["damaged"] = damaged;
            return out;
          },
          "Checks every checksum: {'commits', 'torn', 'damaged': [(file, offset, what)]}.")
      .def("compact",
           [](const py_store& s) {
             auto r = on_store(s, [](kv::store& st) { return st.compact(); });
             py::dict out;
             out["segments_removed"] = r->segments_removed;
             out["records_moved"] = r->records_moved;
             out["bytes_freed"] = r->bytes_freed;
             return out;
           })
      .def("checkpoint",
           [](const py_store& s) {
             (void)on_store(s, [](kv::store& st) { return st.checkpoint(); });
           })
      .def(
          "backup",
          [](const py_store& s, const std::string& to) {
            checked_path(to);
            auto r = on_store(s, [&](kv::store& st) { return st.backup(to); });
            py::dict out;
            out["keys"] = r->keys;
            out["bytes"] = r->bytes;
            out["seq"] = r->seq;
            return out;
          },
          py::arg("to"))
      .def("close", &py_store::close)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](py_store& s, const py::args&) { s.close(); });
}

}  // namespace keel::python
