// The workers of the engines that run one request at a time per thread: a thread that takes
// its inbox and runs each request through the engine, and lets a waiting thread do the same
// (help) rather than hand the request over.

#include "sync_engine.hpp"

#include <new>
#include <system_error>

#include "caller_clock.hpp"
#include "detail.hpp"

namespace keel::aio::detail {
namespace {

class sync_worker final : public worker {
 public:
  sync_worker(controller::impl& c, sync_engine& e) : worker(c), engine_(e) {}
  ~sync_worker() override { join(); }

  void wake() noexcept override {
    signal_.fetch_add(1);
    base::futex_wake(signal_, 1);
  }

  bool help() noexcept override {
    op* list = take_all();
    bool ran = false;
    while (list != nullptr) {
      op* o = list;
      list = o->next;
      if (o->kind == op_kind::task) {
        push(o, o);  // tasks run on the controller's threads only
      } else {
        execute(*o);
        ran = true;
      }
    }
    return ran;
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
      while (list != nullptr) {
        op* o = list;
        list = o->next;
        execute(*o);
      }
    }
  }

  void execute(op& o) noexcept {
    if (auto early = ctl_.before_engine(o)) {
      ctl_.finish(&o, std::move(early->outcome), early->cancelled);
      return;
    }
    ctl_.finish(&o, engine_.run(o));
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
  controller::impl& c = *o.file->owner;
  switch (c.opts.submit_on) {
    case submitter::workers:
      return 0;
    case submitter::adaptive: {
      if (!waiting_bound(c.timed_callers)) return 0;
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

std::unique_ptr<worker> sync_engine::make_worker(controller::impl& c, unsigned index) noexcept {
  (void)index;
  return std::unique_ptr<worker>(new (std::nothrow) sync_worker(c, *this));
}

}  // namespace keel::aio::detail
