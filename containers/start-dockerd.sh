#!/usr/bin/env bash
# Start a private Docker engine for the kit's tests and CI on a machine without one (no systemd,
# no iptables, no overlay): its own socket, data root and the vfs storage driver.
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
nohup dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=vfs \
  --data-root="$dir/data" --exec-root="$dir/exec" --pidfile="$dir/docker.pid" \
  -H "unix://$sock" >"$dir/dockerd.log" 2>&1 &
for _ in $(seq 1 60); do
  docker -H "unix://$sock" info >/dev/null 2>&1 && { echo "unix://$sock"; exit 0; }
  sleep 1
done
echo "dockerd did not start; see $dir/dockerd.log" >&2; tail -20 "$dir/dockerd.log" >&2; exit 1
