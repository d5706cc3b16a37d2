// Per-thread ordering (stream.hpp): which request must wait for which, and the streams'
// bookkeeping as requests come and go.

#include "stream.hpp"

#include <algorithm>

namespace keel::aio::detail {

bool must_follow(const op& earlier, const op& later) noexcept {
  if (earlier.kind == op_kind::task || later.kind == op_kind::task) return true;
  const auto is_sync = [](op_kind k) { return k == op_kind::fsync || k == op_kind::fdatasync; };
  if (is_sync(later.kind)) return earlier.kind == op_kind::write && earlier.length != 0;
  if (is_sync(earlier.kind)) return false;
  if (earlier.kind == op_kind::read && later.kind == op_kind::read) return false;
  if (earlier.length == 0 || later.length == 0) return false;  // sees nothing, changes nothing
  return earlier.offset < later.offset + later.length &&
         later.offset < earlier.offset + earlier.length;
}

bool stream::may_wait(const op& later) const noexcept {
  if (later.kind == op_kind::task) return !unfinished.empty();
  if (tasks_ != 0) return true;
  const auto overlaps = [&](std::uint64_t lo, std::uint64_t hi) {
    return lo < later.offset + later.length && later.offset < hi;
  };
  switch (later.kind) {
    case op_kind::fsync:
    case op_kind::fdatasync:
      return writes_ != 0;
    case op_kind::read:
      return overlaps(written_lo_, written_hi_);
    case op_kind::write:
      return overlaps(touched_lo_, touched_hi_);
    case op_kind::task:
      break;
  }
  return true;
}

bool stream::append(op& o) noexcept {
  bool ready = true;
  if (may_wait(o)) {
    for (const op* earlier : unfinished) {
      if (must_follow(*earlier, o)) {
        ready = false;
        break;
      }
    }
  }
  unfinished.push_back(&o);
  const std::uint64_t end = o.offset + o.length;
  switch (o.kind) {
    case op_kind::task:
      ++tasks_;
      break;
    case op_kind::write:
      ++writes_;
      written_lo_ = std::min(written_lo_, o.offset);
      written_hi_ = std::max(written_hi_, end);
      [[fallthrough]];
    case op_kind::read:
      touched_lo_ = std::min(touched_lo_, o.offset);
      touched_hi_ = std::max(touched_hi_, end);
      break;
    case op_kind::fsync:
    case op_kind::fdatasync:
      break;
  }
  return ready;
}

bool stream::chainable(std::size_t first) noexcept {
  op& later = *unfinished.back();
  const std::size_t n = unfinished.size() - 1;
  for (std::size_t i = 0; i < n; ++i) {
    const op& earlier = *unfinished[i];
    if (must_follow(earlier, later) && (i < first || !earlier.dispatched)) return false;
  }
  for (std::size_t i = first; i < n; ++i) {
    if (must_follow(*unfinished[i], later)) unfinished[i]->chained = true;
  }
  later.chained = true;
  return true;
}

void stream::remove(op& o) noexcept {
  if (!unfinished.empty() && unfinished.front() == &o) {
    unfinished.pop_front();  // the usual case: requests end in order
  } else {
    for (auto it = unfinished.begin(); it != unfinished.end(); ++it) {
      if (*it == &o) {
        unfinished.erase(it);
        break;
      }
    }
  }
  if (o.kind == op_kind::task) --tasks_;
  if (o.kind == op_kind::write) --writes_;
  if (unfinished.empty()) {
    written_lo_ = touched_lo_ = UINT64_MAX;
    written_hi_ = touched_hi_ = 0;
  }
}

void stream::finished(op& o, released& out) noexcept {
  const base::lock_guard lock(mutex);
  remove(o);
  for (std::size_t i = 0; held_back != 0 && i < unfinished.size(); ++i) {
    op* y = unfinished[i];
    if (y->dispatched) continue;
    bool held = false;
    for (std::size_t j = 0; j < i && !held; ++j)
      held = must_follow(*unfinished[j], *y);
    if (held) continue;
    y->dispatched = true;
    --held_back;
    if (out.n_few < out.few.size()) {
      out.few[out.n_few++] = y;
    } else {
      out.more.push_back(y);
    }
  }
  out.first_worker = next_worker;
  next_worker += static_cast<unsigned>(out.n_few + out.more.size());
}

}  // namespace keel::aio::detail
