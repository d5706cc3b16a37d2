// deny_io_uring PROGRAM [ARGS...]: runs PROGRAM where io_uring is forbidden, as Docker's
// default seccomp profile forbids it (tests/support/seccomp.hpp). ctest runs the aio tests
// so once; `deny_io_uring ctest ...` runs the whole suite so.

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "support/seccomp.hpp"

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0) {
    std::fprintf(argc < 2 ? stderr : stdout,
                 "usage: deny_io_uring PROGRAM [ARGS...]\n"
                 "Runs PROGRAM with io_uring_setup, io_uring_enter and io_uring_register\n"
                 "failing with EPERM (a seccomp filter, inherited by its children).\n");
    return argc < 2 ? 2 : 0;
  }
  if (!keel::test::deny_io_uring()) {
    std::fprintf(stderr, "deny_io_uring: cannot install the seccomp filter: %s\n",
                 std::strerror(errno));
    return 125;
  }
  ::execvp(argv[1], argv + 1);
  std::fprintf(stderr, "deny_io_uring: %s: %s\n", argv[1], std::strerror(errno));
  return 127;
}
