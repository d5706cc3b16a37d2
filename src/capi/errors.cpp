// The C API's error codes and the calling thread's last error.

#include "capi/errors.hpp"

#include <cstring>
#include <string>

#include "keel/keel.h"
#include "keel/version.hpp"

namespace keel::capi {
namespace {

// keel.h's codes are -30900 less keel::errc's value: each named one checked here.
constexpr int errc_base = -30900;
constexpr int code_of(errc e) {
  return errc_base - static_cast<int>(e);
}
static_assert(code_of(errc::corrupt) == KEEL_CORRUPT);
static_assert(code_of(errc::not_keel_file) == KEEL_NOT_KEEL_FILE);
static_assert(code_of(errc::unsupported_version) == KEEL_UNSUPPORTED_VERSION);
static_assert(code_of(errc::too_many_users) == KEEL_TOO_MANY_USERS);
static_assert(code_of(errc::not_found) == KEEL_NOT_FOUND);
static_assert(code_of(errc::conflict) == KEEL_CONFLICT);
static_assert(code_of(errc::too_large) == KEEL_TOO_LARGE);
static_assert(code_of(errc::read_only) == KEEL_READ_ONLY);
static_assert(code_of(errc::budget_reached) == KEEL_BUDGET_REACHED);
static_assert(code_of(errc::sync_failed) == KEEL_SYNC_FAILED);
static_assert(code_of(errc::needs_local_filesystem) == KEEL_NEEDS_LOCAL_FILESYSTEM);
static_assert(code_of(errc::used_by_another_algorithm) == KEEL_USED_BY_ANOTHER_ALGORITHM);
constexpr int largest_errc = static_cast<int>(errc::used_by_another_algorithm);

// The calling thread's last failed call's error (the C API's own: what keel.h's
// keel_last_error_* read).
struct last_error {
  std::string path;
  std::uint64_t offset = UINT64_MAX;
  std::string message;
};
thread_local last_error last;

}  // namespace

int fail(const error& e) noexcept {
  int code = KEEL_UNKNOWN_ERROR;
  if (e.category() == std::system_category() || e.category() == std::generic_category()) {
    code = e.value();
  } else if (e.category() == keel::category() && e.value() >= 1 && e.value() <= largest_errc) {
    code = errc_base - e.value();
  }
  try {
    last.path.assign(e.path());
    last.offset = e.has_offset() ? e.offset() : UINT64_MAX;
    last.message = e.message();
  } catch (...) {
    // (Out of memory: the code still says what went wrong.)
    last.path.clear();
    last.message.clear();
  }
  return code;
}

}  // namespace keel::capi

extern "C" {

const char* keel_version(int* major, int* minor, int* patch) {
  if (major != nullptr) *major = KEEL_VERSION_MAJOR;
  if (minor != nullptr) *minor = KEEL_VERSION_MINOR;
  if (patch != nullptr) *patch = KEEL_VERSION_PATCH;
  return KEEL_VERSION_STRING;
}

const char* keel_strerror(int code) {
  if (code == 0) return "Success";
  if (code > 0) {
    // strerror's table (static for every known errno; "Unknown error N" otherwise).
    return ::strerrordesc_np(code) != nullptr ? ::strerrordesc_np(code) : "Unknown error";
  }
  const int e = keel::capi::errc_base - code;
  if (e >= 1 && e <= keel::capi::largest_errc) {
    // The category's messages, copied once into storage of the process's lifetime.
    static const auto* const table = []() -> const std::string* {
      try {
        auto* t = new std::string[keel::capi::largest_errc + 1];
        for (int i = 1; i <= keel::capi::largest_errc; ++i)
          t[i] = keel::category().message(i);
        return t;
      } catch (...) {
        return nullptr;
      }
    }();
    return table != nullptr ? table[e].c_str() : "keel error";
  }
  return "Unknown keel error";
}

const char* keel_last_error_path(void) {
  return keel::capi::last.path.c_str();
}

uint64_t keel_last_error_offset(void) {
  return keel::capi::last.offset;
}

const char* keel_last_error_message(void) {
  return keel::capi::last.message.c_str();
}

}  // extern "C"
