#pragma once
// What every harness uses: a check that holds in release builds too, and `input`, which takes
// a fuzz input apart: fixed-size numbers from the front, zeros once it runs out (so every
// input, however short, decodes to something, and a prefix of an input decodes to a prefix of
// its operations).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>

//! Aborts (a finding, for libFuzzer and for the replay) when `cond` is false, whatever NDEBUG.
#define KEEL_FUZZ_CHECK(cond)                                                       \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (false)

namespace keel::fuzz {

class input {
 public:
  input(const std::uint8_t* data, std::size_t size) noexcept : data_(data), size_(size) {}

  [[nodiscard]] bool empty() const noexcept { return at_ >= size_; }
  [[nodiscard]] std::size_t left() const noexcept { return empty() ? 0 : size_ - at_; }

  template <class T>
  T take() noexcept {
    T v{};
    const std::size_t n = std::min(sizeof v, left());
    if (n != 0) std::memcpy(&v, data_ + at_, n);
    at_ += sizeof v;
    return v;
  }
  std::uint8_t byte() noexcept { return take<std::uint8_t>(); }
  //! Up to `n` bytes (fewer at the end).
  std::span<const std::uint8_t> bytes(std::size_t n) noexcept {
    const std::size_t k = std::min(n, left());
    std::span<const std::uint8_t> s(data_ + (empty() ? size_ : at_), k);
    at_ += k;
    return s;
  }
  //! Everything not taken yet.
  std::span<const std::uint8_t> rest() noexcept { return bytes(left()); }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t at_ = 0;
};

}  // namespace keel::fuzz
