#pragma once

// The deadline types live in keel/deadline.hpp, below every layer that waits; the io layer
// names them too, as it always has.
#include "keel/deadline.hpp"

namespace keel::io {
using keel::countdown;
using keel::deadline;
}  // namespace keel::io
