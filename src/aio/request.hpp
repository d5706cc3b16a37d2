#pragma once
// The life of a request from the submitting thread's side: made, refused or counted in,
// appended to its stream, handed to a worker or to the write-back cache (request.cpp).

#include <cstddef>
#include <cstdint>
#include <memory>

#include "detail.hpp"

namespace keel::aio::detail {

//! A new op with one reference for the controller and one for the receipt.
op* make_op(op_kind k, std::uint64_t offset, std::byte* buffer, std::size_t length,
            completion on_done) noexcept;
//! Why keel refuses `o` on `f` (null: closed) before running it, or nothing.
error refusal(const file_state* f, const op& o) noexcept;
//! Finishes `o`, refused for `why`, on the submitting thread (never counted in).
receipt refuse(op* o, const error& why) noexcept;
//! Finishes a counted-in `o` at once if its file is closed (file_closed) or the controller
//! is stopping (cancelled); whether it did.
bool finished_as_shut(controller::impl& c, file_state& f, op* o) noexcept;
//! Submits one request on `f` (null: a closed file).
receipt submit_one(const std::shared_ptr<file_state>& f, op* o) noexcept;

}  // namespace keel::aio::detail
