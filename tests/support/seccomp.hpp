#pragma once
// Forbidding io_uring the way containers do (Docker's default seccomp profile, gVisor):
// io_uring_setup, io_uring_enter and io_uring_register fail with EPERM in this process and
// everything it starts (a seccomp filter is inherited and cannot be removed). Used by the
// test of the fallback and by the deny_io_uring launcher that runs whole test binaries so.
//
// Three rules of classic BPF, written out here rather than through libseccomp: tests need no
// further library for them.

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>

#if defined(__x86_64__)
#define KEEL_TEST_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define KEEL_TEST_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "tests/support/seccomp.hpp: add this architecture's AUDIT_ARCH"
#endif

namespace keel::test {

//! Which calls deny_io_uring forbids, and for which threads.
struct io_uring_denial {
  //! Only io_uring_enter (rings can still be set up: what a probe that only sets one up
  //! misses).
  bool enter_only = false;
  //! Every thread of the process at once (SECCOMP_FILTER_FLAG_TSYNC), not only the caller
  //! and what it starts: rings already running are cut off too.
  bool all_threads = false;
};

//! Installs the filter. False (errno set) where seccomp filters cannot be installed.
inline bool deny_io_uring(io_uring_denial how = {}) noexcept {
  const auto deny = static_cast<unsigned>(SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA));
  const unsigned setup = how.enter_only ? ~0u : static_cast<unsigned>(__NR_io_uring_setup);
  const unsigned reg = how.enter_only ? ~0u : static_cast<unsigned>(__NR_io_uring_register);
  sock_filter rules[] = {
      // Another architecture's calls (a 32-bit binary): their numbers differ; let them be.
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, KEEL_TEST_AUDIT_ARCH, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, setup, 3, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_enter, 2, 0),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, reg, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_RET | BPF_K, deny),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof rules / sizeof rules[0]), rules};
  // Without root a filter needs no_new_privs (container runtimes set it too).
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  if (!how.all_threads) return ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) == 0;
  return ::syscall(__NR_seccomp, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &program) == 0;
}

}  // namespace keel::test
