// The workers of the engines that run one request at a time per thread: a thread that takes
// its inbox and runs each request through the engine, and lets a waiting thread do the same
// (help) rather than hand the request over.

#include "sync_engine.hpp"

#include <new>
#include <system_error>

#include "caller_clock.hpp"
#include "file_state.hpp"
#include "worker.hpp"

namespace keel::aio::detail {
namespace {

class sync_worker;

// What a thread took from workers' inboxes and has not run yet, innermost first (a wait
// inside a completion may take more). Completions may wait for other requests: one taken
// with the completion's own must not be left waiting on this very thread (help).
struct taken {
  sync_worker* from;
  op* rest;
  bool runs_tasks;
  taken* outer;
};
thread_local taken* taken_here = nullptr;

class sync_worker final : public worker {
 public:
  sync_worker(engine_context& c, sync_engine& e) : worker(c), engine_(e) {}
  ~sync_worker() override { join(); }

  void wake() noexcept override {
    signal_.fetch_add(1);
    base::futex_wake(signal_, 1);
  }

  bool help() noexcept override {
    // First what this thread took from an inbox and has yet to run: a completion it ran
    // from there waits, maybe for one of them, and no other thread will run them.
    for (taken* t = taken_here; t != nullptr; t = t->outer) {
      while (t->rest != nullptr) {
        op* o = t->rest;
        t->rest = o->next;
        if (t->from->run_one(*o, t->runs_tasks)) return true;
      }
    }
    // Tasks run on the controller's threads only: on one of its workers, here too.
    op* list = take_all();
    const worker* here = of_this_thread();
    return list != nullptr && run_list(list, here != nullptr && &here->owner() == &ctx_);
  }

  result<void> start() noexcept override {
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      return std::unexpected(e.code());
    }
    return {};
  }

 private:
  void run() noexcept {
    this_thread_is_mine();
    for (;;) {
      op* list = take_all();
      if (list == nullptr) {
        if (may_exit()) return;
        if (spin_for_work() && !inbox_empty()) continue;
        const std::uint32_t seen = signal_.load();
        sleeping_.store(true);
        if (inbox_empty() && !may_exit()) {
          base::futex_wait(signal_, seen, nullptr);
        }
        sleeping_.store(false);
        continue;
      }
      (void)run_list(list, true);
    }
  }

  // Runs `list` on this thread, oldest first, where a wait inside a completion finds what
  // is left of it (help). Tasks run on the controller's threads only: elsewhere
  // (`runs_tasks` false) they go back to the inbox. Whether it ran a request.
  bool run_list(op* list, bool runs_tasks) noexcept {
    taken level{this, list, runs_tasks, taken_here};
    taken_here = &level;
    bool ran = false;
    while (level.rest != nullptr) {
      op* o = level.rest;
      level.rest = o->next;
      ran |= run_one(*o, runs_tasks);
    }
    taken_here = level.outer;
    return ran;
  }

  bool run_one(op& o, bool runs_tasks) noexcept {
    if (o.kind == op_kind::task && !runs_tasks) {
      push(&o, &o);
      return false;
    }
    execute(o);
    return true;
  }

  void execute(op& o) noexcept {
    if (auto early = ctx_.before_engine(o)) {
      ctx_.finish(&o, std::move(early->outcome), early->cancelled);
      return;
    }
    ctx_.finish(&o, engine_.run(o));
  }

  sync_engine& engine_;
  std::atomic<std::uint32_t> signal_{0};  // futex word: bumped by wake()
};

}  // namespace

std::size_t sync_engine::submit_here(std::span<op* const> ops) noexcept {
  // A batch runs in parallel; tasks run on the controller's threads; some requests must
  // meet the cache in a worker. Nor from a completion on this thread (a chain of them would
  // recurse).
  if (ops.size() != 1 || ops[0]->kind == op_kind::task || for_the_cache(*ops[0]) ||
      completions_running != 0) {
    return 0;
  }
  op& o = *ops[0];
  engine_context& c = context();
  switch (c.opts().submit_on) {
    case submitter::workers:
      return 0;
    case submitter::adaptive: {
      if (!waiting_bound(c.timed_callers())) return 0;
      const base::lock_guard lock(o.owner->mutex);
      if (o.owner->unfinished.size() != 1) return 0;
      break;
    }
    case submitter::caller:
      break;
  }
  const running_completions completing;
  if (auto early = c.before_engine(o)) {
    c.finish(&o, std::move(early->outcome), early->cancelled);
  } else {
    c.finish(&o, run_here(o));
  }
  return 1;
}

std::unique_ptr<worker> sync_engine::make_worker(unsigned index) noexcept {
  (void)index;
  return std::unique_ptr<worker>(new (std::nothrow) sync_worker(context(), *this));
}

}  // namespace keel::aio::detail
