#!/usr/bin/env bash
# Start a private Docker engine for the kit's tests and CI on a machine without one (no systemd,
# no iptables): its own socket and data root. Storage: overlay2 where the kernel mounts overlays
# (layers share files: the CPU image costs its size once), else vfs (every layer a full copy of the
# image's filesystem: a 4 GB image with a few layers on top costs tens of GB of disk; CI once ran
# out of space that way). KIT_DOCKER_STORAGE=vfs forces the fallback.
# Usage: containers/start-dockerd.sh DIR   -> prints the DOCKER_HOST to export.
set -euo pipefail
dir=$(realpath -m "${1:?usage: start-dockerd.sh DIR}")
mkdir -p "$dir"
sock="$dir/docker.sock"
if ! command -v dockerd >/dev/null; then
  echo "installing Debian's docker.io (dockerd)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi
if [ -S "$sock" ] && docker -H "unix://$sock" info >/dev/null 2>&1; then
  echo "unix://$sock"; exit 0
fi

overlay_works() {  # can this kernel mount an overlay on the data root's filesystem?
  local t
  t=$(mktemp -d "$dir/.overlay-probe.XXXXXX")
  mkdir -p "$t/l" "$t/u" "$t/w" "$t/m"
  if mount -t overlay overlay -o "lowerdir=$t/l,upperdir=$t/u,workdir=$t/w" "$t/m" 2>/dev/null; then
    umount "$t/m"; rm -rf "$t"; return 0
  fi
  rm -rf "$t"; return 1
}

start() {  # start() DRIVER: dockerd on $sock with that storage driver; 0 once it answers
  nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="$1" \
    --data-root="$dir/data-$1" --exec-root="$dir/exec" --pidfile="$dir/docker.pid" \
    -H "unix://$sock" >"$dir/dockerd.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 60); do
    docker -H "unix://$sock" info >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || return 1
    sleep 1
  done
  kill "$pid" 2>/dev/null || true
  return 1
}

drivers=(vfs)
if [ "${KIT_DOCKER_STORAGE:-}" != vfs ] && overlay_works; then drivers=(overlay2 vfs); fi
for driver in "${drivers[@]}"; do
  if start "$driver"; then
    echo "dockerd: storage driver $driver, data in $dir/data-$driver" >&2
    echo "unix://$sock"; exit 0
  fi
  echo "dockerd did not start with storage driver $driver:" >&2; tail -5 "$dir/dockerd.log" >&2
  rm -f "$sock" "$dir/docker.pid"
done
echo "dockerd did not start; see $dir/dockerd.log" >&2; exit 1
