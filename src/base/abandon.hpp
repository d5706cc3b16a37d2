#pragma once
// Letting go of an owner without destroying what it owns: for a forked child's copies of
// state that the parent's threads own (their locks may be held, their threads do not exist
// here, their buffers are the parent's to write). The memory stays until the child exits.

#include <memory>
#include <new>
#include <utility>

namespace keel::base {

//! Empties `p` and leaks what it owned (no destructor runs, no reference is given back).
template <class T>
void abandon(T&& p) noexcept {
  union keep {
    keep() noexcept {}
    ~keep() {}
    std::remove_reference_t<T> held;
  } k;
  ::new (&k.held) std::remove_reference_t<T>(std::move(p));
}

}  // namespace keel::base
