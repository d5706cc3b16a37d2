#!/usr/bin/env bash
# The seam is the only door to files: outside src/io, keel's sources reach files through
# io::filesystem (include/keel/io/filesystem.hpp), so every file operation can be failed or
# power-cut in a test. This check lists raw file system calls anywhere else in src/. A call
# that must stay raw says why in a comment containing "seam" on its line or the line before.
# The io_uring engine's files are exempt whole (src/aio/uring*): its point is to reach the
# kernel without a virtual call per request (aio::options::fs refuses io_uring for any other filesystem).
#
# Usage: raw_syscalls.sh SOURCE_DIR
set -euo pipefail
cd "$1"
calls='open|openat|openat2|creat|close|dup|dup2|dup3|read|write|pread|pwrite|pread64|pwrite64|readv|writev|preadv|pwritev|preadv2|pwritev2|lseek|fsync|fdatasync|sync_file_range|fallocate|posix_fallocate|ftruncate|truncate|unlink|unlinkat|link|linkat|rename|renameat|renameat2|mkdir|mkdirat|rmdir|stat|lstat|fstat|fstatat|statx|statfs|fstatfs|mmap|munmap|mremap|msync|fcntl|flock|lockf|opendir|fdopendir|readdir|fopen|fdopen|io_uring_[a-z_]+'
found=0
while IFS= read -r hit; do
  file=${hit%%:*}
  rest=${hit#*:}
  line=${rest%%:*}
  prev=$((line > 1 ? line - 1 : 1))
  if sed -n "${prev},${line}p" "$file" | grep -q 'seam'; then continue; fi
  echo "raw file call outside the seam: $hit"
  found=1
done < <(grep -rnE "(^|[^A-Za-z0-9_:>.])(::)?($calls)\(" src --include='*.cpp' --include='*.hpp' |
         grep -v '^src/io/' | grep -vE '^src/aio/uring(\.hpp|_[a-z]+\.cpp):' | grep -vE ':[0-9]+:\s*//')
if [ "$found" -ne 0 ]; then
  echo "(reach files through io::filesystem, or say in a comment why not, with the word seam)"
  exit 1
fi
echo "no raw file calls outside src/io"
