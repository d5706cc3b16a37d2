#pragma once
// Runs N forked worker processes for a fixed time and collects what they counted: the engine
// of keel-bench lockscale and keel-bench lockmatrix.
//
// Workers share an anonymous shared-memory block with the parent: a start barrier, a stop
// flag, one counter per worker, and a count of the holders currently inside the critical
// section, which every worker checks at each acquisition (exclusion verified, not assumed).
// At the end the parent snapshots the counters, lets the workers finish their round and exit
// (killing one inside a lock request can wedge a network filesystem), SIGKILLs those still
// running after 10 s (asleep in a lock nobody lets go), and reaps them for their CPU time.

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace keel::tools {

struct shared_control {
  std::atomic<std::uint32_t> ready{0};
  std::atomic<std::uint32_t> stop{0};
  std::atomic<std::int64_t> failures{0};    // workers that hit an error
  std::atomic<std::int64_t> violations{0};  // exclusion seen broken
  char first_error[256] = {};
  std::atomic<std::uint32_t> error_claimed{0};
  std::atomic<std::int64_t> start_user_us{0};  // CPU the workers had used when the run began
  std::atomic<std::int64_t> start_system_us{0};
  // Followed by one std::atomic<std::uint64_t> counter per worker, then one
  // std::atomic<std::int64_t> holder count per "group" (entities locked together).
};

class worker_context {
 public:
  worker_context(shared_control* c, std::size_t index, std::atomic<std::uint64_t>* counter,
                 std::atomic<std::int64_t>* holders)
      : control_(c), index_(index), counter_(counter), holders_(holders) {}
  [[nodiscard]] std::size_t index() const { return index_; }
  [[nodiscard]] bool stopping() const {
    return control_->stop.load(std::memory_order_relaxed) != 0;
  }
  //! Call right after acquiring: checks nobody else is inside (exclusive) and counts in.
  void enter(bool exclusive) {
    const auto before = holders_->fetch_add(exclusive ? 1'000'000 : 1);
    if (exclusive ? before != 0 : before >= 1'000'000) control_->violations.fetch_add(1);
  }
  //! Call right before releasing.
  void leave(bool exclusive) { holders_->fetch_sub(exclusive ? 1'000'000 : 1); }
  void count() { counter_->fetch_add(1, std::memory_order_relaxed); }
  //! Records a failure (the first message is kept) and makes the run fail.
  void fail(const std::string& message);

 private:
  shared_control* control_;
  std::size_t index_;
  std::atomic<std::uint64_t>* counter_;
  std::atomic<std::int64_t>* holders_;
};

struct run_result {
  std::size_t workers = 0;
  double seconds = 0;   // measured, start to stop
  double user_cpu = 0;  // all workers, seconds, from start to the end of the run
  double system_cpu = 0;
  std::vector<std::uint64_t> counts;
  std::int64_t violations = 0;
  std::int64_t failures = 0;
  std::string first_error;

  [[nodiscard]] std::uint64_t total() const;
  [[nodiscard]] std::uint64_t min() const;
  [[nodiscard]] std::uint64_t max() const;
  [[nodiscard]] double mean() const;
  [[nodiscard]] double stddev() const;
};

struct run_options {
  std::size_t workers = 1;
  std::chrono::duration<double> duration{1.0};
  //! Which holder counter worker i uses (workers locking the same entities share one).
  std::function<std::size_t(std::size_t)> group_of = [](std::size_t) { return 0; };
  std::size_t groups = 1;
  //! Runs in each worker before the start (opening what it works on): not timed.
  std::function<void(worker_context&)> setup;
  //! Called on stderr-bound progress lines ("" when none wanted).
  std::function<void(const std::string&)> progress;
};

//! Forks `workers` processes running `body(ctx)` until stopped; returns what they did.
//! `body` runs in the child and returns when ctx.stopping() (or is killed).
run_result run_workers(const run_options& options,
                       const std::function<void(worker_context&)>& body);

//! What a child run by run_in_child did: its output, or why there is none.
struct child_outcome {
  bool ok = false;
  std::string output;  // what `body` returned
  std::string error;   // when not ok: how the child failed or died
};

//! Runs `body` in one forked process and returns the string it returned, passed back through
//! `result_file` (made, then removed). A body that throws fails with the exception's message;
//! a child that dies fails with its signal or status. Isolates a run from the next: its
//! memory (peak RSS), its crashes and what it leaves open.
child_outcome run_in_child(const std::function<std::string()>& body,
                           const std::string& result_file);

}  // namespace keel::tools
