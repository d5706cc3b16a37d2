#include "keel/aio/errors.hpp"

#include <string>

namespace keel::aio {
namespace {

class aio_category final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "keel.aio"; }

  [[nodiscard]] std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
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
        return "the write-back cache cannot serve an O_DIRECT file: open without direct or "
               "without cache";
    }
    return "unknown keel.aio error";
  }

  [[nodiscard]] std::error_condition default_error_condition(int value) const noexcept override {
    switch (static_cast<errc>(value)) {
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
        return std::errc::operation_not_supported;
    }
    return {value, *this};
  }
};

}  // namespace

const std::error_category& category() noexcept {
  static const aio_category c;
  return c;
}

}  // namespace keel::aio
