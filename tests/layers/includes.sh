#!/bin/bash
# Layers only include downwards: base <- io <- lock <- space, aio <- kv <- capi. A file of one
# layer may include its own layer's headers and those of the layers below it, public
# (include/keel/<layer>/) or internal (src/<layer>/); space and aio do not include each other.
# keel/result.hpp, keel/error.hpp, keel/deadline.hpp and keel/version.hpp are base's.
set -euo pipefail
root=${1:?usage: includes.sh SOURCE_DIR}
cd "$root"

rank() {
  case $1 in
    base) echo 0 ;; io) echo 1 ;; lock) echo 2 ;; space | aio) echo 3 ;; kv) echo 4 ;;
    capi) echo 5 ;; *) echo "?" ;;
  esac
}

# The layer a header named in an #include belongs to ("" for a header of the same directory).
layer_of_include() {
  case $1 in
    keel/result.hpp | keel/error.hpp | keel/deadline.hpp | keel/version.hpp) echo base ;;
    keel/keel.h) echo capi ;;
    keel/*/*) local rest=${1#keel/}; echo "${rest%%/*}" ;;
    */*) echo "${1%%/*}" ;;
    *) echo "" ;;
  esac
}

bad=0
checked=0
while IFS= read -r file; do
  case $file in
    src/*/*) layer=${file#src/}; layer=${layer%%/*} ;;
    src/*) layer=base ;;
    include/keel/keel.h) layer=capi ;;
    include/keel/*/*) layer=${file#include/keel/}; layer=${layer%%/*} ;;
    include/keel/*) layer=base ;;
  esac
  mine=$(rank "$layer")
  [[ $mine == "?" ]] && { echo "$file: unknown layer $layer"; bad=1; continue; }
  checked=$((checked + 1))
  while IFS= read -r inc; do
    theirs_layer=$(layer_of_include "$inc")
    [[ -z $theirs_layer || $theirs_layer == "$layer" ]] && continue
    theirs=$(rank "$theirs_layer")
    if [[ $theirs == "?" ]]; then
      continue  # a directory of the same layer's own (e.g. "detail/...", "memory_map/...")
    fi
    if ((theirs >= mine)); then
      echo "$file ($layer) includes \"$inc\" ($theirs_layer): layers only include downwards"
      bad=1
    fi
  done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$file")
done < <(find src include -name '*.hpp' -o -name '*.cpp' -o -name '*.h' | sort)

# The aio controller's insides (src/aio/detail.hpp) are its own: its engines and workers see it
# through engine_context.hpp.
for file in src/aio/*_engine.cpp src/aio/*_engine.hpp src/aio/engine.hpp src/aio/worker.* \
  src/aio/file_state.hpp src/aio/engine_context.hpp src/aio/cache.hpp; do
  if grep -q '^#include "detail.hpp"' "$file"; then
    echo "$file includes the aio controller's insides (detail.hpp): use engine_context.hpp"
    bad=1
  fi
done

((checked > 100)) || { echo "only $checked files found: wrong directory?"; exit 1; }
((bad == 0)) && echo "$checked files: every include points down"
exit $bad
