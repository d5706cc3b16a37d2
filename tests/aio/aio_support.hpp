#pragma once
// What the aio tests share.

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

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

//! The descriptor this process has open on `path` (found in /proc/self/fd), or -1.
inline int descriptor_of(const std::string& path) {
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (std::filesystem::read_symlink(e.path(), ec).string() == path) {
      return std::stoi(e.path().filename().string());
    }
  }
  return -1;
}

}  // namespace keel::aio::test_support
