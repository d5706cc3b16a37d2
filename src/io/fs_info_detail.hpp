#pragma once
// What statfs(2) returned, as keel describes it (shared by the seam's implementations).

#include <sys/statfs.h>

#include "keel/io/fs_info.hpp"

namespace keel::io::detail {

[[nodiscard]] fs_info fs_info_of(const struct statfs& s) noexcept;

}  // namespace keel::io::detail
