#include "keel/error.hpp"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <ostream>

namespace keel {
namespace {

class keel_category final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "keel"; }

  [[nodiscard]] std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::corrupt:
        return "keel data is corrupt (a checksum or structure check failed)";
      case errc::not_keel_file:
        return "not a keel file: refused and left untouched";
      case errc::unsupported_version:
        return "written by an incompatible version of keel";
      case errc::too_many_users:
        return "too many users of one lock (its shared table is full)";
      case errc::controller_stopped:
        return "the aio controller stopped before the request ran";
      case errc::file_closed:
        return "the file was closed before the request was submitted";
      case errc::misaligned_direct_io:
        return "O_DIRECT request not aligned: offset, length and buffer address must be "
               "multiples of file::alignment()";
      case errc::bad_request:
        return "bad request: null buffer, or the range passes the largest file offset";
      case errc::not_opened_for:
        return "the file was not opened for this kind of request (read or write)";
      case errc::not_supported_by_engine:
        return "the aio engine cannot do this (O_DIRECT through stdio)";
      case errc::cache_needs_buffered_io:
        return "the write-back cache cannot serve this O_DIRECT file (it needs an alignment "
               "coarser than the cache's 4 KiB pages): open without direct or without cache";
      case errc::not_found:
        return "not found";
      case errc::conflict:
        return "conflict: another transaction committed a key this one used; retry";
      case errc::too_large:
        return "too large for the store";
      case errc::read_only:
        return "opened read-only";
      case errc::budget_reached:
        return "the store's byte budget is reached (the device may still have room)";
      case errc::sync_failed:
        return "read-only: an fdatasync of this file failed (data written since may be lost); "
               "close the store in every process and reopen it";
      case errc::needs_local_filesystem:
        return "works only with every user on this machine, and this filesystem may be shared "
               "by others (network, cluster, FUSE or unknown)";
      case errc::used_by_another_algorithm:
        return "open with another keel lock algorithm, which would not exclude this one: use "
               "the same algorithm everywhere";
      case errc::inherited_across_fork:
        return "the aio controller was inherited across fork(): only the parent may use it; "
               "start a controller in the child";
    }
    return "unknown keel error";
  }

  [[nodiscard]] std::error_condition default_error_condition(int value) const noexcept override {
    switch (static_cast<errc>(value)) {
      case errc::corrupt:
      case errc::not_keel_file:
        return std::errc::bad_message;
      case errc::unsupported_version:
        return std::errc::protocol_not_supported;
      case errc::too_many_users:
        return {EUSERS, std::generic_category()};
      case errc::controller_stopped:
        return std::errc::operation_canceled;
      case errc::file_closed:
      case errc::not_opened_for:
        return std::errc::bad_file_descriptor;
      case errc::misaligned_direct_io:
      case errc::bad_request:
      case errc::cache_needs_buffered_io:
        return std::errc::invalid_argument;
      case errc::not_supported_by_engine:
      case errc::needs_local_filesystem:
        return std::errc::operation_not_supported;
      case errc::too_large:
        return std::errc::value_too_large;
      case errc::read_only:
        return std::errc::read_only_file_system;
      case errc::sync_failed:
        return std::errc::io_error;
      case errc::used_by_another_algorithm:
        return std::errc::device_or_resource_busy;
      case errc::not_found:
      case errc::conflict:
      case errc::budget_reached:
      case errc::inherited_across_fork:
        break;
    }
    return {value, *this};
  }
};

}  // namespace

const std::error_category& category() noexcept {
  static const keel_category c;
  return c;
}

namespace detail {

struct shared_path::rep {
  std::atomic<std::uint32_t> refs;
  std::uint32_t size;
  char text[1];  // size + 1 bytes, NUL-terminated
};

shared_path::shared_path(std::string_view s) noexcept {
  if (s.empty() || s.size() > UINT32_MAX - sizeof(rep)) return;
  void* mem = std::malloc(sizeof(rep) + s.size());
  if (mem == nullptr) return;  // the path is context: an error goes on without it
  rep_ = new (mem) rep{{1}, static_cast<std::uint32_t>(s.size()), {}};
  std::memcpy(rep_->text, s.data(), s.size());
  rep_->text[s.size()] = '\0';
}

std::string_view shared_path::view() const noexcept {
  return rep_ == nullptr ? std::string_view() : std::string_view(rep_->text, rep_->size);
}

const char* shared_path::c_str() const noexcept {
  return rep_ == nullptr ? "" : rep_->text;
}

void shared_path::acquire() noexcept {
  if (rep_ != nullptr) rep_->refs.fetch_add(1, std::memory_order_relaxed);
}

void shared_path::release() noexcept {
  if (rep_ != nullptr && rep_->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    rep_->~rep();
    std::free(rep_);
  }
  rep_ = nullptr;
}

}  // namespace detail

error error::about(std::string_view path, std::uint64_t offset) const noexcept {
  if (!path_.empty() || path.empty()) return *this;
  return error(code_, path, offset == no_offset ? offset_ : offset);
}

error error::about(const detail::shared_path& path, std::uint64_t offset) const noexcept {
  if (!path_.empty() || path.empty()) return *this;
  return error(code_, path, offset == no_offset ? offset_ : offset);
}

std::string error::message() const {
  std::string m;
  if (!path_.empty()) {
    m += path_.view();
    if (has_offset()) {
      m += " at offset ";
      m += std::to_string(offset_);
    }
    m += ": ";
  }
  m += code_.message();
  return m;
}

std::ostream& operator<<(std::ostream& os, const error& e) {
  return os << e.message() << " [" << e.category().name() << ":" << e.value() << "]";
}

}  // namespace keel
