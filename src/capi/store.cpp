// The C API's store (include/keel/keel.h): keel::kv behind opaque handles. Each handle owns
// what it wraps: a keel_store its kv::store, a keel_txn its transaction, a keel_cursor the
// page of a scan it hands items out of.

#include <cerrno>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "capi/errors.hpp"
#include "keel/keel.h"
#include "keel/kv/store.hpp"

struct keel_store {
  std::unique_ptr<keel::kv::store> s;
};

struct keel_txn {
  keel::kv::transaction t;
  // Its cursors, told when it ends (this owns the list; a cursor takes itself off when it
  // closes). One thread uses a transaction and its cursors.
  std::vector<keel_cursor*> cursors;
  ~keel_txn();
};

struct keel_cursor {
  keel_store* store = nullptr;  // one of these two
  keel_txn* txn = nullptr;
  bool ended = false;  // its transaction ended first: every next call fails
  bool keys_only = false;
  std::string next;  // where the next page starts
  bool done = false;
  keel::kv::scan_page page;
  std::size_t at = 0;  // the next item of `page`
};

keel_txn::~keel_txn() {
  for (keel_cursor* c : cursors) {
    c->txn = nullptr;
    c->ended = true;
  }
}

namespace {

using keel::capi::code_of;
using keel::capi::fail;
using keel::capi::guarded;

// Items per page a cursor reads ahead.
constexpr std::size_t cursor_page = 256;

std::string_view bytes(const void* p, std::size_t n) {
  return {static_cast<const char*>(p), p == nullptr ? 0 : n};
}

// A length with no bytes behind it (a caller's slip, refused rather than read as empty).
bool missing(const void* p, std::size_t n) {
  return p == nullptr && n != 0;
}

int invalid() {
  return fail(std::make_error_code(std::errc::invalid_argument));
}

keel::kv::options options_of(const keel_store_options& c) {
  keel::kv::options o;
  o.create_if_missing = c.create_if_missing != 0;
  o.error_if_exists = c.error_if_exists != 0;
  o.read_only = c.read_only != 0;
  o.durable =
      c.durable == KEEL_DURABLE_SYNC ? keel::kv::durability::sync : keel::kv::durability::none;
  o.verify_checksums = c.verify_checksums != 0;
  o.every_user_on_this_host = c.every_user_on_this_host != 0;
  o.segment_size = c.segment_size;
  o.max_bytes = c.max_bytes;
  o.checkpoint_bytes = c.checkpoint_bytes;
  o.lock_timeout = std::chrono::milliseconds(c.lock_timeout_ms);
  o.compact_dead_fraction = c.compact_dead_fraction;
  return o;
}

// keel_get's and keel_txn_get's: copies the value of `key` in `t` into the caller's buffer
// (as much as fits) and says its whole length.
int copy_out(keel::kv::transaction& t, const void* key, std::size_t key_length, void* buffer,
             std::size_t capacity, std::size_t* length) {
  if (length == nullptr || missing(key, key_length)) return invalid();
  auto v = t.get_view(bytes(key, key_length));
  if (!v) return fail(v.error());
  if (buffer != nullptr && capacity != 0) {
    std::memcpy(buffer, v->data(), std::min(capacity, v->size()));
  }
  *length = v->size();
  return 0;
}

// A cursor over the store `s`, or over the snapshot of `t`.
int open_cursor(keel_store* s, keel_txn* t, int keys_only, keel_cursor** out) {
  if ((s == nullptr && t == nullptr) || out == nullptr) return invalid();
  auto c = std::make_unique<keel_cursor>();
  c->store = s;
  c->txn = t;
  c->keys_only = keys_only != 0;
  if (t != nullptr) t->cursors.push_back(c.get());  // (bad_alloc: guarded's ENOMEM)
  *out = c.release();
  return 0;
}

}  // namespace

extern "C" {

void keel_store_options_init(keel_store_options* c) {
  if (c == nullptr) return;
  const keel::kv::options o;
  *c = {};
  c->version = KEEL_STORE_OPTIONS_VERSION;
  c->create_if_missing = o.create_if_missing ? 1 : 0;
  c->error_if_exists = o.error_if_exists ? 1 : 0;
  c->read_only = o.read_only ? 1 : 0;
  c->durable = o.durable == keel::kv::durability::sync ? KEEL_DURABLE_SYNC : KEEL_DURABLE_NONE;
  c->verify_checksums = o.verify_checksums ? 1 : 0;
  c->every_user_on_this_host = o.every_user_on_this_host ? 1 : 0;
  c->segment_size = o.segment_size;
  c->max_bytes = o.max_bytes;
  c->checkpoint_bytes = o.checkpoint_bytes;
  c->lock_timeout_ms = static_cast<uint32_t>(o.lock_timeout.count());
  c->compact_dead_fraction = o.compact_dead_fraction;
}

int keel_store_open(const char* path, const keel_store_options* c, keel_store** out) {
  return guarded([&] {
    if (path == nullptr || out == nullptr) return invalid();
    keel_store_options defaults;
    keel_store_options_init(&defaults);
    if (c == nullptr) c = &defaults;
    if (c->version < 1 || c->version > KEEL_STORE_OPTIONS_VERSION ||
        (c->durable != KEEL_DURABLE_DEFAULT && c->durable != KEEL_DURABLE_NONE &&
         c->durable != KEEL_DURABLE_SYNC)) {
      return invalid();
    }
    auto s = keel::kv::store::open(path, options_of(*c));
    if (!s) return fail(s.error());
    *out = new keel_store{std::move(*s)};
    return 0;
  });
}

void keel_store_close(keel_store* s) {
  delete s;
}

int keel_get(keel_store* s, const void* key, size_t key_length, void* buffer, size_t capacity,
             size_t* length) {
  return guarded([&] {
    if (s == nullptr) return invalid();
    auto t = s->s->begin();
    if (!t) return fail(t.error());
    return copy_out(*t, key, key_length, buffer, capacity, length);
  });
}

int keel_put(keel_store* s, const void* key, size_t key_length, const void* value,
             size_t value_length) {
  return guarded([&] {
    if (s == nullptr || missing(key, key_length) || missing(value, value_length)) {
      return invalid();
    }
    return code_of(s->s->put(bytes(key, key_length), bytes(value, value_length)));
  });
}

int keel_erase(keel_store* s, const void* key, size_t key_length) {
  return guarded([&] {
    if (s == nullptr || missing(key, key_length)) return invalid();
    return code_of(s->s->erase(bytes(key, key_length)));
  });
}

int keel_txn_begin(keel_store* s, keel_txn** out) {
  return guarded([&] {
    if (s == nullptr || out == nullptr) return invalid();
    auto t = s->s->begin();
    if (!t) return fail(t.error());
    *out = new keel_txn{std::move(*t), {}};
    return 0;
  });
}

int keel_txn_get(keel_txn* t, const void* key, size_t key_length, void* buffer, size_t capacity,
                 size_t* length) {
  return guarded([&] {
    if (t == nullptr) return invalid();
    return copy_out(t->t, key, key_length, buffer, capacity, length);
  });
}

int keel_txn_get_view(keel_txn* t, const void* key, size_t key_length, const void** value,
                      size_t* length) {
  return guarded([&] {
    if (t == nullptr || value == nullptr || length == nullptr || missing(key, key_length)) {
      return invalid();
    }
    auto v = t->t.get_view(bytes(key, key_length));
    if (!v) return fail(v.error());
    *value = v->data();
    *length = v->size();
    return 0;
  });
}

int keel_txn_put(keel_txn* t, const void* key, size_t key_length, const void* value,
                 size_t value_length) {
  return guarded([&] {
    if (t == nullptr || missing(key, key_length) || missing(value, value_length)) {
      return invalid();
    }
    return code_of(t->t.put(bytes(key, key_length), bytes(value, value_length)));
  });
}

int keel_txn_erase(keel_txn* t, const void* key, size_t key_length) {
  return guarded([&] {
    if (t == nullptr || missing(key, key_length)) return invalid();
    return code_of(t->t.erase(bytes(key, key_length)));
  });
}

int keel_txn_commit(keel_txn* t, int durability, uint64_t* seq) {
  const std::unique_ptr<keel_txn> owned(t);  // ended either way
  return guarded([&] {
    if (t == nullptr) return invalid();
    keel::result<std::uint64_t> r = keel::errc_error(std::errc::invalid_argument);
    switch (durability) {
      case KEEL_DURABLE_DEFAULT:
        r = t->t.commit();
        break;
      case KEEL_DURABLE_NONE:
        r = t->t.commit(keel::kv::durability::none);
        break;
      case KEEL_DURABLE_SYNC:
        r = t->t.commit(keel::kv::durability::sync);
        break;
      default:
        t->t.abort();
        return invalid();
    }
    if (!r) return fail(r.error());
    if (seq != nullptr) *seq = *r;
    return 0;
  });
}

void keel_txn_abort(keel_txn* t) {
  delete t;
}

int keel_cursor_open(keel_store* s, int keys_only, keel_cursor** out) {
  return guarded([&] { return open_cursor(s, nullptr, keys_only, out); });
}

int keel_cursor_open_txn(keel_txn* t, int keys_only, keel_cursor** out) {
  return guarded([&] { return open_cursor(nullptr, t, keys_only, out); });
}

int keel_cursor_next(keel_cursor* c, const void** key, size_t* key_length, const void** value,
                     size_t* value_length) {
  return guarded([&] {
    if (c == nullptr || key == nullptr || key_length == nullptr) return invalid();
    if (c->ended) {
      // Its snapshot went with the transaction: never another's data, nor a freed one's.
      return fail(keel::error(std::make_error_code(std::errc::invalid_argument))
                      .about("keel_cursor_next: the cursor's transaction has ended"));
    }
    while (c->at == c->page.items.size()) {
      if (c->done) return fail(keel::make_error_code(keel::errc::not_found));
      auto p = c->txn != nullptr ? c->txn->t.scan(c->next, cursor_page, c->keys_only)
                                 : c->store->s->scan(c->next, cursor_page, c->keys_only);
      if (!p) return fail(p.error());
      c->page = std::move(*p);
      c->at = 0;
      c->next = c->page.cursor;
      c->done = c->page.done;
    }
    const auto& item = c->page.items[c->at++];
    *key = item.key.data();
    *key_length = item.key.size();
    if (value != nullptr) *value = item.value.data();
    if (value_length != nullptr) *value_length = item.value.size();
    return 0;
  });
}

void keel_cursor_close(keel_cursor* c) {
  if (c != nullptr && c->txn != nullptr) std::erase(c->txn->cursors, c);
  delete c;
}

int keel_store_stats(keel_store* s, keel_store_stat* out, size_t size) {
  return guarded([&] {
    if (s == nullptr || out == nullptr) return invalid();
    auto st = s->s->stats();
    if (!st) return fail(st.error());
    keel_store_stat all{};
    all.records = st->records;
    all.live_bytes = st->live_bytes;
    all.dead_bytes = st->dead_bytes;
    all.segments = st->segments;
    all.segment_bytes = st->segment_bytes;
    all.index_bytes = st->index_bytes;
    all.visible_seq = st->visible_seq;
    all.compactions = st->compactions;
    all.users = st->users.size();
    // A caller built against an older header passes a smaller struct: its fields only; one
    // built against a newer header, a larger one: the fields this library does not know are 0.
    std::memcpy(out, &all, std::min(size, sizeof all));
    if (size > sizeof all)
      std::memset(reinterpret_cast<char*>(out) + sizeof all, 0, size - sizeof all);
    return 0;
  });
}

int keel_store_verify(keel_store* s, uint64_t* commits, uint64_t* damaged) {
  return guarded([&] {
    if (s == nullptr) return invalid();
    keel::kv::verify_report report;
    auto r = s->s->verify(&report);
    if (damaged != nullptr) *damaged = report.damaged.size();
    if (commits != nullptr) *commits = report.commits;
    return code_of(r);
  });
}

int keel_store_compact(keel_store* s, uint64_t* segments_removed) {
  return guarded([&] {
    if (s == nullptr) return invalid();
    auto r = s->s->compact();
    if (!r) return fail(r.error());
    if (segments_removed != nullptr) *segments_removed = r->segments_removed;
    return 0;
  });
}

int keel_store_checkpoint(keel_store* s) {
  return guarded([&] {
    if (s == nullptr) return invalid();
    return code_of(s->s->checkpoint());
  });
}

int keel_store_backup(keel_store* s, const char* to, uint64_t* keys) {
  return guarded([&] {
    if (s == nullptr || to == nullptr) return invalid();
    auto r = s->s->backup(to);
    if (!r) return fail(r.error());
    if (keys != nullptr) *keys = r->keys;
    return 0;
  });
}

}  // extern "C"
