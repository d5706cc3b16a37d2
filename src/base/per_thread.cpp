#include "per_thread.hpp"

#include <pthread.h>

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

// Registered while the program starts, before any thread can fork: every later fork counts.
const bool fork_handler_registered = [] {
  ::pthread_atfork(nullptr, nullptr,
                   [] { detail::fork_count.fetch_add(1, std::memory_order_relaxed); });
  return true;
}();

}  // namespace

std::atomic<std::uint64_t> detail::fork_count{0};

per_thread_states::per_thread_states(bool keep_after_exit)
    : id_(next_instance_id.fetch_add(1)), registry_(std::make_shared<thread_state_registry>()) {
  registry_->keep_after_exit = keep_after_exit;
}

per_thread_states::~per_thread_states() {
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
