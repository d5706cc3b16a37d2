// The controller: starting (options checked, the engine chosen, the cache started),
// stopping, and what it tells about itself.

#include "keel/aio/controller.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "base/abandon.hpp"
#include "cache.hpp"
#include "completing.hpp"
#include "detail.hpp"

namespace keel::aio {

controller::impl::impl() = default;

controller::impl::~impl() {
  if (!inherited()) return;
  // A forked child's copy (the last file or request of it gone there): its threads are the
  // parent's (joining one would fail) and so is its engine state (a stdio stream would flush
  // the parent's buffer). Left as they are.
  for (auto& w : workers)
    base::abandon(std::move(w));
  base::abandon(std::move(engine));
  base::abandon(std::move(cache));
}

controller::controller(std::shared_ptr<impl> p) noexcept : impl_(std::move(p)) {}

controller::~controller() {
  if (impl_->inherited()) {
    base::abandon(std::move(impl_));  // the parent's (see impl::~impl)
    return;
  }
  stop();
}

result<std::unique_ptr<controller>> controller::start(options opts) noexcept {
  if (opts.workers == 0 || opts.queue_depth == 0 || opts.cache_soft_limit > opts.cache_hard_limit) {
    return errc_error(std::errc::invalid_argument);
  }
  // The registered buffers, in address order (their index in every ring's table).
  std::vector<std::span<std::byte>> buffers = std::move(opts.registered_buffers);
  std::sort(buffers.begin(), buffers.end(),
            [](const auto& a, const auto& b) { return a.data() < b.data(); });
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    const auto& b = buffers[i];
    const bool overlaps = i > 0 && buffers[i - 1].data() + buffers[i - 1].size() > b.data();
    if (b.empty() || b.size() > (std::size_t{1} << 30) || overlaps) {
      return errc_error(std::errc::invalid_argument);
    }
  }
  std::shared_ptr<impl> p;
  try {
    p = std::make_shared<impl>();
  } catch (const std::bad_alloc&) {
    return errc_error(std::errc::not_enough_memory);
  }
  if (opts.fs == nullptr) opts.fs = &io::os();
  p->opts = std::move(opts);
  p->readers_left = std::min(p->opts.reader_descriptions, detail::descriptor_share());
  if (auto s = detail::start_engine(*p, std::move(buffers)); !s) return std::unexpected(s.error());
  if (p->opts.cache_hard_limit != 0) {
    auto cache = detail::write_back_cache::start(*p);
    if (!cache) {
      controller stopping(std::move(p));  // its destructor stops the workers
      return std::unexpected(cache.error());
    }
    p->cache = std::move(*cache);
  }
  return std::unique_ptr<controller>(new controller(std::move(p)));
}

void controller::stop() noexcept {
  impl& c = *impl_;
  if (c.inherited()) return;  // the parent's to stop
  if (const detail::worker* w = detail::worker::of_this_thread();
      w != nullptr && &w->owner() == &c.context) {
    // A completion or task on one of its own workers: stopping joins that very thread.
    std::fputs(
        "keel::aio: a controller was stopped or destroyed from a completion or task on "
        "one of its own threads, which stopping must join; aborting\n",
        stderr);
    std::abort();
  }
  // From a completion on another thread: the requests completing here are not waited for.
  if (detail::completing_here != nullptr) detail::let_go_of_completions(&c);
  const base::lock_guard lock(c.stop_mutex);
  if (c.stopped) return;
  c.stopping.store(true);
  for (auto& w : c.workers)
    w->wake();
  // Every request still queued or held back is cancelled by the workers; running ones end.
  // A completion on this controller may wait for a request that only this thread runs (this
  // is another controller's worker, or took that request from an inbox): help meanwhile.
  c.outstanding.wait_for_zero([&] { return detail::worker::help_waiting(&c.context); },
                              detail::worker::longest_sleep());
  for (auto& w : c.workers) {
    w->wake();
    w->join();
  }
  // Cached writes finished: their bytes go to the files now (an error waits for close).
  if (c.cache) c.cache->stop();
  c.stopped = true;
}

engine_kind controller::engine() const noexcept {
  return impl_->kind();
}
const std::string& controller::fallback_reason() const noexcept {
  return impl_->fallback_reason;
}
unsigned controller::workers() const noexcept {
  return static_cast<unsigned>(impl_->workers.size());
}

cache_stats controller::cache() const noexcept {
  return impl_->cache ? impl_->cache->stats() : cache_stats{};
}

engine_stats controller::engine_counts() const noexcept {
  engine_stats s;
  for (const auto& w : impl_->workers)
    w->add_counts(s);
  if (impl_->engine) impl_->engine->add_counts(s);
  return s;
}

// How the controller hands requests to its workers.
bool controller::impl::help() noexcept {
  for (auto& w : workers) {
    if (w->help()) return true;
  }
  return false;
}

void controller::impl::dispatch(detail::op* o, unsigned& next_worker) noexcept {
  detail::worker& w = *workers[next_worker++ % workers.size()];
  o->next = nullptr;
  w.push(o, o);
}

}  // namespace keel::aio
