// base/fork.hpp's gate: a fork waits for the makers of lock descriptors, never for itself,
// and a child finds the gate open.
#include "base/fork.hpp"

#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <optional>
#include <thread>

#include "support/process.hpp"

namespace {

using keel::base::making_descriptors;

// An atfork child handler registered before keel's (which registers while the program's
// statics are made): in a child it runs before keel's has opened the gate again.
std::atomic<bool> make_in_early_child_handler{false};
void early_child_handler() {
  if (make_in_early_child_handler.load()) const making_descriptors m;
}
__attribute__((constructor(101))) void register_early_child_handler() {
  ::pthread_atfork(nullptr, nullptr, &early_child_handler);
}

TEST(ForkGate, AForkUnderAMakerGoesOnAndItsChildMakesMore) {
  const std::uint64_t before = keel::base::fork_generation();
  std::optional<making_descriptors> outer(std::in_place);
  const pid_t child = keel::test::fork_child([before] {
    if (keel::base::fork_generation() != before + 1) return 1;
    { const making_descriptors nested; }
    return 0;
  });
  outer.reset();
  const making_descriptors after;  // (the parent's gate is open again)
  EXPECT_EQ(keel::test::wait_exit(child), 0);
  EXPECT_EQ(keel::base::fork_generation(), before);
}

TEST(ForkGate, AChildFindsTheGateOpenAfterItsParentsHoldEnded) {
  const pid_t child = keel::test::fork_child([] {
    const making_descriptors one;
    const pid_t grandchild = keel::test::fork_child([] {
      const making_descriptors two;
      return 0;
    });
    return keel::test::wait_exit(grandchild);
  });
  EXPECT_EQ(keel::test::wait_exit(child), 0);
}

TEST(ForkGate, AForkWaitsForAnotherThreadsMaker) {
  // The maker notes what it made only after the forker is on its way to fork(): a fork that
  // did not wait would copy the memory before the note (the maker yields long first).
  std::atomic<int> stage{0};
  std::atomic<int> made{0};
  std::thread maker([&] {
    const making_descriptors m;
    stage.store(1);
    while (stage.load() != 2)
      std::this_thread::yield();
    for (int i = 0; i < 2000; ++i)
      ::sched_yield();
    made.store(1);
  });
  while (stage.load() != 1)
    std::this_thread::yield();
  stage.store(2);
  const pid_t child = keel::test::fork_child([&made] { return made.load() == 1 ? 0 : 1; });
  EXPECT_EQ(keel::test::wait_exit(child), 0) << "the fork did not wait for the maker";
  maker.join();
}

TEST(ForkGate, AForkUnderAMakerAndAnotherThreadsForkBothEnd) {
  // Each fork waited on the other: one for the maker to leave, the maker's for its turn.
  for (int round = 0; round < 50; ++round) {
    std::atomic<int> ready{0};
    pid_t under = -1;
    std::thread maker([&] {
      const making_descriptors m;
      ready.fetch_add(1);
      while (ready.load() < 2)
        std::this_thread::yield();
      under = keel::test::fork_child([] { return 0; });
    });
    ready.fetch_add(1);
    while (ready.load() < 2)
      std::this_thread::yield();
    const pid_t other = keel::test::fork_child([] { return 0; });
    maker.join();
    EXPECT_EQ(keel::test::wait_exit(under), 0);
    EXPECT_EQ(keel::test::wait_exit(other), 0);
  }
}

TEST(ForkGate, AChildHandlerBeforeKeelsMayMakeADescriptor) {
  make_in_early_child_handler.store(true);
  const pid_t child = keel::test::fork_child([] {
    const making_descriptors m;
    return 0;
  });
  make_in_early_child_handler.store(false);
  EXPECT_EQ(keel::test::wait_exit(child), 0) << "the child slept on its parent's fork";
}

}  // namespace
