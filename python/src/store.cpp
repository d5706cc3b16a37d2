// keel._keel's store: keel.Store (a mapping of bytes to bytes over keel::kv::store, shared by
// threads and processes) and its transactions. Every call that may wait or touch the disk
// runs without the GIL. A transaction's state is owned by its Transaction and by the views
// of its values (a view keeps a read-only transaction's snapshot alive while it lives).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "errors.hpp"
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

 private:
  Py_buffer buffer_{};
  bool held_ = false;
  std::string_view view_;
};

py::bytes to_bytes(std::string_view s) {
  return {s.data(), s.size()};
}

// A store, or none once closed. Transactions and iterators hold the kv::store too, so it is
// closed when the last of them goes.
struct py_store {
  std::shared_ptr<kv::store> s;
  std::string path;
  py::dict options;  // as given, for pickling (a process started by spawn reopens the store)

  kv::store& get() {
    if (!s) throw py::value_error("the store is closed");
    return *s;
  }
};

kv::options options_of(const py::dict& kw) {
  kv::options o;
  for (const auto& [k, v] : kw) {
    const auto name = k.cast<std::string>();
    if (name == "create_if_missing") {
      o.create_if_missing = v.cast<bool>();
    } else if (name == "error_if_exists") {
      o.error_if_exists = v.cast<bool>();
    } else if (name == "read_only") {
      o.read_only = v.cast<bool>();
    } else if (name == "durable") {
      o.durable = v.cast<bool>() ? kv::durability::sync : kv::durability::none;
    } else if (name == "verify_checksums") {
      o.verify_checksums = v.cast<bool>();
    } else if (name == "segment_size") {
      o.segment_size = v.cast<std::uint64_t>();
    } else if (name == "lock_timeout") {
      const double seconds = v.cast<double>();
      if (!(seconds >= 0 && seconds < 1e9)) throw py::value_error("lock_timeout: 0 to 1e9 s");
      o.lock_timeout = std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
    } else if (name == "max_bytes") {
      o.max_bytes = v.cast<std::uint64_t>();
    } else if (name == "checkpoint_bytes") {
      o.checkpoint_bytes = v.cast<std::uint64_t>();
    } else if (name == "compact_dead_fraction") {
      o.compact_dead_fraction = v.cast<double>();
    } else if (name == "ledger") {
      o.ledger = v.cast<bool>();
    } else if (name == "every_user_on_this_host") {
      o.every_user_on_this_host = v.cast<bool>();
    } else {
      throw py::type_error("keel.Store() got an unexpected keyword argument '" + name + "'");
    }
  }
  return o;
}

std::shared_ptr<py_store> open_store(const std::string& path, const py::kwargs& kw) {
  const kv::options o = options_of(kw);
  auto p = std::make_shared<py_store>();
  p->path = path;
  p->options = py::dict(kw);
  result<std::unique_ptr<kv::store>> r;
  {
    py::gil_scoped_release nogil;
    r = kv::store::open(path, o);
  }
  if (!r) throw raise(r.error().about(path));
  p->s = std::shared_ptr<kv::store>(std::move(*r));
  return p;
}

// Runs `op(store)` without the GIL.
template <class F>
auto nogil(kv::store& s, F&& op) {
  py::gil_scoped_release release;
  return op(s);
}

py::object store_get(py_store& self, const py::handle& key, const py::object& fallback,
                     bool missing_is_error) {
  bytes_arg k(key);
  auto& s = self.get();
  auto r = nogil(s, [&](kv::store& st) { return st.get(k.view()); });
  if (r) return to_bytes(*r);
  if (r.error() != keel::errc::not_found) throw raise(r.error());
  if (missing_is_error) throw key_error(k.view());
  return fallback;
}

// ---- transactions ----

struct txn_state {
  std::mutex m;  // one call at a time: a kv::transaction belongs to one thread at a time
  kv::transaction t;
  std::shared_ptr<kv::store> store;  // lives as long as the transaction
  kv::durability durable{};
  bool ended = false;  // committed or aborted, as Python sees it (under the GIL)
  bool wrote = false;  // whether it put or erased (under the GIL)
  int views = 0;       // views of its snapshot alive (under the GIL)
  std::unordered_set<std::string> written;  // keys it wrote: their views are copies
};

// A value of a transaction's snapshot, exported without a copy (the buffer behind a
// memoryview); keeps the snapshot while it lives.
struct value_view {
  std::shared_ptr<txn_state> st;
  std::span<const std::byte> bytes;
  value_view(std::shared_ptr<txn_state> s, std::span<const std::byte> b)
      : st(std::move(s)), bytes(b) {
    ++st->views;
  }
  value_view(const value_view&) = delete;
  value_view& operator=(const value_view&) = delete;
  ~value_view() {
    // The last view of a transaction Python ended lets its snapshot go (with the GIL held,
    // as every change of `views` and `ended`; nobody calls an ended transaction).
    if (--st->views == 0 && st->ended) st->t.abort();
  }
};

struct py_txn {
  std::shared_ptr<txn_state> st;

  txn_state& live() {
    if (st->ended) throw py::value_error("the transaction has ended");
    return *st;
  }
  template <class F>
  auto call(F&& op) {
    txn_state& s = live();
    py::gil_scoped_release release;
    std::lock_guard g(s.m);
    return op(s.t);
  }
};

py::object txn_get(py_txn& self, const py::handle& key, const py::object& fallback,
                   bool missing_is_error) {
  bytes_arg k(key);
  auto r = self.call([&](kv::transaction& t) { return t.get(k.view()); });
  if (r) return to_bytes(*r);
  if (r.error() != keel::errc::not_found) throw raise(r.error());
  if (missing_is_error) throw key_error(k.view());
  return fallback;
}

py::object txn_view(py_txn& self, const py::handle& key) {
  bytes_arg k(key);
  txn_state& s = self.live();
  if (s.written.contains(std::string(k.view()))) {
    // Its own write lives only until the key is written again: a copy is what stays valid.
    auto r = self.call([&](kv::transaction& t) { return t.get(k.view()); });
    if (!r) throw r.error() == keel::errc::not_found ? key_error(k.view()) : raise(r.error());
    return py::memoryview(py::bytes(*r));
  }
  auto r = self.call([&](kv::transaction& t) { return t.get_view(k.view()); });
  if (!r) throw r.error() == keel::errc::not_found ? key_error(k.view()) : raise(r.error());
  auto holder = py::cast(std::make_unique<value_view>(self.st, *r));
  return py::reinterpret_steal<py::object>(PyMemoryView_FromObject(holder.ptr()));
}

void txn_write(py_txn& self, const py::handle& key, const py::handle* value) {
  bytes_arg k(key);
  std::optional<bytes_arg> v;
  if (value != nullptr) v.emplace(*value);
  txn_state& s = self.live();
  auto r = self.call(
      [&](kv::transaction& t) { return v ? t.put(k.view(), v->view()) : t.erase(k.view()); });
  if (!r) throw raise(r.error());
  s.wrote = true;
  s.written.emplace(k.view());
}

// Ends the transaction: commits (or aborts) it, unless views of its snapshot are alive,
// when a read-only one keeps its snapshot until they go (nothing to commit) and one that
// wrote is refused (its commit would end the snapshot they point into).
py::object txn_end(py_txn& self, bool commit, const py::object& durable) {
  txn_state& s = self.live();
  if (s.views > 0 && s.wrote && commit) {
    throw py::buffer_error(
        "views of this transaction's values are alive: release them (del, or "
        "memoryview.release()) or copy them (bytes(view)) before it commits");
  }
  if (s.views > 0) {
    s.ended = true;  // the snapshot goes with the last view
    return commit ? py::object(py::int_(s.t.snapshot())) : py::object(py::none());
  }
  if (!commit) {
    self.call([](kv::transaction& t) {
      t.abort();
      return 0;
    });
    s.ended = true;
    return py::none();
  }
  kv::durability d = s.durable;
  if (!durable.is_none()) d = durable.cast<bool>() ? kv::durability::sync : kv::durability::none;
  auto r = self.call([&](kv::transaction& t) { return t.commit(d); });
  s.ended = true;  // either way (kv::transaction::commit)
  if (!r) throw raise(r.error());
  return py::int_(*r);
}

// ---- iteration: pages of a scan ----

enum class yield_kind { keys, values, items };

struct scan_iter {
  scan_iter(std::shared_ptr<kv::store> s, std::shared_ptr<txn_state> t, yield_kind k)
      : store(std::move(s)), txn(std::move(t)), kind(k) {}
  std::shared_ptr<kv::store> store;  // a store's newest state, page by page ...
  std::shared_ptr<txn_state> txn;    // ... or a transaction's snapshot
  yield_kind kind;
  std::string cursor = {};
  std::vector<kv::item> page;
  std::size_t at = 0;
  bool done = false;

  py::object next() {
    while (at == page.size()) {
      if (done) throw py::stop_iteration();
      const bool keys_only = kind == yield_kind::keys;
      result<kv::scan_page> r;
      if (txn) {
        if (txn->ended) throw py::value_error("the transaction has ended");
        py::gil_scoped_release release;
        std::lock_guard g(txn->m);
        r = txn->t.scan(cursor, 256, keys_only);
      } else {
        py::gil_scoped_release release;
        r = store->scan(cursor, 256, keys_only);
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

scan_iter txn_iter(py_txn& t, yield_kind k) {
  t.live();
  return scan_iter(nullptr, t.st, k);
}

scan_iter store_iter(py_store& self, yield_kind k) {
  return scan_iter(self.s, nullptr, k);
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

}  // namespace

void register_store(py::module_& m) {
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
           [](py_txn& t, const py::handle& k) { return txn_get(t, k, py::none(), true); })
      .def(
          "get",
          [](py_txn& t, const py::handle& k, const py::object& d) {
            return txn_get(t, k, d, false);
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("__contains__",
           [](py_txn& t, const py::handle& k) {
             return !txn_get(t, k, py::none(), false).is_none();
           })
      .def("view", &txn_view, py::arg("key"),
           "The value of `key` as a read-only memoryview, without a copy. It stays valid "
           "while it lives (a transaction that only read keeps its snapshot for it).")
      .def("__setitem__",
           [](py_txn& t, const py::handle& k, const py::handle& v) { txn_write(t, k, &v); })
      .def("__delitem__",
           [](py_txn& t, const py::handle& k) {
             if (txn_get(t, k, py::none(), false).is_none()) {
               throw key_error(bytes_arg(k).view());
             }
             txn_write(t, k, nullptr);
           })
      .def("keys", [](py_txn& t) { return txn_iter(t, yield_kind::keys); })
      .def("values", [](py_txn& t) { return txn_iter(t, yield_kind::values); })
      .def("items", [](py_txn& t) { return txn_iter(t, yield_kind::items); })
      .def("__iter__", [](py_txn& t) { return txn_iter(t, yield_kind::keys); })
      .def(
          "commit", [](py_txn& t, const py::object& d) { return txn_end(t, true, d); },
          py::arg("durable") = py::none(),
          "Applies every write at once and returns the commit's seq. Raises keel.Conflict "
          "when another commit got in the way (nothing was applied: retry).")
      .def("abort", [](py_txn& t) { txn_end(t, false, py::none()); })
      .def_property_readonly("active", [](py_txn& t) { return !t.st->ended; })
      .def_property_readonly("snapshot", [](py_txn& t) { return t.live().t.snapshot(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](py_txn& t, const py::object& type, const py::args&) {
        if (t.st->ended) return false;
        txn_end(t, type.is_none(), py::none());
        return false;
      });

  py::class_<py_store, std::shared_ptr<py_store>>(
      m, "Store",
      "keel's embedded transactional store, as a mutable mapping of bytes to bytes, shared by "
      "every thread and process that opens it.")
      .def(py::init(&open_store), py::arg("path"))
      .def_property_readonly("path", [](py_store& s) { return s.path; })
      .def_property_readonly("options", [](py_store& s) { return py::dict(s.options); })
      .def_property_readonly("closed", [](py_store& s) { return !s.s; })
      .def("__getitem__",
           [](py_store& s, const py::handle& k) { return store_get(s, k, py::none(), true); })
      .def(
          "get",
          [](py_store& s, const py::handle& k, const py::object& d) {
            return store_get(s, k, d, false);
          },
          py::arg("key"), py::arg("default") = py::none())
      .def("__contains__",
           [](py_store& s, const py::handle& k) {
             return !store_get(s, k, py::none(), false).is_none();
           })
      .def("__setitem__",
           [](py_store& s, const py::handle& k, const py::handle& v) {
             bytes_arg key(k);
             bytes_arg value(v);
             auto r =
                 nogil(s.get(), [&](kv::store& st) { return st.put(key.view(), value.view()); });
             if (!r) throw raise(r.error());
           })
      .def("__delitem__",
           [](py_store& s, const py::handle& k) {
             bytes_arg key(k);
             auto r = nogil(s.get(), [&](kv::store& st) { return st.erase(key.view()); });
             if (r) return;
             if (r.error() == keel::errc::not_found) throw key_error(key.view());
             throw raise(r.error());
           })
      .def("__len__",
           [](py_store& s) {
             auto r = nogil(s.get(), [](kv::store& st) { return st.stats(); });
             if (!r) throw raise(r.error());
             return r->records;
           })
      .def("__iter__",
           [](py_store& s) {
             s.get();
             return store_iter(s, yield_kind::keys);
           })
      .def("keys",
           [](py_store& s) {
             s.get();
             return store_iter(s, yield_kind::keys);
           })
      .def("values",
           [](py_store& s) {
             s.get();
             return store_iter(s, yield_kind::values);
           })
      .def("items",
           [](py_store& s) {
             s.get();
             return store_iter(s, yield_kind::items);
           })
      .def(
          "transaction",
          [](py_store& s, const py::object& durable) {
            auto st = std::make_shared<txn_state>();
            st->store = s.s;
            st->durable = durable.is_none()      ? kv::durability::none
                          : durable.cast<bool>() ? kv::durability::sync
                                                 : kv::durability::none;
            if (durable.is_none() && s.options.contains("durable") &&
                s.options["durable"].cast<bool>()) {
              st->durable = kv::durability::sync;
            }
            auto r = nogil(s.get(), [](kv::store& x) { return x.begin(); });
            if (!r) throw raise(r.error());
            st->t = std::move(*r);
            return py_txn{std::move(st)};
          },
          py::arg("durable") = py::none(),
          "Begins a transaction; use it with `with`: it commits when the block ends, or aborts "
          "when it raises.")
      .def("stats",
           [](py_store& s) {
             auto r = nogil(s.get(), [](kv::store& st) { return st.stats(); });
             if (!r) throw raise(r.error());
             return stats_dict(*r);
           })
      .def(
          "verify",
          [](py_store& s) {
            kv::verify_report rep;
            auto r = nogil(s.get(), [&](kv::store& st) { return st.verify(&rep); });
            if (!r && r.error() != keel::errc::corrupt) throw raise(r.error());
            py::list damaged;
            for (const auto& d : rep.damaged) {
              damaged.append(py::make_tuple(d.file, d.offset, d.what));
            }
            py::dict out;
            out["commits"] = rep.commits;
            out["torn"] = rep.torn;
            out["damaged"] = damaged;
            return out;
          },
          "Checks every checksum: {'commits', 'torn', 'damaged': [(file, offset, what)]}.")
      .def("compact",
           [](py_store& s) {
             auto r = nogil(s.get(), [](kv::store& st) { return st.compact(); });
             if (!r) throw raise(r.error());
             py::dict out;
             out["segments_removed"] = r->segments_removed;
             out["records_moved"] = r->records_moved;
             out["bytes_freed"] = r->bytes_freed;
             return out;
           })
      .def("checkpoint",
           [](py_store& s) {
             auto r = nogil(s.get(), [](kv::store& st) { return st.checkpoint(); });
             if (!r) throw raise(r.error());
           })
      .def(
          "backup",
          [](py_store& s, const std::string& to) {
            auto r = nogil(s.get(), [&](kv::store& st) { return st.backup(to); });
            if (!r) throw raise(r.error());
            py::dict out;
            out["keys"] = r->keys;
            out["bytes"] = r->bytes;
            out["seq"] = r->seq;
            return out;
          },
          py::arg("to"))
      .def("close", [](py_store& s) { s.s.reset(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](py_store& s, const py::args&) { s.s.reset(); });
}

}  // namespace keel::python
