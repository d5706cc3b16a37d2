#pragma once
// What the store's tests share: small segments (so a few thousand keys fill several) and an
// open that reports its error.

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "keel/kv/store.hpp"

namespace keel::kv::test_support {

//! 1 MiB segments.
inline options small() {
  options o;
  o.segment_size = std::uint64_t{1} << 20;
  return o;
}

//! The store at `path`, or null after a test failure naming the error.
inline std::unique_ptr<store> open_ok(const std::string& path, const options& o = small()) {
  auto s = store::open(path, o);
  if (!s) ADD_FAILURE() << s.error().message();
  return s ? std::move(*s) : nullptr;
}

}  // namespace keel::kv::test_support
