#include "per_thread.hpp"

#include <algorithm>
#include <atomic>

namespace keel::base {
namespace {

std::atomic<std::uint64_t> next_instance_id{1};

struct cache_entry {
  std::uint64_t id;
  std::weak_ptr<thread_state_registry> registry;
  thread_state* state;
};

// The last state found: a lock and its unlock (and a loop of them) look up the same one.
// Instance ids are never reused, so a stale entry can only miss.
struct last_found {
  std::uint64_t id = 0;
  std::uint64_t generation = 0;
  thread_state* state = nullptr;
};
thread_local last_found last;

struct thread_cache {
  std::vector<cache_entry> entries;
  std::uint64_t generation = 0;

  ~thread_cache() {
    last = {};
    // A forked child's copy of a thread that never looked since: the entries are the
    // parent's (their registries' locks may be held by the parent's threads, which do not
    // exist here). The registries free their states in time.
    if (generation != fork_generation()) return;
    for (auto& e : entries) {
      if (auto r = e.registry.lock()) {
        const base::lock_guard lock(r->mutex);
        if (r->dead || r->keep_after_exit) continue;
        auto it = std::find(r->live.begin(), r->live.end(), e.state);
        if (it != r->live.end()) {
          r->live.erase(it);
          delete e.state;
        }
      }
    }
  }
};

thread_local thread_cache cache;

// Every registry of a live instance: one owner, this file. Each is locked across fork(2), so
// that the child finds every state whole and can have each close what it holds of the
// parent's (a registry's lock is only ever taken after this one's, never the other way).
class all_registries {
 public:
  static all_registries& get() noexcept {
    static all_registries* const it = new all_registries;  // never destroyed: forks may come
    return *it;                                            // while statics go
  }
  void add(thread_state_registry* r) noexcept {
    const base::lock_guard g(m_);
    try {
      all_.push_back(r);
    } catch (...) {  // no room to note it: its states keep their descriptors in a child
    }
  }
  void remove(thread_state_registry* r) noexcept {
    const base::lock_guard g(m_);
    std::erase(all_, r);
  }

  // The fork hooks (base/fork.hpp), called with the gate held.
  static void before_fork() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    auto& self = get();
    self.m_.lock();
    for (auto* r : self.all_)
      r->mutex.lock();
  }
  static void after_fork_in_parent() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    auto& self = get();
    for (auto* r : self.all_)
      r->mutex.unlock();
    self.m_.unlock();
  }
  static void after_fork_in_child() KEEL_NO_THREAD_SAFETY_ANALYSIS {
    auto& self = get();
    for (auto* r : self.all_) {
      for (thread_state* s : r->live)
        s->close_in_child();
      r->mutex.unlock();
    }
    self.m_.unlock();
  }

 private:
  base::mutex m_;
  std::vector<thread_state_registry*> all_ KEEL_GUARDED_BY(m_);
};

// Set while the program starts, before any thread can fork.
const bool fork_hooks_set = [] {
  (void)all_registries::get();
  set_thread_state_fork_hooks({&all_registries::before_fork, &all_registries::after_fork_in_parent,
                               &all_registries::after_fork_in_child});
  return true;
}();

}  // namespace

per_thread_states::per_thread_states(bool keep_after_exit)
    : id_(next_instance_id.fetch_add(1)), registry_(std::make_shared<thread_state_registry>()) {
  registry_->keep_after_exit = keep_after_exit;
  all_registries::get().add(registry_.get());
}

per_thread_states::~per_thread_states() {
  all_registries::get().remove(registry_.get());
  const base::lock_guard lock(registry_->mutex);
  registry_->dead = true;
  for (thread_state* s : registry_->live)
    delete s;
  registry_->live.clear();
}

thread_state* per_thread_states::find() noexcept {
  const std::uint64_t gen = fork_generation();
  if (last.id == id_ && last.generation == gen) return last.state;
  if (cache.generation != gen) {
    // A forked child: what the cache holds is the parent's (its descriptors share the
    // parent's locks). The registry still owns those states and frees them in time.
    cache.entries.clear();
    cache.generation = gen;
  }
  for (const auto& e : cache.entries) {
    if (e.id == id_) {
      last = {id_, gen, e.state};
      return e.state;
    }
  }
  return nullptr;
}

void per_thread_states::add(thread_state* s) noexcept {
  {
    const base::lock_guard lock(registry_->mutex);
    registry_->live.push_back(s);
  }
  // Entries of instances gone since are dropped here, so that a thread that uses many
  // short-lived instances (aio's files) neither grows its cache nor scans the dead.
  std::erase_if(cache.entries, [](const cache_entry& e) { return e.registry.expired(); });
  cache.entries.push_back({id_, registry_, s});
}

}  // namespace keel::base
