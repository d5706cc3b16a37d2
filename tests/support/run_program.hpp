#pragma once
// Runs a program as a user would, with its stdout and stderr captured in files.

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "support/process.hpp"

namespace keel::test {

struct program_outcome {
  int code = -1;  // exit status, or 128 + signal
  std::string out;
  std::string err;
};

inline std::string slurp(const std::string& path) {
  std::string s;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    std::size_t n = 0;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0)
      s.append(buf, n);
    std::fclose(f);
  }
  return s;
}

//! Starts `program args...` with stdout and stderr going to the files named; returns the pid.
inline pid_t start_program(const std::string& program, const std::vector<std::string>& args,
                           const std::string& out_file, const std::string& err_file) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(err_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program.c_str()));
    for (const auto& a : args)
      argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(program.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

//! Runs it to the end, files in `scratch_dir`.
inline program_outcome run_program(const std::string& program, const std::vector<std::string>& args,
                                   const std::string& scratch_dir) {
  static int n = 0;
  const std::string base =
      scratch_dir + "/run." + std::to_string(::getpid()) + "." + std::to_string(n++);
  program_outcome o;
  o.code = wait_exit(start_program(program, args, base + ".out", base + ".err"));
  o.out = slurp(base + ".out");
  o.err = slurp(base + ".err");
  return o;
}

}  // namespace keel::test
