#!/usr/bin/env bash
# A real distributed filesystem for the tests: one GlusterFS volume on this host, mounted twice
# through FUSE, so that the two mounts are two clients with their own caches and the volume's
# own lock server between them.
#
# Usage: scripts/glusterfs-fixture.sh up STATE_DIR     start glusterd if it is not running, make
#                                                      and start a volume, mount it twice
#        scripts/glusterfs-fixture.sh down STATE_DIR   unmount, delete the volume, stop the
#                                                      glusterd this script started
#
# `up` always exits 0 once STATE_DIR is written: STATE_DIR/mounts then names the two mount
# points (one per line), or STATE_DIR/skip says why there is no volume (not root, no FUSE, no
# glusterd), and the tests skip with that reason. Each STATE_DIR has a volume of its own, so
# two builds' test runs do not share one. `down` is safe to run twice, or after a failed `up`.
set -uo pipefail

cmd=${1:-}
state=${2:-}
if [ -z "$cmd" ] || [ -z "$state" ] || { [ "$cmd" != up ] && [ "$cmd" != down ]; }; then
  echo "usage: $0 up|down STATE_DIR" >&2
  exit 2
fi
mkdir -p "$state" || exit 1
state=$(cd "$state" && pwd)
# A volume name of its own per state directory (glusterd allows letters, digits, - and _).
volume="keel-test-$(printf '%s' "$state" | cksum | cut -d' ' -f1)"
host=$(hostname)
gluster_cli() { timeout 60 gluster --mode=script "$@"; }
# One glusterd serves every state directory's volume. The fixture that finds none running
# starts it and says so in $started (not in a state directory: another fixture may be the
# last to go), and the last `down` (no volume left on it) stops it. `up` and `down` take
# turns under $turns, so two runs never both start one, nor stop one the other still uses.
started=/run/keel-glusterfs-fixture.glusterd.pid
turns=/run/lock/keel-glusterfs-fixture.lock

skip() {
  echo "$*" >"$state/skip"
  echo "glusterfs-fixture: no volume: $*" >&2
  exit 0
}

# Cuts off a client that no longer answers (seen: its server wedged by a test that failed,
# with processes stuck in D state in a lock request): aborting its FUSE connection fails
# every request still waiting, so those processes exit and the unmount goes through.
abort_if_unanswering() {
  timeout 10 stat -f "$1" >/dev/null 2>&1 && return 0
  dev=$(awk -v m="$1" '$5 == m { print $3; exit }' /proc/self/mountinfo)
  [ -n "$dev" ] || return 0
  conns=/sys/fs/fuse/connections
  grep -qs " $conns fusectl" /proc/mounts || mount -t fusectl none "$conns" 2>/dev/null
  conn="$conns/$(((${dev%%:*} << 20) | ${dev#*:}))"
  if [ -w "$conn/abort" ]; then
    echo "glusterfs-fixture: $1 does not answer: aborting its FUSE connection" >&2
    echo 1 >"$conn/abort"
  fi
}

down() {
  for m in "$state/client-a" "$state/client-b"; do
    if grep -qs " $m fuse" /proc/mounts; then abort_if_unanswering "$m"; fi
    # From the mount table: a client whose process died is no longer a mountpoint(1).
    if grep -qs " $m fuse" /proc/mounts; then umount "$m" 2>/dev/null || umount -l "$m"; fi
  done
  if command -v gluster >/dev/null && gluster_cli volume info "$volume" >/dev/null 2>&1; then
    gluster_cli volume stop "$volume" force >/dev/null 2>&1
    gluster_cli volume delete "$volume" >/dev/null 2>&1
  fi
  if [ -f "$started" ] &&
    [ -z "$(gluster_cli volume list 2>/dev/null | grep -v '^No volumes present')" ]; then
    # Only the glusterd a fixture started (the pid may have been reused since it died).
    pid=$(cat "$started")
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = glusterd ]; then kill "$pid"; fi
    rm -f "$started"
  fi
  rm -rf "$state/brick" "$state/mounts" "$state/skip" "$state/client-a" "$state/client-b"
  rm -f "$state"/client-*.log "$state/glusterd.log"
}

mkdir -p "$(dirname "$turns")" "$(dirname "$started")"
exec 9>"$turns"
flock 9

if [ "$cmd" = down ]; then
  down
  exit 0
fi

rm -f "$state/mounts" "$state/skip"
[ "$(id -u)" -eq 0 ] || skip "mounting GlusterFS needs root"
[ -c /dev/fuse ] || modprobe fuse 2>/dev/null
[ -c /dev/fuse ] || skip "no /dev/fuse (FUSE is not available here)"
command -v glusterd >/dev/null || skip "glusterd is not installed (scripts/deps.sh installs glusterfs-server)"
command -v mount.glusterfs >/dev/null || skip "mount.glusterfs is not installed (glusterfs-client)"
getent hosts "$host" >/dev/null || skip "this host's name ($host) does not resolve, and glusterd needs it"

# A leftover of an earlier run with this state directory goes first.
down

if ! gluster_cli volume list >/dev/null 2>&1; then
  glusterd -p "$started" --log-file="$state/glusterd.log" 9>&- ||
    skip "glusterd did not start (see $state/glusterd.log)"
  for _ in $(seq 300); do
    gluster_cli volume list >/dev/null 2>&1 && break
    sleep 0.1
  done
  gluster_cli volume list >/dev/null 2>&1 || skip "glusterd did not answer within 30 s"
fi

mkdir -p "$state/brick" "$state/client-a" "$state/client-b"
# `force`: the brick is a directory of the root filesystem, which gluster warns about.
out=$(gluster_cli volume create "$volume" "$host:$state/brick" force 2>&1) ||
  skip "gluster volume create failed: $out"
out=$(gluster_cli volume start "$volume" 2>&1) || skip "gluster volume start failed: $out"
for m in "$state/client-a" "$state/client-b"; do
  out=$(mount -t glusterfs -o log-file="$state/$(basename "$m").log" "$host:/$volume" "$m" 2>&1 9>&-) ||
    skip "mounting $volume at $m failed: $out"
  mountpoint -q "$m" || skip "$m is not a mount point after mount.glusterfs"
done
# Both clients see each other's files: the volume works.
echo "$volume" >"$state/client-a/.keel-fixture"
[ "$(cat "$state/client-b/.keel-fixture" 2>/dev/null)" = "$volume" ] ||
  skip "a file written through one mount is not seen through the other"
rm -f "$state/client-a/.keel-fixture"
printf '%s\n%s\n' "$state/client-a" "$state/client-b" >"$state/mounts"
echo "glusterfs-fixture: volume $volume mounted at $state/client-a and $state/client-b" >&2
exit 0
