#pragma once
// What the aio tests share.

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "keel/aio/controller.hpp"

namespace keel::aio::test_support {

//! Opens `path` through `c` for reading and writing, made if missing; a closed file (and a
//! test failure) if it cannot.
inline file open_rw(controller& c, const std::string& path) {
  open_options how;
  how.write = true;
  how.create = true;
  auto f = c.open(path, how);
  if (!f) ADD_FAILURE() << "open " << path << ": " << f.error().message();
  return f ? std::move(*f) : file();
}

//! The descriptors this process has open on `path` (found in /proc/self/fd).
inline std::vector<int> descriptors_on(const std::string& path) {
  std::vector<int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string() == path) {
      out.push_back(std::stoi(e.path().filename().string()));
    }
  }
  return out;
}

//! A descriptor this process has open on `path`, or -1.
inline int descriptor_of(const std::string& path) {
  const std::vector<int> fds = descriptors_on(path);
  return fds.empty() ? -1 : fds.front();
}

}  // namespace keel::aio::test_support
