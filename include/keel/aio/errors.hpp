#pragma once

#include "keel/error.hpp"

//! keel::aio's own conditions are keel::errc's (controller_stopped, file_closed,
//! misaligned_direct_io, bad_request, not_opened_for, not_supported_by_engine,
//! cache_needs_buffered_io), in the one keel category; `aio::errc` names the same enum.
namespace keel::aio {

using keel::errc;
using keel::make_error_code;

//! The keel category (kept for code written against keel::aio::category()).
[[nodiscard]] inline const std::error_category& category() noexcept {
  return keel::category();
}

}  // namespace keel::aio
