// The C API's filesystem mutexes (include/keel/keel.h): keel::lock behind opaque handles. A
// keel_mutex owns its shared_fs_mutex, a keel_guard the entities one lock call holds.

#include <algorithm>
#include <chrono>
#include <memory>
#include <span>
#include <vector>

#include "capi/errors.hpp"
#include "keel/keel.h"
#include "keel/lock/algorithms.hpp"

struct keel_mutex {
  std::unique_ptr<keel::lock::shared_fs_mutex> m;
};

struct keel_guard {
  keel::lock::entities_guard g;
};

namespace {

using keel::capi::code_of;
using keel::capi::fail;
using keel::capi::guarded;

int invalid() {
  return fail(std::make_error_code(std::errc::invalid_argument));
}

}  // namespace

extern "C" {

uint64_t keel_entity_of(const void* name, size_t length) {
  if (name == nullptr) length = 0;
  return keel::lock::entity::from_bytes({static_cast<const std::byte*>(name), length}).value;
}

const char* keel_mutex_algorithm(size_t index) {
  const auto names = keel::lock::algorithm_names();
  // The names are string literals (algorithms.cpp): NUL-terminated, static.
  return index < names.size() ? names[index].data() : nullptr;
}

int keel_mutex_open(const char* algorithm, const char* path, keel_mutex** out) {
  return guarded([&] {
    if (algorithm == nullptr || path == nullptr || out == nullptr) return invalid();
    auto m = keel::lock::open_mutex(algorithm, path);
    if (!m) return fail(m.error());
    *out = new keel_mutex{std::move(*m)};
    return 0;
  });
}

void keel_mutex_close(keel_mutex* m) {
  delete m;
}

int keel_mutex_remove_resources(const char* algorithm, const char* path) {
  return guarded([&] {
    if (algorithm == nullptr || path == nullptr) return invalid();
    // An unknown name is refused as keel_mutex_open refuses it (the C++ call does nothing).
    const auto names = keel::lock::algorithm_names();
    if (std::ranges::find(names, std::string_view(algorithm)) == names.end()) return invalid();
    return code_of(keel::lock::remove_mutex_resources(algorithm, path));
  });
}

int keel_mutex_lock(keel_mutex* m, const keel_entity* set, size_t count, int64_t timeout_ms,
                    keel_guard** out) {
  return guarded([&] {
    if (m == nullptr || out == nullptr || (set == nullptr && count != 0)) return invalid();
    std::vector<keel::lock::entity> entities;
    entities.reserve(count);
    for (const keel_entity& e : std::span(set, count)) {
      // Above the largest lockable value, refused by lock (not folded into range here).
      if (e.value > keel::lock::entity::max_value) return invalid();
      entities.emplace_back(e.value, e.exclusive != 0);
    }
    const keel::io::deadline d = timeout_ms < 0 ? keel::io::deadline::never()
                                 : timeout_ms == 0
                                     ? keel::io::deadline::zero()
                                     : keel::io::deadline(std::chrono::milliseconds(timeout_ms));
    auto g = m->m->lock(entities, d);
    if (!g) return fail(g.error());
    *out = new keel_guard{std::move(*g)};
    return 0;
  });
}

int keel_guard_unlock(keel_guard* g) {
  const std::unique_ptr<keel_guard> owned(g);
  if (g == nullptr) return 0;
  return guarded([&] { return code_of(g->g.unlock()); });
}

}  // extern "C"
