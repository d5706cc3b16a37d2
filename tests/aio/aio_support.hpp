#pragma once
// What the aio tests share.

#include <gtest/gtest.h>

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

}  // namespace keel::aio::test_support
