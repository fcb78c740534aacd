#!/usr/bin/env bash
# Start a container registry on loopback for the kit's tests and CI (no registry is reachable from
# our machines): Debian's docker-registry, the distribution registry 2.8, storage in DIR. The
# kit's pin code (refresh_pins, builds FROM a digest) then runs against a real registry: push a
# locally made base image to it, and its digest is the registry's own.
# Docker trusts registries on 127.0.0.0/8 over plain HTTP, so the engine pushes and pulls as is.
# Usage: containers/start-registry.sh DIR   -> prints the registry's address (127.0.0.1:PORT).
set -euo pipefail
dir=$(realpath -m "${1:?usage: start-registry.sh DIR}")
mkdir -p "$dir"
if ! command -v docker-registry >/dev/null; then
  echo "installing Debian's docker-registry" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-registry >/dev/null
fi
probe() { python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null; }
if [ -f "$dir/address" ] && probe "http://$(cat "$dir/address")/v2/"; then
  cat "$dir/address"; exit 0
fi
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat >"$dir/config.yml" <<YAML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $dir/data
  delete:
    enabled: true
http:
  addr: 127.0.0.1:$port
YAML
nohup docker-registry serve "$dir/config.yml" >"$dir/registry.log" 2>&1 &
echo $! >"$dir/registry.pid"
for _ in $(seq 1 30); do
  if probe "http://127.0.0.1:$port/v2/"; then
    echo "127.0.0.1:$port" | tee "$dir/address"; exit 0
  fi
  sleep 0.5
done
echo "the registry did not answer; see $dir/registry.log" >&2
exit 1
